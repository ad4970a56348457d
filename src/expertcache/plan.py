"""A plan: what ``expertcache plan`` chose for a model at a budget, as the engine and the timing model run it.

A plan names the cache policy and its per-layer budgets (``None``: one cache shared by all layers), the
miss path, the predictor and its window, for a model of given shape (layers, experts, top-k) and a cache
of ``capacity`` experts; beside the choice it keeps what was predicted for it and for every candidate the
planner compared, and which of its parts are lossy. ``expertcache generate --plan``, ``expertcache
timing --plan`` and ``expertcache.load(..., plan=...)`` read it; a plan for another model's shape is
refused. Plain JSON, so a plan can be read, diffed and edited; torch-free.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from expertcache.cache.tiers import exclusive_reserve
from expertcache.config import SCHEDULES, CacheConfig, HostConfig, MissConfig, PrefetchConfig
from expertcache.errors import ExpertcacheError, did_you_mean
from expertcache.miss.registry import miss_class
from expertcache.paths import not_json_kind, write_output
from expertcache.policy.registry import is_offline

FORMAT = "expertcache-plan"
VERSION = 1
METHODS = ("shared", "uniform", "knapsack", "fate", "moepic")  # how the planner laid the budgets out
OBJECTIVES = ("tpot", "ttft", "tpot-p99", "ttft-p99", "throughput")  # what it chose by (sim.planner)


def _check_layout(source: dict) -> None:
    """How a plan's trace laid its steps out (``source.batched``: ``trace batch``'s recipe;
    ``source.served``: a server's layout), checked as read: ``timing`` and ``serve`` follow them, and a
    bad value would otherwise be refused naming options the user never gave."""
    for name, fields in (
        ("batched", ("trace", "concurrency", "requests", "stagger", "schedule", "batch_tokens")),
        ("served", ("batch_tokens", "schedule")),
    ):
        how = source.get(name)
        if how is None:
            continue
        where = f"plan: source.{name}"
        if name == "batched" and isinstance(how, dict):  # an older plan's: the defaults it was made with
            how = source[name] = {"stagger": 1, "schedule": "fifo", "batch_tokens": None, **how}
        if not isinstance(how, dict) or set(how) != set(fields):
            raise ExpertcacheError(f"{where} must be an object of {', '.join(fields)}, got {how!r}")
        least = {"concurrency": 1, "requests": 1, "stagger": 0, "batch_tokens": 1}
        for key, low in least.items():
            value = how.get(key)
            if key not in how or (value is None and key == "batch_tokens" and name == "batched"):
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ExpertcacheError(
                    f"{where}.{key} must be a whole number of at least {low}, got {value!r}"
                )
        if name == "batched" and how["batch_tokens"] is not None and how["batch_tokens"] < how["concurrency"]:
            raise ExpertcacheError(
                f"{where}.batch_tokens {how['batch_tokens']} is below its concurrency "
                f"{how['concurrency']}: a step must hold the next token of every running request"
            )
        if how["schedule"] not in SCHEDULES:
            raise ExpertcacheError(
                f"{where}.schedule must be one of {', '.join(SCHEDULES)}, got {how['schedule']!r}"
            )
        if name == "batched" and not isinstance(how["trace"], str):
            raise ExpertcacheError(f"{where}.trace must be a file's path, got {how['trace']!r}")


@dataclass(frozen=True)
class Plan:
    """One plan (see the module's docstring). ``budgets``: experts per layer, summing to ``capacity``."""

    layers: int
    experts: int
    top_k: int
    capacity: int
    policy: str = "lru"
    budgets: tuple[int, ...] | None = None
    miss: str = "fetch"
    prefetch: str = "none"
    window: int | None = None
    method: str = "uniform"
    objective: str = "tpot"
    predicted: dict = field(default_factory=dict)  # the timing model's figures for the choice
    candidates: tuple[dict, ...] = ()  # every layout compared, with its figures
    lower_bound: dict = field(default_factory=dict)  # OPT's, shared cache, same miss path
    source: dict = field(default_factory=dict)  # the trace and cost model it was planned on
    host_capacity: int | None = None  # a host level of this many experts (``cache.tiers``), or none
    host_policy: str | None = None  # its policy
    host_exclusive: bool = False  # exclusive of the expert memory (its memory then holds a reserve too)
    deterministic: bool = False  # planned on a settled link: a run of it is deterministic (its counts)
    file: str | None = field(default=None, compare=False)  # the file it was read from (not written)

    def __post_init__(self) -> None:
        for name in ("layers", "experts", "top_k", "capacity"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ExpertcacheError(f"plan: {name} must be a positive integer, got {value!r}")
        for name in ("policy", "miss", "prefetch", "method", "objective", "host_policy"):  # "policy": 5
            value = getattr(self, name, None)
            if value is not None and not isinstance(value, str):
                raise ExpertcacheError(f"plan: {name} must be text, got {value!r}")
        for name, known in (("method", METHODS), ("objective", OBJECTIVES)):
            if getattr(self, name) not in known:
                raise ExpertcacheError(
                    f"plan: {name} must be one of {', '.join(known)}, got {getattr(self, name)!r}"
                )
        if not isinstance(self.deterministic, bool):
            raise ExpertcacheError(f"plan: deterministic must be true or false, got {self.deterministic!r}")
        for name in ("predicted", "lower_bound", "source"):  # read with .get() by the engine and timing
            if not isinstance(getattr(self, name), dict):
                raise ExpertcacheError(f"plan: {name} must be an object, got {getattr(self, name)!r}")
        _check_layout(self.source)
        if self.top_k > self.experts:
            raise ExpertcacheError(
                f"plan: top_k {self.top_k} is more than the {self.experts} experts a layer has"
            )
        if not self.top_k <= self.capacity <= self.layers * self.experts:  # as make_plan lays one out
            raise ExpertcacheError(
                f"plan: capacity must be {self.top_k} .. {self.layers * self.experts} experts (top-k .. "
                f"all), got {self.capacity}"
            )
        if not isinstance(self.candidates, tuple | list) or not all(
            isinstance(c, dict) for c in self.candidates
        ):
            raise ExpertcacheError("plan: candidates is a list of the rows compared (objects)")
        object.__setattr__(self, "candidates", tuple(self.candidates))
        if self.budgets is not None:
            budgets = tuple(self.budgets)
            object.__setattr__(self, "budgets", budgets)
            if len(budgets) != self.layers:
                raise ExpertcacheError(f"plan: {len(budgets)} budgets for a model of {self.layers} layers")
            if any(not isinstance(b, int) or b < self.top_k or b > self.experts for b in budgets):
                raise ExpertcacheError(
                    f"plan: every layer's budget must be {self.top_k} .. {self.experts} experts, got "
                    f"{list(budgets)}"
                )
            if sum(budgets) != self.capacity:
                raise ExpertcacheError(
                    f"plan: budgets sum to {sum(budgets)}, not the plan's capacity of {self.capacity}"
                )
            if ":" in self.policy or self.policy.endswith("-dist"):
                raise ExpertcacheError(
                    f"plan: with budgets, policy is the per-layer policy's name, not {self.policy!r}"
                )
        if (self.host_capacity is None) != (self.host_policy is None):
            raise ExpertcacheError(
                "plan: host_capacity and host_policy go together (a host level), or neither"
            )
        if self.host_capacity is not None:
            if not isinstance(self.host_capacity, int) or isinstance(self.host_capacity, bool):
                raise ExpertcacheError(
                    f"plan: host_capacity must be a positive integer, got {self.host_capacity!r}"
                )
            if not 1 <= self.host_capacity <= self.layers * self.experts:
                raise ExpertcacheError(
                    f"plan: host_capacity must be 1 .. {self.layers * self.experts} experts, got "
                    f"{self.host_capacity}"
                )
            if not isinstance(self.host_exclusive, bool):
                raise ExpertcacheError(
                    f"plan: host_exclusive must be true or false, got {self.host_exclusive!r}"
                )
            self.host_config(1)
        elif self.host_exclusive:
            raise ExpertcacheError("plan: host_exclusive without a host level (host_capacity)")
        if is_offline(self.cache_config().name):  # a plan is run by the engine
            raise ExpertcacheError(f"plan: policy {self.policy} needs the future: it cannot run in an engine")
        self.cache_config()  # a bad policy, miss path or predictor is refused here, by its own check
        self.miss_config()
        self.prefetch_config()

    # ------------------------------------------------------------------------------ what it runs
    @property
    def policy_spec(self) -> str:
        """The policy as the engine and the simulator take it: ``lru-dist:budgets=2/3/...`` or ``lru``."""
        if self.budgets is None:
            return self.policy
        return f"{self.policy}-dist:budgets={'/'.join(map(str, self.budgets))}"

    def cache_config(self, seed: int = 0, profile=None) -> CacheConfig:
        """The plan's policy; ``profile``: the usage profile a ``static`` plan ranks its experts by (a
        plan holds none: run it with one, ``--profile TRACE.npz``)."""
        return CacheConfig(self.policy_spec, seed=seed, profile=profile)

    def host_config(self, slot_bytes: int) -> HostConfig | None:
        """The host level for slots of ``slot_bytes`` (its memory is its experts' slots, and an exclusive
        level's reserve: ``cache.tiers.exclusive_reserve``), or None."""
        if self.host_capacity is None:
            return None
        slots = self.host_capacity + (exclusive_reserve(self.top_k) if self.host_exclusive else 0)
        return HostConfig(slots * int(slot_bytes), self.host_policy, exclusive=self.host_exclusive)

    def refuse_host(self, given: list[str]) -> None:
        """One clear error where a host level's options (``given``, as the user named them) come beside a
        plan that sets its own host level."""
        if self.host_capacity is not None and given:
            raise ExpertcacheError(
                f"the plan sets a host level ({self.host_policy}, {self.host_capacity} experts); leave out "
                f"{given[0]}"
            )

    def predictor_trace(self) -> str | None:
        """The recorded trace the plan's predictor learned from (token, eam: ``plan --predictor``), which
        a run of the plan learns from too unless given another; None where it reads none."""
        from expertcache.predict.registry import trace_readers

        if not trace_readers([self.prefetch]):
            return None
        return self.source.get("predictor_trace")

    def predictor_trace_changed(self) -> str | None:
        """A note where the predictor's trace (``predictor_trace``) no longer holds the routing it held
        when the plan was made (another recording written over it): what runs is then not what was
        planned. None where it is the same, or the plan recorded no digest of it."""
        from expertcache.trace.trace import load_trace

        path, digest = self.predictor_trace(), self.source.get("predictor_digest")
        if path is None or digest is None or load_trace(path).digest() == digest:
            return None
        return (
            f"{path} has changed since the plan was made: prefetch {self.prefetch} learns from what it "
            "holds now, not what was planned"
        )

    def batched(self) -> dict | None:
        """How the plan's trace was made where it is requests served N at a time (``plan --concurrency``):
        the trace it was made from and ``batch_requests``' arguments; None for another trace."""
        batched = self.source.get("batched")
        return batched if isinstance(batched, dict) else None

    def serving(self) -> dict | None:
        """How the steps of the plan's trace were laid out where they served several requests at once:
        ``batch_tokens`` (None: the server's default) and ``schedule``, with ``concurrency`` where the
        trace was made by serving a trace N at a time (``batched``), or without it where it was recorded
        by a server (``serve --record-trace``); None for another trace. ``serve --plan`` lays its steps
        out so."""
        made = self.batched()
        if made is not None:
            return made
        served = self.source.get("served")
        return served if isinstance(served, dict) else None

    def served_trace(self):
        """The plan's trace of requests served N at a time, made again from the trace it was made from
        (the plan holds the recipe, not the trace), or None where that trace is not there or the plan's
        trace was not made so."""
        from expertcache.trace.batch import batch_requests
        from expertcache.trace.trace import load_trace

        how = self.batched()
        if how is None or not Path(how["trace"]).is_file():
            return None
        return batch_requests(
            load_trace(how["trace"]), how["concurrency"], requests=how["requests"],
            batch_tokens=how["batch_tokens"], stagger=how["stagger"], schedule=how["schedule"],
        )  # fmt: skip

    def trace_file(self) -> str | None:
        """The file of the trace the plan was made on, where it is still there (``timing --plan``
        replays it by default)."""
        made_on = self.source.get("trace")
        return made_on if isinstance(made_on, str) and Path(made_on).is_file() else None

    def miss_config(self) -> MissConfig:
        return MissConfig(self.miss)

    def prefetch_config(self, **options: object) -> PrefetchConfig:
        """The plan's predictor and window with ``options`` (``PrefetchConfig``'s); a plan made
        ``deterministic`` runs so whatever ``options`` say (its predicted counts are a settled run's)."""
        if self.deterministic:
            options["deterministic"] = True
        return PrefetchConfig(self.prefetch, window=self.window, **options)

    @property
    def lossy(self) -> list[str]:
        """The parts of the plan that change the model's output (empty: the plan is exact)."""
        return [f"miss path {self.miss}"] if miss_class(self.miss_config().name).lossy else []

    def check_model(self, layers: int, experts: int, top_k: int, what: str = "the model") -> None:
        """Refuse to run the plan on a model of another shape."""
        have, want = (layers, experts, top_k), (self.layers, self.experts, self.top_k)
        if have != want:
            raise ExpertcacheError(
                f"the plan{f' {self.file}' if self.file else ''} is for a model of {want[0]} MoE layers x "
                f"{want[1]} experts, top-{want[2]}; "
                f"{what} has {have[0]} x {have[1]}, top-{have[2]}"
            )

    def __repr__(self) -> str:  # the dataclass's printed every candidate's figures (kilobytes: a trial)
        return f"<Plan {self.describe()}{f' ({self.file})' if self.file else ''}>"

    def describe(self) -> str:
        layout = "shared" if self.budgets is None else "/".join(map(str, self.budgets))
        if self.budgets is None and "/" in self.miss:  # a miss path laid out per layer (moepic's split)
            layout = "per-layer split"
        pf = "" if self.prefetch == "none" else f", prefetch {self.prefetch}"
        if self.window is not None and self.prefetch != "none":
            pf += f" (window {self.window})"
        host = (
            ""
            if self.host_capacity is None
            else f", host level {self.host_policy} ({self.host_capacity} experts"
            + (", exclusive)" if self.host_exclusive else ")")
        )
        settled = ", deterministic" if self.deterministic else ""
        return (
            f"{self.method}: {self.policy} {layout} ({self.capacity} experts), miss {self.miss}{pf}{host}"
            f"{settled}"
        )

    # ------------------------------------------------------------------------------ files
    def to_dict(self) -> dict[str, object]:
        data = asdict(self)
        del data["file"]
        data["budgets"] = None if self.budgets is None else list(self.budgets)
        data["candidates"] = list(self.candidates)
        return {"format": FORMAT, "version": VERSION, **data, "lossy": self.lossy}

    def save(self, path: str | Path) -> None:
        write_output(path, json.dumps(self.to_dict(), indent=1) + "\n", "plan")

    @classmethod
    def from_dict(cls, data: object, source: str = "plan") -> Plan:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ExpertcacheError(f"{source}: not an expertcache plan (written by 'expertcache plan')")
        if data.get("version") != VERSION:
            raise ExpertcacheError(
                f"{source}: plan version {data.get('version')!r}; this expertcache reads {VERSION}"
            )
        known = set(cls.__dataclass_fields__) - {"file"}
        unknown = sorted(set(data) - known - {"format", "version", "lossy"})  # lossy: computed, written
        if unknown:  # an edited plan's misspelt key ran the plan without it, in silence
            hint = did_you_mean(unknown[0], known, n=1)
            raise ExpertcacheError(f"{source}: the plan has no field {unknown[0]!r}{hint}")
        fields = {k: v for k, v in data.items() if k in known}
        missing = [k for k in ("layers", "experts", "top_k", "capacity") if k not in fields]
        if missing:
            raise ExpertcacheError(f"{source}: the plan has no {', '.join(missing)}")
        try:
            plan = cls(**fields)
        except TypeError as exc:
            raise ExpertcacheError(f"{source}: {exc}") from None
        except ExpertcacheError as exc:
            raise ExpertcacheError(f"{source}: {exc}") from None
        return plan

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8-sig"))
        except OSError as exc:
            raise ExpertcacheError(
                f"{path}: cannot read the plan ({(exc.strerror or str(exc)).lower()})"
            ) from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            kind = not_json_kind(path)
            if kind is not None:
                raise ExpertcacheError(
                    f"{path} is {kind}, not a plan (expertcache plan -o writes one)"
                ) from None
            raise ExpertcacheError(f"plan {path} is not JSON: {exc}") from None
        return replace(cls.from_dict(data, str(path)), file=str(path))


def as_plan(value: object) -> Plan | None:
    """A ``Plan``, a plan file's path, or None."""
    if value is None or isinstance(value, Plan):
        return value
    if isinstance(value, str | Path):
        return Plan.load(value)
    raise ExpertcacheError(f"plan must be a Plan or a plan file's path, got {type(value).__name__}")
