"""The simulator's entry point: trace x policies x capacities x order -> results, OPT included."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from expertcache.cache.schedule import build_schedule, usage_profile, with_profile
from expertcache.errors import (
    ExpertcacheError,
    ExpertcacheWarning,
    arguments_checked,
    caller_stacklevel,
    option,
)
from expertcache.miss.registry import miss_class
from expertcache.policy.dist import uniform_budgets
from expertcache.policy.registry import fixed_capacity, min_capacity, parse_policy, policy_class
from expertcache.sim import fast
from expertcache.sim.curves import all_capacities, run_policy, with_opt
from expertcache.sim.replay import SimResult
from expertcache.sim.timing import RECORDED, host_level_replay, preloaded_note, unsettled
from expertcache.trace.default import default_trace  # noqa: F401 (re-exported)
from expertcache.trace.trace import Trace, as_trace
from expertcache.units import capacity_beyond, capacity_items, true_or_false, whole_number

DEFAULT_POLICIES = ("opt", "lru", "lru-dist", "llru", "lcp", "lfu", "marking", "fifo", "static")


@arguments_checked
def simulate(
    trace: Trace | str,
    policies: Sequence[str] = DEFAULT_POLICIES,
    capacities: Sequence[int | str] | int | str = "all",
    order: str = "layer",
    seed: int = 0,
    skip_infeasible: bool = False,
    jobs: int = 1,
    profile: Trace | str | None = None,
) -> list[SimResult]:
    """Replay ``trace`` (a ``Trace`` or its file) through every policy ('name' or 'name:k=v,...') at
    every capacity ('all' = 1..L*E, or items as ``sim --capacity`` takes them: 24, "8:96:8", "25%");
    each result carries OPT's misses at its capacity. With ``skip_infeasible``, capacities a
    policy cannot run with (below one slot per layer for -dist, other than the sum of -dist budgets
    given) are left out instead of raising.
    ``jobs`` > 1 replays capacities on that many processes. ``profile`` (a trace or its file): the
    usage profile the static policies rank by, as the engine's ``profile`` (default: the replayed
    trace's own use, an oracle's)."""
    trace = as_trace(trace, replay=True)
    seed = whole_number(seed, option("--seed", "seed"), 0)  # -1 would draw as 1 does
    jobs = whole_number(jobs, "jobs")
    true_or_false(skip_infeasible, "skip_infeasible")
    if not isinstance(policies, str) and not (isinstance(policies, Sequence) and policies):
        raise ExpertcacheError(
            f"policies: a policy spec ('lru') or a non-empty list of them, got {policies!r}"
        )
    if not isinstance(policies, str):  # each once, as capacities are: a repeat is the same replay
        policies = list(dict.fromkeys(policies))
    ranked, names = None, [policies] if isinstance(policies, str) else list(policies)
    if profile is not None:
        if not any(policy_class(parse_policy(p)[0]).needs_profile for p in names):
            raise ExpertcacheError(
                f"{option('--profile', 'profile')} ranks experts for the static policies; none of "
                f"{', '.join(names)} ranks by one"
            )
        ranked = usage_profile(profile, trace)
    for note in replay_notes(trace, trace.source, profiled=profile is not None, policies=names, seed=seed):
        warnings.warn(note, ExpertcacheWarning, stacklevel=caller_stacklevel())
    with fast.plain_pages():  # arrays of 100M requests: see plain_pages
        return _simulate(trace, policies, capacities, order, seed, skip_infeasible, jobs, ranked)


def replay_notes(
    trace: Trace,
    name: str = "TRACE",
    profiled: bool = False,
    policies: Sequence[str] | None = None,
    seed: int | None = None,
) -> list[str]:
    """Why these replays (a whole-expert cache, fetched on demand, no prefetching) do not count what the
    run that recorded ``trace`` (its file ``name``) counted, and what replays it: the run prefetched,
    served its misses by another miss path, or both (one note, one command); or it ranked a static
    policy by a profiling run's use that the replay was not given (``profiled``: it was); or ran a policy
    that ``policies`` (those replayed) do not hold, where they hold its name with other parameters (the
    uniform ``lru-dist`` beside a plan's ``lru-dist:budgets=...``) or are the default ones; or its policy
    drew at random from another seed than ``seed``. ``simulate`` warns them, ``sim`` notes them."""
    meta = trace.meta
    drew = meta.get("policy_seed")
    miss = str(meta.get("miss", "fetch"))
    other_miss = miss.partition(":")[0] != "fetch"
    prefetched = ""
    if trace.predicted is not None:
        steps = trace.step_id if trace.step_id is not None else np.arange(trace.num_tokens)
        predicted = (trace.predicted >= 0).reshape(trace.num_tokens, -1).any(axis=1)
        who = meta.get("predictor", "a predictor")
        prefetched = (
            f"prefetched ({who}, in {len(np.unique(steps[predicted]))} of {len(np.unique(steps))} steps)"
        )
    notes = [preloaded_note(meta)] if meta.get("preloaded") else []
    policy, profile = meta.get("policy", "POLICY"), meta.get("profile")
    if drew is not None and seed is not None and int(drew) != seed and str(policy) in (policies or ()):
        notes.append(
            f"this run's policy {policy} drew at random with seed {drew}, these replays with seed {seed}: "
            + option(f"--seed {drew}", f"seed={drew}")
            + " replays it"
        )
    if profile is not None and not profiled:  # a static policy's ranking: the run's, not this trace's
        notes.append(
            f"this run's policy {policy} ranked experts by the use of {profile}; these replays rank by "
            f"{name}'s own unless given it: " + option(f"--profile {profile}", f"profile={str(profile)!r}")
        )
    level = host_level_replay(meta, trace.top_k, bool(prefetched))  # a host level below, which sim has not
    if not other_miss and not prefetched:
        if policies is not None and _other_policy(str(policy), policies):  # its counts are its policy's
            notes.append(
                f"this run's policy was {policy}, which these replays do not run: "
                + option(f"--policy {policy}", f"policies=[{policy!r}]")
                + " replays it"
            )
        if level is not None:
            named = f" --policy {policy}" if policy not in ("lru", "POLICY") else ""
            notes.append(
                f"this run had a host level of {meta['host_capacity']} experts below its expert memory, "
                "which these replays leave out (their counts are the expert memory's): "
                + option(
                    f"'expertcache timing --trace {name}{named} {level[0]}'",
                    f"simulate_timing(trace, 'recorded', cache={policy!r}, {level[1]})",
                )
                + " replays its host level too"
            )
        return notes
    recorded = "capacities" in meta  # an engine's run: timing replays its own cache parts
    did, undone = [], []
    # the run's own policy (timing's default is LRU; a new user replayed an LLRU run as LRU)
    named = other_miss or policy not in ("lru", "POLICY")
    cache = repr(policy) if profile is None else f"CacheConfig({policy!r}, profile={str(profile)!r})"
    flags, args = (f" --policy {policy}", f", cache={cache}") if named else ("", "")
    if profile is not None:  # a static policy ranks by the run's profile
        flags += f" --profile {profile}"
    if other_miss:
        memory = meta.get("memory")  # an engine's expert memory in whole experts (not its parts' slots)
        did.append(
            f"served its misses by miss path {miss}"
            + (f" (in an expert memory of {memory} experts)" if memory is not None else "")
        )
        undone.append("fetch every miss whole")
        flags, args = f"{flags} --miss {miss}", f"{args}, miss={miss!r}"
    if prefetched:
        did.insert(0, prefetched)
        undone.insert(0, "do not prefetch")
        if meta.get("deterministic"):  # its transfers landed before each decision: so do the replay's
            flags += " --prefetch recorded --deterministic"
            args += ", prefetch=PrefetchConfig('recorded', deterministic=True)"
        else:
            flags, args = f"{flags} --prefetch recorded", f"{args}, prefetch='recorded'"
    if level is not None:
        flags, args = f"{flags} {level[0]}", f"{args}, {level[1]}"
    capacity = meta.get("capacity", "N")
    given = repr(RECORDED) if recorded else "capacity" if capacity == "N" else capacity
    note = (
        f"this run {' and '.join(did)}; these replays {', '.join(undone)}, so their counts are not the "
        "run's: "
        + option(
            f"'expertcache timing --trace {name}{flags}"
            + ("" if recorded else f" --capacity {capacity}")
            + "'",
            f"simulate_timing(trace, {given}{args})",
        )
        + " replays it"
        + (" at the run's own cache parts" if recorded else "")
        + (" (each transfer settled, as in the run)" * bool(prefetched and meta.get("deterministic")))
    )
    if prefetched and meta.get("deterministic") is False:
        note += "; " + unsettled(meta)
    if other_miss and _decides_by_costs(miss):
        note += (
            ", its decisions priced by the costs the run decided by, which the trace holds"
            if "costs" in meta and recorded
            else ", its decisions priced by the cost model given (the machine's: "
            + option("--cost PROFILE.json", "cost=CostModel.load('PROFILE.json')")
            + ")"
        )
    return [*notes, note]


def _decides_by_costs(miss: str) -> bool:
    """A miss path (spec) whose choices depend on the machine's costs (host, hybrid, ...)."""
    try:
        return miss_class(miss.partition(":")[0]).needs_costs
    except ExpertcacheError:
        return True  # unknown here: the advice does no harm


def _other_policy(policy: str, policies: Sequence[str]) -> bool:
    """The run's ``policy`` is not replayed, and the replays would pass for it: its name with other
    parameters, or the default set (which a new user reads as covering the run's)."""
    if policy == "POLICY" or policy in policies:
        return False
    try:
        name, params = parse_policy(policy)
        budgets = params.get("budgets")
        plain = set(params) == {"budgets"} and isinstance(budgets, list) and name in policies
        if plain and list(budgets) == uniform_budgets(sum(budgets), len(budgets)):  # the plain -dist's split
            return False
        return list(policies) == list(DEFAULT_POLICIES) or name in {parse_policy(p)[0] for p in policies}
    except ExpertcacheError:
        return False


def _simulate(
    trace: Trace,
    policies: Sequence[str],
    capacities: Sequence[int] | str,
    order: str,
    seed: int,
    skip_infeasible: bool,
    jobs: int,
    profile: dict | None = None,
) -> list[SimResult]:
    schedule = build_schedule(trace, order)
    if profile is not None:
        schedule = with_profile(schedule, profile)
    caps = (
        all_capacities(schedule)
        if capacities == "all"
        else _capacities(capacities, trace.num_keys, schedule.min_room)
    )
    specs = [parse_policy(spec) for spec in ([policies] if isinstance(policies, str) else policies)]
    with ThreadPoolExecutor(1) as background:
        opt, opt_caps = None, []
        if fast.use_compiled(schedule):  # OPT's bound beside the policies: the kernels release the GIL
            opt_caps = sorted({c for c in caps if c >= schedule.min_room})
            opt = background.submit(run_policy, schedule, "opt", opt_caps)
        results: list[SimResult] = []
        for name, params in specs:
            low = min_capacity(name, trace.num_layers, params, schedule.min_room)
            fixed = fixed_capacity(name, params)
            mine = [c for c in caps if c >= low and fixed in (None, c)] if skip_infeasible else caps
            if name == "opt" and not params and opt is not None and set(mine) <= set(opt_caps):
                by_cap = {r.capacity: r for r in opt.result()}  # the bound is the policy's row
                results += [copy.copy(by_cap[c]) for c in mine]
                continue
            results += run_policy(schedule, name, mine, seed, params, jobs) if mine else []
        return with_opt(schedule, results, None if opt is None else opt.result())


def _capacities(given: Sequence[int | str] | int | str, total: int, room: int = 1) -> list[int]:
    """Capacities as ``simulate`` takes them: one or a list of items of ``sim --capacity``'s grammar
    (``units.capacity_items``: whole experts, ranges, shares of all ``total`` experts, ``all`` from
    ``room``, the least the order allows); as ``sim``, a range's capacities beyond the trace's bounds are
    left out and one capacity above all experts is capped, each with a warning."""
    if isinstance(given, int | str) and not isinstance(given, bool):
        given = [given]
    elif not (isinstance(given, Sequence) and given):
        raise ExpertcacheError(
            "capacities: experts (24), a range ('8:96:8'), a share ('25%'), 'all' or a non-empty list of "
            f"these, got {given!r}"
        )
    caps = []
    for c in given:
        got = capacity_items(c, total, room)
        if any(isinstance(n, str) for n in got):
            raise ExpertcacheError(f"capacity {c!r} is less than one expert of {total}")
        if ":" in str(c):  # a range: what lies beyond the trace's bounds is left out, and said
            out = [n for n in got if n < room]
            beyond = capacity_beyond(c, total)
            for what, bound in ((", ".join(map(str, out)), f"below top-k {room}"),
                                (beyond, f"above all {total} experts")):  # fmt: skip
                if what:
                    warnings.warn(
                        f"capacity {c}: left out {what} ({bound})", ExpertcacheWarning,
                        stacklevel=caller_stacklevel(),
                    )  # fmt: skip
            got = [n for n in got if n >= room]
        elif len(got) == 1 and got[0] > total:  # as sim --capacity: capped, and said
            warnings.warn(
                f"a cache of {got[0]} experts is more than all {total}; capped at {total}",
                ExpertcacheWarning,
                stacklevel=caller_stacklevel(),  # the user's line that called simulate
            )
            got = [total]
        caps += got
    if not caps:
        raise ExpertcacheError(f"capacities {given!r} select no capacity of the trace's {total} experts")
    return list(dict.fromkeys(caps))  # each once, in the order given, as sim --capacity
