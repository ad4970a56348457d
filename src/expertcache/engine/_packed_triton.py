"""The packed experts' kernels on a GPU (Triton): one weight matrix of a slot times one row of activations,
read from the slot pool's packed bytes and multiplied in one pass (no expanded copy of the matrix).

Each program computes ``BLOCK_N`` outputs of one (row, slot) pair: it walks the matrix's input columns in
blocks, unpacks the block's weights in registers, multiplies them by the row's activations (float32) and
sums; int8 scales the row's sum once, int4 scales and shifts each group's partial sums (a weight is
``q * scale + minimum``, so a group contributes ``scale * sum(q x) + minimum * sum(x)``). The reduction
order depends only on the matrix's shape (the block sizes are fixed by it, never tuned at run time), so a
pair's output is the same bit for bit whichever other pairs share its call: a miss computed alone and the
same expert in a batch of resident ones agree. A pair whose slot is out of the pool (the sentinel of
an expert computed elsewhere) gets zeros. The layouts are ``engine.packed``'s.

Other tools' formats (``_packed_jit``'s ``rows_mxfp4`` and ``rows_fp8`` are the reference): mxfp4 sums
each block of 32 columns and scales it by its e8m0 power of two (``fp4 * 2 ** e`` is exact in bfloat16:
no rounding to the compute dtype is missed); fp8 walks each row's blocks of scale columns and scales each
block's sum, or, for a bfloat16 model (``ROUND_BF16``), rounds each weight ``fp8 * scale`` to bfloat16
first, as transformers' dequantised weights are. Their codes are decoded with integer arithmetic on the
bits (no float8 type: not every GPU nor the interpreter has one).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# never specialised on the pool's size, the row stride or the slot size: one compilation per matrix shape,
# whether a call covers one slot's view (a miss) or the whole pool (resident experts)
_GENERIC = ["slot_bytes", "num_slots", "x_stride"]


@triton.jit(do_not_specialize=_GENERIC)
def _rows_int8(
    pool, slot_bytes, num_slots, off_q, off_scale, slots, x, x_stride, out, rows, cols,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pair = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slots + pair).to(tl.int64)
    valid = slot < num_slots
    base = pool + tl.where(valid, slot, 0) * slot_bytes
    n_ok = n < tl.where(valid, rows, 0)  # an out-of-pool slot reads no row (``_rows_mxfp4``)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for c0 in range(0, cols, BLOCK_K):
        c = c0 + tl.arange(0, BLOCK_K)
        c_ok = c < cols
        # a pair past the pool reads its input row (in bounds) and zero weights and scales: zeros out
        xv = tl.load(x + pair * x_stride + c, mask=c_ok, other=0.0).to(tl.float32)
        q = tl.load(base + off_q + n[:, None].to(tl.int64) * cols + c[None, :],
                    mask=n_ok[:, None] & c_ok[None, :], other=0)  # fmt: skip
        acc += tl.sum(q.to(tl.int8, bitcast=True).to(tl.float32) * xv[None, :], axis=1)
    scale = tl.load((base + off_scale).to(tl.pointer_type(tl.float32)) + n, mask=n_ok, other=0.0)
    tl.store(out + pair * rows + n, acc * scale, mask=n < rows)


@triton.jit(do_not_specialize=_GENERIC)
def _rows_int4(
    pool, slot_bytes, num_slots, off_q, off_scale, off_min, slots, x, x_stride, out, rows, cols, groups,
    HALF: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr,
):  # fmt: skip
    pair = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slots + pair).to(tl.int64)
    valid = slot < num_slots
    base = pool + tl.where(valid, slot, 0) * slot_bytes
    n_ok = n < tl.where(valid, rows, 0)  # an out-of-pool slot reads no row (``_rows_mxfp4``)
    half_cols = cols // 2  # bytes a row
    scale_at = (base + off_scale).to(tl.pointer_type(tl.bfloat16))
    min_at = (base + off_min).to(tl.pointer_type(tl.bfloat16))
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    BLOCK_B: tl.constexpr = HALF * GROUPS  # bytes a step: GROUPS groups of 2 * HALF columns
    for b0 in range(0, half_cols, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        b_ok = b < half_cols
        xrow = x + pair * x_stride + 2 * b
        even = tl.load(xrow, mask=b_ok, other=0.0).to(tl.float32)  # a pair past the pool: zero weights
        odd = tl.load(xrow + 1, mask=b_ok, other=0.0).to(tl.float32)
        q = tl.load(base + off_q + n[:, None].to(tl.int64) * half_cols + b[None, :],
                    mask=n_ok[:, None] & b_ok[None, :], other=0)  # fmt: skip
        prod = (q & 15).to(tl.float32) * even[None, :] + (q >> 4).to(tl.float32) * odd[None, :]
        qx = tl.sum(tl.reshape(prod, (BLOCK_N, GROUPS, HALF)), axis=2)  # [N, GROUPS]: sum(q x) per group
        xs = tl.sum(tl.reshape(even + odd, (GROUPS, HALF)), axis=1)  # [GROUPS]: sum(x) per group
        g = b0 // HALF + tl.arange(0, GROUPS)
        g_ok = n_ok[:, None] & (g < groups)[None, :]
        at = n[:, None].to(tl.int64) * groups + g[None, :]
        scale = tl.load(scale_at + at, mask=g_ok, other=0.0).to(tl.float32)
        low = tl.load(min_at + at, mask=g_ok, other=0.0).to(tl.float32)
        acc += tl.sum(qx * scale + low * xs[None, :], axis=1)
    tl.store(out + pair * rows + n, acc, mask=n < rows)


@triton.jit
def _e2m1(code):
    """e2m1 codes (int32, 0..15) -> float32: float32 bits ``(m << 22) + (126 << 23)`` of the magnitude bits
    ``m`` are the value for ``m >= 2``, ``2 f - 1`` is for the subnormal ``m < 2``; bit 3 is the sign."""
    f = (((code & 7) << 22) + (126 << 23)).to(tl.float32, bitcast=True)
    f = tl.where((code & 6) != 0, f, 2.0 * f - 1.0)
    return tl.where((code & 8) != 0, -f, f)


@triton.jit
def _e8m0(e):
    """e8m0 exponents (int32, 0..255) -> float32 ``2 ** (e - 127)``: the bits ``e << 23``, but for 0 (the
    subnormal ``2 ** -127``) and 255 (NaN)."""
    bits = tl.where(e == 0, 0x00400000, e << 23)
    return tl.where(e == 255, 0x7FC00000, bits).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3(code):
    """float8 e4m3fn codes (int32, 0..255) -> float32: float32 bits ``(em << 20) + (120 << 23)`` of the
    exponent and mantissa bits are the value for a normal code, ``2 f - 2 ** -6`` is for a subnormal one
    (exponent 0: ``m * 2 ** -9``); 0x7F and 0xFF are NaN; bit 7 is the sign."""
    mag = code & 0x7F
    f = ((mag << 20) + (120 << 23)).to(tl.float32, bitcast=True)
    f = tl.where((code & 0x78) != 0, f, 2.0 * f - 0.015625)
    f = tl.where(mag == 0x7F, float("nan"), f)
    return tl.where((code & 0x80) != 0, -f, f)


@triton.jit
def _round_bf16(f):
    """float32 -> the nearest bfloat16 (ties to even), as float32: what ``.to(torch.bfloat16)`` gives."""
    u = f.to(tl.uint32, bitcast=True)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=_GENERIC)
def _rows_mxfp4(
    pool, slot_bytes, num_slots, off_q, off_scale, slots, x, x_stride, out, rows, cols,
    BLOCK_N: tl.constexpr, GROUPS: tl.constexpr,
):  # fmt: skip
    pair = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slots + pair).to(tl.int64)
    valid = slot < num_slots
    base = pool + tl.where(valid, slot, 0) * slot_bytes
    # an out-of-pool slot reads no row and no column (bounds rather than ``& valid``: the interpreter
    # types a scalar comparison broadcast into a block's ``&`` wrongly, and the masks must be boolean)
    n_ok = n < tl.where(valid, rows, 0)
    half_cols = cols // 2  # bytes a row
    half_ok = tl.where(valid, half_cols, 0)
    groups = cols // 32  # scales a row
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    BLOCK_B: tl.constexpr = 16 * GROUPS  # bytes a step: GROUPS blocks of 32 columns
    for b0 in range(0, half_cols, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        b_ok = b < half_ok
        xrow = x + pair * x_stride + 2 * b
        even = tl.load(xrow, mask=b_ok, other=0.0).to(tl.float32)
        odd = tl.load(xrow + 1, mask=b_ok, other=0.0).to(tl.float32)
        q = tl.load(base + off_q + n[:, None].to(tl.int64) * half_cols + b[None, :],
                    mask=n_ok[:, None] & b_ok[None, :], other=0).to(tl.int32)  # fmt: skip
        prod = _e2m1(q & 15) * even[None, :] + _e2m1(q >> 4) * odd[None, :]
        qx = tl.sum(tl.reshape(prod, (BLOCK_N, GROUPS, 16)), axis=2)  # [N, GROUPS]: sum(fp4 x) per block
        g = b0 // 16 + tl.arange(0, GROUPS)
        g_ok = n_ok[:, None] & (g < groups)[None, :]
        e = tl.load(base + off_scale + n[:, None].to(tl.int64) * groups + g[None, :], mask=g_ok, other=127)
        acc += tl.sum(qx * _e8m0(e.to(tl.int32)), axis=1)
    tl.store(out + pair * rows + n, acc, mask=n < rows)


@triton.jit(do_not_specialize=_GENERIC)
def _rows_fp8(
    pool, slot_bytes, num_slots, off_q, off_scale, slots, x, x_stride, out, rows, cols, bcols, srow,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROUND_BF16: tl.constexpr,
):  # fmt: skip
    pair = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slots + pair).to(tl.int64)
    valid = slot < num_slots
    base = pool + tl.where(valid, slot, 0) * slot_bytes
    n_ok = n < tl.where(valid, rows, 0)  # an out-of-pool slot reads no row and no column (``_rows_mxfp4``)
    cols_ok = tl.where(valid, cols, 0)
    per_row = tl.cdiv(cols, bcols)  # scales a scale row
    first = tl.load(srow + n, mask=n_ok, other=0) * per_row  # the row's first scale
    scale_at = (base + off_scale).to(tl.pointer_type(tl.float32)) + first
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in range(0, per_row):  # the row's blocks of bcols columns, each with its scale
        scale = tl.load(scale_at + j, mask=n_ok, other=0.0)
        part = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, bcols, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            c = j * bcols + k
            c_ok = (k < bcols) & (c < cols_ok)
            xv = tl.load(x + pair * x_stride + c, mask=c_ok, other=0.0).to(tl.float32)
            q = tl.load(base + off_q + n[:, None].to(tl.int64) * cols + c[None, :],
                        mask=n_ok[:, None] & c_ok[None, :], other=0).to(tl.int32)  # fmt: skip
            w = _e4m3(q)
            if ROUND_BF16:  # each weight as transformers' bfloat16 model has it
                w = _round_bf16(w * scale[:, None])
            part += tl.sum(w * xv[None, :], axis=1)
        if ROUND_BF16:
            acc += part
        else:
            acc += part * scale
    tl.store(out + pair * rows + n, acc, mask=n < rows)


def blocks(fmt: str, rows: int, cols: int, group: int) -> tuple[int, int]:
    """The block sizes for a matrix: (outputs a program, int8, fp8: columns a step / int4, mxfp4: groups a
    step), ``group`` int4's and mxfp4's columns a scale, fp8's columns a block of scales. Fixed by the shape
    alone, from ``bench/packed_gpu.py``'s sweeps on an H100 (Mixtral-8x7B's and Qwen3-30B-A3B's matrices:
    int8 and int4 on 2026-11-24, fp8 and mxfp4 on 2026-11-26; docs/BENCHMARKS.md)."""
    tall = rows > 8192  # Mixtral's gate_up, 28672 rows
    block_n = 32 if tall else 16
    if fmt == "int8":
        return block_n, 256 if tall else 512
    if fmt == "fp8":  # columns a step, within one block of scales (``group``: its columns)
        return (
            (32, min(32, triton.next_power_of_2(group)))
            if tall
            else (8, min(128, triton.next_power_of_2(group)))
        )
    if fmt == "mxfp4":  # groups of 32 columns a step: longer steps on long rows (Mixtral's down, 14336)
        return block_n, 32 if cols > 8192 else 16
    return block_n, max(1, 512 // group)  # int4: groups a step


def project(
    fmt: str,
    group: int,
    pool: torch.Tensor,
    offsets: tuple[int, ...],
    rows: int,
    cols: int,
    slots: torch.Tensor,
    x: torch.Tensor,
    *,
    bcols: int = 0,
    srow: torch.Tensor | None = None,
    round_bf16: bool = False,
) -> torch.Tensor:
    """``x`` ``[P, cols]`` (row p with slot ``slots[p]``; one row shared by all when ``P`` is 1) times each
    slot's matrix (the packed tensors at ``offsets`` in its slot of ``pool`` ``[S, slot bytes]``) -> float32
    ``[len(slots), rows]``. fp8 takes its scales' ``bcols`` columns a block, ``srow`` (int32 ``[rows]`` on
    the pool's device: each row's scale row) and ``round_bf16`` (each weight rounded to bfloat16 first)."""
    pairs = slots.numel()
    x = x.contiguous()
    x_stride = 0 if x.shape[0] == 1 else x.stride(0)
    out = torch.empty(pairs, rows, dtype=torch.float32, device=pool.device)
    if pairs == 0:
        return out
    block_n, block = blocks(fmt, rows, cols, bcols if fmt == "fp8" else group)
    grid = (pairs, triton.cdiv(rows, block_n))
    S, slot_bytes = pool.shape
    if fmt == "int8":
        _rows_int8[grid](pool, slot_bytes, S, *offsets, slots, x, x_stride, out, rows, cols,
                         BLOCK_N=block_n, BLOCK_K=block)  # fmt: skip
    elif fmt == "int4":
        groups = -(-cols // group)
        _rows_int4[grid](pool, slot_bytes, S, *offsets, slots, x, x_stride, out, rows, cols, groups,
                         HALF=group // 2, BLOCK_N=block_n, GROUPS=block)  # fmt: skip
    elif fmt == "mxfp4":
        _rows_mxfp4[grid](pool, slot_bytes, S, *offsets, slots, x, x_stride, out, rows, cols,
                          BLOCK_N=block_n, GROUPS=block)  # fmt: skip
    else:  # fp8
        _rows_fp8[grid](pool, slot_bytes, S, *offsets, slots, x, x_stride, out, rows, cols, bcols, srow,
                        BLOCK_N=block_n, BLOCK_K=block, ROUND_BF16=round_bf16)  # fmt: skip
    return out


def warm(
    fmt: str,
    group: int,
    pool: torch.Tensor,
    offsets: dict[str, tuple[int, ...]],
    shapes,
    dtype: torch.dtype,
    extras: dict[str, dict] | None = None,
) -> None:
    """Compile the kernels for each matrix (``shapes``: name -> (rows, cols)) before the first step, for
    inputs of ``dtype`` (the compute dtype: Triton compiles a kernel per argument type) and int64 slot ids
    (the slot table's); ``extras``: name -> ``project``'s keyword arguments for it (fp8's)."""
    slots = torch.zeros(1, dtype=torch.int64, device=pool.device)
    for name, (rows, cols) in shapes.items():
        x = torch.zeros(1, cols, dtype=dtype, device=pool.device)
        project(fmt, group, pool, offsets[name], rows, cols, slots, x, **(extras or {}).get(name, {}))
