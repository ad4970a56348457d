"""The dense weights quantised at load (``load(quantize_dense="int8")``, ``--quantize-dense int8``): lossy.

A decode step on a CPU reads every dense weight once (attention projections, shared experts, dense MLP
layers, the output head) besides its experts' weights. The experts of a packed checkpoint
(``engine.packed``) are read at int8's byte a weight by numba's loops; the dense weights stay in the
checkpoint's dtype and go through torch's ``linear``, whose bfloat16 matrix-vector product (oneDNN) runs at
12-15 GB/s on 2 cores of the development VM against 19-26 GB/s for the packed loops. On the
Granite-3.1-1B-A400M configuration the dense products took about 20 ms of a 60 ms int8 decode token.

With ``quantize_dense="int8"`` every ``nn.Linear`` outside the experts and the routers is replaced at load by
a ``QuantizedLinear``: its weight packed as the ``int8`` experts are (``packed.pack_int8``: symmetric, one
float32 scale per output row), computed by the same kernels (numba's on a CPU, Triton's on a GPU) from a
one-slot pool. Half the bytes of bfloat16, read by faster loops. The routers stay in full precision (a
router's error changes which experts run; it is a few KiB), so do the embeddings and the norms.

The checkpoint is not rewritten: the dense weights are read in their dtype and quantised at each load
(under a second for Granite's 97 linear layers, 244 MB: its load took 2.6 s with them quantised, 2.9 s
without, in the benchmark of docs/BENCHMARKS.md). The cost in accuracy is measured by
``expertcache quality --quantize-dense int8`` against the full-precision model.

How a product runs depends on the number of rows ``T`` alone (the input's tokens): up to
``packed.CPU_ROWS["int8"]`` (8) in the one-token loops on a CPU, up to ``packed.DECODE_ROWS`` in Triton's
kernel on a GPU; else the weight is expanded to the compute dtype for that call and multiplied by torch.
Unlike an expert's share of a prefill (a few tokens each), a dense layer takes every token of it, and
torch's bfloat16 matrix product is compute-bound there and faster: at 16 to 64 tokens through a
1024 x 1024 matrix on the development VM (2 threads) the one-token loops took 367-1311 us, the packed
experts' several-token loops 432-1524 us, expanding (one compiled pass) and multiplying 252-438 us; at 8
tokens they are even (199 and 192 us).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np
import torch
from torch.nn import functional as F

from expertcache.engine.kernels import cast, host_f32
from expertcache.engine.packed import CPU_ROWS, DECODE_ROWS, _has_triton, pack_int8
from expertcache.engine.routing import moe_routers
from expertcache.errors import ExpertcacheError, option

DENSE_FORMATS = ("int8",)
_ALIGN = 64  # the scales start on a 64-byte boundary of the pool
_CHUNK = 1 << 20  # weights quantised at a time (an output head of 100 M weights needs no 400 MB copy)


def check_dense_format(fmt: str | None) -> str | None:
    """``fmt`` if it is a dense format this engine quantises to (or None: as stored); else one clear line."""
    if fmt is None or fmt in DENSE_FORMATS:
        return fmt
    raise ExpertcacheError(
        f"dense format {fmt!r} ({option('--quantize-dense', 'quantize_dense')}) is not one the dense layers "
        f"can be quantised to: {', '.join(DENSE_FORMATS)}"
    )


class QuantizedLinear(torch.nn.Module):
    """An ``nn.Linear`` whose weight is int8, one float32 scale a row, held as one slot of bytes (``pool``
    ``[1, bytes]``: the int8 weights row-major, then the scales from byte ``soff``); its bias as it was."""

    def __init__(self, linear: torch.nn.Linear, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dtype = compute_dtype(linear.weight, dtype)
        rows, cols = linear.weight.shape
        self.soff = -(-rows * cols // _ALIGN) * _ALIGN
        pool = torch.zeros(1, self.soff + 4 * rows, dtype=torch.uint8, device=linear.weight.device)
        step = max(1, _CHUNK // cols)  # rows packed at a time: float32 copies of a few MiB, not the matrix
        for first in range(0, rows, step):
            last = min(rows, first + step)
            parts = pack_int8(linear.weight.detach()[first:last].to(torch.float32))
            pool[0, first * cols : last * cols] = parts["q"]
            pool[0, self.soff + 4 * first : self.soff + 4 * last] = parts["scale"]
        self.register_buffer("pool", pool, persistent=False)
        self.qoff = 0  # where the int8 weights start in the pool (a sibling group's pool: further on)
        self.bias = linear.bias  # a Parameter or None
        self.group: SiblingGroup | None = None  # computed with its siblings (``fuse_siblings``)
        self.last: _Last | None = None  # the model's sibling product waiting for its other members
        self._array: tuple[torch.Tensor, np.ndarray] | None = None  # ``array``: (pool, its array)

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return f"in_features={self.in_features}, out_features={self.out_features}, int8, bias={bias}"

    def array(self) -> np.ndarray:
        """The pool as numpy's array for the loops (CPU), made once for each pool tensor the layer holds."""
        made = self._array
        if made is None or made[0] is not self.pool:
            made = self._array = (self.pool, self.pool.numpy())
        return made[1]

    @property
    def nbytes(self) -> int:
        bias = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        if self.group is not None:  # its share of the group's pool
            return self.out_features * (self.in_features + 4) + bias
        return self.pool.numel() + bias

    @property
    def weight(self) -> torch.Tensor:
        """The weight as the model sees it: expanded at each read (some families read a linear layer's
        weight themselves: its dtype for a cast, or its values, as Jamba's ``dt_proj``); never stored."""
        return self.weight_expanded()

    def weight_expanded(self) -> torch.Tensor:
        """The weight the int8 values and scales stand for, in the compute dtype ``[out, in]``: each weight
        ``(q * scale)`` in float32, rounded once to the compute dtype (on a CPU in one compiled pass: 70-82 us
        for a 1024 x 1024 bfloat16 matrix against 379 us for torch's three operations; the same bits)."""
        rows, cols = self.out_features, self.in_features
        if self.pool.device.type == "cpu" and self.dtype in (torch.bfloat16, torch.float32):
            from expertcache.engine import _packed_jit

            bf16 = self.dtype == torch.bfloat16
            out = np.empty((rows, cols), dtype=np.uint16 if bf16 else np.float32)
            _packed_jit.expand_int8(self.pool.numpy(), self.qoff, self.soff, rows, cols, bf16, out)
            return torch.from_numpy(out).view(torch.bfloat16) if bf16 else torch.from_numpy(out)
        return self.weight_expanded_torch()

    def weight_expanded_torch(self) -> torch.Tensor:
        """``weight_expanded`` in torch's operations (any device and dtype)."""
        rows, cols = self.out_features, self.in_features
        q = self.pool[0, self.qoff : self.qoff + rows * cols].view(torch.int8).view(rows, cols)
        scale = self.pool[0, self.soff : self.soff + 4 * rows].view(torch.float32)
        return (q.to(torch.float32) * scale[:, None]).to(self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            y = self.group.output(self, x)
            if y is not None:
                return y
        elif self.last is not None:
            self.last.clear()  # a sibling product is taken right after it is made, or not at all
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        t = x2.shape[0]
        y = self._product(x2, t)
        if y is None:  # beyond the kernels' rows: the weight expanded for this call
            return F.linear(x2, self.weight_expanded(), self.bias).view(*lead, self.out_features)
        if self.bias is not None:
            y = y + self.bias.to(torch.float32)
        return cast(y, x.dtype).view(*lead, self.out_features)

    def _product(self, x2: torch.Tensor, t: int) -> torch.Tensor | None:
        """``x2`` ``[T, in]`` times the weight in float32 ``[T, out]``, or None where the kernels do not take
        ``T`` rows on this device."""
        rows, cols = self.out_features, self.in_features
        if x2.device.type == "cpu" and t <= CPU_ROWS["int8"]:
            from expertcache.engine import _packed_jit

            out = np.empty((t, rows), dtype=np.float32)
            xf = host_f32(x2)
            _packed_jit.rows_int8(self.array(), self.qoff, self.soff, rows, cols, _zeros(t), xf, out, True)
            return torch.from_numpy(out)
        if x2.device.type == "cuda" and t <= DECODE_ROWS and _has_triton():
            return self.triton_product(x2)
        return None

    def triton_product(self, x2: torch.Tensor) -> torch.Tensor:
        """``x2`` ``[T, in]`` (on the pool's device) times the weight in Triton's int8 kernel -> float32."""
        from expertcache.engine import _packed_triton

        slots = torch.zeros(x2.shape[0], dtype=torch.int64, device=x2.device)
        return _packed_triton.project(
            "int8", 0, self.pool, (self.qoff, self.soff), self.out_features, self.in_features, slots, x2
        )


@functools.cache
def _zeros(t: int) -> np.ndarray:  # the slot of each row: the one slot (read only)
    z = np.zeros(t, dtype=np.int64)
    z.setflags(write=False)
    return z


# Sibling projections of one input, computed in one pass of the one-token loops: a decode token's attention
# reads its query, key and value projections from the same hidden states, a dense MLP its gate and up
# projections. Each output row is computed by the loop from its own weight row and scale alone, the same way
# in a group as alone (``_packed_jit``: one thread a value, the reduction over the columns only), so the
# group's rows are its members' bits; what the group saves is a call per member beyond the first (the input's
# conversion, numba's dispatch, the output's): about 10 us each on the development VM.
SIBLINGS = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
    ("w1", "w3"),
    ("q_a_proj", "kv_a_proj_with_mqa"),  # MLA's two down-projections of the hidden states
)


class _Last:
    """The model's one sibling product made and not yet taken by all its members: valid only until any
    other ``QuantizedLinear`` of the model runs (a group's members run one after another, on one input),
    so a member never takes a product of an input that may have changed since."""

    __slots__ = ("group", "x", "y", "taken")

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.group: SiblingGroup | None = None
        self.x: torch.Tensor | None = None
        self.y: torch.Tensor | None = None
        self.taken: set[int] = set()


class SiblingGroup:
    """Sibling ``QuantizedLinear`` layers of one parent that take the same input, over one pool: their int8
    rows one after another, then their scales; each member's ``pool`` is that pool, its ``qoff`` and
    ``soff`` where its rows and scales lie. The first member called on an input computes every member's
    rows on it in one loop; the others take theirs while nothing else has run. Members called on other
    inputs (a family whose key projection reads something else) are computed alone: after two products
    left untaken the group stops computing for its siblings."""

    def __init__(self, members: list[QuantizedLinear], last: _Last) -> None:
        self.members, self.last = members, last
        cols = members[0].in_features
        self.cols, self.rows = cols, sum(m.out_features for m in members)
        self.soff = -(-self.rows * cols // _ALIGN) * _ALIGN
        pool = torch.zeros(1, self.soff + 4 * self.rows, dtype=torch.uint8)
        self.bounds: list[tuple[int, int]] = []
        first = 0
        for m in members:
            r = m.out_features
            pool[0, first * cols : (first + r) * cols] = m.pool[0, m.qoff : m.qoff + r * cols]
            pool[0, self.soff + 4 * first : self.soff + 4 * (first + r)] = m.pool[0, m.soff : m.soff + 4 * r]
            m.pool, m.qoff, m.soff, m.group = pool, first * cols, self.soff + 4 * first, self
            self.bounds.append((first, first + r))
            first += r
        self.pool = pool
        self.array = pool.numpy()
        self.index = {id(m): i for i, m in enumerate(members)}  # a member's place, looked up at each call
        has_bias = members[0].bias is not None  # all or none (``fuse_siblings``)
        self.bias = torch.cat([m.bias.detach().to(torch.float32) for m in members]) if has_bias else None
        self.on, self.untaken = True, 0

    def output(self, member: QuantizedLinear, x: torch.Tensor) -> torch.Tensor | None:
        """``member``'s output on ``x`` from the group's product, or None: computed alone."""
        last = self.last
        index = self.index[id(member)]
        if last.group is self and last.x is x and index not in last.taken:
            y = last.y
        else:
            if last.group is self and len(last.taken) < len(self.members):
                self.untaken += 1  # a product some members never took: they read other inputs
                self.on = self.untaken < 2
            last.clear()
            if not self.on or x.device.type != "cpu" or x.shape[-1] != self.cols:
                return None
            x2 = x.reshape(-1, self.cols)
            t = x2.shape[0]
            if t > CPU_ROWS["int8"]:
                return None
            from expertcache.engine import _packed_jit

            out = np.empty((t, self.rows), dtype=np.float32)
            xf = host_f32(x2)
            _packed_jit.rows_int8(self.array, 0, self.soff, self.rows, self.cols, _zeros(t), xf, out, True)
            y = torch.from_numpy(out)
            if self.bias is not None:
                y = y + self.bias
            y = cast(y, x.dtype)
            last.group, last.x, last.y = self, x, y
        last.taken.add(index)
        if len(last.taken) == len(self.members):
            last.clear()
        a, b = self.bounds[index]
        part = y[:, a:b]
        return (part if part.shape[0] == 1 else part.contiguous()).view(*x.shape[:-1], b - a)


def fuse_siblings(model: torch.nn.Module) -> int:
    """Group ``model``'s sibling ``QuantizedLinear`` layers on a CPU (``SIBLINGS``) -> how many groups."""
    last = _Last()
    groups = 0
    for parent in model.modules():
        for names in SIBLINGS:
            members = [getattr(parent, n, None) for n in names]
            if not all(isinstance(m, QuantizedLinear) and m.group is None for m in members):
                continue
            first = members[0]
            if any(
                m.in_features != first.in_features
                or m.dtype != first.dtype
                or m.pool.device.type != "cpu"
                or (m.bias is None) != (first.bias is None)
                for m in members
            ):
                continue
            SiblingGroup(members, last)
            groups += 1
    for m in model.modules():
        if isinstance(m, QuantizedLinear):
            m.last = last
    return groups


@dataclass(frozen=True)
class DenseReport:
    """What ``quantize_dense`` did: the format, how many linear layers and their bytes before and after."""

    format: str
    layers: int
    bytes_before: int  # the replaced layers' weights and biases as they were
    bytes_after: int  # their packed weights and biases
    bytes_shared: int  # of ``bytes_before``, weights another module still holds (a tied output head)
    sibling_groups: int = 0  # groups of sibling layers computed in one pass on a CPU (``SIBLINGS``)

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        """One phrase for the user: the format, the layers and what their bytes became."""
        from expertcache.units import format_bytes

        shared = (
            f"; {format_bytes(self.bytes_shared)} of their weights stay, shared with the embeddings"
            if self.bytes_shared
            else ""
        )
        return (
            f"dense layers {self.format}, quantised at load ({self.layers} linear layers, "
            f"{format_bytes(self.bytes_before)} -> {format_bytes(self.bytes_after)}{shared})"
        )


def quantize_dense(
    model: torch.nn.Module, fmt: str, *, siblings: bool = True, dtype: torch.dtype | None = None
) -> DenseReport:
    """Replace every ``nn.Linear`` of ``model`` (a transformers MoE model) outside its experts and routers
    with its ``QuantizedLinear`` in ``fmt`` (``DENSE_FORMATS``). A weight shared with another module (an
    output head tied to the embeddings) stays where else it is used; the head gets its own int8 copy.
    ``siblings``: group sibling layers of one input (``fuse_siblings``; the same bits, fewer calls).
    ``dtype``: the model's compute dtype, where the loader kept these weights narrower, as stored
    (``compute_dtype``); bytes before are counted in it."""
    check_dense_format(fmt)
    linears = [(name, m) for name, m in dense_linears(model) if not m.weight.is_meta]
    before = after = 0
    for name, linear in linears:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        q = QuantizedLinear(linear, dtype)
        setattr(parent, attr, q)
        before += linear.weight.numel() * q.dtype.itemsize
        before += 0 if linear.bias is None else linear.bias.numel() * linear.bias.element_size()
        after += q.nbytes
    held = {p.data_ptr() for p in model.parameters()}  # what the model still holds, the replaced layers gone
    shared = sum(
        lin.weight.numel() * lin.weight.element_size() for _, lin in linears if lin.weight.data_ptr() in held
    )
    groups = fuse_siblings(model) if siblings else 0
    return DenseReport(fmt, len(linears), before, after, shared, groups)


def dense_linears(model: torch.nn.Module) -> list[tuple[str, torch.nn.Linear]]:
    """The ``nn.Linear`` layers ``quantize_dense`` replaces, by name: every one outside the experts and the
    routers (found on a model whose parameters are still on the meta device as well)."""
    skip = {id(m) for k in _experts_and_routers(model) for m in k.modules()}
    return [
        (name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and id(m) not in skip
    ]


def compute_dtype(weight: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a quantised layer computes in: ``dtype`` where its weight is a narrower float (kept as
    stored at load: a bfloat16 checkpoint run in float32 holds its dense weights in bfloat16 until they are
    quantised, which gives the same int8 values and scales, ``pack_int8`` working in float32), else the
    weight's own (a layer the model keeps in float32 whatever its dtype)."""
    own = weight.dtype
    if dtype is None or not own.is_floating_point or own.itemsize >= dtype.itemsize:
        return own
    return dtype


def _experts_and_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every MoE block's ``experts`` module and router (the router a child of the block)."""
    routers = moe_routers(model)
    ids = {id(r) for r in routers}
    blocks = [m for m in model.modules() if any(id(c) in ids for c in m.children())]
    experts = [b.experts for b in blocks if isinstance(getattr(b, "experts", None), torch.nn.Module)]
    return [*experts, *routers]
