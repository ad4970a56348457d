"""Configuration: one frozen dataclass per domain, validated once, on creation.

The engine (``expertcache.load``), the timing simulator (``simulate_timing``), the CLI and the Python
API all build these and nothing else, so an option means the same everywhere and a bad one is refused
with the same one-line message, before any work starts. Torch-free.
"""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass, field, fields

from expertcache.errors import ExpertcacheError, option
from expertcache.miss.registry import parse_miss
from expertcache.policy.registry import is_offline, parse_policy, policy_class
from expertcache.predict.base import PredictorError
from expertcache.predict.registry import predictor_class
from expertcache.trace.batch import SCHEDULES  # the server's step scheduling (``serve.scheduling``)
from expertcache.trace.trace import Trace
from expertcache.units import parse_duration, parse_rate, parse_share, parse_size, true_or_false

RECORDED = "recorded"  # the timing model's replay of the predictions an engine recorded into a trace
RECORDED_STEP = "recorded"  # a step time: what a recorded run's clock says (``sim.timing.recorded_step_s``)
AUTO = "auto"  # the engine's default: the model's best predictor, switched on only while it pays
# where experts wait (``engine.transfer``): every expert in host memory; the checkpoint read from disk, each
# expert's pages let go once copied; the checkpoint's memory map, its pages left to the page cache
SLOW_TIERS = ("host", "disk", "mapped")
WHEN = ("always", "pays")  # prefetch in every step, or only while the governor measures that it pays
CHECKPOINT_DTYPES = ("float32", "bfloat16", "float16")  # a random checkpoint's weights (model synth)
REFERENCE_IMPLEMENTATIONS = ("grouped_mm", "eager", "batched_mm")  # transformers' experts functions (quality)


def _set(obj: object, **values: object) -> None:
    for name, value in values.items():
        object.__setattr__(obj, name, value)


@dataclass(frozen=True)
class CacheConfig:
    """The eviction policy (``'name'`` or ``'name:k=v,...'``), its seed, and a usage profile (a trace or
    its path, for ``static``)."""

    policy: str = "lru"
    seed: int = 0
    profile: object = None
    name: str = field(init=False, repr=False)
    params: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        name, params = parse_policy(self.policy)
        _set(self, name=name, params=params)
        if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral):  # "a" was kept
            raise ExpertcacheError(
                f"{option('--policy-seed', 'seed')} must be a whole number, got {self.seed!r}"
            )
        _set(self, seed=int(self.seed))
        if self.profile is not None and not isinstance(self.profile, str | os.PathLike | Trace):
            raise ExpertcacheError(
                f"{option('--profile', 'profile')}: a trace or its file, got {type(self.profile).__name__}"
            )
        if self.profile is not None and not policy_class(name).needs_profile:
            raise ExpertcacheError(
                f"a usage profile ({option('--profile', 'profile')}) ranks experts for the static policies; "
                f"policy {name} uses none (give {option('--policy static', 'policy=static')} or static-dist, "
                f"or leave out {option('--profile', 'profile')})"
            )

    @property
    def offline(self) -> bool:
        """Needs the future (``opt``): the simulator's only."""
        return is_offline(self.name)


# PrefetchConfig's switches: (field, the command line's flag, load()'s argument)
_SWITCHES = (
    ("chunking", "--no-chunking", "chunking"), ("preemption", "--no-preemption", "preemption"),
    ("reorder", "--no-reorder", "reorder"), ("thread", "--predictor-thread", "predictor_thread"),
    ("deterministic", "--deterministic", "deterministic"),
)  # fmt: skip


@dataclass(frozen=True)
class PrefetchConfig:
    """Proactive caching (ProMoE): the predictor (``none`` to switch it off), its window (layers ahead;
    None: the predictor's default) and data (a trained predictor directory, or a recorded trace), the
    experts prefetched per predicted layer (None: top-k), chunked transfers (``chunk_size`` bytes, None:
    a third of an expert), early preemption, reordered execution, and a predictor thread.

    ``auto`` (the engine's default) picks the model's predictor when the model is loaded (the trained
    ``learned`` one where there is one, else ``next-gate``). ``when``: ``always`` predicts in every step;
    ``pays`` only while the governor (``cache.governor``) measures that prefetching makes steps shorter.
    None: ``pays`` for ``auto``, ``always`` for a named predictor.

    ``deterministic``: a run that repeats exactly (hits, misses, what each miss path did, the outputs of
    lossy paths): every transfer lands before the cache's next decision (no prefetch is cancelled or in
    flight when a victim is chosen) and prefetching never follows measured times (``when`` is ``always``;
    ``pays`` and a predictor thread are refused). Prefetches then do not overlap compute."""

    predictor: str = "none"
    window: int | None = None
    data: object = None
    limit: int | None = None
    chunking: bool = True
    chunk_size: str | int | None = None
    preemption: bool = True
    reorder: bool = True
    thread: bool = False
    when: str | None = None
    deterministic: bool = False
    chunk_bytes: int | None = field(init=False, repr=False)
    predictor_object: object = field(init=False, repr=False, compare=False)

    def __repr__(self) -> str:  # a predictor given as an object shown as one, not as a registered name
        shown = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if f.repr]
        if self.predictor_object is not None:
            shown[0] = f"predictor={self.predictor_object!r}"
        return f"PrefetchConfig({', '.join(shown)})"

    def __post_init__(self) -> None:
        for value, flag, arg in _SWITCHES:
            if not isinstance(getattr(self, value), bool):
                raise ExpertcacheError(
                    f"{option(flag, arg)} must be True or False, got {getattr(self, value)!r}"
                )
        obj = None
        if self.predictor is not None and not isinstance(self.predictor, str):  # a Predictor (the API)
            obj, name = self.predictor, str(getattr(self.predictor, "name", "custom"))
        else:
            name = "none" if self.predictor in (None, "none") else str(self.predictor).strip().lower()
        _set(self, predictor=name, predictor_object=obj)
        if ":" in name and obj is None:  # a policy's or miss path's spec form: predictors take none
            base = name.partition(":")[0]
            predictor_class(base)
            raise ExpertcacheError(
                f"predictor {base!r} takes no parameters ({name!r}); how far ahead it predicts is "
                f"{option('--window K', 'window=K')}"
            )
        if name not in ("none", RECORDED, AUTO) and obj is None:
            try:
                predictor_class(name)
            except PredictorError as e:  # the names a prefetch takes beyond the predictors themselves
                raise PredictorError(
                    f"{e}; or none, auto (the engine's choice, its default), recorded (the simulator's "
                    "replay of the predictions an engine recorded)"
                ) from None
        if name == "none" and (self.window is not None or self.data is not None or self.thread):
            raise ExpertcacheError(
                "a window, predictor data or a predictor thread needs a predictor "
                f"({option('--prefetch NAME', 'prefetch=NAME')})"
            )
        if name == "none" and (self.limit is not None or not self.preemption):
            given = (
                option("--prefetch-limit", "prefetch_limit")
                if self.limit is not None
                else option("--no-preemption", "preemption=False")
            )
            raise ExpertcacheError(
                f"{given} is about prefetched experts, and nothing is prefetched without a predictor "
                f"({option('--prefetch NAME', 'prefetch=NAME')})"
            )
        when = None if self.when is None else str(self.when).strip().lower()
        if when is not None and when not in WHEN:
            raise ExpertcacheError(f"prefetch when {self.when!r} is not one of: {', '.join(WHEN)}")
        if when is not None and name == "none":
            raise ExpertcacheError(
                f"prefetch when {when!r} needs a predictor: {option('--prefetch ', 'prefetch=')}NAME (or, in "
                "the engine, auto)"
            )
        if self.deterministic and when == "pays":
            raise ExpertcacheError(
                "prefetch when 'pays' follows measured times, so no two runs are alike: a deterministic run "
                f"prefetches always ({option('--prefetch-when always', 'prefetch_when=always')}) or not at "
                f"all ({option('--prefetch none', 'prefetch=none')})"
            )
        if self.deterministic and self.thread:
            raise ExpertcacheError(
                "a predictor thread races the model's layers: a deterministic run predicts inline (leave out "
                f"{option('--predictor-thread', 'predictor_thread')})"
            )
        _set(self, when=when or ("pays" if name == AUTO and not self.deterministic else "always"))
        for value, flag, arg, unit in (
            ("window", "--window", "window", "layer"),
            ("limit", "--prefetch-limit", "prefetch_limit", "expert"),
        ):
            n = getattr(self, value)
            if n is not None and (isinstance(n, bool) or not isinstance(n, int)):
                raise ExpertcacheError(f"{option(flag, arg)} must be a whole number of {unit}s, got {n!r}")
        if self.window is not None and self.window < 1:
            raise ExpertcacheError(f"prefetch window must be at least 1 layer, got {self.window}")
        if self.limit is not None and self.limit < 1:
            raise ExpertcacheError(f"prefetch limit must be at least 1 expert per layer, got {self.limit}")
        chunk = None
        if self.chunk_size is not None:
            if not self.chunking:
                raise ExpertcacheError(
                    f"a chunk size was given with chunking off ({option('--no-chunking', 'chunking=False')})"
                )
            chunk = parse_size(self.chunk_size, "chunk size")
            if chunk < 1 or chunk != int(chunk):
                got = self.chunk_size
                raise ExpertcacheError(f"chunk size must be a positive whole number of bytes, got {got}")
        _set(self, chunk_bytes=None if chunk is None else int(chunk))

    @property
    def enabled(self) -> bool:
        return self.predictor != "none"

    @property
    def governed(self) -> bool:
        """Prefetching only while it pays (a governor decides, step by step)."""
        return self.enabled and self.when == "pays"

    def idle_chunking_note(self, background: bool = False) -> str | None:
        """A note where a chunking option was given and changes nothing: only speculative transfers move
        in chunks (a prefetcher's; a miss path's that fills the cache in the background, ``background``),
        demand transfers move whole, and there are none to chunk. The engine and the timing model say it
        alike."""
        if self.enabled or background:
            return None
        if self.chunk_bytes is not None:
            given = option("--chunk-size", "chunk_size")
        elif not self.chunking:
            given = option("--no-chunking", "chunking=False")
        else:
            return None
        predictor = option("--prefetch NAME", "prefetch=NAME")
        return (
            f"{given} changes nothing here: only prefetched experts move in chunks (demand misses move "
            f"whole), and nothing is prefetched without a predictor ({predictor})"
        )

    def chunked(self, background: bool = False) -> bool:
        """Whether transfers move in chunks. Chunks bound how long a demand transfer waits behind a
        speculative one, so they pay only where speculative transfers exist: a prefetcher, or a miss
        path that fills the cache in the background (``background``); or where a chunk size was given.
        Otherwise an expert moves as one piece per tensor: on the disk tier a third fewer, larger reads
        (TPOT 0.265 s against 0.31-0.32 s, a Granite-shaped model at 25 %, no prefetch)."""
        return self.chunking and (self.enabled or background or self.chunk_bytes is not None)


SLOWEST_LINK = 1e6  # bytes a second: an emulated link slower is a unit's mistake (B/s for GB/s)


@dataclass(frozen=True)
class LinkConfig:
    """An emulated slow-tier link: bandwidth (``16GB/s``; None: unbounded) and latency per transfer
    (``20us``). Neither set: no emulation, transfers run at the machine's own speed."""

    bandwidth: str | float | None = None
    latency: str | float = 0.0
    bandwidth_Bps: float = field(init=False, repr=False)
    latency_s: float = field(init=False, repr=False)

    def __post_init__(self) -> None:
        lat = parse_duration(self.latency if self.latency is not None else 0, "link latency")
        bw = math.inf if self.bandwidth is None else parse_rate(self.bandwidth, "link bandwidth")
        if bw < SLOWEST_LINK:  # 1B/s for 1GB/s: an expert's transfer would take days, the run would hang
            raise ExpertcacheError(
                f"link bandwidth {self.bandwidth}: below {SLOWEST_LINK / 1e6:g} MB/s an expert's transfer "
                "takes minutes to days; give the rate meant (16GB/s, 200MB/s)"
            )
        _set(self, bandwidth_Bps=bw, latency_s=lat)

    @property
    def emulated(self) -> bool:
        return self.bandwidth is not None or self.latency_s > 0


def _host_refuses(cls) -> str | None:
    """Why a host level cannot run a policy of class ``cls`` (None: it can): it sees only the device's
    transfers, so a policy must be online and decide by hits and insertions alone."""
    if cls.offline:
        return "needs the future"
    if cls.needs_profile:
        return "needs a usage profile"
    if cls.observes or cls.weighs:
        return "decides by the router's requests, which the host level does not see"
    return None


def host_policies() -> list[str]:
    """The policies a host level can run."""
    from expertcache.policy.registry import POLICIES

    return [name for name in POLICIES if _host_refuses(policy_class(name)) is None]


@dataclass(frozen=True)
class HostConfig:
    """The host level of a tier stack (``cache.tiers``): device slots <- a host cache of ``memory``
    (bytes, ``8GiB``, or a share of all experts, ``30%``; None: no host level) <- the checkpoint on disk.
    Its eviction policy (any online policy that decides by hits and insertions alone), whether it is
    ``exclusive`` of the device's cache (a hit moves up, the device's victim comes down), and
    ``stage``: predicted experts per layer read into it early, beyond what the device's prefetch takes."""

    memory: str | int | None = None
    policy: str = "lru"
    exclusive: bool = False
    stage: int = 0
    name: str = field(init=False, repr=False)
    params: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        true_or_false(self.exclusive, "host_exclusive")
        if isinstance(self.policy, str):  # as it is shown and recorded: " lru" is lru
            object.__setattr__(self, "policy", self.policy.strip())
        try:
            name, params = parse_policy(self.policy)
            cls = policy_class(name)
        except ExpertcacheError as exc:  # its choices are the host level's, not every policy's
            if not str(exc).startswith("unknown policy"):
                raise
            raise ExpertcacheError(
                f"unknown host policy {str(self.policy).partition(':')[0]!r}; a host level takes "
                f"{', '.join(host_policies())}"
            ) from None
        why = _host_refuses(cls)
        if why is not None:
            raise ExpertcacheError(
                f"host policy {name} {why}; the host level sees only the device's transfers: give one "
                "that decides by hits and insertions (lru, lfu, fifo, lcp, llru, ...)"
            )
        if not isinstance(self.stage, int) or isinstance(self.stage, bool) or self.stage < 0:
            raise ExpertcacheError(f"host stage: a number of experts, 0 or more, got {self.stage!r}")
        if self.exclusive and self.stage:
            raise ExpertcacheError(
                f"host stage {self.stage} reads predicted experts into an inclusive host level; an exclusive "
                "one takes experts only from the device (leave out the stage or exclusive)"
            )
        if self.memory is not None:
            text = str(self.memory).strip()
            if text.endswith("%"):
                parse_share(self.memory, "host memory")
            else:
                parse_size(self.memory, "host memory")
        _set(self, name=name, params=params)

    @property
    def enabled(self) -> bool:
        return self.memory is not None

    def bytes_of(self, total: int) -> int:
        """The host level's bytes, for experts that take ``total`` bytes in all (capped at it)."""
        text = str(self.memory).strip()
        got = (
            round(total * parse_share(text, "host memory") / 100)
            if text.endswith("%")
            else int(parse_size(self.memory, "host memory"))
        )
        return min(got, total)

    def exceeds(self, total: int) -> bool:
        """Whether the memory given is more than ``total`` bytes (a share, at most 100 %, never is)."""
        return not str(self.memory).strip().endswith("%") and self.bytes_of(2 * total) > total


@dataclass(frozen=True)
class MissConfig:
    """What to do on a miss (``--miss NAME[:k=v,...]``): ``fetch`` (default, exact) or another miss path
    of ``expertcache misses``; its name and parameters are checked here, its values when it is built."""

    path: str = "fetch"
    name: str = field(init=False, repr=False)
    params: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        name, params = parse_miss(str(self.path))
        _set(self, name=name, params=params)


def _flag(name: str) -> str:
    """A sampling option as a message names it: ``--top-p`` on the command line, ``top_p`` in Python."""
    return option("--" + name.replace("_", "-"), name)


@dataclass(frozen=True)
class SamplingConfig:
    """How tokens are chosen: greedy (``temperature`` 0, the default: the offloaded model's tokens equal
    the reference's) or sampled at ``temperature`` with ``top_p`` / ``top_k`` cut-offs and a ``seed``
    (None: a fresh one, reported with the result); a ``repetition_penalty`` (1: none) for both; and
    ``stop`` strings that end a sequence (the text is cut before the first one)."""

    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        t = self.temperature
        for name, kind in (("top_p", "a number"), ("repetition_penalty", "a number"), ("top_k", "int"),
                           ("seed", "int")):  # fmt: skip
            v = getattr(self, name)
            numeric = isinstance(v, int) if kind == "int" else isinstance(v, int | float)
            if v is not None and (isinstance(v, bool) or not numeric):
                what = "a whole number" if kind == "int" else kind
                raise ExpertcacheError(f"{_flag(name)} must be {what}, got {v!r}")
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
            raise ExpertcacheError(f"{_flag('temperature')} must be a number >= 0 (0: greedy), got {t!r}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ExpertcacheError(f"{_flag('top_p')} must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise ExpertcacheError(f"{_flag('top_k')} must be at least 1, got {self.top_k}")
        for name in ("top_p", "top_k", "seed"):
            if t == 0 and getattr(self, name) is not None:
                raise ExpertcacheError(
                    f"{_flag(name)} is for sampling: give {_flag('temperature')} > 0 too (greedy ignores it)"
                )
        rp = self.repetition_penalty
        if rp is not None and (not math.isfinite(rp) or rp <= 0):
            raise ExpertcacheError(f"{_flag('repetition_penalty')} must be > 0 (1: none), got {rp}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ExpertcacheError(f"{_flag('seed')} must be in 0 .. 2**63-1, got {self.seed}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise ExpertcacheError(f"stop strings must be non-empty text, got {list(stop)!r}")
        _set(self, stop=stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
KV_PAGE = 256  # tokens in one page of the server's paged KV cache (transformers' block)
SERVE_BATCH_TOKENS = 512  # tokens a served step computes at most, by default (serve --max-batch-tokens)


_WHOLE, _TEXT, _FLAG = ((numbers.Integral,), "a whole number"), ((str,), "text"), ((bool,), "True or False")
_OR_NONE = {
    int: ((numbers.Integral, type(None)), "a whole number or None"),
    str: ((str, type(None)), "text or None"),
}
_SERVE_TYPES: dict[str, tuple[tuple[type, ...], str]] = {  # ServeConfig's fields not parsed from text
    "host": _TEXT,
    "port": _WHOLE,
    "api_key": _OR_NONE[str],
    "max_queue": _WHOLE,
    "kv_tokens": _OR_NONE[int],
    "batch_tokens": _WHOLE,
    "schedule": _TEXT,
    "max_connections": _OR_NONE[int],
    "allowed_hosts": ((tuple, list), "a list of host names"),
    "metrics_open": _FLAG,
    "docs": _FLAG,
    "log_level": _TEXT,
}


LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's


@dataclass(frozen=True)
class ServeConfig:
    """How ``expertcache serve`` meets its clients: where it listens, who may use it, and the bounds that
    keep one client from hurting the others (``docs/SERVE.md``, "Limits").

    ``max_queue`` requests running or waiting; a KV cache of ``kv_tokens`` (None: ``max_queue`` x
    min(context, 2048); rounded up to whole pages of ``KV_PAGE``); ``batch_tokens`` tokens a step
    computes at most (decode tokens and prompt chunks of every running request); ``schedule`` which
    requests a step runs (``SCHEDULES``: transformers' FIFO order, or new prompts in a step of their own
    first, ``serve.scheduling``); a request body of
    ``max_body`` at most (413); request headers complete within ``header_timeout`` of the connection
    (or of the last response on it), the body within ``body_timeout`` of its headers (408); an idle keep-alive
    connection closed after ``idle_timeout``; ``max_connections`` open at once (None: 4096, or less
    below the open-file limit), the longest-idle dropped first beyond that. ``allowed_hosts`` adds
    Host names to the loopback ones (``*``: any, behind a proxy that checks them). With an ``api_key``
    everything but ``/health`` needs it, ``/metrics`` too unless ``metrics_open``; ``docs`` serves
    ``/docs``, ``/redoc`` and ``/openapi.json`` (behind the key)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_queue: int = 64
    kv_tokens: int | None = None
    batch_tokens: int = SERVE_BATCH_TOKENS
    schedule: str = "fifo"
    max_body: str | int = "4MiB"
    max_connections: int | None = None
    header_timeout: str | float = "10s"
    body_timeout: str | float = "30s"
    idle_timeout: str | float = "5s"
    allowed_hosts: tuple[str, ...] = ()
    metrics_open: bool = False
    docs: bool = False
    log_level: str = "info"
    max_body_bytes: int = field(init=False, repr=False)
    header_timeout_s: float = field(init=False, repr=False)
    body_timeout_s: float = field(init=False, repr=False)
    idle_timeout_s: float = field(init=False, repr=False)

    def __post_init__(self) -> None:
        for name, (kinds, what) in _SERVE_TYPES.items():  # a str is not a list of names, True not a port
            value = getattr(self, name)
            if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
                raise ExpertcacheError(f"ServeConfig {name} must be {what}, got {value!r}")
            if isinstance(value, numbers.Integral) and not isinstance(value, bool):
                _set(self, **{name: int(value)})  # numpy's integers too, as Python's for the server
        if not all(isinstance(h, str) for h in self.allowed_hosts):
            raise ExpertcacheError(f"ServeConfig allowed_hosts must be names, got {self.allowed_hosts!r}")
        if self.api_key is not None and not self.api_key.strip():
            raise ExpertcacheError(
                f"{option('--api-key', 'api_key')} is empty: give the key clients must send, or leave it out "
                "(an empty key would leave every endpoint open)"
            )
        if not 0 < self.port < 65536:
            raise ExpertcacheError(f"{option('--port', 'port')} must be in 1..65535, got {self.port}")
        if self.max_queue < 1:
            raise ExpertcacheError(
                f"{option('--max-queue', 'max_queue')} must be at least 1, got {self.max_queue}"
            )
        if self.kv_tokens is not None and self.kv_tokens < 1:
            raise ExpertcacheError(
                f"{option('--kv-cache-tokens', 'kv_tokens')} must be at least 1, got {self.kv_tokens}"
            )
        if self.batch_tokens < 1:
            raise ExpertcacheError(
                f"{option('--max-batch-tokens', 'batch_tokens')} must be at least 1, got {self.batch_tokens}"
            )
        if self.schedule not in SCHEDULES:
            raise ExpertcacheError(
                f"{option('--schedule', 'schedule')} must be one of {', '.join(SCHEDULES)}, got "
                f"{self.schedule!r}"
            )
        if self.max_connections is not None and self.max_connections < 1:
            raise ExpertcacheError(
                f"{option('--max-connections', 'max_connections')} must be at least 1, got "
                f"{self.max_connections}"
            )
        body = parse_size(self.max_body, option("--max-body", "max_body"))
        if body < 1024:
            raise ExpertcacheError(
                f"{option('--max-body', 'max_body')} must be at least 1KiB, got {self.max_body!r}"
            )
        times = {}
        for name in ("header_timeout", "body_timeout", "idle_timeout"):
            flag = option("--" + name.replace("_", "-"), name)
            value = getattr(self, name)
            if str(value).strip().startswith("-"):  # one message for 0 and below: a time longer than 0
                raise ExpertcacheError(f"{flag} must be longer than 0, got {value!r}")
            times[name + "_s"] = t = parse_duration(value, flag)
            if t <= 0:
                raise ExpertcacheError(f"{flag} must be longer than 0, got {getattr(self, name)!r}")
        if self.log_level not in LOG_LEVELS:  # uvicorn's, checked when the server started
            raise ExpertcacheError(
                f"ServeConfig log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}"
            )
        hosts = tuple(host_name(h) for h in self.allowed_hosts)
        if any(not h for h in hosts):
            raise ExpertcacheError(
                f"{option('--allowed-host', 'allowed_hosts')} needs a host name, got "
                f"{list(self.allowed_hosts)!r}"
            )
        _set(self, max_body_bytes=int(body), allowed_hosts=hosts, **times)

    @property
    def kv_rounded(self) -> int | None:
        """``kv_tokens`` in whole pages, as the cache holds them (None: the default size)."""
        return None if self.kv_tokens is None else -(-self.kv_tokens // KV_PAGE) * KV_PAGE

    def host_names(self) -> frozenset[str] | None:
        """The Host header names served (None: any): loopback, ``allowed_hosts``, and the address bound
        when it is one address (not 0.0.0.0 or ::)."""
        if "*" in self.allowed_hosts:
            return None
        bound = host_name(self.host)
        extra = (bound,) if bound not in ("0.0.0.0", "::", "") else ()
        return frozenset(LOOPBACK_HOSTS + self.allowed_hosts + extra)


def host_name(host: str) -> str:
    """A Host header's (or an address's) name: lower case, no port, no brackets, no trailing dot."""
    host = str(host).strip().lower()
    if host.startswith("["):  # [::1]:8000
        host = host[1 : host.find("]")] if "]" in host else host[1:]
    elif host.count(":") == 1:  # name:port (an IPv6 address without brackets has several colons)
        host = host.split(":")[0]
    return host.rstrip(".")


def as_config(value: object, cls: type):
    """``value`` as a ``cls`` config: itself, None (the defaults), or the config's first field (a spec)."""
    if isinstance(value, cls):
        return value
    return cls() if value is None else cls(value)
