"""Where a packed checkpoint's decode token goes on a CPU: the compiled int8 loops, timed in place, and
the rest (transformers' modules, torch's small operations, the engine's Python).

    .venv/bin/python bench/decode_split_cpu.py PACKED_DIR [--quantize-dense int8] [--dtype float32] \\
        [--threads 2] [--new-tokens 64] [--rounds 3] [--no-huge-pages]

Loads ``PACKED_DIR`` (an int8 checkpoint of ``expertcache quantize --checkpoint``) at 100 % on the CPU,
warms it up, then per round generates greedily from a fixed 64-token prompt (token ids 100-163), once
with 1 new token and once with ``--new-tokens`` + 1, so that TPOT is the difference over the decode
tokens alone. ``_packed_jit.rows_int8`` is wrapped to time each call by matrix shape (rows, columns,
rows of input): the experts' two projections (8 pairs a call in a decode step), the dense layers' and
the output head's (one row). Prints per shape the milliseconds per decode token and the weight bytes
read per second, and TPOT, medians over rounds; results to stdout, progress to stderr.

``--modules`` also times, per decode token, the parts of the model around the loops, each wrapped where
it is called (so a part's time includes what it calls): the engine's experts step (``Engine.run_experts``,
its loops included), the dense int8 layers (``QuantizedLinear``, the output head's included), the
decoder layers' attention modules (their projections, rotary, cache update and attention), transformers'
attention function alone (``sdpa``), the key-value cache's update, the routers and the RMSNorms (the
classes of the first decoder layer's modules). Each wrapper adds about a microsecond a call.

``--no-huge-pages`` leaves the slot pool on 4 KiB pages (``memory.advise_huge_pages`` switched off), and
``NUMBA_CPU_FEATURES`` set to the host's own features gives numba's default vector width
(``expertcache/jit.py``): together, the engine before full-width vectors and huge pages.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time


class OneLineParser(argparse.ArgumentParser):
    """Its refusals in one line (no usage block), as the command line's are."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def model_options(ap: argparse.ArgumentParser, new_tokens: int, rounds: int) -> None:
    """The options of a benchmark that decodes a packed checkpoint at 100 % on the CPU (this one's, and
    ``inline_layer_cpu.py``'s); ``load_kwargs`` turns them into ``expertcache.load``'s."""
    ap.add_argument("model")
    ap.add_argument("--quantize-dense", default=None)
    ap.add_argument("--dtype", default=None, help="compute dtype, e.g. float32 (default: the checkpoint's)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=new_tokens)
    ap.add_argument("--rounds", type=int, default=rounds)


def load_kwargs(args: argparse.Namespace) -> dict[str, object]:
    kw: dict[str, object] = {"quantize_dense": args.quantize_dense} if args.quantize_dense else {}
    if args.dtype:
        kw["dtype"] = args.dtype
    return kw


def main() -> None:
    ap = OneLineParser(description=__doc__.split("\n\n")[0])
    model_options(ap, new_tokens=64, rounds=3)
    ap.add_argument("--no-huge-pages", action="store_true")
    ap.add_argument("--modules", action="store_true", help="time the parts of the model around the loops")
    args = ap.parse_args()
    if min(args.threads, args.new_tokens, args.rounds) < 1:
        ap.error("--threads, --new-tokens and --rounds must be at least 1")
    import torch

    import expertcache
    from expertcache.engine import _packed_jit, memory
    from expertcache.jit import wide_vectors

    torch.set_num_threads(args.threads)
    if args.no_huge_pages:
        memory.advise_huge_pages = lambda tensor: False
    kw = load_kwargs(args)
    try:
        model = expertcache.load(args.model, expert_memory="100%", slow_tier="disk", device="cpu", **kw)
    except expertcache.ExpertcacheError as e:
        ap.error(str(e))
    if model.stats["expert_format"] != "int8":  # the loops timed here are the int8 ones
        ap.error(f"{args.model} holds {model.stats['expert_format']} experts, not int8: give an int8 "
                 "checkpoint (expertcache quantize --bits 8 --checkpoint)")  # fmt: skip
    ids = torch.arange(100, 164)[None]
    spent: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    inner = _packed_jit.rows_int8

    def timed(pool, qoff, soff, rows, cols, slots, x, out, by_block=False):
        t = time.perf_counter()
        inner(pool, qoff, soff, rows, cols, slots, x, out, by_block)
        key = (rows, cols, len(slots))
        spent[key] += time.perf_counter() - t
        calls[key] += 1

    _packed_jit.rows_int8 = timed
    parts: collections.Counter = collections.Counter()
    if args.modules:
        _wrap_parts(model, parts)
    model.generate(ids, max_new_tokens=4)
    n = args.new_tokens
    tpots, per_shape, rates = [], collections.defaultdict(list), collections.defaultdict(list)
    by_part = collections.defaultdict(list)
    for r in range(args.rounds):
        spent.clear(), calls.clear(), parts.clear()
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=1)
        first = time.perf_counter() - t
        prefill, prefill_parts = dict(spent), dict(parts)
        spent.clear(), calls.clear(), parts.clear()
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=n + 1)
        tpots.append((time.perf_counter() - t - first) / n)
        for name, s in parts.items():
            by_part[name].append((s - prefill_parts.get(name, 0.0)) / n)
        for key, s in spent.items():
            per_shape[key].append((s - prefill.get(key, 0.0)) / n)
            rates[key].append(key[0] * key[1] * key[2] * calls[key] / s / 1e9)  # the whole run's calls
        print(f"round {r + 1}: TPOT {tpots[-1] * 1e3:.1f} ms", file=sys.stderr)
    print(f"full-width vectors: {wide_vectors()}; huge pages: {not args.no_huge_pages}")
    print("| rows x cols, input rows | ms a decode token | GB/s |")
    print("|---|---|---|")
    total = 0.0
    for key in sorted(per_shape, key=lambda k: -statistics.median(per_shape[k])):
        ms = statistics.median(per_shape[key])
        if ms < 5e-5:  # under 0.05 ms a token: a prefill's shapes
            continue
        rows, cols, k = key
        print(f"| {rows} x {cols}, {k} | {ms * 1e3:.2f} | {statistics.median(rates[key]):.1f} |")
        total += ms
    tpot, low, high = (1e3 * f(tpots) for f in (statistics.median, min, max))
    print(f"int8 loops {total * 1e3:.1f} ms of a {tpot:.1f} ms decode token (TPOT median of {args.rounds}, "
          f"range {low:.1f}-{high:.1f} ms)")  # fmt: skip
    if by_part:
        print()
        print("| part of the model (with what it calls) | ms a decode token |")
        print("|---|---|")
        for name in sorted(by_part, key=lambda k: -statistics.median(by_part[k])):
            print(f"| {name} | {statistics.median(by_part[name]) * 1e3:.2f} |")


def _wrap_parts(model, parts) -> None:
    """Time the model's parts around the loops (``--modules``), by class: each call adds to ``parts``."""
    from transformers import cache_utils
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from expertcache.engine import dense, kv, runtime
    from expertcache.engine.routing import moe_routers

    def timing(inner, name: str):
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                parts[name] += time.perf_counter() - t

        return timed

    def wrap(owner, attr: str, name: str) -> None:
        setattr(owner, attr, timing(getattr(owner, attr), name))

    layer = model.model.model.layers[0]
    wrap(runtime.Engine, "run_experts", "experts step (engine, loops included)")
    wrap(dense.QuantizedLinear, "forward", "dense int8 layers (output head included)")
    attention = getattr(layer, "self_attn", None)
    if attention is not None:
        wrap(type(attention), "forward", f"attention module ({type(attention).__name__})")
    impl = model.model.config._attn_implementation
    if impl in ALL_ATTENTION_FUNCTIONS:  # looked up at every call: the registered function, timed
        functions = ALL_ATTENTION_FUNCTIONS._global_mapping
        functions[impl] = timing(functions[impl], f"attention function ({impl})")
    wrap(cache_utils.DynamicLayer, "update", "key-value cache update")  # transformers' own, and the
    wrap(kv.GrowingLayer, "update", "key-value cache update")  # engine's, which grows it in place
    wrap(type(moe_routers(model.model)[0]), "forward", "routers")
    norm = getattr(layer, "input_layernorm", None)
    if norm is not None:
        wrap(type(norm), "forward", f"norms ({type(norm).__name__})")


if __name__ == "__main__":
    main()
