"""What transformers' module structure costs a decode token on a CPU: Granite-MoE's decoder layer as
transformers runs it, against the same layer written out in one function (the same torch operations in the
same order, the same int8 loops and the same engine experts step, without the module calls, their
wrappers and the keyword plumbing between them), alternating in one process.

    .venv/bin/python bench/inline_layer_cpu.py GRANITE_INT8_DIR [--quantize-dense int8] [--dtype float32] \\
        [--threads 2] [--new-tokens 32] [--rounds 6] [--out FILE.json]

``GRANITE_INT8_DIR``: a granitemoe checkpoint with int8 experts (``expertcache quantize --bits 8
--checkpoint``), loaded at 100 % on the CPU. Each round generates greedily from a fixed 64-token prompt
(token ids 100-163) once with 1 new token and once with ``--new-tokens`` + 1 under each layer (the order
alternating by round), so that TPOT is the difference over the decode tokens; the inlined layer takes decode
steps only (a prefill runs transformers' own). Prints each layer's median TPOT, the median of the rounds'
ratios (inlined / transformers'), and whether the two generated the same tokens; results to stdout, progress
to stderr. This is an experiment, not a path of the engine: it asks whether an engine-owned decode layer
of the same operations would be faster (docs/BENCHMARKS.md, "On a Zen 4 VM").
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from decode_split_cpu import OneLineParser, load_kwargs, model_options  # the same options and model


def inlined(original):
    """Granite-MoE's decoder layer for one decode token, written out (what transformers' modules do)."""
    import torch
    import torch.nn.functional as F
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def rms(norm, h):
        dtype = h.dtype
        h = h.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + norm.variance_epsilon)
        return norm.weight * h.to(dtype)

    def rotate_half(x):
        d = x.shape[-1] // 2
        return torch.cat((-x[..., d:], x[..., :d]), dim=-1)

    def forward(self, hidden_states, attention_mask=None, cache=None, position_embeddings=None, **kwargs):
        if hidden_states.shape[:2] != (1, 1):  # a prefill, or a batch: transformers' own
            return original(self, hidden_states, attention_mask=attention_mask, cache=cache,
                            position_embeddings=position_embeddings, **kwargs)  # fmt: skip
        residual = hidden_states
        h = rms(self.input_layernorm, hidden_states)
        a = self.self_attn
        shape = (1, 1, -1, a.head_dim)
        q = a.q_proj.forward(h).view(shape).transpose(1, 2)
        k = a.k_proj.forward(h).view(shape).transpose(1, 2)
        v = a.v_proj.forward(h).view(shape).transpose(1, 2)
        cos, sin = (t.unsqueeze(1) for t in position_embeddings)
        q = (q * cos) + (rotate_half(q) * sin)
        k = (k * cos) + (rotate_half(k) * sin)
        k, v = cache.update(k, v, a.layer_idx)
        o, _ = sdpa_attention_forward(a, q, k, v, attention_mask, dropout=0.0, scaling=a.scaling)
        o = a.o_proj.forward(o.reshape(1, 1, -1).contiguous())
        hidden_states = residual + o * self.residual_multiplier
        residual = hidden_states
        h = rms(self.post_attention_layernorm, hidden_states).reshape(1, -1)
        moe = self.block_sparse_moe
        logits = F.linear(h, moe.router.weight).float()
        top, index = logits.topk(moe.router.top_k, dim=-1)
        weights = torch.softmax(top, dim=-1).type_as(h)
        experts = moe.experts
        out = experts._expertcache_engine.run_experts(experts, experts._expertcache_layer, h, index, weights)
        return residual + out.view(1, 1, -1) * self.residual_multiplier

    return forward


def main() -> None:
    ap = OneLineParser(description=__doc__.split("\n\n")[0])
    model_options(ap, new_tokens=32, rounds=6)
    ap.add_argument("--out", default=None, help="also write the results as JSON")
    args = ap.parse_args()
    if min(args.threads, args.new_tokens, args.rounds) < 1:
        ap.error("--threads, --new-tokens and --rounds must be at least 1")
    if args.out and (Path(args.out).is_dir() or not Path(args.out).resolve().parent.is_dir()):
        ap.error(f"--out {args.out}: not a file in a folder that exists")  # before minutes of work
    import torch
    from transformers.models.granitemoe import modeling_granitemoe as granite

    import expertcache

    torch.set_num_threads(args.threads)
    kw = load_kwargs(args)
    try:
        model = expertcache.load(args.model, expert_memory="100%", slow_tier="disk", device="cpu", **kw)
    except expertcache.ExpertcacheError as e:
        ap.error(str(e))
    family = model.model.config.model_type
    if family != "granitemoe":
        ap.error(f"{args.model} is a {family} model: the inlined layer is Granite-MoE's")
    layer = granite.GraniteMoeDecoderLayer
    ways = {"transformers' layer": layer.forward, "inlined layer": inlined(layer.forward)}
    ids = torch.arange(100, 164)[None]
    model.generate(ids, max_new_tokens=4)
    tpots: dict[str, list[float]] = {name: [] for name in ways}
    tokens: dict[str, list[int]] = {}
    for r in range(args.rounds):
        for name in list(ways)[:: 1 if r % 2 == 0 else -1]:
            layer.forward = ways[name]
            t = time.perf_counter()
            model.generate(ids, max_new_tokens=1)
            first = time.perf_counter() - t
            t = time.perf_counter()
            out = model.generate(ids, max_new_tokens=args.new_tokens + 1)
            tpots[name].append((time.perf_counter() - t - first) / args.new_tokens)
            tokens.setdefault(name, out[0].tolist())
        print(
            f"round {r + 1}: " + ", ".join(f"{n} {v[-1] * 1e3:.2f} ms" for n, v in tpots.items()),
            file=sys.stderr,
        )
    layer.forward = ways["transformers' layer"]
    a, b = tpots.values()
    ratios = [y / x for x, y in zip(a, b, strict=True)]
    same = len({tuple(t) for t in tokens.values()}) == 1
    for name, v in tpots.items():
        print(f"{name}: TPOT {statistics.median(v) * 1e3:.2f} ms [{min(v) * 1e3:.2f}-{max(v) * 1e3:.2f}]")
    print(f"inlined / transformers': {statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}]; "
          f"same tokens: {same}")  # fmt: skip
    if args.out:
        result = {
            "tpot_ms": {n: [round(x * 1e3, 3) for x in v] for n, v in tpots.items()},
            "ratio_median": statistics.median(ratios),
            "same_tokens": same,
            "rounds": args.rounds,
            "new_tokens": args.new_tokens,
            "threads": args.threads,
            "quantize_dense": args.quantize_dense,
            "dtype": args.dtype,
        }
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
