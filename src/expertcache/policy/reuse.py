"""Reuse: evict the latest predicted next use (a logistic model fitted by train-policy; Hawkeye, LRB).

A logistic model estimates, for every expert, the probability ``p`` that it is requested at its layer's
next visit (the next round: token in flat order, forward step in layer order) from features known at
that moment (``FEATURES``): rounds since its last use (as indicators for 1 and 2, and log), its requests
in exponentially decaying windows of about 2, 8 and 32 rounds, its request rate since the start, its
routing score (renormalised gate weight) at its last use, and whether that use was in a step of several
tokens (a prompt). From the model's ``p`` for the next ``horizon`` rounds (if nothing is requested
meanwhile) and a geometric tail after them comes E[N], the expected round of its next request; the
victim is the resident expert with the latest expected next use, ``D + L * (E[N] - 1)`` in layer
visits, D being the visits until its layer comes again: Belady's rule with predicted next uses, and
LLRU's D.

The model learns while it runs: at each round's end every expert's features at the round's start are
labelled by whether it was requested in the round (the label never depends on the cache, so the same
examples train it offline: ``expertcache train-policy``), and one gradient step of size ``lr`` is taken
on the log-loss over all experts. It starts from trained weights: ``weights=FILE`` (a ``train-policy``
output), else the weights shipped with the package (``DEFAULT_WEIGHTS``, trained on the embedded
trace). An expert requested in the current round counts as certain (``p`` = 1) until the round ends.

It observes every requested group (``on_request``), so prefetched experts, inserted without a request,
are not counted as used. Cost: compiled work (``_reuse_jit``, numba) over every expert once per round
(the learning step and the predictions) and over the resident ones for the next ``horizon`` rounds at the
round's first eviction (the ranking); then each eviction takes the first live entry of two pointers into
that ranking. The simulator replays it on a compiled kernel that calls the same functions, so its
decisions equal this object's (``tests/test_fast.py``).
"""

from __future__ import annotations

import json
import math
import operator
from collections.abc import Container, Sequence
from pathlib import Path

import numpy as np

from expertcache.errors import PolicyError
from expertcache.policy.base import Key, Policy, PolicyContext, no_victim

FEATURES = (
    "bias",
    "age == 1",
    "age == 2",
    "log(1 + age) / 5",
    "requests, decay 1/2 per round",
    "requests / 4, decay 1/8 per round",
    "requests / 16, decay 1/32 per round",
    "request rate / top-k share",
    "score at last use, if age == 1",
    "score at last use",
    "last use in a step of several tokens",
)
_DECAY = np.array([0.5, 0.875, 0.96875])  # 1 - 1/2, 1 - 1/8, 1 - 1/32
_SCALE = np.array([1.0, 4.0, 16.0])
_NEVER_AGE = 1 << 20  # the age of an expert never requested
MAX_HORIZON = 256
# ``expertcache train-policy default -o FILE``: the embedded trace, layer and flat order (docs/POLICIES.md).
DEFAULT_WEIGHTS = (
    -2.268658, -0.215159, 0.392364, -1.18711, -0.078484, 1.134546,
    1.0422, 0.282201, -0.059615, 0.176722, -0.532515,
)  # fmt: skip


class ReuseModel:
    """The features and the online logistic model, over every (layer, expert) key; no cache state, so
    ``train-policy`` runs it alone over recorded traces."""

    def __init__(self, num_layers: int, num_experts: int, top_k: int, weights: Sequence[float], lr: float):
        if len(weights) != len(FEATURES):
            raise PolicyError(f"reuse: {len(weights)} weights given, the model has {len(FEATURES)}")
        if not (math.isfinite(lr) and lr >= 0):
            raise PolicyError(f"reuse: lr must be a finite number >= 0, got {lr}")
        K = num_layers * num_experts
        self.num_experts, self.top_k = num_experts, max(1, top_k)
        self.w = np.asarray(weights, dtype=np.float64).copy()
        self.lr = float(lr)
        self.last = np.full(K, -_NEVER_AGE, dtype=np.int64)  # round of the last request
        self.counts = np.zeros((3, K))  # decaying request counts
        self.total = np.zeros(K)
        self.score = np.zeros(K)  # routing score at the last request
        self.seen: dict[int, float] = {}  # requested in the current round: key id -> highest score
        self.wide = np.zeros(K)  # 1 where the last request was in a step of several tokens (a prompt)
        self.rounds = 0  # rounds closed
        self.round = 0  # the current round
        self.token = 0  # the current round's first token
        self._start()

    @property
    def X(self) -> np.ndarray:
        """[K, F]: every key's features at the current round's start (``features()``, computed once)."""
        return self.XT.T

    @property
    def used(self) -> np.ndarray:
        """[K] bool: requested in the current round."""
        u = np.zeros(len(self.last), dtype=bool)
        u[list(self.seen)] = True
        return u

    def _start(self) -> None:
        """The round's features (``features()``, computed by the compiled kernel) and predictions."""
        j = _jit()
        self.XT = np.empty((len(FEATURES), len(self.last)))  # a new one each round: train-policy keeps them
        self.p = np.empty(len(self.last))
        m = self
        j.start(m.w, m.last, m.counts, m.total, m.score, m.wide, m.round, m.rounds, m.top_k, m.num_experts,
                m.XT, m.p)  # fmt: skip

    def rank(self, ids: np.ndarray, horizon: int, num_layers: int) -> tuple[np.ndarray, ...]:
        """The keys ``ids`` (ascending) in the policy's victim order, with their waits: ``_reuse_jit.rank``.
        -> (ids, v, wait, layer)"""
        m = self
        return _jit().rank(ids, horizon, num_layers, m.num_experts, m.w, m.p, m.last, m.counts, m.total,
                           m.score, m.wide, m.round, m.rounds, m.top_k)  # fmt: skip

    def features(self, ahead: int | np.ndarray = 0, ids: np.ndarray | None = None) -> np.ndarray:
        """[K, F] at the start of the current round, or ``ahead`` rounds later if nothing is requested
        (only the keys ``ids``, if given). With several ``ahead`` values: [len(ahead) * K, F], one block
        of rows per value."""
        at = slice(None) if ids is None else ids
        ahead = np.atleast_1d(np.asarray(ahead, dtype=np.int64))[:, None]  # [A, 1]
        shape = (ahead.shape[0], len(self.last) if ids is None else len(ids))
        age = np.minimum(self.round + ahead - self.last[at], _NEVER_AGE)  # [A, n]
        share = self.top_k / self.num_experts * max(1, self.rounds)
        one = age == 1
        decay = (_DECAY[:, None] ** ahead[None, :, 0])[:, :, None] / _SCALE[:, None, None]  # [3, A, 1]
        counts = self.counts[:, None, at] * decay  # [3, A, n]
        score = np.broadcast_to(self.score[at], shape)
        cols = [
            np.ones(shape),
            one,
            age == 2,
            np.log1p(np.minimum(age, 256)) / 5.0,
            counts[0],
            counts[1],
            counts[2],
            np.broadcast_to(np.minimum(self.total[at] / share, 8.0) / 4.0, shape),
            one * score,
            score,
            np.broadcast_to(self.wide[at], shape),
        ]
        return np.stack([np.asarray(c, dtype=np.float64).reshape(-1) for c in cols], axis=1)

    def predict(self, X: np.ndarray) -> np.ndarray:
        """The reference of the compiled predictions: ``predict(features())`` equals ``p``."""
        return 1.0 / (1.0 + np.exp(-np.clip(X @ self.w, -30.0, 30.0)))

    def observe(self, ids: Sequence[int], scores: Sequence[float] | None) -> None:
        """Keys (by id) requested in the current round, with their routing scores if known."""
        seen = self.seen
        if scores is None:
            for i in ids:
                seen[i] = 1.0
        else:
            for i, sc in zip(ids, scores, strict=True):
                sc = float(sc)
                if seen.get(i, 0.0) < sc:
                    seen[i] = sc
                elif i not in seen:
                    seen[i] = 0.0

    def advance(self, new_round: int, token: int) -> None:
        """Close the current round (label, learn, update the features) and open ``new_round``, whose first
        token is ``token`` (so the closed round covered ``token - self.token`` tokens)."""
        seen, m = self.seen, self
        used = np.fromiter(seen, dtype=np.int64, count=len(seen))
        scores = np.fromiter(seen.values(), dtype=np.float64, count=len(seen))
        _jit().finish(m.w, m.lr, m.XT, m.p, used, scores, len(used), m.last, m.counts, m.total, m.score,
                      m.wide, m.round, token - m.token > 1)  # fmt: skip
        self.token = token
        seen.clear()
        self.rounds += 1
        self.round = new_round
        self._start()


_JIT = None


def _jit():
    """The compiled kernels (``_reuse_jit``), imported on first use: numba loads in about 0.15 s, which
    every other policy's user would otherwise pay."""
    global _JIT
    if _JIT is None:
        try:
            from expertcache.policy import _reuse_jit
        except ImportError as e:  # numba is a dependency; a broken install is one line, not a traceback
            raise PolicyError(f"reuse: its kernels need numba, which does not import here ({e})") from None
        _JIT = _reuse_jit
    return _JIT


def load_weights(path: str | Path) -> tuple[float, ...]:
    """The weights of a ``train-policy`` file (JSON: {"policy": "reuse", "features": [...], "weights":
    [...]}); any problem is a PolicyError naming the file."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8-sig"))
    except OSError as e:
        raise PolicyError(f"reuse: cannot read weights {path}: {e.strerror or e}") from None
    except ValueError:
        raise PolicyError(f"reuse: {path} is not JSON (expected a train-policy output)") from None
    if not isinstance(data, dict) or data.get("policy") != "reuse" or "weights" not in data:
        raise PolicyError(f"reuse: {path} is not a reuse weights file (expected a train-policy output)")
    if list(data.get("features", [])) != list(FEATURES):
        raise PolicyError(f"reuse: {path} was trained on other features; train again with this version")
    try:
        return check_weights(data["weights"])
    except PolicyError as e:
        raise PolicyError(f"reuse: {path}: {str(e).removeprefix('reuse: ')}") from None


def check_weights(w: object) -> tuple[float, ...]:
    """``len(FEATURES)`` finite numbers (not booleans), as a tuple; else a PolicyError."""
    ok = isinstance(w, list | tuple | np.ndarray) and len(w) == len(FEATURES)
    ok = ok and all(
        isinstance(x, int | float | np.floating | np.integer) and not isinstance(x, bool) for x in w
    )
    if not ok or not np.isfinite(np.asarray(w, dtype=np.float64)).all():
        raise PolicyError(f"reuse: 'weights' must be {len(FEATURES)} finite numbers")
    return tuple(float(x) for x in w)


class Reuse(Policy):
    name = "reuse"
    observes = True
    text_params = frozenset({"weights"})

    def __init__(
        self,
        ctx: PolicyContext,
        *,
        lr: float = 0.5,
        weights: str | Path | Sequence[float] | None = None,
        horizon: int = 8,
    ) -> None:
        super().__init__(ctx)
        whole = (
            isinstance(horizon, int | float) and not isinstance(horizon, bool) and float(horizon).is_integer()
        )
        if not (whole and 1 <= horizon <= MAX_HORIZON):
            raise PolicyError(
                f"reuse: horizon must be a whole number of rounds, 1 to {MAX_HORIZON}, got {horizon}"
            )
        self._horizon = int(horizon)
        L, E = ctx.num_layers, ctx.num_experts
        if weights is None:
            w = DEFAULT_WEIGHTS
        elif isinstance(weights, str | Path):
            w = load_weights(weights)
        else:  # in memory (the API): a train-policy result's "weights"
            w = check_weights(weights)
        self.model = ReuseModel(L, E, ctx.top_k, w, float(lr))
        self._L, self._E = L, E
        self._resident = np.zeros(L * E, dtype=bool)
        self._live = bytearray(L * E)  # resident and not requested this round: the round's candidates
        self._live_view = np.frombuffer(self._live, dtype=np.uint8)
        self._n = 0
        lay = np.arange(L * E) // E
        here = np.arange(L)[:, None]
        self._dist = np.where(lay[None, :] > here, lay[None, :] - here, lay[None, :] + L - here).tolist()
        self._by_dist: dict[int, np.ndarray] = {}  # per layer: every key by distance, then id (built lazily)
        # this round's candidates, built at its first eviction: (ids, v, wait, layer) in victim order, and
        # best's pointers
        self._rank: tuple[np.ndarray, ...] | None = None

    def __len__(self) -> int:
        return self._n

    def __contains__(self, key: object) -> bool:
        try:
            layer, e = (operator.index(k) for k in key)  # type: ignore[union-attr]
        except (TypeError, ValueError):  # not a (layer, expert) pair of integers
            return False
        return 0 <= layer < self._L and 0 <= e < self._E and bool(self._resident[layer * self._E + e])

    def _sync(self) -> None:
        r = self.clock.round
        if r != self.model.round:
            self.model.advance(r, self.clock.token)
            self._rank = None
            self._live = bytearray(self._resident.tobytes())
            self._live_view = np.frombuffer(self._live, dtype=np.uint8)

    def waits(self, ids: np.ndarray) -> np.ndarray:
        """Layer visits from each key's next visit to its expected next use: L * (E[N] - 1), N the visit
        of the next use, from the model's hazards over the next ``horizon`` visits and the last one's
        geometric tail (in the order of ``ids``)."""
        ids = np.asarray(ids, dtype=np.int64)
        order, _, wait, _ = self.model.rank(ids, self._horizon, self._L)
        out = np.empty(len(ids))
        out[np.searchsorted(ids, order) if len(ids) else order] = wait
        return out

    def on_request(self, keys: Sequence[Key], scores: Sequence[float] | None = None) -> None:
        if self.clock.round != self.model.round:
            self._sync()
        E, live = self._E, self._live
        ids = [layer * E + e for layer, e in keys]
        self.model.observe(ids, scores)
        for i in ids:
            live[i] = 0

    def on_hit(self, key: Key) -> None:
        if self.clock.round != self.model.round:
            self._sync()

    def on_insert(self, key: Key) -> None:
        if self.clock.round != self.model.round:
            self._sync()
        i = key[0] * self._E + key[1]
        self._resident[i] = True
        self._n += 1
        if i not in self.model.seen:  # a prefetch: a candidate the round's ranking lacks
            self._live[i] = 1
            self._rank = None

    def on_evict(self, key: Key) -> None:
        i = key[0] * self._E + key[1]
        self._resident[i] = False
        self._live[i] = 0
        self._n -= 1

    def victim(self, incoming: Key, pinned: Container[Key]) -> Key | None:
        """The candidate (resident, not requested this round) with the latest expected next use,
        D + wait in layer visits (D: the visits until its layer comes again, 1..L; ties: the longer
        wait, then the lower key); the keys requested this round count as certain, so they go last."""
        if self._n < self.capacity:
            return None
        if self.clock.round != self.model.round:
            self._sync()
        E, c = self._E, self.clock.layer
        if self._rank is None:
            ids = np.flatnonzero(self._live_view)
            self._rank = (*self.model.rank(ids, self._horizon, self._L), np.array([0, -1, 0, 0]))
        ids, v, wait, lay, ptr = self._rank
        best = _jit().best(c, self._live_view, ids, v, wait, lay, self._L, ptr)
        if best >= 0:
            if divmod(best, E) not in pinned:
                return divmod(best, E)
            best = self._scan(c, pinned)  # the best is pinned: the next best
            if best >= 0:
                return divmod(best, E)
        # every candidate pinned or gone: the keys requested this round, by layer distance, then key
        by_dist = self._by_dist.get(c)
        if by_dist is None:
            by_dist = self._by_dist[c] = np.lexsort((np.arange(self._L * E), -np.asarray(self._dist[c])))
        for i in by_dist[self._resident[by_dist]].tolist():
            if divmod(i, E) not in pinned:
                return divmod(i, E)
        raise no_victim(self, incoming)

    def _scan(self, c: int, pinned: Container[Key]) -> int:
        """As ``_reuse_jit.best``, among the live candidates not in ``pinned``; -1 if none."""
        assert self._rank is not None
        ids, v, wait, lay, _ = (a.tolist() for a in self._rank)
        live, L, E = self._live, self._L, self._E
        best, top = -1, (-math.inf, 0.0, 0)
        for j, i in enumerate(ids):
            if live[i]:
                rank = (v[j] - c + L if lay[j] <= c else v[j] - c, wait[j], -i)
                if rank > top and divmod(i, E) not in pinned:
                    best, top = i, rank
        return best
