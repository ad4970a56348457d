"""Why the grouped kernel is not bit-exact on a GPU, and what it would save: ``grouped_mm`` over the slot
pool against transformers' call over the layer's own stacked experts, one difference at a time, and one
MoE layer's experts at 1 to 256 tokens by the grouped kernel and by one expert at a time.

The reference is transformers' ``grouped_mm_experts_forward``'s call: rows sorted by expert id, one group
per expert (E groups), weights ``[E, 2F, H]`` contiguous, transposed views. Each variant changes one
thing and reports whether every output row is bit-equal to the reference's:

- ``pool_strides``: the same experts as views of a slot pool's buffer ``[E, slot elements]`` (the
  engine's ``StackedPool``; a slot holds both matrices, so the stride between experts differs)
- ``more_groups``: a pool of 2E slots, the experts in the first E (E empty groups more)
- ``permuted_slots``: the experts in the pool in another order (the groups in another order)
- ``rows_reordered``: a group's rows in another order (a CUDA sort of equal keys may order them otherwise)
- ``eager``: each expert alone by ``F.linear`` (transformers' eager loop)

``python bench/grouped_gpu.py --out FILE`` (a GPU; Qwen1.5-MoE's expert shapes in bfloat16 by default;
``--experts 8 --top-k 2 --hidden 32 --intermediate 32 --dtype float32``: the tests' tiny models').
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from provenance import provenance, write_json  # bench/provenance.py
from torch.nn import functional as F

DEV = "cuda"
DTYPE = torch.bfloat16


def offsets(ids_g, n):
    """grouped_mm's group ends from sorted ids, by histogram (transformers' way)."""
    counts = torch.histc(ids_g.int() if ids_g.is_cuda else ids_g.float(), bins=n, min=0, max=n - 1)
    return torch.cumsum(counts, dim=0, dtype=torch.int32)


def call(x, ids_g, perm, w, n):
    """One grouped product of ``x``'s rows in the order ``perm`` (ids ``ids_g``) by ``w`` ``[n, out, in]``,
    its rows put back in ``x``'s order."""
    out = F.grouped_mm(x[perm], w.transpose(-2, -1), offs=offsets(ids_g, n))
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return out[inv]


def reference(x, ids, w, E):
    """transformers' grouped call: sort by id, gather, histogram offsets, grouped_mm."""
    ids_g, perm = torch.sort(ids)
    return call(x, ids_g, perm, w, E)


def grouped(x, ids, w, S, perm=None):
    """The engine's call: ``ids`` are slot ids into ``w`` ``[S, out, in]``; ``perm`` the rows' order."""
    if perm is None:
        ids_g, perm = torch.sort(ids, stable=True)
    else:
        ids_g = ids[perm]
    return call(x, ids_g, perm, w, S)


def compare(a, b) -> dict:
    bits = torch.int16 if a.element_size() == 2 else torch.int32
    equal = (a.view(bits) == b.view(bits)).all(dim=-1)
    return {
        "rows_equal": int(equal.sum()),
        "rows": int(equal.numel()),
        "max_abs_diff": float((a.float() - b.float()).abs().max()),
    }


def probe(T, K, E, H, F_, gen) -> dict:
    dev = DEV
    w = torch.randn(E, 2 * F_, H, generator=gen, device=dev, dtype=DTYPE) * 0.02
    x = torch.randn(T, H, generator=gen, device=dev, dtype=DTYPE)
    ids = torch.stack([torch.randperm(E, generator=gen, device=dev)[:K] for _ in range(T)]).reshape(-1)
    rows = x[torch.arange(T, device=dev).repeat_interleave(K)]
    ref = reference(rows, ids, w, E)
    out = {}
    # the pool's buffer: each slot holds this matrix and another of the same size after it
    buf = torch.zeros(E, 2 * w[0].numel(), device=dev, dtype=DTYPE)
    buf[:, : w[0].numel()] = w.reshape(E, -1)
    pool = buf[:, : w[0].numel()].view(E, 2 * F_, H)
    out["pool_strides"] = compare(grouped(rows, ids, pool, E), ref)
    big = torch.zeros(2 * E, 2 * F_, H, device=dev, dtype=DTYPE)
    big[:E] = w
    out["more_groups"] = compare(grouped(rows, ids, big, 2 * E), ref)
    place = torch.randperm(E, generator=gen, device=dev)  # expert e in slot place[e]
    permuted = torch.empty_like(w)
    permuted[place] = w
    out["permuted_slots"] = compare(grouped(rows, place[ids], permuted, E), ref)
    ids_g, perm = torch.sort(ids, stable=True)
    key = ids_g.double() + torch.rand(ids.numel(), generator=gen, device=dev, dtype=torch.double) * 0.5
    out["rows_reordered"] = compare(grouped(rows, ids, w, E, perm=perm[torch.argsort(key)]), ref)
    eager = torch.empty_like(ref)
    for e in range(E):
        at = (ids == e).nonzero().squeeze(-1)
        if at.numel():
            eager[at] = F.linear(rows[at], w[e])
    out["eager"] = compare(eager, ref)
    out["reference_again"] = compare(reference(rows, ids, w, E), ref)
    return out


def timing(T, K, E, H, F_, gen, reps=30, pool_layers=8) -> dict:
    """One layer's experts (gate_up, SiLU gate, down, weight, sum) at T tokens: grouped over the layer's
    experts, grouped over a slot pool of ``pool_layers`` layers' slots (the engine's call), and one expert
    at a time (transformers' eager loop); the median of ``reps`` calls, each waited for."""
    dev = DEV
    wgu = torch.randn(E, 2 * F_, H, generator=gen, device=dev, dtype=DTYPE) * 0.02
    wd = torch.randn(E, H, F_, generator=gen, device=dev, dtype=DTYPE) * 0.02
    x = torch.randn(T, H, generator=gen, device=dev, dtype=DTYPE)
    idx = torch.stack([torch.randperm(E, generator=gen, device=dev)[:K] for _ in range(T)])
    wts = torch.rand(T, K, generator=gen, device=dev, dtype=DTYPE)

    # the engine's slot pool holds every layer's slots, and its grouped call passes them all: a pool of
    # ``pool_layers`` layers' slots, this layer's experts in the fourth layer's range
    S, first = pool_layers * E, min(3, pool_layers - 1) * E
    pool_gu = torch.zeros(S, 2 * F_, H, device=dev, dtype=DTYPE)
    pool_d = torch.zeros(S, H, F_, device=dev, dtype=DTYPE)
    pool_gu[first : first + E], pool_d[first : first + E] = wgu, wd

    def grouped_over(gu, d, ids, n):
        ids_g, perm = torch.sort(ids)
        offs = offsets(ids_g, n)
        h = F.grouped_mm(x[perm // K], gu.transpose(-2, -1), offs=offs)
        g, u = h.chunk(2, dim=-1)
        o = F.grouped_mm(F.silu(g) * u, d.transpose(-2, -1), offs=offs) * wts.reshape(-1)[perm, None]
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.numel(), device=dev)
        return o[inv].view(T, K, H).sum(1)

    def run_grouped():
        return grouped_over(wgu, wd, idx.reshape(-1), E)

    def run_grouped_pool():
        return grouped_over(pool_gu, pool_d, idx.reshape(-1) + first, S)

    def run_eager():
        out = torch.zeros(T, H, device=dev, dtype=DTYPE)
        mask = F.one_hot(idx, E).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit:
            e = int(e[0])
            k, tok = torch.where(mask[e])
            g, u = F.linear(x[tok], wgu[e]).chunk(2, dim=-1)
            o = F.linear(F.silu(g) * u, wd[e]) * wts[tok, k, None]
            out.index_add_(0, tok, o)
        return out

    res = {}
    for name, fn in (
        ("grouped", run_grouped),
        ("grouped_pool", run_grouped_pool),
        ("eager", run_eager),
    ):
        for _ in range(3):
            fn()
        if DEV == "cuda":
            torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            if DEV == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        times.sort()
        res[f"{name}_ms"] = round(1000 * times[len(times) // 2], 4)
    res["pool_slots"] = S
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=60, help="experts a layer (default 60)")
    p.add_argument("--top-k", type=int, default=4, help="experts a token (default 4)")
    p.add_argument("--hidden", type=int, default=2048, help="hidden size (default 2048)")
    p.add_argument(
        "--intermediate", type=int, default=1408, help="an expert's intermediate size (default 1408)"
    )
    p.add_argument(
        "--tokens", default="1,4,16,64,256", help="token counts, a comma list (default 1,4,16,64,256)"
    )
    p.add_argument("--out", help="write the results here as JSON (default: print them to stdout)")
    p.add_argument(
        "--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke test of the script"
    )
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = p.parse_args(argv)
    try:
        tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        p.error(f"--tokens {args.tokens!r} is not a comma list of whole numbers")
    if min(tokens) < 1 or not 1 <= args.top_k <= args.experts:
        p.error("--tokens must be at least 1 and --top-k between 1 and --experts")
    global DEV, DTYPE
    DEV, DTYPE = args.device, getattr(torch, args.dtype)
    if DEV == "cuda" and not torch.cuda.is_available() or not hasattr(F, "grouped_mm"):
        print("grouped_gpu.py: needs a GPU and torch.nn.functional.grouped_mm", file=sys.stderr)
        return 2
    gen = torch.Generator(device=DEV).manual_seed(0)
    shape = (args.top_k, args.experts, args.hidden, args.intermediate)
    result = {
        "provenance": provenance(),
        "device": torch.cuda.get_device_name() if DEV == "cuda" else DEV,
        "torch": torch.__version__,
        "dtype": args.dtype,
        "shape": dict(zip(("top_k", "experts", "hidden", "intermediate"), shape, strict=True)),
        "by_tokens": {},
    }
    for T in tokens:
        r = {"bits": probe(T, *shape, gen), "layer_time": timing(T, *shape, gen)}
        result["by_tokens"][str(T)] = r
        print(T, json.dumps(r), file=sys.stderr, flush=True)
    if args.out:
        write_json(args.out, result)
    else:
        print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
