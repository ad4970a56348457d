#!/usr/bin/env python
"""Record the simulator's embedded default trace from the embedded default model.

Runs the default model through the engine (every expert resident, so the routing does not depend on
a policy) on prompts cut from held-out standard-library files (the training script's validation
split), greedy, and saves the routing of every step in the trace format:

    python tools/record_default_trace.py            # -> src/expertcache/data/default_trace.npz
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_default_model import is_validation, stdlib_files  # noqa: E402

import expertcache  # noqa: E402
from expertcache.engine.offloaded import DEFAULT_MODEL  # noqa: E402

OUT = DEFAULT_MODEL.parent / "default_trace.npz"


def prompts(n: int, chars: int, val_percent: float) -> list[tuple[str, str]]:
    """``n`` prompts: the first ``chars`` characters of held-out files, in sorted path order."""
    root, files = stdlib_files()
    out = []
    for path in files:
        rel = path.relative_to(root).as_posix()
        if not is_validation(rel, val_percent):
            continue
        text = path.read_text(encoding="utf-8", errors="replace").strip()
        if len(text) >= chars:
            out.append((rel, text[:chars]))
        if len(out) == n:
            break
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-chars", type=int, default=600)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--val-percent", type=float, default=3.0)
    args = p.parse_args(argv)
    model = expertcache.load(expert_memory="100%", device="cpu")
    chosen = prompts(args.prompts, args.prompt_chars, args.val_percent)
    for rel, text in chosen:
        out = model.generate_text(text, max_new_tokens=args.new_tokens)
        print(f"{rel}: {out.prompt_tokens} prompt + {len(out.tokens)} new tokens")
    trace = model.trace()
    trace.meta.update(
        {
            "model": "embedded",  # the engine's name for it; never this machine's path
            "source": "expertcache embedded default model, tools/record_default_trace.py",
            "prompts": ";".join(rel for rel, _ in chosen),
            "new_tokens": args.new_tokens,
        }
    )
    model.close()
    trace.save(args.out)
    print(
        f"wrote {args.out}: {trace.num_tokens} tokens, {trace.num_layers} layers, {trace.num_experts} experts"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
