"""numba kernels behind ``sim/fast.py``: imported only there, and only when numba is installed.

Every function is compiled once per machine and cached on disk (``cache=True``: next to this file where
the package folder is writable, else in numba's per-user cache). ``replay`` is one function for every
supported policy, so a run loads one compiled object.
"""

from __future__ import annotations

import numpy as np

from expertcache.jit import numba

# policy kinds of ``replay`` (fast.py maps registry names to them)
LRU, FIFO, LFU, LCP, OPT, LLRU = 0, 1, 2, 3, 4, 5
NO_VICTIM = -1  # replay's status when every candidate was pinned


@numba.njit(cache=True, nogil=True)
def next_use(keys, groups, num_keys, never, out):  # pragma: no cover (compiled)
    """Fill ``out`` [R] with the group index of the next request of the same key, or ``never``; groups
    ascend. (``out``'s dtype is the caller's: int32 halves the largest array of an OPT run.)"""
    last = np.full(num_keys, never, dtype=out.dtype)
    for r in range(len(keys) - 1, -1, -1):
        k = keys[r]
        out[r] = last[k]
        last[k] = groups[r]


@numba.njit(cache=True, nogil=True, _nrt=False)  # takes arrays, allocates none: no reference counting
def _group_end(groups, i):  # pragma: no cover (compiled)
    """End of the group whose first request is i (a group's requests are contiguous)."""
    j, g, n = i + 1, groups[i], len(groups)
    while j < n and groups[j] == g:
        j += 1
    return j


@numba.njit(cache=True, nogil=True, _nrt=False)  # scalars only
def _visit(g, base, per_layer, layer, rnd, L):  # pragma: no cover (compiled)
    """Advance (base, layer, rnd), the (round, layer) visit of group g and its first group, to g's visit
    (groups ascend, so without divisions)."""
    while g >= base + per_layer:
        base += per_layer
        layer += 1
        if layer == L:
            layer = 0
            rnd += 1
    return base, layer, rnd


@numba.njit(cache=True, nogil=True, _nrt=False)  # takes arrays, allocates none: no reference counting
def _split_order(keys, i, j, resident, order):  # pragma: no cover (compiled)
    """Requests i..j of a group larger than its room into ``order``, resident first
    (``Residency.chunks``); the common case, a group that fits, stays inline in the callers (a call per
    group cost LRU's flat replay 30 %). Returns the count."""
    n = 0
    for r in range(i, j):
        if resident[keys[r]]:
            order[n] = r
            n += 1
    for r in range(i, j):
        if not resident[keys[r]]:
            order[n] = r
            n += 1
    return n


@numba.njit(cache=True, nogil=True)
def lru_depths(keys, groups, num_keys):  # pragma: no cover (compiled)
    """LRU stack depth at each request's group start (``stack.lru_depths``)."""
    out = np.zeros(len(keys), dtype=np.int64)
    stack = np.empty(num_keys, dtype=np.int64)  # stack[0] is the most recent
    size = 0
    j = 0
    while j < len(keys):
        i = j
        j = _group_end(groups, i)
        for r in range(i, j):  # depths at the group's start
            k = keys[r]
            for d in range(size):
                if stack[d] == k:
                    out[r] = d + 1
                    break
        for r in range(i, j):  # remove the members found ...
            if out[r]:
                k = keys[r]
                for d in range(size):
                    if stack[d] == k:
                        for e in range(d, size - 1):
                            stack[e] = stack[e + 1]
                        size -= 1
                        break
        for r in range(i, j):  # ... and push every member on top, in service order
            for e in range(size, 0, -1):
                stack[e] = stack[e - 1]
            stack[0] = keys[r]
            size += 1
    return out


@numba.njit(cache=True, nogil=True)
def opt_depths(keys, groups, nxt, num_keys, never):  # pragma: no cover (compiled)
    """OPT stack depth of each request (``stack.opt_depths``)."""
    out = np.zeros(len(keys), dtype=np.int64)
    prio = np.full(num_keys, never, dtype=np.int64)
    stack = np.empty(num_keys, dtype=np.int64)
    size = 0
    j = 0
    while j < len(keys):
        i = j
        j = _group_end(groups, i)
        for r in range(i, j):
            x = keys[r]
            prio[x] = groups[r]  # pinned while its group is served
            d = -1
            for e in range(size):
                if stack[e] == x:
                    d = e
                    break
            if d >= 0:
                out[r] = d + 1
            else:
                d = size
                stack[size] = x
                size += 1
            if d == 0:
                continue
            carried = stack[0]
            stack[0] = x
            cp = prio[carried]
            for pos in range(1, d):
                y = stack[pos]
                py = prio[y]
                if py > cp:
                    stack[pos] = carried
                    carried = y
                    cp = py
            stack[d] = carried
        for r in range(i, j):
            prio[keys[r]] = nxt[r]
    return out


# -- the replay ----------------------------------------------------------------------------------------
# Resident keys of a scope (the whole cache, or one layer for -dist) live either in a doubly linked list
# (LRU, FIFO, LLRU: oldest first) or in an indexed binary min-heap on (score, stamp) (LFU, LCP, OPT).


@numba.njit(cache=True, nogil=True, _nrt=False)  # takes arrays, allocates none: no reference counting
def _less(a, b, score, stamp):  # pragma: no cover (compiled)
    return score[a] < score[b] or (score[a] == score[b] and stamp[a] < stamp[b])


# A scope's heap is h[b : b + n] (b: the scope's base); pos[k] is k's index relative to b.
@numba.njit(cache=True, nogil=True, _nrt=False)  # takes arrays, allocates none: no reference counting
def _sift_up(h, b, pos, i, score, stamp):  # pragma: no cover (compiled)
    k = h[b + i]
    while i > 0:
        p = (i - 1) >> 1
        q = h[b + p]
        if not _less(k, q, score, stamp):
            break
        h[b + i] = q
        pos[q] = i
        i = p
    h[b + i] = k
    pos[k] = i


@numba.njit(cache=True, nogil=True, _nrt=False)  # takes arrays, allocates none: no reference counting
def _sift_down(h, b, pos, i, n, score, stamp):  # pragma: no cover (compiled)
    k = h[b + i]
    while True:
        c = 2 * i + 1
        if c >= n:
            break
        if c + 1 < n and _less(h[b + c + 1], h[b + c], score, stamp):
            c += 1
        q = h[b + c]
        if not _less(q, k, score, stamp):
            break
        h[b + i] = q
        pos[q] = i
        i = c
    h[b + i] = k
    pos[k] = i


@numba.njit(cache=True, nogil=True, _nrt=False)  # takes arrays, allocates none: no reference counting
def _pop_root(h, b, pos, m, score, stamp):  # pragma: no cover (compiled)
    """Remove the root of a heap of m + 1 entries (Floyd): the hole goes down along the smaller children
    to a leaf (one comparison a level), the last entry fills it and moves up (rarely far)."""
    i = 0
    while True:
        c = 2 * i + 1
        if c >= m:
            break
        if c + 1 < m and _less(h[b + c + 1], h[b + c], score, stamp):
            c += 1
        h[b + i] = h[b + c]
        pos[h[b + i]] = i
        i = c
    if i < m:
        h[b + i] = h[b + m]
        pos[h[b + i]] = i
        _sift_up(h, b, pos, i, score, stamp)


@numba.njit(cache=True, nogil=True, _nrt=False)  # takes arrays, allocates none: no reference counting
def _heap_remove(h, b, pos, n, k, score, stamp):  # pragma: no cover (compiled)
    """Remove k from a heap of n entries; returns the new size."""
    i = pos[k]
    n -= 1
    if i < n:
        h[b + i] = h[b + n]
        pos[h[b + i]] = i
        _sift_down(h, b, pos, i, n, score, stamp)
        _sift_up(h, b, pos, i, score, stamp)
    return n


@numba.njit(cache=True, nogil=True, _nrt=False)  # takes arrays, allocates none: no reference counting
def _list_remove(k, s, prv, nxt, head, tail):  # pragma: no cover (compiled)
    a, b = prv[k], nxt[k]
    if a >= 0:
        nxt[a] = b
    else:
        head[s] = b
    if b >= 0:
        prv[b] = a
    else:
        tail[s] = a


@numba.njit(cache=True, nogil=True, _nrt=False)  # takes arrays, allocates none: no reference counting
def _list_append(k, s, prv, nxt, head, tail):  # pragma: no cover (compiled)
    t = tail[s]
    prv[k] = t
    nxt[k] = -1
    if t >= 0:
        nxt[t] = k
    else:
        head[s] = k
    tail[s] = k


@numba.njit(cache=True, nogil=True, _nrt=False)  # takes arrays, allocates none: no reference counting
def _llru_victim(s, now, L, head, nxt, tau, pin, epoch):  # pragma: no cover (compiled)
    """LLRU's victim in a list ordered by last use (``policy/llru.py``, the same scan)."""
    oldest = tau[head[s]]
    edge = now - (now - oldest) // L * L
    best, best_tau = -1, oldest - 1
    k = head[s]
    while k >= 0 and tau[k] < edge:
        if tau[k] > best_tau and pin[k] != epoch:
            best, best_tau = k, tau[k]
        k = nxt[k]
    if best >= 0:
        return best
    k = head[s]
    while k >= 0 and tau[k] <= edge:
        if tau[k] == edge and pin[k] != epoch:
            return k
        k = nxt[k]
    best_r, best_d = -1, -1  # every key of the window is pinned: max (R, D), first in order on ties
    k = head[s]
    while k >= 0:
        if pin[k] != epoch:
            r = (now - tau[k]) // L
            d = ((tau[k] - now) % L + L) % L
            if r > best_r or (r == best_r and d > best_d):
                best, best_r, best_d = k, r, d
        k = nxt[k]
    return best


@numba.njit(cache=True, nogil=True)
def replay(
    kind, dist, keys, groups, per_layer, L, E, round_prefill, round_token, nxt_use, rooms, decay, hits
):  # pragma: no cover (compiled)
    """Serve every group (its requests are contiguous: ``groups`` gives each one's group index) through a
    cache of ``rooms`` (per layer: the capacity, or each layer's -dist budget): ``residency.Residency``'s
    rules (pinned groups; a group above its room in chunks, resident first) and one policy's victims.
    ``hits``: empty, or one byte per request, set to 1 where the request hits.
    Returns (misses int64 [2, L], status: 0, or NO_VICTIM)."""
    record = len(hits) > 0
    K = L * E
    S = L if dist else 1
    M = E if dist else K
    caps = np.empty(S, dtype=np.int64)
    if dist:
        caps[:] = rooms
    else:
        caps[0] = rooms[0]
    resident = np.zeros(K, dtype=np.bool_)
    size = np.zeros(S, dtype=np.int64)
    pin = np.zeros(K, dtype=np.int64)
    epoch = 0
    listed = kind in (LRU, FIFO, LLRU)
    prv = np.full(K, -1, dtype=np.int64)
    nxt = np.full(K, -1, dtype=np.int64)
    head = np.full(S, -1, dtype=np.int64)
    tail = np.full(S, -1, dtype=np.int64)
    tau = np.zeros(K, dtype=np.int64)
    heap = np.empty(S * M, dtype=np.int64)
    pos = np.zeros(K, dtype=np.int64)
    score = np.zeros(K, dtype=np.float64)
    stamp = np.zeros(K, dtype=np.int64)
    count = np.zeros(K, dtype=np.int64)
    held = np.empty(K, dtype=np.int64)  # pinned keys lifted off a heap while its victim is found
    order = np.empty(K, dtype=np.int64)  # a split group's requests, resident first
    misses = np.zeros((2, L), dtype=np.int64)
    st = 0
    j, n_req = 0, len(keys)
    rnd, layer, base = 0, 0, 0  # the (round, layer) visit of group g, and its first group (no divisions)
    while j < n_req:
        i = j
        g = groups[i]
        j = i + 1  # the group's end (its requests are contiguous)
        while j < n_req and groups[j] == g:
            j += 1
        base, layer, rnd = _visit(g, base, per_layer, layer, rnd, L)
        phase = 1 if round_prefill[rnd] else 0
        now = rnd * L + layer
        token = round_token[rnd]
        room, n = rooms[layer], j - i
        if n <= room:
            for r in range(i, j):
                order[r - i] = r
            room = n
        else:
            _split_order(keys, i, j, resident, order)
        c0 = 0
        while c0 < n:
            c1 = min(c0 + room, n)
            epoch += 1
            for c in range(c0, c1):
                pin[keys[order[c]]] = epoch
            for c in range(c0, c1):
                r = order[c]
                k = keys[r]
                s = layer if dist else 0  # a key's layer is its group's
                if resident[k]:  # a hit
                    if record:
                        hits[r] = 1
                    if kind in (LRU, LLRU):
                        _list_remove(k, s, prv, nxt, head, tail)
                        _list_append(k, s, prv, nxt, head, tail)
                        tau[k] = now
                    elif kind != FIFO:
                        st += 1
                        stamp[k] = st
                        if kind == OPT:  # the next use moves from now to later: a lower score, up
                            score[k] = -float(nxt_use[r])
                            _sift_up(heap, s * M, pos, pos[k], score, stamp)
                        else:  # a count grows (and LCP's time): a higher score, down
                            count[k] += 1
                            score[k] = count[k] if kind == LFU else np.log(count[k]) + decay * token
                            _sift_down(heap, s * M, pos, pos[k], size[s], score, stamp)
                    continue
                misses[phase, layer] += 1
                if size[s] >= caps[s]:  # evict the policy's victim, never a pinned key
                    v = -1
                    if kind == LLRU:
                        v = _llru_victim(s, now, L, head, nxt, tau, pin, epoch)
                    elif listed:
                        v = head[s]
                        while v >= 0 and pin[v] == epoch:
                            v = nxt[v]
                    else:
                        b, lifted, m = s * M, 0, size[s]
                        while m > 0:
                            top = heap[b]
                            if pin[top] != epoch:
                                v = top
                                break
                            held[lifted] = top
                            lifted += 1
                            m = _heap_remove(heap, b, pos, m, top, score, stamp)
                        for x in range(lifted):
                            heap[b + m] = held[x]
                            pos[held[x]] = m
                            m += 1
                            _sift_up(heap, b, pos, m - 1, score, stamp)
                    if v < 0:
                        return misses, NO_VICTIM
                    resident[v] = False
                    if listed:
                        _list_remove(v, s, prv, nxt, head, tail)
                    else:
                        b, m = s * M, size[s] - 1
                        if pos[v] == 0:  # the root (no pinned key above it): Floyd's pop
                            _pop_root(heap, b, pos, m, score, stamp)
                        else:
                            _heap_remove(heap, b, pos, size[s], v, score, stamp)
                    size[s] -= 1
                resident[k] = True
                if listed:
                    _list_append(k, s, prv, nxt, head, tail)
                    tau[k] = now
                else:
                    st += 1
                    stamp[k] = st
                    if kind == OPT:
                        score[k] = -float(nxt_use[r])
                    else:
                        count[k] += 1
                        score[k] = count[k] if kind == LFU else np.log(count[k]) + decay * token
                    heap[s * M + size[s]] = k
                    pos[k] = size[s]
                    _sift_up(heap, s * M, pos, size[s], score, stamp)
                size[s] += 1
            c0 = c1
    return misses, 0


# -- OPT's bound: a scan over packed priorities ---------------------------------------------------------
# ``replay``'s OPT keeps an indexed heap and moves a key's entry on each hit: about log2(capacity)
# unpredictable branches per request. OPT's bound is on every row of every run, so it has its own kernel:
# each resident key holds one int64 in a dense array (next use << 32 | ~stamp: the farthest next use
# first, the oldest stamp first among equals, ``replay``'s order exactly); a hit rewrites it, a miss scans
# for the largest. Keys of the chunk being served are pinned by holding -1 until the chunk ends.
# Needs group indices < 2**31 - 1 and fewer than 2**32 - 1 requests (``fast`` checks; beyond, ``replay``).

_FAR = (1 << 31) - 1  # a never-again next use, packed
_LOW = (1 << 32) - 1


@numba.njit(cache=True, nogil=True, _nrt=False)  # scalars only
def _pack(u, never, st):  # pragma: no cover (compiled)
    """The priority of a key next used at group u (or never) and touched at stamp st."""
    u = np.int64(u)
    return ((_FAR if u == never else u) << 32) | (_LOW - st)


@numba.njit(cache=True, nogil=True, _nrt=False)  # takes arrays, allocates none: no reference counting
def _latest(prio, size):  # pragma: no cover (compiled)
    """The slot with the largest priority (-1 if every slot is pinned): a branch-free maximum
    (vectorised), then its place."""
    best = -1
    for q in range(size):
        best = max(best, prio[q])
    if best < 0:
        return -1
    v = 0
    while prio[v] != best:
        v += 1
    return v


@numba.njit(cache=True, nogil=True, _nrt=False)  # takes arrays, allocates none: no reference counting
def _evict(v, size, slot, owner, prio, resident):  # pragma: no cover (compiled)
    """Empty slot v (the last slot fills the hole); returns the new size."""
    resident[owner[v]] = False
    slot[owner[v]] = -1
    size -= 1
    if v < size:
        owner[v], prio[v] = owner[size], prio[size]
        slot[owner[v]] = v
    return size


@numba.njit(cache=True, nogil=True, _nrt=False)  # takes arrays, allocates none: no reference counting
def _insert(k, p, size, slot, owner, prio, resident):  # pragma: no cover (compiled)
    resident[k] = True
    slot[k] = size
    owner[size] = k
    prio[size] = p
    return size + 1


@numba.njit(cache=True, nogil=True)
def opt_replay(
    keys, groups, per_layer, L, E, round_prefill, nxt_use, never, rooms, single, hits
):  # pragma: no cover
    """``replay(OPT, dist=False, ...)``'s result (same misses, same hits, same status), faster.
    ``single``: every group is one request (flat and rounds orders), so no key is ever pinned against
    its own group's eviction, and the loop needs no chunks."""
    record = len(hits) > 0
    K = L * E
    cap = rooms[0]
    size = 0
    resident = np.zeros(K, dtype=np.bool_)
    slot = np.full(K, -1, dtype=np.int64)  # key -> its slot, -1 when not resident
    owner = np.empty(K, dtype=np.int64)  # slot -> key
    prio = np.empty(K, dtype=np.int64)  # slot -> packed priority, -1 while pinned
    later = np.empty(K, dtype=np.int64)  # the chunk's keys' priorities, set when the chunk ends
    order = np.empty(K, dtype=np.int64)
    misses = np.zeros((2, L), dtype=np.int64)
    st = 0
    j, n_req = 0, len(keys)
    rnd, layer, base = 0, 0, 0
    if single:
        for r in range(n_req):
            base, layer, rnd = _visit(groups[r], base, per_layer, layer, rnd, L)
            k = keys[r]
            st += 1
            p = _pack(nxt_use[r], never, st)
            q = slot[k]
            if q >= 0:
                if record:
                    hits[r] = 1
                prio[q] = p
                continue
            misses[1 if round_prefill[rnd] else 0, layer] += 1
            if size >= cap:  # nothing is pinned: a victim always exists
                size = _evict(_latest(prio, size), size, slot, owner, prio, resident)
            size = _insert(k, p, size, slot, owner, prio, resident)
        return misses, 0
    while j < n_req:
        i = j
        j = _group_end(groups, i)
        base, layer, rnd = _visit(groups[i], base, per_layer, layer, rnd, L)
        phase = 1 if round_prefill[rnd] else 0
        room, m = rooms[layer], j - i
        if m <= room:
            for r in range(i, j):
                order[r - i] = r
            room = m
        else:
            _split_order(keys, i, j, resident, order)
        c0 = 0
        while c0 < m:
            c1 = min(c0 + room, m)
            for c in range(c0, c1):  # pin the chunk's resident keys
                q = slot[keys[order[c]]]
                if q >= 0:
                    prio[q] = -1
            for c in range(c0, c1):
                r = order[c]
                k = keys[r]
                if slot[k] >= 0:
                    if record:
                        hits[r] = 1
                else:
                    misses[phase, layer] += 1
                    if size >= cap:  # evict the unpinned key with the largest priority
                        v = _latest(prio, size)
                        if v < 0:
                            return misses, NO_VICTIM
                        size = _evict(v, size, slot, owner, prio, resident)
                    size = _insert(k, -1, size, slot, owner, prio, resident)  # pinned until the chunk ends
                st += 1
                later[c - c0] = _pack(nxt_use[r], never, st)
            for c in range(c0, c1):  # unpin: each key's priority from its access
                prio[slot[keys[order[c]]]] = later[c - c0]
            c0 = c1
    return misses, 0
