"""numba kernels behind the packed experts (``engine.packed``): one token's product with several experts'
quantised matrices, read from the slot pool in their packed bytes, never expanded.

Why: a decode step on a CPU multiplies one row by each of its experts' matrices, at the memory's speed;
a packed matrix is 2x (int8) or 3.6x (int4) fewer bytes than bfloat16. torch's own packed kernels were
measured first (``bench/gemv_cpu.py --packed``): ``_weight_int8pack_mm`` takes the same per-row int8
layout, but one call per expert and projection; ``_weight_int4pack_mm_for_cpu`` reads its own blocked
layout and was compute-bound at half the int8 kernel's bytes per second here. These loops take every
expert of a layer in one call, over the pool, with the slot ids.

Layout: ``pool`` is the slot pool's buffer ``[S, slot bytes]`` (uint8); a matrix of ``rows x cols``
(transformers' ``[out, in]``) of slot ``s`` is, from byte offsets in the slot:

- int8: ``q`` ``rows * cols`` signed bytes (row-major) at ``qoff``, one float32 scale per row at
  ``soff``; a weight is ``q * scale``.
- int4: ``q`` ``rows * cols / 2`` bytes at ``qoff``, two columns a byte (the even one in the low
  nibble), and per group of ``group`` columns of a row (the last one shorter where ``group`` does not
  divide ``cols``) a bfloat16 scale (at ``soff``) and minimum (at ``moff``); a weight is
  ``q * scale + minimum``. A group's sum ``scale * sum(q * x) + minimum * sum(x)`` takes ``xsum``
  (``[R, groups]``, the input's sum over each group).

``x`` ``[R, cols]`` float32 (int4: ``x_even``/``x_odd`` ``[R, cols / 2]``), one row for every expert or one
each; ``out`` ``[K, rows]`` float32. Every output value is computed by one thread from start to end, so a
result does not depend on the number of threads.

Compiled once per machine and cached on disk (``cache=True``); imported only when packed experts run.
"""

from __future__ import annotations

import numba
import numpy as np

BLOCK_ROWS = 64  # output rows a parallel task takes


@numba.njit(parallel=True, fastmath=True, cache=True, nogil=True)
def rows_int8(pool, qoff, soff, rows, cols, slots, x, out):  # pragma: no cover (compiled)
    blocks = (rows + BLOCK_ROWS - 1) // BLOCK_ROWS
    shared = x.shape[0] == 1
    for task in numba.prange(len(slots) * blocks):
        k = task // blocks
        first = (task % blocks) * BLOCK_ROWS
        last = min(rows, first + BLOCK_ROWS)
        slot = pool[slots[k]]
        xk = x[0 if shared else k]
        q = slot[qoff : qoff + rows * cols].view(np.int8)
        scale = slot[soff : soff + 4 * rows].view(np.float32)
        for n in range(first, last):
            row = q[n * cols : (n + 1) * cols]
            acc = np.float32(0.0)
            for c in range(cols):
                acc += np.float32(row[c]) * xk[c]
            out[k, n] = acc * scale[n]


@numba.njit(inline="always")
def _bf16(bits):  # pragma: no cover (compiled)
    return np.uint32(np.uint32(bits) << np.uint32(16)).view(np.float32)


@numba.njit(parallel=True, fastmath=True, cache=True, nogil=True)
def rows_int4(pool, qoff, soff, moff, rows, cols, group, slots, x_even, x_odd, xsum, out):  # pragma: no cover
    blocks = (rows + BLOCK_ROWS - 1) // BLOCK_ROWS
    shared = x_even.shape[0] == 1
    per_row = (cols + group - 1) // group  # groups in a row (the last one may be shorter)
    half = group // 2  # bytes of a whole group
    row_bytes = cols // 2
    for task in numba.prange(len(slots) * blocks):
        k = task // blocks
        first = (task % blocks) * BLOCK_ROWS
        last = min(rows, first + BLOCK_ROWS)
        slot = pool[slots[k]]
        xr = 0 if shared else k
        xe, xo, xs = x_even[xr], x_odd[xr], xsum[xr]
        q = slot[qoff : qoff + rows * cols // 2]
        scale = slot[soff : soff + 2 * rows * per_row].view(np.uint16)
        low = slot[moff : moff + 2 * rows * per_row].view(np.uint16)
        for n in range(first, last):
            acc = np.float32(0.0)
            for j in range(per_row):
                width = min(half, row_bytes - j * half)
                base = n * row_bytes + j * half
                part = q[base : base + width]
                pe = xe[j * half : j * half + width]
                po = xo[j * half : j * half + width]
                a = np.float32(0.0)
                for c in range(width):
                    b = part[c]
                    a += np.float32(b & np.uint8(15)) * pe[c] + np.float32(b >> np.uint8(4)) * po[c]
                g = n * per_row + j
                acc += _bf16(scale[g]) * a + _bf16(low[g]) * xs[j]
            out[k, n] = acc


# -- several tokens through one expert (a prefill's share of it) ------------------------------------------
# Each row of the matrix is unpacked once into float32 and multiplied by every token's input: the weights
# are read once for all the tokens (the one-token loops above would read them once a token).


@numba.njit(parallel=True, fastmath=True, cache=True, nogil=True)
def tokens_int8(pool, qoff, soff, rows, cols, slot, x, out):  # pragma: no cover (compiled)
    blocks = (rows + BLOCK_ROWS - 1) // BLOCK_ROWS
    src = pool[slot]
    q = src[qoff : qoff + rows * cols].view(np.int8)
    scale = src[soff : soff + 4 * rows].view(np.float32)
    for b in numba.prange(blocks):
        w = np.empty(cols, dtype=np.float32)
        for n in range(b * BLOCK_ROWS, min(rows, (b + 1) * BLOCK_ROWS)):
            row = q[n * cols : (n + 1) * cols]
            for c in range(cols):
                w[c] = np.float32(row[c])
            for m in range(x.shape[0]):
                xm = x[m]
                acc = np.float32(0.0)
                for c in range(cols):
                    acc += w[c] * xm[c]
                out[m, n] = acc * scale[n]


@numba.njit(parallel=True, fastmath=True, cache=True, nogil=True)
def tokens_int4(pool, qoff, soff, moff, rows, cols, group, slot, x, out):  # pragma: no cover (compiled)
    blocks = (rows + BLOCK_ROWS - 1) // BLOCK_ROWS
    per_row = (cols + group - 1) // group
    row_bytes = cols // 2
    src = pool[slot]
    q = src[qoff : qoff + rows * cols // 2]
    scale = src[soff : soff + 2 * rows * per_row].view(np.uint16)
    low = src[moff : moff + 2 * rows * per_row].view(np.uint16)
    for b in numba.prange(blocks):
        w = np.empty(cols, dtype=np.float32)
        for n in range(b * BLOCK_ROWS, min(rows, (b + 1) * BLOCK_ROWS)):
            row = q[n * row_bytes : (n + 1) * row_bytes]
            for c in range(row_bytes):
                j = (2 * c) // group
                s = _bf16(scale[n * per_row + j])
                lo = _bf16(low[n * per_row + j])
                w[2 * c] = np.float32(row[c] & np.uint8(15)) * s + lo
                w[2 * c + 1] = np.float32(row[c] >> np.uint8(4)) * s + lo
            for m in range(x.shape[0]):
                xm = x[m]
                acc = np.float32(0.0)
                for c in range(cols):
                    acc += w[c] * xm[c]
                out[m, n] = acc
