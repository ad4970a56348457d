"""numba kernels of the ``reuse`` policy: its model's round update, its ranking, its victim choice.

The policy object (``reuse.py``, which the engine and the Python replay drive) and the simulator's
compiled replay (``sim/_kernels.reuse_replay``) both call these same compiled functions, so their floats,
and so their decisions, are identical by construction (numpy's and LLVM's ``exp`` and ``log1p`` may
differ in the last bit, and sums in another order do). Imported only when a ``reuse`` policy is built;
compiled once per machine and cached on disk (``cache=True``).

State, over K = L * E keys: ``w`` [F] weights; ``last`` int64 [K] the round of each key's last request;
``counts`` [3, K] decaying request counts; ``total`` [K]; ``score`` [K] routing score at the last
request; ``wide`` [K] 1 where that request was in a step of several tokens. ``XT`` [F, K] and ``p`` [K]:
the current round's features and predictions.
"""

from __future__ import annotations

import math

import numpy as np

from expertcache.jit import numba

NEVER_AGE = 1 << 20  # the age of an expert never requested
D0, D1, D2 = 0.5, 0.875, 0.96875  # count decays per round: 1 - 1/2, 1 - 1/8, 1 - 1/32
S0, S1, S2 = 1.0, 4.0, 16.0  # and their scales
LOG_AGE = np.log1p(np.arange(257.0)) / 5.0  # the log-age feature by age (above 256: as 256); a constant


@numba.njit(cache=True, nogil=True)
def _sigmoid(z):  # pragma: no cover (compiled)
    z = min(30.0, max(-30.0, z))
    return 1.0 / (1.0 + math.exp(-z))


@numba.njit(cache=True, nogil=True)
def _age_terms(w, age, score):  # pragma: no cover (compiled)
    """w's terms of the age features (and of the score at an age of 1) for one key."""
    one = 1.0 if age == 1 else 0.0
    two = 1.0 if age == 2 else 0.0
    return w[1] * one + w[2] * two + w[3] * LOG_AGE[min(age, 256)] + w[8] * (one * score)


@numba.njit(cache=True, nogil=True)
def start(w, last, counts, total, score, wide, rnd, rounds, top_k, E, XT, p):  # pragma: no cover
    """Fill ``XT`` and ``p`` for the round ``rnd`` (``rounds`` closed so far): ``ReuseModel.features``."""
    share = top_k / E * max(1, rounds)
    for k in range(len(last)):
        age = min(rnd - last[k], NEVER_AGE)
        one = 1.0 if age == 1 else 0.0
        XT[0, k] = 1.0
        XT[1, k] = one
        XT[2, k] = 1.0 if age == 2 else 0.0
        XT[3, k] = LOG_AGE[min(age, 256)]
        XT[4, k] = counts[0, k] / S0
        XT[5, k] = counts[1, k] / S1
        XT[6, k] = counts[2, k] / S2
        XT[7, k] = min(total[k] / share, 8.0) / 4.0
        XT[8, k] = one * score[k]
        XT[9, k] = score[k]
        XT[10, k] = wide[k]
        z = 0.0
        for f in range(XT.shape[0]):
            z += w[f] * XT[f, k]
        p[k] = _sigmoid(z)


@numba.njit(cache=True, nogil=True)
def finish(w, lr, XT, p, used, used_score, n_used, last, counts, total, score, wide, rnd, prompt):
    # pragma: no cover (compiled)
    """Close the round ``rnd``: a gradient step of ``lr`` on the log-loss of its predictions ``p`` (from
    ``XT``) against ``used[:n_used]`` (the keys requested, with their highest scores), then the state
    update. ``prompt``: the round was a step of several tokens."""
    K = len(p)
    if lr != 0.0:
        y = np.zeros(K)
        for j in range(n_used):
            y[used[j]] = 1.0
        for f in range(XT.shape[0]):
            g = 0.0
            for k in range(K):
                g += XT[f, k] * (y[k] - p[k])
            w[f] += lr * g / K
    for k in range(K):
        counts[0, k] *= D0
        counts[1, k] *= D1
        counts[2, k] *= D2
    flag = 1.0 if prompt else 0.0
    for j in range(n_used):
        k = used[j]
        counts[0, k] += 1.0
        counts[1, k] += 1.0
        counts[2, k] += 1.0
        total[k] += 1.0
        score[k] = min(used_score[j], 1.0)
        last[k] = rnd
        wide[k] = flag


@numba.njit(cache=True, nogil=True)
def rank(ids, horizon, L, E, w, p, last, counts, total, score, wide, rnd, rounds, top_k):
    # pragma: no cover (compiled)
    """The candidates ``ids`` (ascending) by due order: -> (ids, v, wait, layer) sorted by v descending,
    then wait descending, then id. wait: layer visits from a key's next visit to its expected next use,
    L * (E[N] - 1), N the visit of the next request, from the hazards over the next ``horizon`` visits
    (``p`` now, then the model's predictions with ages growing and counts decaying) and a geometric tail
    after the last; v = wait + the key's layer."""
    n = len(ids)
    share = top_k / E * max(1, rounds)
    wait = np.empty(n)
    for j in range(n):
        k = ids[j]
        q = max(p[k], 1e-9)
        alive = 1.0 - q
        total_alive = 0.0
        d0, d1, d2 = 1.0, 1.0, 1.0
        static = w[0] + w[7] * (min(total[k] / share, 8.0) / 4.0) + w[9] * score[k] + w[10] * wide[k]
        for a in range(1, horizon):
            d0 *= D0
            d1 *= D1
            d2 *= D2
            age = min(rnd + a - last[k], NEVER_AGE)
            z = static + _age_terms(w, age, score[k])
            z += w[4] * (counts[0, k] * d0 / S0) + w[5] * (counts[1, k] * d1 / S1)
            z += w[6] * (counts[2, k] * d2 / S2)
            q = max(_sigmoid(z), 1e-9)
            total_alive += alive  # alive: not requested in the visits before this one
            alive *= 1.0 - q
        expect = 1.0 + total_alive + alive / q
        wait[j] = L * (expect - 1.0)
    lay = ids // E
    v = wait + lay
    first = np.argsort(-wait, kind="mergesort")  # stable: ids ascending within equal waits
    order = first[np.argsort(-v[first], kind="mergesort")]
    return ids[order], v[order], wait[order], lay[order]


@numba.njit(cache=True, nogil=True)
def best(c, live, ids, v, wait, lay, L, ptr):  # pragma: no cover (compiled)
    """The live candidate with the latest due at layer c, or -1. At layer c a candidate of layer l is due
    at v - c + L visits if l <= c (its layer comes again next round) and at v - c if l > c; within each
    of the two sets the ranking order is the due order, so one pointer per set to its first live member
    suffices (``ptr``: the first live entry, the layer the pointers are for, and the two pointers). As
    the layer advances the set l <= c grows (its pointer restarts at the first live entry) and the set
    l > c shrinks (its pointer only moves on). Ties: the longer wait, then the lower key."""
    n = len(ids)
    j = ptr[0]
    while j < n and live[ids[j]] == 0:
        j += 1
    ptr[0] = j
    if c != ptr[1]:
        if c < ptr[1]:
            ptr[3] = j  # the set l > c grew: its pointer restarts too
        ptr[1] = c
        ptr[2] = j
    a = ptr[2]
    while a < n and (lay[a] > c or live[ids[a]] == 0):
        a += 1
    b = max(ptr[3], j)
    while b < n and (lay[b] <= c or live[ids[b]] == 0):
        b += 1
    ptr[2] = a
    ptr[3] = b
    if a == n:
        return -1 if b == n else ids[b]
    if b == n:
        return ids[a]
    da = v[a] - c + L
    db = v[b] - c
    if da != db:
        return ids[a] if da > db else ids[b]
    if wait[a] != wait[b]:
        return ids[a] if wait[a] > wait[b] else ids[b]
    return min(ids[a], ids[b])


@numba.njit(cache=True, nogil=True)
def _scan(c, live, ids, v, wait, lay, L, pin, epoch):  # pragma: no cover (compiled)
    """``best`` among the live candidates not pinned (pin[k] == epoch); -1 if none (``Reuse._scan``)."""
    found, top_due, top_wait = -1, -np.inf, 0.0
    for j in range(len(ids)):
        k = ids[j]
        if live[k] == 0:
            continue
        due = v[j] - c + L if lay[j] <= c else v[j] - c
        tie = due == top_due and (wait[j] > top_wait or (wait[j] == top_wait and k < found))
        later = due > top_due or tie
        if later and pin[k] != epoch:
            found, top_due, top_wait = k, due, wait[j]
    return found


@numba.njit(cache=True, nogil=True)
def replay(keys, groups, scores, per_layer, L, E, top_k, round_prefill, round_token, capacity, horizon,
           w, lr, hits):  # fmt: skip  # pragma: no cover (compiled)
    """A whole replay of the ``reuse`` policy: ``sim.replay.replay`` with ``Residency``'s rules (a chunk
    pinned together; a group above the capacity served in chunks, resident first) and ``Reuse``'s events
    in the same order, calling the same kernels. ``scores`` [R]: each request's routing score as the
    policy observes it. ``w`` is updated in place. Returns (misses int64 [2, L], status: 0, or -1 when
    every candidate was pinned)."""
    record = len(hits) > 0
    K = L * E
    last = np.full(K, -NEVER_AGE, dtype=np.int64)
    counts = np.zeros((3, K))
    total = np.zeros(K)
    score = np.zeros(K)
    wide = np.zeros(K)
    XT = np.empty((len(w), K))
    p = np.empty(K)
    used = np.empty(K, dtype=np.int64)  # the round's requested keys, in first-request order
    used_score = np.zeros(K)
    slot = np.full(K, -1, dtype=np.int64)  # a requested key's place in used, -1 if not requested
    n_used = 0
    rounds, m_round, m_token = 0, 0, 0
    start(w, last, counts, total, score, wide, m_round, rounds, top_k, E, XT, p)
    resident = np.zeros(K, dtype=np.bool_)
    live = np.zeros(K, dtype=np.uint8)
    size = 0
    pin = np.zeros(K, dtype=np.int64)
    epoch = 0
    ranked = False
    r_ids = np.zeros(0, dtype=np.int64)
    r_v = np.zeros(0)
    r_wait = np.zeros(0)
    r_lay = np.zeros(0, dtype=np.int64)
    ptr = np.zeros(4, dtype=np.int64)
    order = np.empty(K, dtype=np.int64)
    misses = np.zeros((2, L), dtype=np.int64)
    j, n_req = 0, len(keys)
    rnd, layer, base = 0, 0, 0
    while j < n_req:
        i = j
        g = groups[i]
        j = i + 1
        while j < n_req and groups[j] == g:
            j += 1
        while g >= base + per_layer:  # the (round, layer) visit of group g
            base += per_layer
            layer += 1
            if layer == L:
                layer = 0
                rnd += 1
        phase = 1 if round_prefill[rnd] else 0
        n = j - i
        room = n
        if n <= capacity:
            for r in range(i, j):
                order[r - i] = r
        else:  # chunks of the capacity, the resident requests first (sim/_kernels._split_order's rule,
            # written here: numba caches a caller with its callees compiled in, and an edit of another
            # file would not invalidate it, so each kernel file keeps its helpers to itself)
            room = capacity
            m = 0
            for r in range(i, j):
                if resident[keys[r]]:
                    order[m] = r
                    m += 1
            for r in range(i, j):
                if not resident[keys[r]]:
                    order[m] = r
                    m += 1
        c0 = 0
        while c0 < n:
            c1 = min(c0 + room, n)
            if rnd != m_round:  # the policy's _sync, at the round's first request
                finish(w, lr, XT, p, used, used_score, n_used, last, counts, total, score, wide, m_round,
                       round_token[rnd] - m_token > 1)  # fmt: skip
                for x in range(n_used):
                    slot[used[x]] = -1
                n_used = 0
                m_token = round_token[rnd]
                rounds += 1
                m_round = rnd
                start(w, last, counts, total, score, wide, m_round, rounds, top_k, E, XT, p)
                ranked = False
                for k in range(K):
                    live[k] = 1 if resident[k] else 0
            for x in range(c0, c1):  # on_request: observe the chunk
                k = keys[order[x]]
                sc = scores[order[x]]
                if slot[k] < 0:
                    slot[k] = n_used
                    used[n_used] = k
                    used_score[n_used] = max(0.0, sc)
                    n_used += 1
                elif used_score[slot[k]] < sc:
                    used_score[slot[k]] = sc
                live[k] = 0
            epoch += 1
            for x in range(c0, c1):
                pin[keys[order[x]]] = epoch
            for x in range(c0, c1):
                r = order[x]
                k = keys[r]
                if resident[k]:
                    if record:
                        hits[r] = 1
                    continue
                misses[phase, layer] += 1
                if size >= capacity:
                    if not ranked:
                        cand = np.flatnonzero(live)
                        r_ids, r_v, r_wait, r_lay = rank(cand, horizon, L, E, w, p, last, counts, total,
                                                         score, wide, m_round, rounds, top_k)  # fmt: skip
                        ptr[0], ptr[1], ptr[2], ptr[3] = 0, -1, 0, 0
                        ranked = True
                    v = best(layer, live, r_ids, r_v, r_wait, r_lay, L, ptr)
                    if v >= 0 and pin[v] == epoch:
                        v = _scan(layer, live, r_ids, r_v, r_wait, r_lay, L, pin, epoch)
                    if v < 0:  # the keys requested this round, by layer distance, then key
                        for d in range(L):
                            lay_d = layer - d if d <= layer else layer - d + L
                            for e in range(E):
                                x2 = lay_d * E + e
                                if resident[x2] and pin[x2] != epoch:
                                    v = x2
                                    break
                            if v >= 0:
                                break
                    if v < 0:
                        return misses, -1
                    resident[v] = False
                    live[v] = 0
                    size -= 1
                resident[k] = True
                size += 1
                if slot[k] < 0:  # inserted without a request: a candidate the ranking lacks
                    live[k] = 1
                    ranked = False
            c0 = c1
    return misses, 0
