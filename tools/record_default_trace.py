#!/usr/bin/env python
"""Record the simulator's embedded default trace from the embedded default model.

Runs the default model through the engine (every expert resident, so the routing does not depend on
a policy) on prompts cut from held-out standard-library files (the training script's validation
split), greedy, and saves the routing of every step in the trace format:

    python tools/record_default_trace.py            # -> src/expertcache/data/default_trace.npz
    python tools/record_default_trace.py --heldout  # -> src/expertcache/data/default/heldout.json

``--heldout`` stores the first 4000 characters of the held-out files the trace's prompts were cut from
(named in its metadata), from this Python's standard library, so that ``quality``, ``predictor``'s
accuracy and the benchmarks read the same text on every Python (3.13 has no ``crypt.py`` or
``lib2to3``, Debian's Python no ``idlelib`` without its own package). Run it with the Python the trace
was recorded with (3.11).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import sysconfig
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_default_model import is_validation, stdlib_files  # noqa: E402

import expertcache  # noqa: E402
from expertcache.engine.offloaded import DEFAULT_MODEL  # noqa: E402
from expertcache.trace.default import HELDOUT, HELDOUT_STORED_CHARS, default_trace  # noqa: E402

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


def write_heldout(out: Path = HELDOUT) -> None:
    """The held-out texts of the default trace's prompts, from this Python's standard library."""
    root = Path(sysconfig.get_paths()["stdlib"])
    names = [n for n in str(default_trace().meta.get("prompts", "")).split(";") if n]
    missing = [n for n in names if not (root / n).is_file()]
    if missing:
        sys.exit(f"record_default_trace.py: {missing[0]} is not in this Python's standard library {root}")
    record = {
        "source": f"the Python {platform.python_version()} standard library, first {HELDOUT_STORED_CHARS} "
        "characters of each file (tools/record_default_trace.py --heldout)",
        "license": "PSF-2.0: Copyright (c) 2001 Python Software Foundation; All Rights Reserved",
        "texts": [
            [n, (root / n).read_text(encoding="utf-8", errors="replace")[:HELDOUT_STORED_CHARS]]
            for n in names
        ],
    }
    out.write_text(json.dumps(record, indent=0, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {out}: {len(names)} texts")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(OUT), help="the trace's file (default: the embedded one)")
    p.add_argument("--prompts", type=int, default=16, help="held-out files to prompt with (default 16)")
    p.add_argument("--prompt-chars", type=int, default=600, help="characters of each (default 600)")
    p.add_argument("--new-tokens", type=int, default=128, help="greedy tokens after each (default 128)")
    p.add_argument("--val-percent", type=float, default=3.0, help="the training's validation share (3)")
    p.add_argument("--heldout", nargs="?", const=str(HELDOUT), metavar="FILE",
                   help="write the held-out texts of the trace's prompts (default: the embedded file), then "
                   "stop; takes no other option")  # fmt: skip
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    if args.heldout is not None:
        others = [a for a in argv if a.startswith("--") and not a.startswith("--heldout")]
        if others:
            p.error(
                f"--heldout takes no other option ({others[0]}): it writes the texts of the trace's prompts"
            )
        write_heldout(Path(args.heldout))
        return 0
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
