"""numba kernels behind the ``compiled`` experts kernel (``engine.kernels``): one token's product with
several experts' matrices in the slot pool, each output a float32 dot product over a whole row.

Why: on a CPU a decode step multiplies one row by each expert's matrices, a matrix-vector product whose
speed is the memory's. torch's bfloat16 ``mm`` (oneDNN) runs it at 12-15 GB/s on an expert's matrices on
2 cores of the development VM, these loops at 24-29 GB/s, about what reading memory reaches there
(``bench/gemv_cpu.py``, ``docs/BENCHMARKS.md``); llama.cpp's own are as fast. Their sums
run in another order than oneDNN's, so a value sometimes rounds to the neighbouring bfloat16: the
kernel is opt-in, and says so.

Layout: ``pool`` is the slot pool's buffer seen as 32-bit words ``[S, W]`` (bfloat16: two values a word,
the even-indexed one in the low half; float32: one value); the matrix of slot ``s`` is ``rows x cols``
values from word ``offset`` on, row-major (transformers' ``[out, in]`` weights). ``x_even`` / ``x_odd``
``[R, cols / 2]``: the input's even and odd columns in float32 (one row for every expert, or one row
each); ``out`` ``[K, rows]`` float32. Each output value is computed by one thread from start to end, so a
result does not depend on the number of threads.

Compiled once per machine and cached on disk (``cache=True``); imported only when the kernel is chosen.
"""

from __future__ import annotations

import numpy as np

from expertcache.jit import numba

BLOCK_ROWS = 64  # output rows a parallel task takes (a few KiB of weights: even work on any core count)


@numba.njit(parallel=True, fastmath=True, cache=True, nogil=True)
def rows_bf16(pool, offset, rows, cols, slots, x_even, x_odd, out):  # pragma: no cover (compiled)
    half = cols // 2
    blocks = (rows + BLOCK_ROWS - 1) // BLOCK_ROWS
    shared = x_even.shape[0] == 1
    for task in numba.prange(len(slots) * blocks):
        k = task // blocks
        first = (task % blocks) * BLOCK_ROWS
        last = min(rows, first + BLOCK_ROWS)
        s = slots[k]
        xr = 0 if shared else k
        xe, xo = x_even[xr], x_odd[xr]
        for n in range(first, last):
            base = offset + n * half
            row = pool[s, base : base + half]  # a 1-d view: indices from 0 up, so the loop vectorises
            acc_even = np.float32(0.0)
            acc_odd = np.float32(0.0)
            for c in range(half):
                word = row[c]
                lo = np.uint32(word << np.uint32(16)).view(np.float32)
                hi = np.uint32(word & np.uint32(0xFFFF0000)).view(np.float32)
                acc_even += lo * xe[c]
                acc_odd += hi * xo[c]
            out[k, n] = acc_even + acc_odd


@numba.njit(parallel=True, fastmath=True, cache=True, nogil=True)
def rows_f32(pool, offset, rows, cols, slots, x, out):  # pragma: no cover (compiled)
    blocks = (rows + BLOCK_ROWS - 1) // BLOCK_ROWS
    shared = x.shape[0] == 1
    for task in numba.prange(len(slots) * blocks):
        k = task // blocks
        first = (task % blocks) * BLOCK_ROWS
        last = min(rows, first + BLOCK_ROWS)
        s = slots[k]
        xk = x[0 if shared else k]
        for n in range(first, last):
            base = offset + n * cols
            row = pool[s, base : base + cols]
            acc = np.float32(0.0)
            for c in range(cols):
                acc += row[c] * xk[c]
            out[k, n] = acc
