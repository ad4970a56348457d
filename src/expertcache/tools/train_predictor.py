"""Training the learned predictor offline: capture a model's gates, fit one MLP per target layer.

1. Capture (``tools/capture.py``): the model, every expert resident, generates greedily after each
   prompt; every token's gate input and chosen experts are recorded at every MoE layer.
2. Split by prompt: ``val_fraction`` of the prompts (at least one) is held out whole, so validation
   never sees a step of a sequence it trained on.
3. Fit, for each target layer i >= 1, an MLP from layer max(i - k, 0)'s gate input to layer i's
   top-k membership: multi-label binary cross-entropy (BCE) on all tokens of the training prompts,
   prompt and generated. BCE asks exactly "is expert e among the k chosen"; the alternative,
   cross-entropy against the gate's softmax, also spends capacity on matching the order and
   temperature of the 14 experts that are not chosen (the default model's gate softmax is flat:
   3.2-3.4 of 4 bits), and it scored 0.7-1.4 points lower ACCURACY at windows 2-4 (docs/PREDICTORS.md).
4. Validate on the held-out prompts' decode tokens: ACCURACY of the learned MLP against the skip
   predictor at the same window (layer i - k's gate input through layer i's router).

Prompts: a UTF-8 text file with one prompt per line (blank lines skipped; ``\\n``, ``\\t`` and
``\\\\`` in a line stand for a newline, a tab and a backslash), or by default the first 600 characters
of standard-library files outside the embedded model's validation split (``default_prompts``).
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from expertcache.engine.routing import router_fns
from expertcache.errors import ExpertcacheError, option
from expertcache.paths import writable_dir
from expertcache.predict.base import PredictorError
from expertcache.predict.learned import (
    CONFIG,
    WEIGHTS,
    make_mlp,
    probe_routing,
    save_predictor,
    source_layer,
    topk_overlap,
)
from expertcache.tools.capture import Captured, capture, load_for_capture
from expertcache.tools.prompts import read_prompts
from expertcache.units import values_of, whole_number

DEFAULT_WINDOW = 2  # Learned.default_window: ProMoE's k
HIDDEN = 128
EPOCHS = 10
MAX_NEW_TOKENS = 64
BATCH = 256
LR = 2e-3
WEIGHT_DECAY = 1e-4
VAL_FRACTION = 0.15
PROMPT_CHARS = 600
DEFAULT_PROMPTS = 300
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def default_prompts(count: int = DEFAULT_PROMPTS, chars: int = PROMPT_CHARS) -> list[str]:
    """The first ``chars`` characters of ``count`` standard-library files, evenly spread in path order.

    Files of the embedded model's validation split (``training.json``), which hold the default
    trace's evaluation prompts, and test directories are left out, as are files shorter than ``chars``.
    """
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"]).resolve()
    held_out = _default_model_validation_files()
    texts = []
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = path.relative_to(root)
        if set(rel.parts[:-1]) & _EXCLUDED_DIRS or rel.as_posix() in held_out:
            continue
        text = path.read_text(encoding="utf-8", errors="replace").strip()
        if len(text) >= chars:
            texts.append(text[:chars])
    if not texts:
        raise ExpertcacheError(f"no standard-library file of {chars}+ characters under {root}")
    picks = np.linspace(0, len(texts) - 1, min(count, len(texts))).round().astype(int)
    return [texts[i] for i in dict.fromkeys(picks.tolist())]


def _default_model_validation_files() -> set[str]:
    from expertcache.engine.offloaded import DEFAULT_MODEL

    record = json.loads((DEFAULT_MODEL / "training.json").read_text())
    return set(record["corpus"]["validation"]["file_list"])


def model_fingerprint(model: torch.nn.Module, captured: Captured) -> dict:
    """What a predictor was trained for: the config's dimensions and a hash of the router weights."""
    from expertcache.engine.routing import moe_routers

    digest = hashlib.sha256()
    for router in moe_routers(model):
        for p in router.parameters():
            digest.update(p.detach().to("cpu", torch.float32).numpy().tobytes())
    return {
        "model_type": model.config.model_type,
        "vocab_size": int(getattr(model.config, "vocab_size", 0)),
        "hidden_size": captured.hidden_size,
        "num_layers": captured.num_layers,
        "num_experts": captured.num_experts,
        "top_k": captured.top_k,
        "routers_sha256": digest.hexdigest(),
    }


def split_by_prompt(captured: Captured, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Boolean row masks (train, validation): whole prompts held out, at least one."""
    prompts = np.unique(captured.sequence)
    if len(prompts) < 2:
        raise ExpertcacheError(
            "training needs at least 2 prompts (whole prompts are held out for validation)"
        )
    if not 0 < val_fraction < 1:
        raise ExpertcacheError(f"validation fraction must be in (0, 1), got {val_fraction}")
    n_val = min(len(prompts) - 1, max(1, round(val_fraction * len(prompts))))
    held = np.random.default_rng(seed).choice(prompts, size=n_val, replace=False)
    val = np.isin(captured.sequence, held)
    return ~val, val


def fit_mlp(x: np.ndarray, experts: np.ndarray, num_experts: int, hidden: int, epochs: int, seed: int):
    """One target layer's MLP: gate inputs x [N, H] -> logits whose top-k are ``experts`` [N, K]."""
    X = torch.from_numpy(np.ascontiguousarray(x))  # [N, H]
    Y = torch.zeros(len(x), num_experts)  # [N, E]: 1 for the chosen top-k
    Y.scatter_(1, torch.from_numpy(experts), 1.0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        mlp = make_mlp(x.shape[1], hidden, num_experts)
    opt = torch.optim.AdamW(mlp.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    batches = (len(X) + BATCH - 1) // BATCH
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, LR, total_steps=max(1, epochs * batches), pct_start=0.1)
    gen = torch.Generator().manual_seed(seed)
    loss = torch.zeros(())
    for _ in range(epochs):
        perm = torch.randperm(len(X), generator=gen)
        for b in range(0, len(X), BATCH):
            idx = perm[b : b + BATCH]
            loss = torch.nn.functional.binary_cross_entropy_with_logits(mlp(X[idx]), Y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    return mlp.eval(), float(loss.detach())


def _round_to(mlp: torch.nn.Module, dtype: torch.dtype) -> None:
    """Round the weights through the storage dtype, so validation scores what is saved."""
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(p.to(dtype).float())


@torch.no_grad()
def _mlp_topk(mlp: torch.nn.Module, x: np.ndarray, k: int) -> np.ndarray:
    return torch.topk(mlp(torch.from_numpy(x)), k, dim=-1).indices.numpy()  # [N, K]


@torch.no_grad()
def _router_topk(router: Callable, x: np.ndarray) -> np.ndarray:
    return router(torch.from_numpy(x)).cpu().numpy()  # [N, K]


def fit_windows(
    captured: Captured,
    windows: Sequence[int],
    routers: Sequence[Callable],
    hidden: int = HIDDEN,
    epochs: int = EPOCHS,
    seed: int = 0,
    val_fraction: float = VAL_FRACTION,
    dtype: torch.dtype = torch.float16,
    log: Callable[[str], None] | None = None,
) -> dict[int, tuple[dict[int, torch.nn.Module], dict]]:
    """{window: ({target: MLP}, validation report)}; a (source, target) pair shared by windows is fit once."""
    train, val = split_by_prompt(captured, val_fraction, seed)
    val_rows = val & ~captured.prefill if (val & ~captured.prefill).any() else val
    L, K = captured.num_layers, captured.top_k
    fitted: dict[tuple[int, int], tuple[torch.nn.Module, dict]] = {}
    out = {}
    for k in windows:
        mlps, layers = {}, []
        for target in range(1, L):
            source = source_layer(target, k)
            if (source, target) not in fitted:
                t0 = time.perf_counter()
                x, truth = captured.gate_input[:, source], captured.experts[:, target]
                mlp, loss = fit_mlp(
                    x[train], truth[train], captured.num_experts, hidden, epochs, seed + target
                )
                _round_to(mlp, dtype)
                learned = topk_overlap(_mlp_topk(mlp, x[val_rows], K), truth[val_rows])
                skip = topk_overlap(_router_topk(routers[target], x[val_rows]), truth[val_rows])
                fitted[source, target] = mlp, {
                    "layer": target, "source": source, "learned": learned, "skip": skip,
                    "train_loss": loss, "seconds": round(time.perf_counter() - t0, 2),
                }  # fmt: skip
                if log:
                    log(f"window {k} layer {target} (from {source}): learned {learned:.3f}, skip {skip:.3f}")
            mlps[target], row = fitted[source, target]
            layers.append(row)
        out[k] = (
            mlps,
            {
                "learned": float(np.mean([r["learned"] for r in layers])),
                "skip": float(np.mean([r["skip"] for r in layers])),
                "per_layer": layers,
                "train_rows": int(train.sum()),
                "val_rows": int(val_rows.sum()),
                "val_prompts": int(np.unique(captured.sequence[val]).size),
            },
        )
    return out


def train_predictor(
    model_path: str | Path | None,
    out_dir: str | Path,
    prompts: str | Path | Sequence[str] | None = None,
    window: int | Sequence[int] | None = None,
    hidden: int = HIDDEN,
    epochs: int = EPOCHS,
    max_new_tokens: int = MAX_NEW_TOKENS,
    seed: int = 0,
    val_fraction: float = VAL_FRACTION,
    log: Callable[[str], None] | None = None,
    progress: bool = False,
    force: bool = False,
) -> dict:
    """Capture, fit and save learned predictors; returns the training report (``log``: a line per
    stage; ``progress``: a progress bar of the capture on stderr). A folder that holds anything is refused
    before the capture, unless ``force``: then the predictors in it (``predictor.*``, ``window-K/``) are
    removed once the new ones are trained, and the new ones written; other files are left as they are.

    ``window`` an int: ``out_dir`` becomes that window's predictor directory. A sequence of windows:
    one capture, and ``out_dir/window-<k>/`` for each. None: 2 (``Learned.default_window``), or 1 on a
    model of 2 MoE layers (said), as an int. ``prompts``: a prompt file (see the module
    docstring), a list of prompts, or None for ``default_prompts()``. ``model_path`` None: the
    embedded model.
    """
    if window is None or isinstance(window, int):
        windows = [DEFAULT_WINDOW if window is None else window]
    else:
        windows = list(dict.fromkeys(window))  # each once
    _check_args(windows, hidden, epochs, max_new_tokens)
    created = not Path(out_dir).exists()
    _check_out_dir(Path(out_dir), force)
    try:
        return _train(model_path, out_dir, prompts, window, windows, hidden, epochs, max_new_tokens, seed,
                      val_fraction, log, progress)  # fmt: skip
    except BaseException:  # a run that fails (a bad window, no prompts) leaves no empty folder of its own
        if created and Path(out_dir).is_dir() and not any(Path(out_dir).iterdir()):
            Path(out_dir).rmdir()
        raise


def _train(
    model_path, out_dir, prompts, window, windows, hidden, epochs, max_new_tokens, seed, val_fraction, log,
    progress,
) -> dict:  # fmt: skip
    """``train_predictor`` once its arguments and folder are checked."""
    from expertcache.engine.hub import resolve_model
    from expertcache.engine.loader import read_config

    path = resolve_model(model_path)
    read_config(path)  # a bad checkpoint fails before any capture
    texts = _prompts(prompts)
    t0 = time.perf_counter()
    model, tokenizer = load_for_capture(path)
    layers = len(router_fns(model))
    if window is None and 1 < layers <= DEFAULT_WINDOW:  # the default reaches past a short model's first
        window, windows = layers - 1, [layers - 1]
        print(f"note: window {layers - 1}, as {path}'s {layers} MoE layers leave room for (the default is "
              f"{DEFAULT_WINDOW})", file=sys.stderr)  # fmt: skip
    elif window is None:
        window = DEFAULT_WINDOW
    _check_windows(windows, layers, path)
    if log:
        log(f"capturing the routing of {len(texts)} prompts, {max_new_tokens} new tokens each")
    captured = capture(model, tokenizer, texts, max_new_tokens, progress=progress)
    capture_s = time.perf_counter() - t0
    if log:
        log(f"captured {len(captured.step)} tokens ({int((~captured.prefill).sum())} generated) "
            f"from {len(texts)} prompts in {capture_s:.0f} s")  # fmt: skip
    fingerprint = model_fingerprint(model, captured)
    routers = router_fns(model)
    probe = probe_routing(routers, captured.hidden_size)
    fits = fit_windows(captured, windows, routers, hidden, epochs, seed, val_fraction, log=log)
    report = {
        "model": {"path": str(model_path) if model_path is not None else "embedded default", **fingerprint},
        "capture": {
            "prompts": len(texts),
            "tokens": int(len(captured.step)),
            "generated_tokens": int((~captured.prefill).sum()),
            "max_new_tokens": max_new_tokens,
            "seconds": round(capture_s, 1),
        },
        "windows": {},
    }
    settings = {"epochs": epochs, "seed": seed, "val_fraction": val_fraction, "capture": report["capture"]}
    _remove_predictors(Path(out_dir))  # one layout in the folder: a window's or several windows'
    for k, (mlps, val) in fits.items():
        directory = Path(out_dir) if isinstance(window, int) else Path(out_dir) / f"window-{k}"
        save_predictor(directory, mlps, _meta(k, hidden, captured, fingerprint, settings, val), probe=probe)
        report["windows"][k] = {"dir": str(directory), **val}
        if val["learned"] < val["skip"] and log:
            log(
                f"note: at window {k} the learned predictor scores {val['learned']:.3f} on the held-out "
                f"prompts, below skip prediction's {val['skip']:.3f}: more prompts, tokens or epochs would "
                f"help (--prefetch window --window {k} predicts by skipping, without training)"
            )
    report["seconds"] = round(time.perf_counter() - t0, 1)
    return report


def _meta(k: int, hidden: int, captured: Captured, fingerprint: dict, settings: dict, val: dict) -> dict:
    """``predictor.json``: what ``Learned`` checks, then the record of how it was trained."""
    return {
        "window": k, "hidden": hidden, "activation": "gelu",
        "num_layers": captured.num_layers, "num_experts": captured.num_experts,
        "hidden_size": captured.hidden_size, "top_k": captured.top_k,
        "model": fingerprint,
        "training": {"loss": "binary cross-entropy on top-k membership", "batch": BATCH, "lr": LR,
                     "weight_decay": WEIGHT_DECAY, **settings},
        "validation": val,
    }  # fmt: skip


def _check_args(windows: list[int], hidden: int, epochs: int, max_new_tokens: int) -> None:
    if not windows or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in windows):
        raise PredictorError(f"prediction windows must be integers >= 1, got {windows}")
    for name, value, low in (
        ("hidden", hidden, 1),
        ("epochs", epochs, 1),  # 2.5 failed in torch's scheduler, after the capture
        ("max_new_tokens", max_new_tokens, 2),
    ):
        whole_number(value, option(f"--{name.replace('_', '-')}", name), low)


def _check_out_dir(out: Path, force: bool) -> None:
    """The predictor's folder can be written, and holds nothing that would be lost or mixed with the
    new predictors (without ``force``): found out before the capture, not after it."""
    if out.is_dir() and not force and any(out.iterdir()):
        trained = (out / CONFIG).is_file() or any((d / CONFIG).is_file() for d in out.glob("window-*"))
        raise ExpertcacheError(
            f"{out}: holds {'a trained predictor' if trained else 'files'} already: give a new folder, or "
            "--force (force=True) to replace the predictors there"
        )
    writable_dir(out, "the predictor")


def _remove_predictors(out: Path) -> None:
    """The predictor files in ``out`` and in its ``window-K/`` folders (a folder left empty goes too)."""
    for folder in [out, *sorted(d for d in out.glob("window-*") if d.is_dir())]:
        for name in (CONFIG, WEIGHTS):
            (folder / name).unlink(missing_ok=True)
        if folder != out and not any(folder.iterdir()):
            folder.rmdir()


def _check_windows(windows: Sequence[int], layers: int, path: Path) -> None:
    """A window reaches back at most to layer 0: one of L or more layers predicts nothing new."""
    far = [k for k in windows if k >= layers]
    if far:
        useful = f"1..{layers - 1}" if layers > 1 else "none"
        raise PredictorError(
            f"window {far[0]} reaches past the first of {path}'s {layers} MoE layers; "
            f"use a window in {useful}"
        )


def _prompts(prompts: str | Path | Sequence[str] | None) -> list[str]:
    """The prompts to capture: at least 2, said before any capture (``split_by_prompt`` holds whole
    prompts out for validation)."""
    if prompts is None:
        return default_prompts()
    if isinstance(prompts, (str, Path)):
        texts = read_prompts(prompts)
    else:
        texts = [p for p in values_of(prompts, "prompts", str) if p.strip()]
        if not texts:
            raise ExpertcacheError("no prompts given")
    if len(texts) < 2:
        raise ExpertcacheError(
            f"{len(texts)} prompt given: training needs at least 2 (whole prompts are held out to validate)"
        )
    return texts


def format_report(report: dict) -> str:
    """The validation ACCURACY per window and layer, learned against skip, as a text table."""
    lines = ["window  layer  source  learned   skip"]
    for k, w in report["windows"].items():
        for r in w["per_layer"]:
            lines.append(f"{k:6d}  {r['layer']:5d}  {r['source']:6d}  {r['learned']:7.3f}  {r['skip']:5.3f}")
        lines.append(f"{k:6d}    all          {w['learned']:7.3f}  {w['skip']:5.3f}   -> {w['dir']}")
    return "\n".join(lines)
