"""Policies, predictors and miss paths of the user's own, outside the package.

A class is registered under its own ``name`` (the name the CLI, the API and result rows use) by
``register_policy``, ``register_predictor`` or ``register_miss``, from Python or from a module of the
user's that ``EXPERTCACHE_PLUGINS`` names (``EXPERTCACHE_PLUGINS=my_policies,my_predictor``, modules
importable from ``sys.path``: ``PYTHONPATH``). The command line imports those modules before it reads its
arguments, and so does every process that runs a sweep's cells (a worker started fresh, a Ray worker
given the variable), so a plugin's names work wherever the package's own do. ``load_plugins`` imports
them in a Python session. What a class must provide is the package's own contract: ``docs/POLICIES.md``,
``docs/PREDICTORS.md``, ``docs/MISS.md``.
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Sequence
from functools import partial

from expertcache.errors import ExpertcacheError, first_line

ENV = "EXPERTCACHE_PLUGINS"
_NAME = re.compile(r"[a-z0-9][a-z0-9._-]*")
_loaded: set[str] = set()


def load_plugins(modules: str | Sequence[str] | None = None) -> list[str]:
    """Import each module of ``modules`` (comma-separated, or a list of names; default:
    ``EXPERTCACHE_PLUGINS``) once per process -> the names imported now. A module that cannot be imported
    is one ExpertcacheError naming it."""
    text = os.environ.get(ENV, "") if modules is None else modules
    if not isinstance(text, str):  # a list of names (it failed on .split: a new user's trial)
        if not all(isinstance(m, str) for m in text):
            raise ExpertcacheError(f"load_plugins: module names (strings), got {modules!r}")
        text = ",".join(text)
    names = [m.strip() for m in text.split(",") if m.strip()]
    where = ENV if modules is None else "load_plugins"
    done = []
    for name in names:
        if name in _loaded:
            continue
        try:
            importlib.import_module(name)
        except ExpertcacheError as e:  # a registration refused: its own words
            raise ExpertcacheError(f"plugin {name} ({where}): {e}") from None
        except Exception as e:  # noqa: BLE001 (the user's module: any error is theirs, said in one line)
            missing = isinstance(e, ModuleNotFoundError) and e.name in (name, name.partition(".")[0])
            what = first_line(e) if missing else f"{type(e).__name__}: {first_line(e)}"
            hint = " (is its folder on PYTHONPATH?)" if missing else ""
            raise ExpertcacheError(f"plugin {name} ({where}) cannot be imported: {what}{hint}") from None
        _loaded.add(name)
        done.append(name)
    return done


def register_policy(cls=None, *, dist: bool = True):
    """Register an eviction policy class (a ``policy.base.Policy`` subclass) under its ``name``, and its
    per-layer split under ``NAME-dist`` as the package's policies have one (a budget a layer, each layer's
    keys under a policy of their own: what the planner lays out; ``dist=False``: not); usable as a
    decorator, ``@register_policy`` or ``@register_policy(dist=False)``."""
    if cls is None:
        return lambda c: register_policy(c, dist=dist)
    from expertcache.policy.base import Policy
    from expertcache.policy.dist import Dist
    from expertcache.policy.registry import POLICIES

    if not isinstance(dist, bool):
        raise ExpertcacheError(f"register_policy's dist must be True or False, got {dist!r}")
    _check(cls, Policy, "policy", POLICIES, "Policy (expertcache.policy.base)")
    split = f"{cls.name}-dist" if dist and not cls.name.endswith("-dist") else None
    if split is not None and split in POLICIES and _identity(POLICIES[split]) != _identity(cls):
        raise ExpertcacheError(
            f"policy name {split!r}, {cls.__qualname__}'s per-layer split, is taken: give {cls.__qualname__} "
            "another name, or register it with dist=False"
        )
    POLICIES[cls.name] = cls
    if split is not None:
        POLICIES[split] = partial(Dist, inner=cls)
    return cls


def register_predictor(cls) -> type:
    """Register a predictor class (a ``predict.base.Predictor`` subclass) under its ``name``; usable as a
    decorator."""
    from expertcache.predict.base import Predictor
    from expertcache.predict.registry import PREDICTORS

    reserved = ("none", "auto", "recorded")  # a prefetch setting, not a predictor
    _check(cls, Predictor, "predictor", PREDICTORS, "Predictor (expertcache.predict.base)", reserved)
    PREDICTORS.register(cls.name, cls)
    return cls


def register_miss(cls) -> type:
    """Register a miss path class (a ``miss.base.MissPath`` subclass) under its ``name``; usable as a
    decorator."""
    from expertcache.miss.base import MissPath
    from expertcache.miss.registry import MISS_PATHS

    _check(cls, MissPath, "miss path", MISS_PATHS, "MissPath (expertcache.miss.base)")
    MISS_PATHS[cls.name] = cls
    return cls


def _check(cls, base: type, kind: str, registry, base_name: str, reserved: tuple[str, ...] = ()) -> None:
    if not (isinstance(cls, type) and issubclass(cls, base)) or cls is base:
        raise ExpertcacheError(f"a {kind} to register is a subclass of {base_name}, got {cls!r}")
    name = cls.__dict__.get("name")
    if isinstance(name, str) and not _NAME.fullmatch(name):
        raise ExpertcacheError(
            f"{kind} {cls.__qualname__}: {name!r} is not a name commands can take (lower-case letters, "
            "digits, '.', '_' or '-', beginning with a letter or digit)"
        )
    if not isinstance(name, str):
        inherited = getattr(cls, "name", None)
        why = f" (it inherits {inherited!r})" if isinstance(inherited, str) and name is None else ""
        raise ExpertcacheError(
            f"{kind} {cls.__qualname__}: set its own name, the one commands and rows use (name = "
            f"'my-{kind.split()[0]}': lower-case letters, digits, '.', '_' or '-'){why}"
        )
    taken = registry.get(name) if name in registry else None
    if name in reserved or (taken is not None and _identity(taken) != _identity(cls)):
        raise ExpertcacheError(f"{kind} name {name!r} is taken: give {cls.__qualname__} another name")


def _identity(cls) -> tuple[str, str]:
    """The same class imported again (a module run twice) registers again; another class does not."""
    if isinstance(cls, partial):  # a -dist policy's: the policy it splits
        cls = cls.keywords.get("inner", cls.func)
    return getattr(cls, "__module__", ""), getattr(cls, "__qualname__", repr(cls))
