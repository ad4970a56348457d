"""The expert activation model of MoE-Infinity (EAM, EAMC, matching), shared by the ``eam`` eviction
policy and the ``eam`` predictor.

An EAM (expert activation matrix) counts, for one request, the tokens routed to each expert: [L, E].
The EAMC keeps up to ``capacity`` past request EAMs; a finished request's EAM is added, and when the
collection is full it replaces the stored EAM most similar to it (smallest cosine distance), which
keeps the collection recent and diverse. To predict, the current request's EAM (flattened) is
matched by cosine similarity against the collection, the ``matches`` most similar are summed and
each row normalised, and future layers are weighted by layer proximity ``1 - (i - l)/L`` (l the
current layer). An empty collection falls back to the current EAM, and an unknown row to uniform.
Counts are integers kept in float64 (exact), and the similarities are updated incrementally, so
matching costs O(capacity) per observed expert and the aggregate is rebuilt only when the set of
matches changes. (MoE-Infinity, Sec. 4.3-4.5 and App. B.1.)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from expertcache.errors import ExpertcacheError
from expertcache.trace.trace import Trace

DEFAULT_CAPACITY = 64  # paper Fig. 9: latency is lowest from a few tens of stored EAMs (1 to 120 tried)
DEFAULT_MATCHES = 3


class EamModel:
    """The current request's EAM, the EAMC, and the matched prediction (shapes: L layers, E experts)."""

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        capacity: int = DEFAULT_CAPACITY,
        matches: int = DEFAULT_MATCHES,
    ) -> None:
        if capacity < 1:
            raise ExpertcacheError(f"eam: EAMC capacity must be at least 1, got {capacity}")
        if matches < 1:
            raise ExpertcacheError(f"eam: matches must be at least 1, got {matches}")
        self.num_layers, self.num_experts = num_layers, num_experts
        self.capacity, self.matches = capacity, matches
        self._stored = np.zeros((num_layers * num_experts, capacity))  # [L*E, C] one column per EAM
        self.norms = np.zeros(capacity)  # [C] |EAM|
        self.size = 0  # EAMs stored
        self.current = np.zeros(num_layers * num_experts)  # [L*E] this request's EAM
        self._norm2 = 0.0  # |current|^2
        self._dots = np.zeros(capacity)  # [C] EAM . current, kept up to date
        self._selection: tuple[int, ...] | None = None  # matched EAMs behind _aggregate
        self._aggregate = np.zeros((num_layers, num_experts))  # [L, E]
        self._dirty = True
        self.version = 0  # bumped whenever the aggregate changes

    def eams(self) -> np.ndarray:
        """The stored EAMs, by slot. -> [size, L, E]"""
        return self._stored[:, : self.size].T.reshape(self.size, self.num_layers, self.num_experts)

    # -- observations ---------------------------------------------------------------------------
    def observe(self, layer: int, experts: np.ndarray) -> None:
        """Layer ``layer`` routed tokens to ``experts`` (any shape, -1 unknown): one count per token."""
        ex = np.asarray(experts).reshape(-1)
        counts = np.bincount(ex[ex >= 0], minlength=self.num_experts)  # [E]
        hit = np.flatnonzero(counts)
        self._add(layer * self.num_experts + hit, counts[hit].astype(np.float64))

    def observe_keys(self, keys: Sequence[tuple[int, int]]) -> None:
        """One count per (layer, expert) key of a request group (the policy's unit); the keys must be
        distinct, as the simulator's and the engine's groups are."""
        E = self.num_experts
        if len(keys) == 1:  # the common case (decode in flat and rounds order): no arrays
            layer, expert = keys[0]
            i = layer * E + expert
            old = self.current[i]
            self.current[i] = old + 1.0
            self._norm2 += 2.0 * old + 1.0
            if self.size:
                self._dots += self._stored[i]
            self._dirty = True
        elif keys:
            idx = np.fromiter((layer * E + expert for layer, expert in keys), np.intp, len(keys))
            self._add(idx, np.ones(len(idx)))

    def _add(self, idx: np.ndarray, counts: np.ndarray) -> None:
        """current[idx] += counts (idx distinct), keeping |current|^2 and the dot products exact."""
        if not len(idx):
            return
        old = self.current[idx]
        self.current[idx] = old + counts
        self._norm2 += float(counts @ (2.0 * old + counts))
        if self.size:
            self._dots += counts @ self._stored[idx]
        self._dirty = True

    def end_request(self) -> None:
        """The current request is over: store its EAM in the EAMC and start an empty one."""
        if self._norm2 > 0:
            self.store(self.current)
        self.current = np.zeros_like(self.current)
        self._norm2 = 0.0
        self._dots[:] = 0.0
        self._dirty = True

    def store(self, eam: np.ndarray) -> int:
        """Add a request EAM ([L, E] or flat) to the EAMC; when full, replace the most similar stored
        one (paper App. B.1; ties: lower slot). Returns the slot used (-1: an all-zero EAM is not stored)."""
        vec = np.asarray(eam, dtype=np.float64).reshape(-1)
        norm = float(np.sqrt(vec @ vec))
        if norm == 0:
            return -1
        if self.size < self.capacity:
            slot = self.size
            self.size += 1
        else:
            slot = int(np.argmax(self.similarity(vec)))
        self._stored[:, slot] = vec
        self.norms[slot] = norm
        self._dots[slot] = float(vec @ self.current)
        self._selection = None  # the collection changed: rebuild the aggregate
        self._dirty = True
        return slot

    def similarity(self, eam: np.ndarray) -> np.ndarray:
        """Cosine similarity of an EAM ([L, E] or flat) to every stored EAM. -> [size]"""
        vec = np.asarray(eam, dtype=np.float64).reshape(-1)
        norm = float(np.sqrt(vec @ vec))
        if norm == 0:
            return np.zeros(self.size)
        return (vec @ self._stored[:, : self.size]) / (self.norms[: self.size] * norm)

    # -- prediction -----------------------------------------------------------------------------
    def matched(self) -> tuple[int, ...]:
        """Indices of the stored EAMs the prediction aggregates: the ``matches`` most similar to the
        current EAM (ties: lower slot); all of them while the current EAM is still empty."""
        n = self.size
        if self._norm2 == 0 or n <= self.matches:
            return tuple(range(n))
        sims = self._dots[:n] / self.norms[:n]  # cosine similarity times |current|, the same ranking
        best = np.argsort(-sims, kind="stable")[: self.matches]
        return tuple(sorted(best.tolist()))

    def aggregate(self) -> np.ndarray:
        """Summed counts of the matched EAMs (the current EAM while the EAMC is empty). -> [L, E]

        Rebuilt only when the state changed since the last call; the returned array is shared."""
        if not self._dirty:
            return self._aggregate
        self._dirty = False
        if self.size == 0:
            self._aggregate = self.current.reshape(self.num_layers, self.num_experts).copy()
            self.version += 1
            return self._aggregate
        selection = self.matched()
        if selection != self._selection:
            self._selection = selection
            agg = self._stored[:, list(selection)].sum(axis=1)  # [L*E]
            self._aggregate = agg.reshape(self.num_layers, self.num_experts)
            self.version += 1
        return self._aggregate

    def likelihood(self) -> np.ndarray:
        """The aggregate normalised per row; rows with nothing known are uniform. -> [L, E]"""
        agg = self.aggregate()
        rows = agg.sum(axis=1, keepdims=True)
        return np.where(rows > 0, agg / np.where(rows > 0, rows, 1.0), 1.0 / self.num_experts)

    def peam(self, layer: int) -> np.ndarray:
        """The predicted EAM at ``layer`` (-1: the step's start): likelihoods of the future layers
        i > layer weighted by the layer proximity 1 - (i - layer)/L; layers already routed are 0."""
        weights = 1.0 - (np.arange(self.num_layers) - layer) / self.num_layers  # [L]
        weights[: layer + 1] = 0.0
        return self.likelihood() * weights[:, None]


def request_eams(trace: Trace) -> list[np.ndarray]:
    """The EAM [L, E] of each request of a trace (by ``seq_id``, in order of first token; the
    whole trace is one request without it): one count per token routed to an expert."""
    L, E = trace.num_layers, trace.num_experts
    seq = trace.seq_id if trace.seq_id is not None else np.zeros(trace.num_tokens, dtype=np.int32)
    ex = trace.experts.astype(np.int64)  # [T, L, K]
    flat = (np.arange(L)[None, :, None] * E + ex).reshape(len(ex), -1)  # [T, L*K] key ids
    flat = np.where(ex.reshape(len(ex), -1) >= 0, flat, -1)
    order = np.argsort(seq, kind="stable")  # tokens grouped by request, each in trace order
    _, starts = np.unique(seq[order], return_index=True)
    rows = np.split(order, starts[1:])
    out = []
    for tokens in sorted(rows, key=lambda r: r[0]):  # requests by first token
        ids = flat[tokens].reshape(-1)
        out.append(np.bincount(ids[ids >= 0], minlength=L * E).reshape(L, E).astype(np.float64))
    return out
