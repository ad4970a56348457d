"""How a layer's device experts are computed: one grouped computation over the slot pool, or one expert
at a time. Each kernel is exact, bit for bit, against one of transformers' own experts implementations.

- ``grouped`` (the default where torch has ``grouped_mm`` for the device): the slot pool seen as stacked
  tensors (``StackedPool``: ``gate_up_proj`` ``[slots, 2F, H]``, ``down_proj`` ``[slots, H, F]``, views
  of the pool's one buffer), the layer's routing mapped through the slot table to slot ids, and one
  ``torch.nn.functional.grouped_mm`` per projection over every slot (vLLM's fused MoE takes an
  ``expert_map`` the same way; fitz-tec turns llama.cpp's ``mul_mat_id(weights, x, ids)`` into
  ``mul_mat_id(cache, x, slot_ids)``). Its operations are those of transformers'
  ``grouped_mm_experts_forward`` (sort by id, gather, histogram offsets, gate, weight, unsort, a sum
  over each token's top-k in the routing weights' precision), so its output equals
  ``experts_implementation="grouped_mm"``'s. On a CPU ``grouped_mm`` computes each group as the matrix
  product ``F.linear`` makes (``tests/test_kernels.py`` checks it), so an expert computed alone (on the
  host, with ``parts.expert_output``) rounds as it would in the group.
- ``eager``: one expert after another, added in ascending expert order into the output (transformers'
  eager loop; ``runtime.Engine``), exact against ``experts_implementation="eager"``.
- ``compiled`` (CPU, opt-in): the grouped kernel, except that a step of one token (a decode step) takes
  its experts' projections from compiled loops (``_gemv_jit``, numba) that read the slot pool near the
  memory's speed: 1.6-2.4x torch's bfloat16 ``mm`` on the experts' matrices on the development VM. Each
  value is a float32 dot product like ``mm``'s, summed in another order, so a value sometimes rounds to
  the neighbouring bfloat16: not bit-equal to any transformers implementation (``reference`` None); its
  accuracy cost is measured (``docs/BENCHMARKS.md``) and its greedy tokens equal the grouped kernel's on
  the tests. Multi-token steps (prefill) are the grouped kernel's, exact.

Shape letters: T tokens, K experts per token, S slots, H hidden size, F the expert's intermediate size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.nn import functional as F

from expertcache.errors import ExpertcacheError, option


@dataclass(frozen=True)
class Kernel:
    """One way of computing a layer's experts, and the transformers implementation it is exact against."""

    name: str
    reference: str | None  # transformers' ``experts_implementation`` it equals bit for bit (None: none)
    summary: str
    stacked: bool = True  # computes over the slot pool as stacked tensors, with the slot table
    rounds: bool = False  # sums in another order than any transformers path: not bit-equal (stats' lossy)


KERNELS: dict[str, Kernel] = {
    "grouped": Kernel(
        "grouped", "grouped_mm", "one grouped matrix product per projection over the slot pool (default)"
    ),
    "eager": Kernel("eager", "eager", "one expert at a time, as transformers' eager loop", stacked=False),
    "compiled": Kernel(
        "compiled",
        None,
        "grouped, with each decode step's experts in compiled loops at the memory's speed "
        "(CPU; opt-in: its sums in another order, not bit-equal to transformers)",
        rounds=True,
    ),
    "packed": Kernel(
        "packed",
        None,
        "the experts of a packed checkpoint (int8, int4), read in their packed bytes (engine.packed; "
        "taken for such a checkpoint, and only for one)",
    ),
}
AUTO_KERNEL = "auto"


def grouped_available(device: torch.device) -> str | None:
    """Why the grouped kernel cannot run on ``device`` with this torch, or None when it can."""
    if not hasattr(F, "grouped_mm"):
        return f"torch {torch.__version__} has no torch.nn.functional.grouped_mm (torch >= 2.10 has)"
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
        return "grouped_mm needs a GPU of compute capability 8.0 or newer"
    return None


# On an H100 (torch 2.11, transformers 5.24; 2026-11-24) the grouped kernel's logits differed from
# transformers' grouped_mm at the first step in every exactness test (37 of 37; the likely cause, not yet
# verified: grouped_mm's CUDA kernels round by the grouping, and the slot pool's groups are not the
# reference's), while the eager kernel
# matched eager in all of them: ``auto`` takes the eager kernel on a GPU, ``--kernel grouped`` opts in.
GROUPED_NOT_EXACT_ON = ("cuda",)


def _auto_refuses_grouped(device: torch.device) -> str | None:
    """Why ``auto`` does not take the grouped kernel on ``device`` (None: it does)."""
    why = grouped_available(device)
    if why is None and device.type in GROUPED_NOT_EXACT_ON:
        take = option("--kernel grouped", "kernel='grouped'")
        why = f"the grouped kernel is not bit-exact on a GPU yet ({take} takes it)"
    return why


def default_kernel(device: str | torch.device = "cpu") -> Kernel:
    """The kernel ``auto`` takes on ``device``."""
    return KERNELS["eager" if _auto_refuses_grouped(torch.device(device)) else "grouped"]


def _unaligned(layout) -> str | None:
    """Why ``grouped_mm`` cannot take an expert of ``layout``: it wants every matrix's rows (the last
    dimension, and the intermediate size's rows of the gate's output) a multiple of 16 bytes."""
    size = torch.empty((), dtype=layout.dtype).element_size()
    for name, shape in zip(layout.names, layout.shapes, strict=True):
        for dim in shape[-2:] if len(shape) >= 2 else ():
            if dim * size % 16:
                return f"grouped_mm needs rows of 16-byte multiples; {name} {tuple(shape)} in {layout.dtype}"
    return None


def host_f32(x: torch.Tensor) -> np.ndarray:
    """A CPU tensor as a C-contiguous float32 array for the loops: its own memory where it is one already.
    A decode step makes a few hundred of these; on a float32 model each is two of torch's dispatches fewer
    than ``np.ascontiguousarray(x.detach().to(torch.float32).numpy())``."""
    if x.dtype != torch.float32:
        x = x.to(torch.float32)
    a = x.detach().numpy()
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)`` without the call where it is that dtype already (the same tensor either way)."""
    return t if t.dtype == dtype else t.to(dtype)


def first_matrix(module: torch.nn.Module) -> str:
    """An expert's first projection: ``gate_up_proj``, or ``up_proj`` where it has no gate (Nemotron-H)."""
    return "gate_up_proj" if getattr(module, "has_gate", True) else "up_proj"


def gate(module: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
    """The first projection's output through the gate, as transformers' experts functions apply it: the
    family's ``_apply_gate`` (``act(gate) * up`` by default), or the activation alone without a gate."""
    return module._apply_gate(h) if getattr(module, "has_gate", True) else module.act_fn(h)


# values a row of the gate's output holds for its rounding not to depend on the row's place: torch's
# vectorised CPU loops take 16 float32 (32 bfloat16) values a step, and finish a tensor's last values apart
GATE_ROW_ALIGN = 32


def _placed_gate(module: torch.nn.Module) -> str | None:
    """Why the grouped kernel is not exact for ``module`` (None when it is): a family's own gate that writes a
    fresh tensor (Hy-V4's, GLM-5-Next's and GPT-OSS's clamp) rounds a value by its place in that tensor where
    a row's length is not a multiple of the vector loops' step; the grouped kernel places rows where
    ``grouped_mm`` does not (a decode step's rows in routing order, not sorted by expert; a missed expert's
    rows computed apart, as they land), so a value can round to its neighbour (6e-8 in a logit of GLM-5-Next
    at 24 values a row). Real checkpoints' rows (768 values and up) are multiples."""
    try:
        from transformers.integrations.moe import _default_apply_gate
    except ImportError:  # a transformers without it: no family's own gate to tell apart
        return None
    own = getattr(type(module), "_apply_gate", _default_apply_gate) is not _default_apply_gate
    # the width of a gate's row (GPT-OSS's experts name it intermediate_size; it was not looked for there)
    width = getattr(module, "intermediate_dim", None) or getattr(module, "intermediate_size", None)
    if own and getattr(module, "has_gate", True) and isinstance(width, int) and width % GATE_ROW_ALIGN:
        return (
            f"{type(module).__name__}'s own gate rounds a value by its place in its rows of {width} values "
            f"(not a multiple of {GATE_ROW_ALIGN}), which the grouped kernel's groups do not keep"
        )
    return None


def not_grouped(module: torch.nn.Module) -> str | None:
    """Why the family of experts ``module`` is computed one expert at a time, whatever the machine (None:
    the grouped kernel is exact for it): experts that normalise each output, or a gate placed by rows."""
    if getattr(module, "has_post_expert_norm", False):
        return f"{type(module).__name__} normalises each expert's output"
    return _placed_gate(module)


def resolve_kernel(
    name: str | None, device: torch.device, module: torch.nn.Module, layout=None
) -> tuple[Kernel, str | None]:
    """The kernel to run for ``name`` (None or ``auto``: grouped where it can run, else eager), and a
    note when ``auto`` could not take the grouped one. A named kernel that cannot run is an error.
    ``layout``: one whole expert's slot layout, whose shapes ``grouped_mm`` must take."""
    why = grouped_available(device)
    if why is None and layout is not None:
        why = _unaligned(layout)
    if why is None:
        why = not_grouped(module)
    if name in (None, AUTO_KERNEL):
        why = why or _auto_refuses_grouped(device)
        if why is None:
            return KERNELS["grouped"], None
        return KERNELS["eager"], f"experts computed one at a time (eager kernel): {why}"
    if name not in KERNELS:
        raise ExpertcacheError(f"experts kernel {name!r} is not one of: {AUTO_KERNEL}, {', '.join(KERNELS)}")
    if name == "compiled" and why is None:
        why = _compiled_unavailable(device, module, layout)
    if name in ("grouped", "compiled") and why is not None:
        also = " (its prefill is the grouped kernel's)" if name == "compiled" else ""
        raise ExpertcacheError(
            f"experts kernel {name} cannot run here{also}: {why}; "
            + option("--kernel eager", "kernel='eager'")
            + " runs anywhere"
        )
    return KERNELS[name], None


def _compiled_unavailable(device: torch.device, module: torch.nn.Module, layout) -> str | None:
    """Why the compiled kernel cannot run (None when it can): it reads ``[out, in]`` matrices of bfloat16
    or float32, in pairs of bfloat16 values (even sizes and offsets), from a CPU pool."""
    if device.type != "cpu":
        return "it runs on a CPU only"
    if getattr(module, "is_transposed", False):
        return f"{type(module).__name__} stores its matrices transposed ([in, out])"
    if layout is not None:
        if layout.dtype not in (torch.bfloat16, torch.float32):
            return f"it reads bfloat16 or float32 experts, not {str(layout.dtype).removeprefix('torch.')}"
        if layout.dtype == torch.bfloat16:
            odd = [n for n, sh in zip(layout.names, layout.shapes, strict=True) if sh[-1] % 2]
            if odd:  # (offsets are aligned to 64 bytes, so even)
                return f"it reads bfloat16 values in pairs: {odd[0]} has rows of odd length"
    try:
        from expertcache.engine import _gemv_jit  # noqa: F401
    except ImportError as e:  # numba is a dependency; a broken install is one line
        return f"it needs numba, which does not import here ({e})"
    return None


class StackedPool:
    """The slot pool of whole experts as stacked tensors, one per tensor of an expert (views of the
    pool's buffer: slot ``s`` of ``gate_up_proj`` is the ``gate_up_proj`` of the expert in slot ``s``)."""

    def __init__(self, pool) -> None:
        layout, buffer = pool.layout, pool.buffer  # [S, slot elements]
        self.layout, self.buffer = layout, buffer
        # a region of a larger pool (``SlotPool.regions``): that pool, and where this one's slots begin
        self.joint, self.offset = getattr(pool, "joint", None) or pool, getattr(pool, "offset", 0)
        self.num_slots = buffer.shape[0]
        self.device = buffer.device
        self.tensors: dict[str, torch.Tensor] = {}
        for name, shape, off in zip(layout.names, layout.shapes, layout.offsets, strict=True):
            n = 1
            for d in shape:
                n *= d
            self.tensors[name] = buffer[:, off : off + n].view(self.num_slots, *shape)
        self._words = None  # the compiled kernel's view of the buffer (``words``)

    def words(self):
        """The buffer as the compiled kernel reads it (the same memory, numpy): 32-bit words, two bfloat16
        values each (float32: one), and each tensor's offset in words. Threads: torch's."""
        if self._words is None:
            follow_torch_threads()
            pairs = self.layout.dtype == torch.bfloat16
            words = self.buffer.view(torch.int32).numpy().view(np.uint32) if pairs else self.buffer.numpy()
            per = 2 if pairs else 1
            offsets = {n: o // per for n, o in zip(self.layout.names, self.layout.offsets, strict=True)}
            self._words = (words, offsets, pairs)
        return self._words


def follow_torch_threads() -> None:
    """Run numba's loops on the calling thread on torch's thread count (at most numba's pool). numba keeps
    its count per thread, and a thread that never set it runs on the whole pool: the engine calls this at
    each step (``runtime``), on the thread that runs it, so the loops of a generation thread, a server's
    or a user's own follow ``OMP_NUM_THREADS`` and ``torch.set_num_threads`` as torch's products do. (Set
    once in the thread that loaded the model, a decode under ``OMP_NUM_THREADS=1`` ran its loops on two
    threads, both cores busy, where it asked for one.)"""
    from expertcache.jit import numba

    threads = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    if numba.get_num_threads() != threads:
        numba.set_num_threads(threads)


def grouped_rows(
    module: torch.nn.Module,
    pool: StackedPool,
    hidden: torch.Tensor,
    slot_ids: torch.Tensor,
    top_k_weights: torch.Tensor,
    order: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each (token, expert) pair's weighted output ``[T*K, H]``, in routing order, from the experts in
    slots ``slot_ids`` ``[T, K]`` (``pool.num_slots`` for a pair computed elsewhere: its row is left
    undefined). The operations of transformers' ``grouped_mm_experts_forward``, with the slot pool for
    the experts' stacked weights and slot ids for expert ids.

    ``order`` (a CPU's): the pairs (indices into ``slot_ids`` flattened, every pair computed here) in the
    order transformers lays them out, its sort of the layer's expert ids (``reference_order``). Within a
    group that order matters: on more than one thread torch's ``mm`` gives a row bits that depend on
    where it sits among the group's rows (the threads' blocks), and a sort of slot ids, or of a subset
    of the layer's pairs, can order a group's equal keys otherwise. None: sorted by slot (every slot
    holding the expert of the same number, as at 100 %, gives transformers' order)."""
    S, K = pool.num_slots, slot_ids.shape[-1]
    t = pool.tensors
    ids = slot_ids.reshape(-1)
    if order is None:
        ids_g, perm = torch.sort(ids)
    else:
        perm, ids_g = order, ids[order]
    x = hidden[perm // K]
    w = top_k_weights.reshape(-1)[perm]
    transposed = module.is_transposed
    gate_up, down = t[first_matrix(module)], t["down_proj"]
    weight = gate_up if transposed else gate_up.transpose(-2, -1)
    if ids_g.device.type == "cpu":  # the groups that hold rows, as grouped_mm's CPU kernel runs each
        slots, counts = torch.unique_consecutive(ids_g, return_counts=True)
        groups = [(s, n) for s, n in zip(slots.tolist(), counts.tolist(), strict=True) if s < S]
        mm = lambda a, b: _mm_groups(a, b, groups)  # noqa: E731
    else:
        counts = torch.histc(ids_g.int(), bins=S, min=0, max=S - 1)
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        mm = lambda a, b: F.grouped_mm(a, b, offs=offs)  # noqa: E731
    h = mm(x.to(weight.dtype), weight)
    at = ids_g.clamp(max=S - 1) if module.has_bias else None
    if at is not None:
        h.add_(t["gate_up_proj_bias"][at])
    h = gate(module, h)
    out = mm(h, down if transposed else down.transpose(-2, -1))
    if at is not None:
        out.add_(t["down_proj_bias"][at])
    out = out * w.unsqueeze(-1)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return out[inv]


def decode_rows(
    module: torch.nn.Module,
    pool: StackedPool,
    hidden: torch.Tensor,
    slots: list[int],
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """``grouped_rows`` for one token on a CPU (a decode step of one sequence), from the slots of its K
    experts in routing order: each expert is a group of one row, so no sort, gather or unsort is needed,
    and each ``mm`` is the one ``grouped_mm``'s CPU kernel makes on that row. The token's row is
    ``hidden`` itself when it has the alignment a freshly allocated gathered copy would have (64 bytes),
    else a copy: the same bytes, shape and alignment, so the same result."""
    t = pool.tensors
    x = hidden if hidden.is_contiguous() and hidden.data_ptr() % 64 == 0 else hidden.clone()
    transposed = module.is_transposed
    gate_up, down = t[first_matrix(module)], t["down_proj"]
    weight = gate_up if transposed else gate_up.transpose(-2, -1)
    K = len(slots)
    x = x.to(weight.dtype)
    h = x.new_empty(K, weight.shape[-1])
    for k, slot in enumerate(slots):
        torch.mm(x, weight[slot], out=h[k : k + 1])
    at = torch.tensor(slots) if module.has_bias else None
    if at is not None:
        h.add_(t["gate_up_proj_bias"][at])
    h = gate(module, h)
    weight = down if transposed else down.transpose(-2, -1)
    out = h.new_empty(K, weight.shape[-1])
    for k, slot in enumerate(slots):
        torch.mm(h[k : k + 1], weight[slot], out=out[k : k + 1])
    if at is not None:
        out.add_(t["down_proj_bias"][at])
    return out * top_k_weights.reshape(-1).unsqueeze(-1)


def compiled_rows(
    module: torch.nn.Module,
    pool: StackedPool,
    hidden: torch.Tensor,
    slots,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """``decode_rows`` with the compiled kernel: one token's weighted output from each of the experts in
    ``slots`` ``[K]``, ``[K, H]``. Each projection is a float32 dot product per output value rounded to
    the experts' dtype, as ``mm``'s is (in another order); bias and gate as the grouped kernel's."""
    from expertcache.engine import _gemv_jit

    words, offsets, pairs = pool.words()
    ids = np.asarray(slots, dtype=np.int64)
    dtype = pool.layout.dtype

    def project(name: str, x: torch.Tensor) -> torch.Tensor:  # x [1 or K, in] -> [K, out]
        rows, cols = pool.tensors[name].shape[-2:]
        out = np.empty((len(ids), rows), dtype=np.float32)
        xf = x.detach().to(torch.float32).numpy()
        if pairs:
            even, odd = np.ascontiguousarray(xf[:, 0::2]), np.ascontiguousarray(xf[:, 1::2])
            _gemv_jit.rows_bf16(words, offsets[name], rows, cols, ids, even, odd, out)
        else:
            _gemv_jit.rows_f32(words, offsets[name], rows, cols, ids, np.ascontiguousarray(xf), out)
        return torch.from_numpy(out).to(dtype)

    t = pool.tensors
    at = torch.from_numpy(ids) if module.has_bias else None
    h = project(first_matrix(module), hidden.reshape(1, -1))
    if at is not None:
        h.add_(t["gate_up_proj_bias"][at])
    h = gate(module, h)
    out = project("down_proj", h)
    if at is not None:
        out.add_(t["down_proj_bias"][at])
    return out * top_k_weights.reshape(-1).unsqueeze(-1)


def reference_order(top_k_index: torch.Tensor, pairs: torch.Tensor | None = None) -> torch.Tensor:
    """The order in which transformers' grouped experts lay out a layer's (token, expert) pairs: its
    ``torch.sort`` of the expert ids ``top_k_index`` flattened. ``pairs`` (indices of some of the pairs,
    in routing order): those pairs' positions among themselves in that order, for ``grouped_rows``'s
    ``order`` over them alone (a batch of the layer's experts)."""
    perm = torch.sort(top_k_index.reshape(-1))[1]
    return perm if pairs is None else order_among(perm, pairs)


def order_among(perm: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """``pairs``' positions among themselves in the layer's order ``perm`` (``reference_order``'s)."""
    rank = torch.empty_like(perm)
    rank[perm] = torch.arange(perm.numel(), device=perm.device)
    return torch.argsort(rank[pairs])


def pair_ranks(perm: np.ndarray) -> np.ndarray:
    """Each pair's place in the layer's order ``perm`` (``reference_order``'s, as an array): made once a
    layer, for ``order_from_ranks`` on each of its groups."""
    ranks = np.empty_like(perm)
    ranks[perm] = np.arange(perm.size)
    return ranks


def order_from_ranks(ranks: np.ndarray, pairs: np.ndarray) -> torch.Tensor:
    """``order_among(perm, pairs)`` from ``pair_ranks(perm)``, on the host: the same positions (the ranks
    are distinct), without four of torch's calls a group."""
    return torch.from_numpy(np.argsort(ranks[pairs]))


def _mm_groups(x: torch.Tensor, weight: torch.Tensor, groups: list[tuple[int, int]]) -> torch.Tensor:
    """``grouped_mm(x, weight, offs)`` on a CPU, over the groups that hold rows: torch's CPU kernel runs
    ``mm`` on each group's rows and its weight, one group after another, empty ones included (about 1 us
    each: over a pool of 768 slots, 0.8 ms a call); this makes the same ``mm`` calls, on the same slices,
    for the few groups a layer uses. Rows past the last group (pairs routed elsewhere) are left undefined."""
    out = x.new_empty(x.shape[0], weight.shape[-1])
    start = 0
    for slot, n in groups:
        torch.mm(x[start : start + n], weight[slot], out=out[start : start + n])
        start += n
    return out


def combine(rows: torch.Tensor, num_tokens: int, top_k: int, dtype: torch.dtype) -> torch.Tensor:
    """The layer's output ``[T, H]`` from its weighted rows ``[T*K, H]``: each token's top-k summed, as
    transformers' grouped and batched implementations do (in the rows' precision), then cast."""
    return cast(rows.view(num_tokens, top_k, rows.shape[-1]).sum(dim=1), dtype)
