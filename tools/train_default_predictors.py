#!/usr/bin/env python
"""Train the embedded default model's learned predictors and measure them on its held-out prompts.

Trains ProMoE's learned predictor for windows 1-4 (``expertcache.tools.train_predictor``) on prompts cut
from standard-library files of the model's training split (``default_prompts``: none of the 23
validation files, so none of the 16 evaluation prompts), writes
``src/expertcache/data/default/predictors/window-{1,2,3,4}/``, then measures ACCURACY of next-gate
and learned at each window on the default trace's 16 held-out prompts (``heldout_prompts``, 128
greedy tokens each) and writes the table to ``predictors/accuracy.json``:

    python tools/train_default_predictors.py            # about 4 minutes on one CPU core
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from expertcache.predict.learned import DEFAULT_PREDICTORS
from expertcache.tools.predictor_accuracy import evaluate_model, format_accuracy
from expertcache.tools.train_predictor import (
    DEFAULT_PROMPTS,
    EPOCHS,
    HIDDEN,
    default_prompts,
    format_report,
    train_predictor,
)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(DEFAULT_PREDICTORS))
    p.add_argument("--windows", type=int, nargs="+", default=[1, 2, 3, 4])
    p.add_argument("--prompts", type=int, default=DEFAULT_PROMPTS, help="training prompts (stdlib files)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--hidden", type=int, default=HIDDEN)
    p.add_argument("--epochs", type=int, default=EPOCHS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    t0 = time.perf_counter()
    report = train_predictor(
        None, args.out, default_prompts(args.prompts), args.windows, args.hidden, args.epochs,
        args.max_new_tokens, args.seed, log=print,
    )  # fmt: skip
    print(format_report(report))
    rows = evaluate_model(None, names=["next-gate", "learned"], windows=args.windows, learned_path=args.out)
    print(format_accuracy(rows))
    record = {
        "command": "python tools/train_default_predictors.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "evaluation": "ACCURACY on decode steps of the default trace's 16 held-out prompts, 128 new tokens",
        "rows": rows,
        "training": {k: {n: v for n, v in w.items() if n != "dir"} for k, w in report["windows"].items()},
        "capture": report["capture"],
        "seconds": round(time.perf_counter() - t0, 1),
    }
    (Path(args.out) / "accuracy.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"done in {record['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
