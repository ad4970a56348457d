"""The registry: every policy by the name the CLI and the API use, in one dict literal."""

from __future__ import annotations

import inspect
import os
import sys
from collections.abc import Callable
from functools import partial

from expertcache.errors import PolicyError, did_you_mean, option
from expertcache.policy.base import Policy, PolicyContext
from expertcache.policy.dist import Dist
from expertcache.policy.eam import EAM
from expertcache.policy.fifo import FIFO
from expertcache.policy.hobbit import Hobbit
from expertcache.policy.lcp import LCP
from expertcache.policy.lfu import LFU
from expertcache.policy.llru import LLRU
from expertcache.policy.lru import LRU
from expertcache.policy.marking import Marking
from expertcache.policy.mrs import MRS
from expertcache.policy.opt import OPT
from expertcache.policy.rand import Random
from expertcache.policy.reuse import Reuse
from expertcache.policy.static import Static
from expertcache.policy.tlfu import TLFU
from expertcache.spec import parse_spec, parse_value

PolicyFactory = Callable[..., Policy]

POLICIES: dict[str, PolicyFactory] = {
    "lru": LRU,
    "fifo": FIFO,
    "lfu": LFU,
    "random": Random,
    "marking": Marking,
    "llru": LLRU,
    "lcp": LCP,
    "eam": EAM,
    "mrs": MRS,
    "tlfu": TLFU,
    "hobbit": Hobbit,
    "reuse": Reuse,
    "static": Static,
    "opt": OPT,
    "lru-dist": partial(Dist, inner=LRU),
    "fifo-dist": partial(Dist, inner=FIFO),
    "lfu-dist": partial(Dist, inner=LFU),
    "random-dist": partial(Dist, inner=Random),
    "marking-dist": partial(Dist, inner=Marking),
    "llru-dist": partial(Dist, inner=LLRU),
    "lcp-dist": partial(Dist, inner=LCP),
    "mrs-dist": partial(Dist, inner=MRS),
    "tlfu-dist": partial(Dist, inner=TLFU),
    "hobbit-dist": partial(Dist, inner=Hobbit),
    "static-dist": partial(Dist, inner=Static),
    "opt-dist": partial(Dist, inner=OPT),
}


def policy_class(name: str) -> type[Policy]:
    """The class implementing a registered name (the inner class for -dist names)."""
    factory = _lookup(name)
    return factory.keywords["inner"] if isinstance(factory, partial) else factory


def is_offline(name: str) -> bool:
    """Whether the policy needs the future (OPT and OPT-Dist): simulator only."""
    return policy_class(name).offline


def min_capacity(
    name: str, num_layers: int, params: dict[str, object] | None = None, min_room: int = 1
) -> int:
    """The smallest capacity the policy can run with when every layer needs ``min_room`` slots:
    that for a whole-cache policy, ``min_room`` per layer for -dist (or the sum of given budgets). Budgets
    given for another number of layers are refused here, before what their sum would fill is judged."""
    factory = _lookup(name)
    if isinstance(factory, partial) and factory.func is Dist:
        budgets = (params or {}).get("budgets")
        if isinstance(budgets, list) and len(budgets) != num_layers:  # as Dist says it
            raise PolicyError(f"{name}: {len(budgets)} budgets given for {num_layers} layers")
        return sum(budgets) if isinstance(budgets, list) else num_layers * min_room
    return min_room


def fixed_capacity(name: str, params: dict[str, object] | None = None) -> int | None:
    """The one capacity a -dist policy with given budgets fills (their sum; at a larger one, slots would
    stay empty under its name), None for a policy that fills any capacity."""
    budgets = (params or {}).get("budgets")
    factory = _lookup(name)
    if isinstance(factory, partial) and factory.func is Dist and isinstance(budgets, list):
        return sum(budgets)
    return None


def capacity_reason(name: str, params: dict[str, object] | None = None, min_room: int = 1) -> str:
    """Why ``min_capacity`` is what it is, for messages: the budgets given, or a layer's room."""
    fixed = fixed_capacity(name, params)
    return f"its budgets sum to {fixed}" if fixed is not None else f"each layer needs {min_room} slot(s)"


def make_policy(name: str, ctx: PolicyContext, **params: object) -> Policy:
    """Build a registered policy; unknown names or parameters raise PolicyError. ``name`` may be a spec
    as the command line gives it (``lcp:rho=0.5``): its parameters join ``params`` (given twice: refused)."""
    if not isinstance(ctx, PolicyContext):
        raise PolicyError(
            f"make_policy needs a PolicyContext (capacity, num_layers, num_experts, top_k, ...), got "
            f"{type(ctx).__name__}"
        )
    name, params = spec_and_params(name, params)
    factory = _lookup(name)
    _check_parameters(name, params)
    budgets = params.get("budgets")
    if isinstance(budgets, str):  # the command line's spelling, 2/2/4: not a string of 5 characters
        parsed = parse_value(budgets)
        if not (isinstance(parsed, list) and all(isinstance(b, int) for b in parsed)):
            raise PolicyError(
                f"policy {name!r}: budgets is a list of whole numbers (or '2/2/4'), got {budgets!r}"
            )
        params = {**params, "budgets": parsed}
    try:
        return factory(ctx, **params)
    except (TypeError, ValueError) as e:  # a parameter of the wrong type; a plugin's own check refused it
        raise PolicyError(f"policy {name!r}: bad parameters {params}: {e}") from None
    except PolicyError as e:  # the policy's own message: named, as the package's policies name themselves
        base = name.removesuffix("-dist")
        if str(e).startswith((f"{base}:", f"{name}:", f"policy {name!r}", f"policy {base!r}")):
            raise
        raise PolicyError(f"policy {name!r}: {e}") from None


def spec_and_params(name: str, params: dict[str, object]) -> tuple[str, dict[str, object]]:
    """A policy given as a spec (``"lcp:rho=0.5"``) as its name and parameters, joined with ``params``
    (a parameter given both ways is refused); a bare name as it is."""
    if not isinstance(name, str) or ":" not in name:
        return name, params
    name, given = parse_policy(name)
    twice = sorted(set(given) & set(params))
    if twice:
        raise PolicyError(f"policy {name!r}: {', '.join(twice)} given in the spec and as a keyword")
    return name, {**given, **params}


def parse_policy(spec: str) -> tuple[str, dict[str, object]]:
    """Parse 'name' or 'name:key=value,key=value' (budgets as 2/2/3) into (name, params)."""
    name, params = parse_spec(spec, "policy", PolicyError)
    _lookup(name)
    if "profile" in params:
        raise PolicyError(
            f"policy {spec!r}: the usage profile is not a policy parameter; give it as "
            + option(f"--policy {name} --profile TRACE.npz", f"policy={name!r}, profile='TRACE.npz'")
            + "; sim and timing profile the trace they replay"
        )
    _check_parameters(name, params)  # when a config is built, not later when the policy is
    text = policy_class(name).text_params
    raw = {k.strip(): v.strip() for k, _, v in (i.partition("=") for i in spec.partition(":")[2].split(","))}
    for key, value in params.items():
        if key in text:  # a file name as written (a number-like one too)
            params[key] = raw.get(key, value)
        elif not isinstance(value, int | float) and not (
            isinstance(value, list) and all(isinstance(v, int) for v in value)
        ):
            raise PolicyError(f"policy {spec!r}: value {value!r} is not a number")
    return name, params


def policy_parameters(name: str) -> list[str] | None:
    """The parameters a registered policy takes by name (``budgets`` first for a -dist one); None where
    it takes any keyword (a user's policy with ``**kwargs``)."""
    return _parameters(name)


def _check_parameters(name: str, params: dict[str, object]) -> None:
    allowed = _parameters(name)
    if allowed is None:  # the class takes any keyword (``**kwargs``): its own __init__ says what it refuses
        return
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        takes = ", ".join(allowed) if allowed else "no parameters"
        raise PolicyError(f"policy {name!r} does not take {', '.join(unknown)} (it takes {takes})")


def _parameters(name: str) -> list[str] | None:
    """The parameters the policy takes by name; None where it takes any keyword (``**kwargs``)."""
    factory = _lookup(name)
    cls = policy_class(name)
    params = inspect.signature(cls).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    names = [p for p in params if p != "ctx"]
    if isinstance(factory, partial):
        names = ["budgets", *names]
    return names


def _lookup(name: str) -> PolicyFactory:
    try:
        return POLICIES[name]
    except KeyError:
        base = name[: -len("-dist")] if isinstance(name, str) and name.endswith("-dist") else None
        if base in POLICIES:  # eam, reuse, a user's registered with dist=False
            own = policy_class(base).__module__.startswith("expertcache.")
            why = (
                "it decides over every layer's experts at once, docs/POLICIES.md"
                if own
                else "it was registered with register_policy(..., dist=False)"
            )
            raise PolicyError(
                f"unknown policy {name!r}: {base} has no per-layer split ({why}); give it the whole cache, "
                "or choose a policy with one: " + ", ".join(n for n in POLICIES if n.endswith("-dist"))
            ) from None
        hint = did_you_mean(name, POLICIES) if isinstance(name, str) else ""
        named = [m.strip() for m in os.environ.get("EXPERTCACHE_PLUGINS", "").split(",") if m.strip()]
        if any(m not in sys.modules for m in named):  # read by the commands; Python imports plugins itself
            hint += (
                " (EXPERTCACHE_PLUGINS is read by the commands; in Python, expertcache.load_plugins() "
                "imports the modules it names)"
            )
        online = [n for n in POLICIES if not policy_class(n).offline]
        offline = [n for n in POLICIES if n not in online]  # (the engine's refusal named them)
        raise PolicyError(
            f"unknown policy {name!r}{hint}; choose from {', '.join(online)}"
            + (f" (and in the simulator, {', '.join(offline)})" if offline else "")
        ) from None
