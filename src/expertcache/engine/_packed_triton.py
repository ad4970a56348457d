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
    n_ok = (n < rows) & valid
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for c0 in range(0, cols, BLOCK_K):
        c = c0 + tl.arange(0, BLOCK_K)
        c_ok = c < cols
        xv = tl.load(x + pair * x_stride + c, mask=c_ok & valid, other=0.0).to(tl.float32)
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
    n_ok = (n < rows) & valid
    half_cols = cols // 2  # bytes a row
    scale_at = (base + off_scale).to(tl.pointer_type(tl.bfloat16))
    min_at = (base + off_min).to(tl.pointer_type(tl.bfloat16))
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    BLOCK_B: tl.constexpr = HALF * GROUPS  # bytes a step: GROUPS groups of 2 * HALF columns
    for b0 in range(0, half_cols, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        b_ok = b < half_cols
        xrow = x + pair * x_stride + 2 * b
        even = tl.load(xrow, mask=b_ok & valid, other=0.0).to(tl.float32)
        odd = tl.load(xrow + 1, mask=b_ok & valid, other=0.0).to(tl.float32)
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


def blocks(fmt: str, rows: int, cols: int, group: int) -> tuple[int, int]:
    """The block sizes for a matrix: (outputs a program, int8: columns a step / int4: groups a step).
    Fixed by the shape alone (``bench/packed_gpu.py`` measured them on an H100)."""
    block_n = 16 if rows <= 8192 else 32
    if fmt == "int8":
        return block_n, 512 if rows <= 8192 else 256
    return block_n, max(1, 512 // group)


def project(
    fmt: str,
    group: int,
    pool: torch.Tensor,
    offsets: tuple[int, ...],
    rows: int,
    cols: int,
    slots: torch.Tensor,
    x: torch.Tensor,
) -> torch.Tensor:
    """``x`` ``[P, cols]`` (row p with slot ``slots[p]``; one row shared by all when ``P`` is 1) times each
    slot's matrix (the packed tensors at ``offsets`` in its slot of ``pool`` ``[S, slot bytes]``) -> float32
    ``[len(slots), rows]``."""
    pairs = slots.numel()
    x = x.contiguous()
    x_stride = 0 if x.shape[0] == 1 else x.stride(0)
    out = torch.empty(pairs, rows, dtype=torch.float32, device=pool.device)
    if pairs == 0:
        return out
    block_n, block = blocks(fmt, rows, cols, group)
    grid = (pairs, triton.cdiv(rows, block_n))
    S, slot_bytes = pool.shape
    if fmt == "int8":
        _rows_int8[grid](pool, slot_bytes, S, *offsets, slots, x, x_stride, out, rows, cols,
                         BLOCK_N=block_n, BLOCK_K=block)  # fmt: skip
    else:
        groups = -(-cols // group)
        _rows_int4[grid](pool, slot_bytes, S, *offsets, slots, x, x_stride, out, rows, cols, groups,
                         HALF=group // 2, BLOCK_N=block_n, GROUPS=block)  # fmt: skip
    return out


def warm(
    fmt: str, group: int, pool: torch.Tensor, offsets: dict[str, tuple[int, ...]], shapes, dtype: torch.dtype
) -> None:
    """Compile the kernels for each matrix (``shapes``: name -> (rows, cols)) before the first step, for
    inputs of ``dtype`` (the compute dtype: Triton compiles a kernel per argument type) and int64 slot ids
    (the slot table's)."""
    slots = torch.zeros(1, dtype=torch.int64, device=pool.device)
    for name, (rows, cols) in shapes.items():
        x = torch.zeros(1, cols, dtype=dtype, device=pool.device)
        project(fmt, group, pool, offsets[name], rows, cols, slots, x)
