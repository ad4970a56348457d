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

import numpy as np
from llvmlite import ir

# isort: off
from expertcache.jit import numba  # first: it settles numba's target and pool before numba loads
from numba.core import cgutils
from numba.extending import intrinsic

# isort: on

BLOCK_ROWS = 64  # output rows a parallel task takes
# Bytes the int8 loop asks the memory for ahead of the row it reads (``_prefetch``): two of Granite's rows.
# A core computes a row's int8-to-float products at about the memory's speed, and without the hint it
# waits for the next row's lines after computing each: on the Zen 4 development VM (2026-11-29) a decode
# step's 8 int8 experts at Granite's shapes took 517 us with it against 571 us without, 24.4 against
# 22.0 GB/s (``bench/packed_width_cpu.py``, docs/BENCHMARKS.md); 1024 to 4096 bytes did about as well.
# The int4 loop, compute-bound at a third of the memory's speed, gained nothing and takes none. A hint
# moves no value: the products' bits are the same.
AHEAD = 2048


@intrinsic
def _prefetch(typingctx, array, index):
    """A hint to bring ``array[index]``'s cache line in for reading (LLVM's ``llvm.prefetch``: read, high
    locality, data); an index beyond the array is harmless (a hint never faults)."""

    def codegen(context, builder, signature, args):
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]], wraparound=False)
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [ptr.type, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        builder.call(fn, [ptr, i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return numba.types.void(array, index), codegen


@numba.njit(inline="always")
def _ahead(q, start, stop):  # pragma: no cover (compiled)
    """Ask for ``q[start:stop]``'s cache lines (64 bytes) ahead of the loop that reads them."""
    for b in range(start, stop, 64):
        _prefetch(q, b)


@numba.njit(inline="always")
def _task(task, pairs, blocks, rows, by_block):  # pragma: no cover (compiled)
    """A parallel task of the one-token loops -> (pair, first row, end row) of its block of output rows:
    every block of a pair before the next pair, or with ``by_block`` a block for every pair before the next
    block (pairs that share a slot read each block once). Each value is computed the same way either way."""
    k = task % pairs if by_block else task // blocks
    first = (task // pairs if by_block else task % blocks) * BLOCK_ROWS
    return k, first, min(rows, first + BLOCK_ROWS)


@numba.njit(parallel=True, fastmath=True, cache=True, nogil=True)
def rows_int8(pool, qoff, soff, rows, cols, slots, x, out, by_block=False):  # pragma: no cover (compiled)
    """``by_block`` (``_task``) for pairs that share a slot (a dense layer's tokens, an expert's few tokens):
    8 tokens through a 100 MB matrix in 39 against 78 ms; distinct experts read each matrix in one stream."""
    blocks = (rows + BLOCK_ROWS - 1) // BLOCK_ROWS
    shared = x.shape[0] == 1
    for task in numba.prange(len(slots) * blocks):
        k, first, last = _task(task, len(slots), blocks, rows, by_block)
        slot = pool[slots[k]]
        xk = x[0 if shared else k]
        q = slot[qoff : qoff + rows * cols].view(np.int8)
        scale = slot[soff : soff + 4 * rows].view(np.float32)
        end = last * cols  # the task's own rows: what lies beyond is another task's
        for n in range(first, last):
            _ahead(q, n * cols + AHEAD, min(n * cols + AHEAD + cols, end))
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
        k, first, last = _task(task, len(slots), blocks, rows, False)
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


@numba.njit(inline="always")
def _times_tokens(w, x, out, n, scale):  # pragma: no cover (compiled)
    """Output row ``n`` of every token: the decoded weight row ``w`` (float32) times each row of ``x``,
    times ``scale``."""
    for m in range(x.shape[0]):
        xm = x[m]
        acc = np.float32(0.0)
        for c in range(len(w)):
            acc += w[c] * xm[c]
        out[m, n] = acc * scale


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
            _times_tokens(w, x, out, n, scale[n])


@numba.njit(parallel=True, fastmath=True, cache=True, nogil=True)
def tokens_int4(pool, qoff, soff, moff, rows, cols, group, slot, x, out):  # pragma: no cover (compiled)
    blocks = (rows + BLOCK_ROWS - 1) // BLOCK_ROWS
    per_row = (cols + group - 1) // group
    row_bytes = cols // 2
    half = group // 2
    src = pool[slot]
    q = src[qoff : qoff + rows * cols // 2].view(np.uint8)  # .view: typed contiguous, so vectorised
    scale = src[soff : soff + 2 * rows * per_row].view(np.uint16)
    low = src[moff : moff + 2 * rows * per_row].view(np.uint16)
    for b in numba.prange(blocks):
        w = np.empty(cols, dtype=np.float32)
        for n in range(b * BLOCK_ROWS, min(rows, (b + 1) * BLOCK_ROWS)):
            for j in range(per_row):  # a group at a time: its scale and minimum loaded once
                s = _bf16(scale[n * per_row + j])
                lo = _bf16(low[n * per_row + j])
                first = n * row_bytes + j * half
                part = q[first : first + min(half, row_bytes - j * half)]
                wj = w[j * group : j * group + 2 * len(part)]
                for c in range(len(part)):
                    wj[2 * c] = np.float32(part[c] & np.uint8(15)) * s + lo
                    wj[2 * c + 1] = np.float32(part[c] >> np.uint8(4)) * s + lo
            _times_tokens(w, x, out, n, np.float32(1.0))


# -- other tools' formats: GPT-OSS's MXFP4 and block-scaled FP8 (``engine.packed``) -------------------------
# e8m0's powers of two by byte (255: NaN), a float32 table: a constant of the compiled loops
E8M0 = np.array([np.ldexp(1.0, s - 127) for s in range(255)] + [np.nan], np.float32)
MX = 32  # columns per MXFP4 scale


@numba.njit(inline="always")
def _sign(n32, bit):  # pragma: no cover (compiled)
    """1.0 or -1.0 as bit ``bit`` of ``n32`` is clear or set."""
    return np.uint32(np.uint32(0x3F800000) | ((n32 >> np.uint32(bit)) & np.uint32(1)) << np.uint32(31)).view(
        np.float32
    )


@numba.njit(inline="always")
def _fp4(n):  # pragma: no cover (compiled)
    """e2m1 code ``n``'s value, without a table or a branch (a table's lookups, or a select, kept the loops
    scalar: 1.5x slower at GPT-OSS's shapes): float32 bits ``(m << 22) + (126 << 23)`` of its magnitude
    bits ``m`` are the value for ``m >= 2``, and ``2 f - 1`` is for the subnormal ``m < 2``; the high bit
    is the sign."""
    n32 = np.uint32(n)
    f = np.uint32(((n32 & np.uint32(7)) << np.uint32(22)) + np.uint32(126 << 23)).view(np.float32)
    sub = np.float32((n32 & np.uint32(6)) == np.uint32(0))
    return (f + sub * (f - np.float32(1.0))) * _sign(n32, 3)


@numba.njit(parallel=True, fastmath=True, cache=True, nogil=True)
def rows_mxfp4(pool, qoff, soff, rows, cols, slots, x_even, x_odd, out):  # pragma: no cover (compiled)
    """``q`` ``[rows, cols / 32, 16]`` bytes at ``qoff`` (two e2m1 a byte, even column low), ``scale``
    ``[rows, cols / 32]`` e8m0 bytes at ``soff``: per block of 32 columns, ``2 ** (scale - 127) *
    sum(fp4 * x)``; ``x_even``/``x_odd`` the input's even and odd columns."""
    blocks = (rows + BLOCK_ROWS - 1) // BLOCK_ROWS
    shared = x_even.shape[0] == 1
    per_row = cols // MX
    half = MX // 2
    for task in numba.prange(len(slots) * blocks):
        k, first, last = _task(task, len(slots), blocks, rows, False)
        slot = pool[slots[k]]
        xr = 0 if shared else k
        xe, xo = x_even[xr], x_odd[xr]
        q = slot[qoff : qoff + rows * cols // 2].view(np.uint8)  # .view: typed contiguous, so vectorised
        scale = slot[soff : soff + rows * per_row]
        for n in range(first, last):
            acc = np.float32(0.0)
            for j in range(per_row):
                base = (n * per_row + j) * half
                part = q[base : base + half]
                pe, po = xe[j * half : (j + 1) * half], xo[j * half : (j + 1) * half]
                a = np.float32(0.0)
                for c in range(half):
                    b = part[c]
                    a += _fp4(b & np.uint8(15)) * pe[c] + _fp4(b >> np.uint8(4)) * po[c]
                acc += a * E8M0[scale[n * per_row + j]]
            out[k, n] = acc


@numba.njit(parallel=True, fastmath=True, cache=True, nogil=True)
def tokens_mxfp4(pool, qoff, soff, rows, cols, slot, x, out):  # pragma: no cover (compiled)
    blocks = (rows + BLOCK_ROWS - 1) // BLOCK_ROWS
    per_row = cols // MX
    row_bytes = cols // 2
    src = pool[slot]
    q = src[qoff : qoff + rows * cols // 2].view(np.uint8)  # .view: typed contiguous, so vectorised
    scale = src[soff : soff + rows * per_row]
    for b in numba.prange(blocks):
        w = np.empty(cols, dtype=np.float32)
        for n in range(b * BLOCK_ROWS, min(rows, (b + 1) * BLOCK_ROWS)):
            row = q[n * row_bytes : (n + 1) * row_bytes]
            for c in range(row_bytes):  # the codes of the whole row, then each block's scale
                w[2 * c] = _fp4(row[c] & np.uint8(15))
                w[2 * c + 1] = _fp4(row[c] >> np.uint8(4))
            for j in range(per_row):
                s = E8M0[scale[n * per_row + j]]
                wj = w[j * MX : (j + 1) * MX]
                for c in range(MX):
                    wj[c] *= s
            _times_tokens(w, x, out, n, np.float32(1.0))


@numba.njit(inline="always")
def _e4m3(n):  # pragma: no cover (compiled)
    """fp8 e4m3fn code ``n``'s value, as ``_fp4``'s: float32 bits ``(em << 20) + (120 << 23)`` of its
    exponent and mantissa bits ``em`` are the value for a normal code, and ``2 f - 2 ** -6`` is for a
    subnormal one (exponent 0); 0x7F and 0xFF are NaN (a float32 NaN's bits ORed in); the high bit is the
    sign. Branch-free, and each block read as a contiguous slice, so the loops are vectorised: eight experts'
    gate_up at OLMoE's shapes in 6.7 ms against 21.6 ms through a 256-entry table."""
    n32 = np.uint32(n)
    mag = n32 & np.uint32(0x7F)
    nan = np.uint32(mag == np.uint32(0x7F)) * np.uint32(0x7FC00000)
    f = np.uint32(((mag << np.uint32(20)) + np.uint32(120 << 23)) | nan).view(np.float32)
    sub = np.float32((n32 & np.uint32(0x78)) == np.uint32(0))
    return (f + sub * (f - np.float32(2.0**-6))) * _sign(n32, 7)


@numba.njit(inline="always")
def _round_bf16(f):  # pragma: no cover (compiled)
    """``f`` rounded to the nearest bfloat16 (ties to even), as float32: what ``.to(torch.bfloat16)`` gives
    (for finite values, which the kernels' products of a code and a scale are)."""
    u = np.float32(f).view(np.uint32)
    u = np.uint32((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000))
    return u.view(np.float32)


@numba.njit(parallel=True, fastmath=True, cache=True, nogil=True)
def rows_fp8(pool, qoff, soff, rows, cols, bcols, srow, rnd, slots, x, out):  # pragma: no cover (compiled)
    """``q`` ``[rows, cols]`` e4m3 bytes at ``qoff``, ``scale`` float32 ``[scale rows, ceil(cols / bcols)]``
    at ``soff``, row ``n`` taking scale row ``srow[n]``: per block of ``bcols`` columns, ``scale *
    sum(fp8 * x)``; with ``rnd`` (a bfloat16 model), ``sum(bf16(fp8 * scale) * x)``: each weight rounded
    to bfloat16 first, as transformers' dequantised weights are."""
    blocks = (rows + BLOCK_ROWS - 1) // BLOCK_ROWS
    shared = x.shape[0] == 1
    per_row = (cols + bcols - 1) // bcols
    nscale = (srow[rows - 1] + 1) * per_row
    for task in numba.prange(len(slots) * blocks):
        k, first, last = _task(task, len(slots), blocks, rows, False)
        slot = pool[slots[k]]
        xk = x[0 if shared else k]
        q = slot[qoff : qoff + rows * cols].view(np.uint8)  # .view: typed contiguous, so vectorised
        scale = slot[soff : soff + 4 * nscale].view(np.float32)
        for n in range(first, last):
            acc = np.float32(0.0)
            for j in range(per_row):
                s = scale[srow[n] * per_row + j]
                end = min(cols, (j + 1) * bcols)
                part = q[n * cols + j * bcols : n * cols + end]
                px = xk[j * bcols : end]
                a = np.float32(0.0)
                if rnd:
                    for c in range(len(part)):
                        a += _round_bf16(_e4m3(part[c]) * s) * px[c]
                    acc += a
                else:
                    for c in range(len(part)):
                        a += _e4m3(part[c]) * px[c]
                    acc += a * s
            out[k, n] = acc


@numba.njit(parallel=True, fastmath=True, cache=True, nogil=True)
def tokens_fp8(pool, qoff, soff, rows, cols, bcols, srow, rnd, slot, x, out):  # pragma: no cover (compiled)
    blocks = (rows + BLOCK_ROWS - 1) // BLOCK_ROWS
    per_row = (cols + bcols - 1) // bcols
    nscale = (srow[rows - 1] + 1) * per_row
    src = pool[slot]
    q = src[qoff : qoff + rows * cols].view(np.uint8)
    scale = src[soff : soff + 4 * nscale].view(np.float32)
    for b in numba.prange(blocks):
        w = np.empty(cols, dtype=np.float32)
        for n in range(b * BLOCK_ROWS, min(rows, (b + 1) * BLOCK_ROWS)):
            for j in range(per_row):  # a block of scales at a time
                s = scale[srow[n] * per_row + j]
                end = min(cols, (j + 1) * bcols)
                part = q[n * cols + j * bcols : n * cols + end]
                wj = w[j * bcols : end]
                if rnd:
                    for c in range(len(part)):
                        wj[c] = _round_bf16(_e4m3(part[c]) * s)
                else:
                    for c in range(len(part)):
                        wj[c] = _e4m3(part[c]) * s
            _times_tokens(w, x, out, n, np.float32(1.0))


# -- compressed-tensors' symmetric pack-quantized int4 and int8 (``engine.packed``: pack-int4, pack-int8) --
# ``q`` ``[rows, cols * bits / 8]`` bytes at ``qoff`` (the int32 words' little-endian bytes: int4 two columns
# a byte, the even one in the low nibble; int8 one), unsigned ``u = q + 2 ** (bits - 1)``; a scale per group
# of ``group`` columns of a row (``[rows, cols / group]``, in the model's dtype: bfloat16 ``wide`` False, or
# float32) at ``soff``; a weight is ``(u - 2 ** (bits - 1)) * scale``, rounded to bfloat16 first with ``rnd``
# (as compressed-tensors computes it in the scale's dtype), else the scale factored out of each group.


@numba.njit(inline="always")
def _scale(s16, s32, wide, g):  # pragma: no cover (compiled)
    return s32[g] if wide else _bf16(s16[g])


@numba.njit(parallel=True, fastmath=True, cache=True, nogil=True)
def rows_ct(pool, qoff, soff, rows, cols, group, bits, wide, rnd, slots, x, out):  # pragma: no cover
    blocks = (rows + BLOCK_ROWS - 1) // BLOCK_ROWS
    shared = x.shape[0] == 1
    per_row = cols // group
    row_bytes = cols * bits // 8
    gbytes = group * bits // 8
    off = np.float32(8.0 if bits == 4 else 128.0)
    for task in numba.prange(len(slots) * blocks):
        k, first, last = _task(task, len(slots), blocks, rows, False)
        slot = pool[slots[k]]
        xk = x[0 if shared else k]
        q = slot[qoff : qoff + rows * row_bytes].view(np.uint8)  # .view: typed contiguous, so vectorised
        s16 = slot[soff : soff + (0 if wide else 2 * rows * per_row)].view(np.uint16)
        s32 = slot[soff : soff + (4 * rows * per_row if wide else 0)].view(np.float32)
        for n in range(first, last):
            acc = np.float32(0.0)
            for j in range(per_row):
                s = _scale(s16, s32, wide, n * per_row + j)
                part = q[n * row_bytes + j * gbytes : n * row_bytes + (j + 1) * gbytes]
                px = xk[j * group : (j + 1) * group]
                a = np.float32(0.0)
                if bits == 8:
                    if rnd:
                        for c in range(group):
                            a += _round_bf16((np.float32(part[c]) - off) * s) * px[c]
                    else:
                        for c in range(group):
                            a += (np.float32(part[c]) - off) * px[c]
                else:
                    if rnd:
                        for c in range(gbytes):
                            lo = _round_bf16((np.float32(part[c] & np.uint8(15)) - off) * s)
                            hi = _round_bf16((np.float32(part[c] >> np.uint8(4)) - off) * s)
                            a += lo * px[2 * c] + hi * px[2 * c + 1]
                    else:
                        for c in range(gbytes):
                            lo = np.float32(part[c] & np.uint8(15)) - off
                            hi = np.float32(part[c] >> np.uint8(4)) - off
                            a += lo * px[2 * c] + hi * px[2 * c + 1]
                acc += a if rnd else a * s
            out[k, n] = acc


@numba.njit(parallel=True, fastmath=True, cache=True, nogil=True)
def tokens_ct(pool, qoff, soff, rows, cols, group, bits, wide, rnd, slot, x, out):  # pragma: no cover
    blocks = (rows + BLOCK_ROWS - 1) // BLOCK_ROWS
    per_row = cols // group
    row_bytes = cols * bits // 8
    gbytes = group * bits // 8
    off = np.float32(8.0 if bits == 4 else 128.0)
    src = pool[slot]
    q = src[qoff : qoff + rows * row_bytes].view(np.uint8)
    s16 = src[soff : soff + (0 if wide else 2 * rows * per_row)].view(np.uint16)
    s32 = src[soff : soff + (4 * rows * per_row if wide else 0)].view(np.float32)
    for b in numba.prange(blocks):
        w = np.empty(cols, dtype=np.float32)
        for n in range(b * BLOCK_ROWS, min(rows, (b + 1) * BLOCK_ROWS)):
            for j in range(per_row):  # a group at a time: its scale loaded once
                s = _scale(s16, s32, wide, n * per_row + j)
                part = q[n * row_bytes + j * gbytes : n * row_bytes + (j + 1) * gbytes]
                wj = w[j * group : (j + 1) * group]
                if bits == 8:
                    for c in range(group):
                        wj[c] = (np.float32(part[c]) - off) * s
                else:
                    for c in range(gbytes):
                        wj[2 * c] = (np.float32(part[c] & np.uint8(15)) - off) * s
                        wj[2 * c + 1] = (np.float32(part[c] >> np.uint8(4)) - off) * s
                if rnd:
                    for c in range(group):
                        wj[c] = _round_bf16(wj[c])
            _times_tokens(w, x, out, n, np.float32(1.0))


@numba.njit(parallel=True, fastmath=True, cache=True, nogil=True)
def expand_int8(pool, qoff, soff, rows, cols, bf16, out):  # pragma: no cover (compiled)
    """The int8 matrix at ``qoff`` (scales at ``soff``) of the one-slot ``pool`` expanded into ``out``
    ``[rows, cols]``: float32 ``q * scale``, or with ``bf16`` its bfloat16 bits (``out`` uint16, rounded to
    nearest even: ``(q * scale).to(torch.bfloat16)``'s). One pass, for a product beyond the loops' rows."""
    src = pool[0]
    q = src[qoff : qoff + rows * cols].view(np.int8)
    scale = src[soff : soff + 4 * rows].view(np.float32)
    for n in numba.prange(rows):
        row = q[n * cols : (n + 1) * cols]
        s = scale[n]
        o = out[n]
        for c in range(cols):
            v = np.float32(row[c]) * s
            if bf16:
                o[c] = np.uint16(np.float32(_round_bf16(v)).view(np.uint32) >> np.uint32(16))
            else:
                o[c] = v
