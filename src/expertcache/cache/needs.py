"""What one layer needs in one step: the experts its router chose, as the cache and the miss paths see them.

``needs_of`` turns a layer's routing (experts ``[T, K]``, gate weights ``[T, K]``) into one ``Need`` per
distinct expert in first-use order (the rule the simulator applies to a trace). ``LayerNeeds`` is the
same sequence made on first use: a plain layer (``ExpertCache``'s shortcut: every decode step of a model
that fits, and most of one that does not) asks only for their keys, which it has at once.

Shape letters: T tokens of the step, K experts per token.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from expertcache.miss.base import Need


class LayerNeeds(Sequence):
    """``needs_of(layer, index, weights)`` as a sequence computed on first use; ``keys_in_order``, the
    distinct experts' keys in first-use order, at once."""

    __slots__ = ("layer", "index", "weights", "keys_in_order", "_needs", "_tokens")

    def __init__(self, layer: int, index: np.ndarray, weights: np.ndarray | None = None) -> None:
        self.layer, self.weights = layer, weights
        if not (isinstance(index, np.ndarray) and index.ndim == 2):
            index = np.asarray(index).reshape(-1, np.shape(index)[-1])
        self.index = index  # [T, K]
        if index.size <= SMALL:
            first = dict.fromkeys(index.ravel().tolist())  # row by row: first-use order
            self.keys_in_order = [(layer, e) for e in first if e >= 0]
        else:
            self.keys_in_order = [(layer, e) for e in _first_use(index).tolist()]
        self._needs: list[Need] | None = None
        self._tokens: list[int] | None = None

    @property
    def tokens(self) -> list[int]:
        """Each distinct expert's tokens (its routing entries), in first-use order: the ``Need.tokens`` of
        ``needs``, without the rest of them (a policy that weighs its keys by tokens asks only these)."""
        if self._tokens is None:
            if self._needs is not None:
                self._tokens = [n.tokens for n in self._needs]
            elif self.index.size <= SMALL:
                counts = Counter(self.index.ravel().tolist())
                self._tokens = [counts[e] for _, e in self.keys_in_order]
            else:
                flat = self.index.reshape(-1)
                experts, counts = np.unique(flat[flat >= 0], return_counts=True)
                firsts = np.array([e for _, e in self.keys_in_order], dtype=experts.dtype)
                self._tokens = counts[np.searchsorted(experts, firsts)].tolist()
        return self._tokens

    @property
    def needs(self) -> list[Need]:
        if self._needs is None:
            firsts = None if self.index.shape[0] == 1 else np.array([e for _, e in self.keys_in_order])
            self._needs = needs_of(self.layer, self.index, self.weights, firsts)
        return self._needs

    def __len__(self) -> int:
        return len(self.keys_in_order)

    def __getitem__(self, i):
        return self.needs[i]

    def __iter__(self):
        return iter(self.needs)


def _first_use(index: np.ndarray) -> np.ndarray:
    """The distinct known experts of ``index`` [T, K], in first-use order (row by row)."""
    seen, first = np.unique(index.reshape(-1), return_index=True)
    known = seen >= 0
    return seen[known][first[known].argsort(kind="stable")]


# a step of at most this many routing entries (tokens x K) is summed up in Python: numpy's fixed cost per
# call is larger than the work (a batched decode step of 16 tokens: ~10x faster); larger ones in numpy
SMALL = 256


def needs_of(
    layer: int, index: np.ndarray, weights: np.ndarray | None = None, firsts: np.ndarray | None = None
) -> list[Need]:
    """The distinct experts of one layer's routing ``index`` [T, K] (-1 unknown) in first-use order,
    each with its tokens, largest renormalised gate weight, best rank, HOBBIT's importance (the least,
    over its tokens, of the summed weight of the experts ranked above it) and its summed weight. Without
    ``weights`` every expert of a token weighs 1/K and ranks in column order. ``firsts``: those experts
    in first-use order, when the caller has them (``LayerNeeds``)."""
    index = np.asarray(index)
    index = index.reshape(-1, index.shape[-1])  # [T, K]
    if index.shape[0] == 1:
        row = index[0].tolist()
        if len(set(row)) == len(row):  # distinct experts (as a router chooses them)
            return _needs_of_token(layer, row, None if weights is None else np.asarray(weights).reshape(-1))
    w = _renormalised(index, weights)  # [T, K]
    if index.size <= SMALL:
        return _needs_of_rows(layer, index.tolist(), w.tolist())
    order = np.argsort(-w, axis=1, kind="stable")  # [T, K] columns by descending weight
    ranked_w = np.take_along_axis(w, order, axis=1)
    above = np.zeros_like(ranked_w)  # [T, K] weight of the experts ranked above: summed in rank order,
    np.cumsum(ranked_w[:, :-1], axis=1, out=above[:, 1:])  # as a token alone sums it
    ranked_e = np.take_along_axis(index, order, axis=1)  # [T, K] experts by descending weight
    ranks = np.broadcast_to(np.arange(index.shape[1]), index.shape)
    valid = ranked_e >= 0  # token by token, best rank first: the order the sums below add in
    experts, slot = np.unique(ranked_e[valid], return_inverse=True)
    if not len(experts):
        return []
    n = len(experts)
    w_v, imp_v, rank_v = ranked_w[valid], above[valid], ranks[valid]
    tokens = np.bincount(slot, minlength=n)
    weight = np.full(n, -np.inf)
    np.maximum.at(weight, slot, w_v)
    importance = np.full(n, np.inf)
    np.minimum.at(importance, slot, imp_v)
    rank = np.full(n, index.shape[1], dtype=np.int64)
    np.minimum.at(rank, slot, rank_v)
    mass = np.zeros(n)
    np.add.at(mass, slot, w_v)  # one after another, in the loop's order: the same float sum
    if firsts is None:
        firsts = _first_use(index)
    by_use = np.searchsorted(experts, firsts)  # ``experts`` ascending: where each first-used one is
    cols = [a[by_use].tolist() for a in (experts, tokens, weight, importance, rank, mass)]
    return [Need((layer, e), *rest) for e, *rest in zip(*cols, strict=True)]


def _needs_of_rows(layer: int, index: list[list[int]], w: list[list[float]]) -> list[Need]:
    """``needs_of`` for a small step, in plain Python: ``w`` are the renormalised weights. The same
    figures as the array version's, summed in the same order (token by token, each token's experts by
    descending weight, ties in column order): the same floats."""
    k = len(index[0]) if index else 0
    stats: dict[int, list] = {}  # expert -> [tokens, weight, importance, rank, mass]
    for row, wr in zip(index, w, strict=True):
        above = 0.0
        for rank, i in enumerate(sorted(range(k), key=wr.__getitem__, reverse=True)):  # stable
            e, x = row[i], wr[i]
            if e >= 0:
                s = stats.get(e)
                if s is None:
                    stats[e] = [1, x, above, rank, x]
                else:
                    s[0] += 1
                    if x > s[1]:
                        s[1] = x
                    if above < s[2]:
                        s[2] = above
                    if rank < s[3]:
                        s[3] = rank
                    s[4] += x
            above += x
    return [Need((layer, e), *stats[e]) for e in dict.fromkeys(e for row in index for e in row) if e >= 0]


def _needs_of_token(layer: int, experts: list[int], weights: np.ndarray | None) -> list[Need]:
    """``needs_of`` for one token (every decode step) routed to distinct ``experts``, in routing order."""
    k = len(experts)
    if weights is None:
        w = [1.0 / k if e >= 0 else 0.0 for e in experts]
    else:
        w = [x if e >= 0 else 0.0 for x, e in zip(weights.tolist(), experts, strict=True)]
    total = sum(w) or 1.0
    w = [x / total for x in w]
    order = sorted(range(k), key=w.__getitem__, reverse=True)  # stable: ties keep column order
    out: list[Need | None] = [None] * k
    above = 0.0
    for rank, i in enumerate(order):
        e = experts[i]
        if e >= 0:
            out[i] = Need((layer, e), 1, w[i], above, rank, w[i])
            above += w[i]
    return [n for n in out if n is not None]


def _renormalised(index: np.ndarray, weights: np.ndarray | None) -> np.ndarray:
    """Gate weights [T, K] scaled to sum to 1 per token over known entries (uniform without weights)."""
    valid = index >= 0
    if weights is None:
        w = valid.astype(np.float64)
    else:
        w = np.where(valid, np.asarray(weights, dtype=np.float64).reshape(index.shape), 0.0)
    total = w.sum(axis=1, keepdims=True)
    return np.divide(w, total, out=np.zeros_like(w), where=total > 0)
