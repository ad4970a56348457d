"""Prediction accuracy, ProMoE's ACCURACY_i(k): the share of layer i's experts predicted k layers ahead.

``evaluate(predictor, captured)`` drives a predictor through captured forward steps exactly as the
engine does (``begin_step``, then ``after_router`` for each layer in order, with the layer's chosen
experts and its gate input) and compares each prediction of a target layer with what the layer then
chose: ACCURACY_i = sum over steps of |pred ∩ actual| / sum of |actual|, where actual is the layer's
distinct experts in the step and pred the first |actual| experts of the ranked prediction (the first
top_k in a decode step). Every step drives the predictor (stateful predictors see the prompts);
by default only decode steps are counted, as in ProMoE. A target layer never predicted in a counted
step scores 0 for that step, so "no prediction" is not rewarded.

``evaluate_model`` captures a model's routing over prompts (``tools/capture.py``) and tabulates
ACCURACY for predictors by name and window; the same window means the same FETCHRATE, so accuracy
alone decides which predictor's GOODPRED is higher (ProMoE Sec. 4).
"""

from __future__ import annotations

import numbers
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from expertcache.engine.routing import router_fns
from expertcache.errors import option
from expertcache.predict.base import PredictContext, Predictor
from expertcache.predict.registry import make_predictor
from expertcache.tools.capture import Captured, capture, load_for_capture
from expertcache.units import values_of, whole_number

HELDOUT_CHARS = 600  # tools/record_default_trace.py's --prompt-chars


def evaluate(predictor: Predictor, captured: Captured, decode_only: bool = True) -> dict:
    """ACCURACY per target layer (None: never predicted) and overall (layers 1..L-1, micro-averaged)."""
    L = captured.num_layers
    hits, totals = np.zeros(L), np.zeros(L)
    predicted = np.zeros(L, dtype=bool)
    seen: set[int] = set()
    counted = 0
    for rows in captured.steps():
        seq, prefill = int(captured.sequence[rows.start]), bool(captured.prefill[rows.start])
        experts = captured.experts[rows]  # [T, L, K]
        actual = [_distinct(experts[:, layer]) for layer in range(L)]
        preds = dict(predictor.begin_step(captured.token_ids[rows], prefill, seq not in seen, actual))
        seen.add(seq)
        for layer in range(L):
            gate_input = torch.from_numpy(captured.gate_input[rows, layer])  # [T, H]
            for target, ranked in predictor.after_router(layer, experts[:, layer], gate_input).items():
                preds.setdefault(target, ranked)
        predicted[list(preds)] = True
        if decode_only and prefill:
            continue
        counted += 1
        for layer in range(L):
            truth = actual[layer]
            hits[layer] += len(set(preds.get(layer, [])[: len(truth)]) & set(truth))
            totals[layer] += len(truth)
    per_layer = [float(h / t) if p and t else None for h, t, p in zip(hits, totals, predicted, strict=True)]
    overall = float(hits[1:].sum() / totals[1:].sum()) if totals[1:].sum() else None
    return {
        "name": predictor.name,
        "window": predictor.window,
        "accuracy": overall,
        "per_layer": per_layer,
        "steps": counted,
    }


def _distinct(index: np.ndarray) -> list[int]:
    """A layer's distinct experts in a step [T, K], in first-use order (the engine's request group)."""
    flat = index.reshape(-1)
    return [int(e) for e in dict.fromkeys(flat[flat >= 0].tolist())]


def build_predictor(
    name: str,
    model: torch.nn.Module,
    window: int | None = None,
    path: str | Path | None = None,
    trace: object | None = None,
) -> Predictor:
    """A registered predictor for a loaded transformers model (routers from ``router_fns``).

    ``path``: a trained predictor directory (``learned``); ``trace``: a recorded trace (``token``).
    """
    from expertcache.engine.routing import moe_routers

    first = moe_routers(model)[0]
    num_experts = int(getattr(first, "num_experts", 0) or first.weight.shape[0])
    top_k = int(getattr(first, "top_k", 0) or getattr(model.config, "num_experts_per_tok", 0))
    routers = router_fns(model)
    ctx = PredictContext(
        num_layers=len(routers),
        num_experts=num_experts,
        top_k=top_k,
        window=window,
        routers=routers,
        trace=trace,
        path=None if path is None else str(path),
    )
    predictor = make_predictor(name, ctx)
    if predictor.note:
        print(f"note: {predictor.note}", file=sys.stderr)
    return predictor


def heldout_prompts(count: int = 16) -> list[str]:
    """The default trace's prompts: the first 600 characters of held-out standard-library files.

    These are the evaluation prompts of the embedded model (``tools/record_default_trace.py``), cut from
    the held-out texts stored with it (``trace.default.heldout_texts``: the same on every Python).
    """
    from expertcache.trace.default import heldout_texts

    return [text.strip()[:HELDOUT_CHARS] for _, text in heldout_texts(count)]


def evaluate_model(
    model_path: str | Path | None = None,
    prompts: Sequence[str] | None = None,
    names: Sequence[str] = ("next-gate", "window", "learned"),
    windows: Sequence[int] | None = None,
    max_new_tokens: int = 128,
    learned_path: str | Path | None = None,
    trace: object | None = None,
    progress: bool = False,
) -> list[dict]:
    """ACCURACY of each named predictor at each window on a model's greedy runs over ``prompts``
    (``progress``: a progress bar of the capture on stderr).

    Defaults: the embedded model, its 16 held-out prompts (``heldout_prompts``) and, for ``learned``,
    the shipped predictors (``learned_path`` None) or those under ``learned_path``. ``trace`` goes
    to the predictors that read a recorded trace (record it on other prompts than these). ``windows``
    None: 1 to 4 layers ahead, those the model's MoE layers leave room for, and for ``learned`` the
    windows it was trained for (``train-predictor`` trains 2 by default: asking it for 1 was an error).
    """
    from expertcache.engine.hub import resolve_model

    names = values_of(names, "names", str)  # "next-gate" is one name, not nine
    given = windows is not None
    windows = [
        whole_number(k, option("--window", "windows"))
        for k in values_of(windows if given else DEFAULT_WINDOWS, "windows", numbers.Integral)
    ]
    texts = values_of(prompts, "prompts", str) if prompts is not None else heldout_prompts()
    # the first new token comes from the prompt's forward: ACCURACY counts the decode steps after it
    max_new_tokens = whole_number(max_new_tokens, option("--max-new-tokens", "max_new_tokens"), 2)
    path = resolve_model(model_path)
    model, tokenizer = load_for_capture(path)
    if not given:  # a window reaches from one MoE layer to a later one
        from expertcache.engine.routing import moe_routers

        windows = [k for k in windows if k < len(moe_routers(model))] or [1]

    def windows_of(name: str) -> list[int]:
        return windows if given or name != "learned" else trained_windows(learned_path, windows)

    built = {  # every predictor before the capture: one that cannot be built fails first, not after
        (name, k): build_predictor(name, model, k, learned_path if name == "learned" else None, trace)
        for name in names
        for k in windows_of(name)
    }
    captured = capture(model, tokenizer, texts, max_new_tokens, progress=progress)
    rows = [evaluate(predictor, captured) for predictor in built.values()]  # each used once, as built
    return rows


DEFAULT_WINDOWS = (1, 2, 3, 4)


def trained_windows(path: str | Path | None, fallback: Sequence[int]) -> list[int]:
    """The windows a learned predictor (``path``: a trained directory, or one of ``window-<k>/`` folders;
    None: the shipped ones) was trained for; ``fallback`` where it cannot tell (building it then says
    why)."""
    import json

    from expertcache.predict.learned import CONFIG, DEFAULT_PREDICTORS

    root = Path(path) if path is not None else DEFAULT_PREDICTORS
    try:
        if (root / CONFIG).is_file():
            return [int(json.loads((root / CONFIG).read_text())["window"])]
        found = sorted(int(p.name.removeprefix("window-")) for p in root.glob("window-[0-9]*") if p.is_dir())
    except (OSError, ValueError, KeyError, TypeError):
        return list(fallback)
    return found or list(fallback)


def format_accuracy(rows: Sequence[dict]) -> str:
    """A text table: one row per (predictor, window), ACCURACY overall and per layer."""
    L = max(len(r["per_layer"]) for r in rows)
    head = f"{'predictor':12s} {'k':>2s} {'overall':>7s}  " + " ".join(
        f"{'L' + str(i):>5s}" for i in range(L)
    )
    lines = [head]
    for r in rows:
        cells = " ".join("    -" if a is None else f"{a:5.3f}" for a in r["per_layer"])
        overall = "-" if r["accuracy"] is None else f"{r['accuracy']:.3f}"
        lines.append(f"{r['name']:12s} {r['window']:2d} {overall:>7s}  {cells}")
    return "\n".join(lines)
