"""From a trace to the request groups a cache sees, in one of three orders.

A schedule is a list of request groups, ``per_layer`` groups for each (round, layer) visit, so
that group g belongs to round g // (L * per_layer) and layer (g // per_layer) % L. Groups may be
empty (unknown entries).

- ``layer`` (what the engine does): one forward step per round: the recorded ``step_id`` (a served
  batch: the tokens of every request that step ran), else all prompt tokens of a request in one prefill
  step (from ``seq_id`` / ``is_prefill``), then one token per decode step; each layer of a step is one
  group, its distinct experts in first-use order (``cache.group_experts``, the rule the engine applies
  to its router's choices), served pinned together. A step holding any prompt token is a prefill step
  (its counts go to the prefill phase), as the engine counts it.
- ``flat``: plain paging over token, layer, experts in stored order: one request per group.
- ``rounds``: the LLRU paper's conversion of top-k routing into K rounds per token: round t*K + k requests
  the k-th expert of every layer.
"""

from __future__ import annotations

import numbers
import os
from dataclasses import dataclass, field, replace
from functools import cached_property

import numpy as np

from expertcache.cache.residency import group_experts
from expertcache.errors import ExpertcacheError
from expertcache.policy.base import Key
from expertcache.trace.trace import Trace, as_trace

ORDERS = ("layer", "flat", "rounds")


@dataclass(frozen=True, eq=False)
class Schedule:
    """Request groups in time order, with the per-request arrays that stack algorithms need."""

    order: str
    num_layers: int
    num_experts: int
    top_k: int
    per_layer: int  # groups per (round, layer) visit
    group_table: list[tuple[Key, ...]]  # the distinct groups (flat and rounds: () then one per key)
    group_index: np.ndarray | None  # int32 [G]: each group's row of group_table (None: 1 + key id)
    round_prefill: np.ndarray  # bool [rounds]: the round is a prefill step / a prompt token
    round_token: np.ndarray  # int64 [rounds]: index of the round's (first) token in the trace
    round_seq: np.ndarray  # int64 [rounds]: request (seq_id) of the round's (first) token, 0 if unknown
    req_group: np.ndarray  # int64 (or int32) [R]: group index of each request, ascending
    req_key: np.ndarray  # int32 [R]: key id (layer * E + expert) of each request
    layer_requests: np.ndarray  # int64 [2, L]: requests per phase (row 0 decode, row 1 prefill) and layer
    trace: Trace | None = field(default=None, repr=False)  # the routing it came from (for group_scores)

    def __repr__(self) -> str:  # the dataclass's printed every group (1,710 characters for a small trace)
        source = "" if self.trace is None else f" of {self.trace.source}"
        shape = f"{self.num_layers} layers x {self.num_experts} experts, top-{self.top_k}"
        return (
            f"<Schedule{source}, {self.order} order: {self.num_rounds} rounds, {len(self.req_key)} requests "
            f"in {self.num_groups} groups, {shape}>"
        )

    @cached_property
    def groups(self) -> list[tuple[Key, ...]]:
        """Every request group's keys in service order, for the reference replay (built on first use:
        one reference per group into ``group_table``; the compiled replay reads the arrays instead)."""
        table, index = self.group_table, self.group_index
        if index is None:  # flat and rounds: a group is one request, or empty (an unknown entry)
            index = np.zeros(self.num_groups, dtype=np.int32)
            index[self.req_group] = self.req_key + 1
        return [table[i] for i in index.tolist()]

    @property
    def num_groups(self) -> int:
        return self.num_rounds * self.num_layers * self.per_layer

    @property
    def num_rounds(self) -> int:
        return len(self.round_prefill)

    @property
    def min_room(self) -> int:
        """Slots a layer needs at least: top-k in layer order (a token's experts co-reside), else 1."""
        return min_room(self.order, self.top_k)

    @property
    def num_requests(self) -> int:
        return len(self.req_key)

    @cached_property
    def bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """First and end request indices of each non-empty group: int64 [G'], [G']."""
        g = self.req_group
        if not len(g):
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty
        if self.order != "layer":  # flat and rounds: one request per group
            starts = np.arange(len(g), dtype=np.int64)
            return starts, starts + 1
        starts = np.flatnonzero(np.r_[True, g[1:] != g[:-1]]).astype(np.int64)
        return starts, np.r_[starts[1:], len(g)].astype(np.int64)

    @cached_property
    def max_group(self) -> int:
        """The largest group: capacities from here up are served without splitting."""
        return int(self.max_group_by_layer.max(initial=0))

    @cached_property
    def max_group_by_layer(self) -> np.ndarray:
        """The largest group of each layer: a layer whose room is smaller has its groups split. -> [L]"""
        out = np.zeros(self.num_layers, dtype=np.int64)
        if self.order != "layer":  # flat and rounds: one request per group
            return (self.layer_requests.sum(axis=0) > 0).astype(np.int64)
        if self.num_requests:
            sizes = np.bincount(self.req_group)  # [G] (0 for empty groups)
            layer = (np.arange(len(sizes)) // self.per_layer) % self.num_layers
            np.maximum.at(out, layer, sizes)
        return out

    def key(self, key_id: int) -> Key:
        return divmod(int(key_id), self.num_experts)

    @cached_property
    def future(self) -> dict[Key, list[int]]:
        """For each key, the ascending group indices that request it (what OPT needs)."""
        if not self.num_requests:
            return {}
        order = np.argsort(self.req_key, kind="stable")
        keys, starts = np.unique(self.req_key[order], return_index=True)
        groups = np.split(self.req_group[order], starts[1:])
        return {self.key(k): g.tolist() for k, g in zip(keys.tolist(), groups, strict=True)}

    @cached_property
    def group_scores(self) -> list[dict[Key, float]] | None:
        """Each group's routing scores by key (the gate weight renormalised per token, summed over the
        group's tokens; 1/K per token without gate weights), what score-based policies (``mrs``)
        observe, as the engine computes them; None for a schedule built without its trace."""
        tr = self.trace
        if tr is None:
            return None
        if self.order != "layer":
            return _token_group_scores(self, tr)
        from expertcache.cache.needs import needs_of  # the engine's own rule, for the same scores

        out: list[dict[Key, float]] = []
        starts = self.round_token.tolist()
        ends = [*starts[1:], tr.num_tokens]
        for s, e in zip(starts, ends, strict=True):
            for layer in range(self.num_layers):
                weights = None if tr.weights is None else tr.weights[s:e, layer]
                needs = needs_of(layer, tr.experts[s:e, layer], weights)
                out.append({n.key: n.mass for n in needs})
        return out

    @cached_property
    def group_tokens(self) -> list[list[int]]:
        """Each group's tokens routed to each of its keys, in the group's order (what token-weighted
        policies, ``tlfu``, observe): one each in flat and rounds order, and for a schedule built without
        its trace."""
        tr = self.trace
        if tr is None or self.order != "layer":
            return [[1] * len(g) for g in self.groups]
        E, L = self.num_experts, self.num_layers
        out: list[list[int]] = []
        starts = self.round_token.tolist()
        ends = [*starts[1:], tr.num_tokens]
        for r, (s, e) in enumerate(zip(starts, ends, strict=True)):
            block = tr.experts[s:e]  # [n, L, K]
            for layer in range(L):
                col = block[:, layer].reshape(-1)
                counts = np.bincount(col[col >= 0], minlength=E)
                out.append(counts[[ex for _, ex in self.groups[r * L + layer]]].tolist())
        return out

    @cached_property
    def req_score(self) -> np.ndarray:
        """Each request's routing score in its group (``group_scores``; 1 for a schedule built without its
        trace, what a policy that observes scores assumes then), as one array for compiled replays. [R]"""
        tr, R = self.trace, self.num_requests
        if tr is None:
            return np.ones(R)
        if self.order != "layer":
            return _token_scores(self, tr)[self.req_group]
        scores, E = self.group_scores, self.num_experts
        assert scores is not None
        pairs = zip(self.req_group.tolist(), self.req_key.tolist(), strict=True)
        return np.fromiter((scores[g].get(divmod(k, E), 0.0) for g, k in pairs), dtype=np.float64, count=R)

    @cached_property
    def profile(self) -> dict[Key, int]:
        """How often each key is requested (what Static ranks by)."""
        counts = np.bincount(self.req_key, minlength=self.num_layers * self.num_experts)
        return {self.key(k): int(c) for k, c in enumerate(counts.tolist()) if c}


def usage_profile(given: Trace | str | os.PathLike, trace: Trace) -> dict[Key, int]:
    """The usage profile ``given`` (a trace or its file: a profiling run's, as the engine's ``--profile``
    takes it) for replaying ``trace``: how often it requested each key, what Static ranks by."""
    got = as_trace(given, "profile", replay=True)
    if (got.num_layers, got.num_experts) != (trace.num_layers, trace.num_experts):
        raise ExpertcacheError(
            f"profile {got.source} has {got.num_layers} layers x {got.num_experts} experts; "
            f"{trace.source} has {trace.num_layers} x {trace.num_experts}"
        )
    return build_schedule(got, "layer").profile


def with_profile(schedule: Schedule, profile: dict[Key, int]) -> Schedule:
    """``schedule`` with another usage profile (``usage_profile``) in place of its own: the static
    policies then rank by the profiling run the engine ranked by, not by the replayed trace itself."""
    copy = replace(schedule)
    copy.__dict__["profile"] = profile  # the cached property's value (the dataclass is frozen)
    return copy


def build_schedule(trace: Trace, order: str = "layer") -> Schedule:
    """The request groups of ``trace`` (a ``Trace`` or its file) in ``order`` (layer, flat or rounds)."""
    trace = as_trace(trace)
    if order == "layer":
        schedule = _layer_order(trace)
    elif order == "flat":
        schedule = _token_order(trace, trace.experts, order, rounds_per_token=1)  # [T, L, K]
    elif order == "rounds":
        ex = trace.experts.transpose(0, 2, 1)[:, :, :, None]  # [T, K, L, 1]
        schedule = _token_order(trace, ex.reshape(-1, trace.num_layers, 1), order, trace.top_k)
    else:
        raise ExpertcacheError(f"unknown order {order!r}; choose from {', '.join(ORDERS)}")
    object.__setattr__(schedule, "trace", trace)
    return schedule


def _token_group_scores(schedule: Schedule, trace: Trace) -> list[dict[Key, float]]:
    """flat and rounds order: each group is one (token, layer, k) entry (or none), scored by its weight
    renormalised over the token's experts of that layer."""
    scores = _token_scores(schedule, trace).tolist()
    return [{g[0]: s} if g else {} for g, s in zip(schedule.groups, scores, strict=True)]


def _token_scores(schedule: Schedule, trace: Trace) -> np.ndarray:
    """flat and rounds order: each group's score (``_token_group_scores``; 0 for an empty group). [G]"""
    given = trace.weights if trace.weights is not None else 1.0
    w = np.where(trace.experts >= 0, given, 0.0).astype(np.float64)  # [T, L, K]
    total = w.sum(axis=2, keepdims=True)
    w = np.divide(w, total, out=np.zeros_like(w), where=total > 0)
    if schedule.order == "rounds":  # round t*K + k holds the k-th expert of every layer
        w = w.transpose(0, 2, 1)  # [T, K, L]
    return w.reshape(-1)


def min_room(order: str, top_k: int) -> int:
    """Slots a layer needs at least: top-k in layer order (a token's experts co-reside), else 1."""
    return top_k if order == "layer" else 1


def check_capacity(capacity: int, order: str, top_k: int) -> None:
    """Capacity must be a whole number of experts (not 24.5, not True, not "24": ``simulate`` takes
    shares), at least 1, and at least top-k in layer order."""
    if isinstance(capacity, bool) or not isinstance(capacity, numbers.Integral):
        raise ExpertcacheError(f"capacity must be a whole number of experts, got {capacity!r}")
    if capacity < 1:
        raise ExpertcacheError(f"capacity must be at least 1 expert, got {capacity}")
    if capacity < min_room(order, top_k):
        raise ExpertcacheError(
            f"capacity {capacity} is below top-k {top_k}: in layer order a token's "
            f"{top_k} experts of a layer must be resident together"
        )


def step_starts(trace: Trace) -> np.ndarray:
    """First token of each forward step: the recorded ``step_id`` if any, else consecutive prompt
    tokens of a sequence share one step and every other token is a step of its own."""
    t = trace.num_tokens
    new = np.ones(t, dtype=bool)
    if trace.step_id is not None:
        new[1:] = trace.step_id[1:] != trace.step_id[:-1]
    elif trace.is_prefill is not None:
        pf = trace.is_prefill == 1
        same = pf[1:] & pf[:-1]
        if trace.seq_id is not None:
            same &= trace.seq_id[1:] == trace.seq_id[:-1]
        new[1:] = ~same
    return np.flatnonzero(new)


def _token_order(trace: Trace, ex: np.ndarray, order: str, rounds_per_token: int) -> Schedule:
    """One request per group: ex is [rounds, L, per_layer] in service order."""
    L, E = trace.num_layers, trace.num_experts
    dtype = np.int32 if L * E < 2**31 else np.int64
    kid = ex.astype(dtype)  # [rounds, L, per_layer] -> key ids, in place (100M requests: memory counts)
    kid += (np.arange(L, dtype=dtype) * E)[None, :, None]
    kid = kid.reshape(-1)
    if ex.min(initial=0) >= 0:  # no unknown entries: one request per group
        wide = np.int32 if len(kid) < 2**31 else np.int64
        req_group, req_key = np.arange(len(kid), dtype=wide), kid
    else:
        valid = (ex >= 0).reshape(-1)
        req_group, req_key = np.flatnonzero(valid), kid[valid]
    prefill = token_prefill(trace)

    def per_layer(ex: np.ndarray) -> np.ndarray:  # known entries per layer of [T, L, K]
        return (ex >= 0).reshape(len(ex), -1).sum(axis=0, dtype=np.int64).reshape(L, -1).sum(axis=1)

    counts = np.zeros((2, L), dtype=np.int64)  # requests per phase and layer, from the trace
    if prefill.any():
        counts[1] = per_layer(trace.experts[prefill])
    counts[0] = per_layer(trace.experts) - counts[1]
    return Schedule(
        order=order,
        num_layers=L,
        num_experts=E,
        top_k=trace.top_k,
        per_layer=ex.shape[2],
        group_table=[()] + [((k // E, k % E),) for k in range(L * E)],
        group_index=None,
        round_prefill=np.repeat(prefill, rounds_per_token),
        round_token=np.repeat(np.arange(trace.num_tokens, dtype=np.int64), rounds_per_token),
        round_seq=np.repeat(token_seq(trace), rounds_per_token),
        req_group=req_group,
        req_key=req_key.astype(np.int32, copy=False),
        layer_requests=counts,
    )


def _layer_order(trace: Trace) -> Schedule:
    L, E, T = trace.num_layers, trace.num_experts, trace.num_tokens
    starts = step_starts(trace)
    ends = np.append(starts[1:], T)
    table: dict[tuple[int, ...], int] = {}  # (layer, e0, e1, ...) -> index in rows
    rows: list[tuple[int, ...]] = []
    gid = np.empty((len(starts), L), dtype=np.int64)  # [steps, L] -> table index

    def intern(layer: int, experts: list[int]) -> int:
        sig = (layer, *experts)
        if sig not in table:
            table[sig] = len(rows)
            rows.append(sig)
        return table[sig]

    single = np.flatnonzero(ends - starts == 1)
    if len(single):  # one-token steps: intern distinct (layer, row) pairs in bulk
        ex = trace.experts[starts[single]]  # [S, L, K]
        uniq, inverse = _unique_layer_rows(ex, base=max(E, L) + 1)
        local = [intern(int(r[0]), group_experts([r[1:]])) for r in uniq.tolist()]
        gid[single] = np.asarray(local, dtype=np.int64)[inverse].reshape(len(single), L)
    for s in np.flatnonzero(ends - starts > 1).tolist():  # prompt steps: union over tokens
        block = trace.experts[starts[s] : ends[s]]  # [n, L, K]
        for layer in range(L):
            gid[s, layer] = intern(layer, group_experts(block[:, layer, :].tolist()))
    keys = [tuple((r[0], e) for e in r[1:]) for r in rows]
    width = max((len(r) - 1 for r in rows), default=0)
    padded = np.full((len(rows), max(width, 1)), -1, dtype=np.int32 if L * E < 2**31 else np.int64)
    for i, r in enumerate(rows):
        padded[i, : len(r) - 1] = [r[0] * E + e for e in r[1:]]
    flat_gid = gid.reshape(-1)
    row_len = (padded >= 0).sum(axis=1)  # a row's members fill it from the left
    req_group = np.repeat(np.arange(len(flat_gid), dtype=np.int64), row_len[flat_gid])
    members = padded[flat_gid].reshape(-1)  # [G * width]
    req_key = members if width == 1 and (row_len == 1).all() else np.compress(members >= 0, members)
    prefill = np.logical_or.reduceat(token_prefill(trace), starts)  # any prompt token: a prefill step
    # requests per phase and layer, from how often each distinct group is used (not per request)
    row_layer = np.asarray([r[0] for r in rows], dtype=np.int64)
    counts = np.zeros((2, L), dtype=np.int64)
    for phase, steps in enumerate((~prefill, prefill)):
        if steps.any():
            uses = np.bincount(gid[steps].reshape(-1), minlength=len(rows))
            counts[phase] = np.bincount(row_layer, weights=uses * row_len, minlength=L).astype(np.int64)
    return Schedule(
        order="layer",
        num_layers=L,
        num_experts=E,
        top_k=trace.top_k,
        per_layer=1,
        group_table=keys,
        group_index=flat_gid.astype(np.int32),
        round_prefill=prefill,
        round_token=starts.astype(np.int64),
        round_seq=token_seq(trace)[starts],
        req_group=req_group,
        req_key=req_key.astype(np.int32, copy=False),
        layer_requests=counts,
    )


def _unique_layer_rows(ex: np.ndarray, base: int) -> tuple[np.ndarray, np.ndarray]:
    """The distinct (layer, e0, e1, ...) rows of ex [S, L, K], sorted, and each (step, layer)'s index
    among them: -> int64 [U, 1 + K], [S * L]. Through one integer code per row when it fits; by a table
    of every code (linear time) when the possible codes are few next to the rows, else by sorting (a
    table of 2 x 61^4 codes for one layer of a 1096-token trace took 0.1 s and 250 MB, a sort 0.1 ms)."""
    S, L, K = ex.shape
    if (K + 1) * np.log2(base) >= 62:  # no code fits: rows as they are
        sig = np.concatenate([np.broadcast_to(np.arange(L)[None, :, None], (S, L, 1)), ex], axis=2)
        uniq, inverse = np.unique(sig.reshape(-1, K + 1).astype(np.int64), axis=0, return_inverse=True)
        return uniq, inverse.reshape(-1)
    code = np.broadcast_to(np.arange(L, dtype=np.int64)[None, :] + 1, (S, L)).copy()
    for col in range(K):
        code *= base
        code += ex[:, :, col] + 1  # +1: unknown entries (-1) become digit 0
    code = code.reshape(-1)
    size = (L + 1) * base**K
    if size <= min(1 << 26, max(1 << 16, 8 * len(code))):  # few possible codes: a table, no sort
        seen = np.zeros(size, dtype=bool)
        seen[code] = True
        codes = np.flatnonzero(seen)
        rank = np.cumsum(seen, dtype=np.int64) - 1
        inverse = rank[code]
    else:
        codes, inverse = np.unique(code, return_inverse=True)
    uniq = np.empty((len(codes), K + 1), dtype=np.int64)  # decode the digits
    rest = codes.astype(np.int64)
    for col in range(K, 0, -1):
        rest, digit = np.divmod(rest, base)
        uniq[:, col] = digit - 1
    uniq[:, 0] = rest - 1
    return uniq, inverse.reshape(-1)


def token_seq(trace: Trace) -> np.ndarray:
    """Each token's request (seq_id), 0 for all where the trace has none."""
    if trace.seq_id is None:
        return np.zeros(trace.num_tokens, dtype=np.int64)
    return trace.seq_id.astype(np.int64)


def token_prefill(trace: Trace) -> np.ndarray:
    """Whether each token is a prompt token (none where the trace does not say)."""
    if trace.is_prefill is None:
        return np.zeros(trace.num_tokens, dtype=bool)
    return trace.is_prefill == 1
