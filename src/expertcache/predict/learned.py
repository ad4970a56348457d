"""ProMoE's learned predictor: one small MLP per target layer (ProMoE Sec. 4, "Learning-based Predictor").

With window k, the MLP of target layer i maps the gate input of layer max(i - k, 0) to layer i's gate
logits (Linear(H, hidden) -> GELU -> Linear(hidden, E)); each token's top-k of those logits, ranked
over the step's tokens by ``rank_union``, is the prediction. The skip predictor (``window``) asks
layer i's own router the same question and loses accuracy fast as k grows, because the hidden state
drifts between layers; the MLP learns that drift offline from (gate input, gate output) pairs
captured from the model (``tools/train_predictor.py``). Inference is two small matmuls per token, float32,
on the gate input's device.

A trained predictor is a directory: ``predictor.json`` (window, shapes, the model it was trained
for, training record) and ``predictor.safetensors`` (``target.{i}.{0,2}.{weight,bias}``, and
``probe``: the routers' top-k for fixed random inputs, which must match the model it runs on, so a
predictor of another checkpoint with the same shapes is refused). A directory of ``window-<k>/``
subdirectories holds one per window; the embedded default model's are in ``data/default/predictors``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from expertcache.errors import option
from expertcache.paths import save_tensors
from expertcache.predict.base import PredictContext, Predictor, PredictorError, rank_union

if TYPE_CHECKING:
    import torch

CONFIG = "predictor.json"
WEIGHTS = "predictor.safetensors"
FORMAT = "expertcache-learned-predictor"
PROBE_ROWS = 32
PROBE_AGREEMENT = 0.75  # the model trained for: about 1 (low precision may flip near-ties); another: K/E
_REQUIRED = ("window", "hidden", "num_layers", "num_experts", "hidden_size", "top_k", "targets")
DEFAULT_PREDICTORS = Path(__file__).resolve().parent.parent / "data" / "default" / "predictors"


def probe_routing(routers, hidden_size: int, device=None, dtype=None) -> np.ndarray:
    """Each router's top-k [L, R, K] for fixed random inputs: identifies the model a predictor fits."""
    import torch

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(PROBE_ROWS, hidden_size, generator=gen).to(device or "cpu", dtype or torch.float32)
    with torch.no_grad():
        return np.stack([np.asarray(r(x).cpu().numpy()) for r in routers])


def topk_overlap(index: np.ndarray, experts: np.ndarray) -> float:
    """Share of the true top-k rows ``experts`` [..., K] found in the predicted rows ``index`` [..., K]."""
    if experts.size == 0:
        return float("nan")
    hits = (index[..., :, None] == experts[..., None, :]).any(axis=-1).sum()
    return float(hits / experts.size)


def make_mlp(hidden_size: int, hidden: int, num_experts: int) -> torch.nn.Sequential:
    """One target layer's predictor: gate input [T, H] -> predicted gate logits [T, E]."""
    import torch

    return torch.nn.Sequential(
        torch.nn.Linear(hidden_size, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, num_experts)
    )


def source_layer(target: int, window: int) -> int:
    """The layer whose gate input predicts ``target`` (ProMoE's fallback to layer 0 near the start)."""
    return max(target - window, 0)


def save_predictor(
    out_dir: str | Path,
    mlps: dict[int, torch.nn.Module],
    meta: dict,
    dtype: torch.dtype | None = None,
    probe: np.ndarray | None = None,
) -> Path:
    """Write ``predictor.json`` and ``predictor.safetensors`` (weights in ``dtype``) into ``out_dir``.

    ``probe``: the model's ``probe_routing`` [L, R, K], checked against the model the predictor runs on.
    """
    import torch

    dtype = torch.float16 if dtype is None else dtype
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {
        f"target.{t}.{name}": p.detach().to("cpu", dtype).contiguous()
        for t, mlp in sorted(mlps.items())
        for name, p in mlp.state_dict().items()
    }
    if probe is not None:
        tensors["probe"] = torch.as_tensor(np.asarray(probe), dtype=torch.int64)
    save_tensors(tensors, out / WEIGHTS)
    meta = {"format": FORMAT, **meta, "targets": sorted(mlps), "dtype": str(dtype).removeprefix("torch.")}
    (out / CONFIG).write_text(json.dumps(meta, indent=1) + "\n")
    return out


def load_predictor(directory: str | Path) -> tuple[dict, dict[int, torch.nn.Sequential], np.ndarray | None]:
    """(meta, {target layer: MLP in float32}, probe or None) from a directory of ``save_predictor``."""
    import torch
    from safetensors.torch import load_file

    directory = Path(directory)
    for name in (CONFIG, WEIGHTS):
        if not (directory / name).is_file():
            raise PredictorError(f"{directory}: no {name} (not a trained learned-predictor directory)")
    try:
        meta = json.loads((directory / CONFIG).read_text(encoding="utf-8-sig"))
        tensors = load_file(str(directory / WEIGHTS))
    except Exception as exc:  # broken JSON or safetensors: one line, whatever the library raised
        raise PredictorError(
            f"{directory}: cannot read the predictor ({type(exc).__name__}: {exc})"
        ) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise PredictorError(f"{directory / CONFIG}: not a learned predictor (no format {FORMAT!r})")
    missing = [key for key in _REQUIRED if key not in meta]
    if missing:
        raise PredictorError(f"{directory / CONFIG}: lacks {', '.join(missing)}")
    _check_meta(directory / CONFIG, meta)
    mlps = {}
    for t in meta["targets"]:
        mlp = make_mlp(meta["hidden_size"], meta["hidden"], meta["num_experts"])
        state = {n: tensors.get(f"target.{t}.{n}") for n in mlp.state_dict()}
        missing = [n for n, v in state.items() if v is None]
        if missing:
            raise PredictorError(f"{directory / WEIGHTS}: target layer {t} lacks {', '.join(missing)}")
        try:
            mlp.load_state_dict({n: v.float() for n, v in state.items()})
        except RuntimeError:
            raise PredictorError(
                f"{directory / WEIGHTS}: target layer {t}'s weights do not fit the shapes in {CONFIG}"
            ) from None
        if not all(torch.isfinite(p).all() for p in mlp.parameters()):  # NaN weights predicted nothing
            raise PredictorError(f"{directory / WEIGHTS}: target layer {t}'s weights are not all finite")
        mlps[int(t)] = mlp.eval()
    probe = tensors.get("probe")
    return meta, mlps, None if probe is None else probe.numpy()


def _check_meta(where: Path, meta: dict) -> None:
    """The predictor's description, each field as ``save_predictor`` writes it: a window of 0, -2 or 9 of
    a 6-layer model, or an activation the MLPs do not use, was taken and ran (or said) something else."""
    for key in ("window", "hidden", "num_layers", "num_experts", "hidden_size", "top_k"):
        v = meta[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise PredictorError(f"{where}: {key} must be a whole number >= 1, got {v!r}")
    if meta["window"] >= meta["num_layers"]:
        raise PredictorError(
            f"{where}: window {meta['window']} reaches past the {meta['num_layers']} MoE layers it was "
            "trained on"
        )
    if meta["top_k"] > meta["num_experts"]:
        raise PredictorError(f"{where}: top_k {meta['top_k']} of {meta['num_experts']} experts")
    targets = meta["targets"]
    if (
        not isinstance(targets, list)
        or not targets
        or not all(
            isinstance(t, int) and not isinstance(t, bool) and 1 <= t < meta["num_layers"] for t in targets
        )
    ):
        raise PredictorError(f"{where}: targets must be layers 1 .. {meta['num_layers'] - 1}")
    if meta.get("activation", "gelu") != "gelu":  # make_mlp's
        raise PredictorError(
            f"{where}: activation {meta['activation']!r}; the learned predictor's MLPs use gelu"
        )
    if meta.get("dtype", "float16") not in ("float16", "bfloat16", "float32"):
        raise PredictorError(
            f"{where}: dtype {meta['dtype']!r} is not a float dtype the weights are stored in"
        )


def resolve_directory(path: str | Path | None, window: int | None) -> Path:
    """The predictor directory for ``window``: ``path`` itself, or its ``window-<k>/`` subdirectory."""
    root = Path(path) if path is not None else DEFAULT_PREDICTORS
    if not root.is_dir():
        raise PredictorError(f"{root}: no such learned-predictor directory")
    if (root / CONFIG).is_file():
        return root
    trained = sorted(int(p.name.removeprefix("window-")) for p in root.glob("window-[0-9]*") if p.is_dir())
    if not trained:
        raise PredictorError(f"{root}: neither {CONFIG} nor window-<k>/ subdirectories (train one first)")
    k = Learned.default_window if window is None else window
    if k not in trained:
        have = ", ".join(map(str, trained))
        raise PredictorError(
            f"{root}: no predictor trained for window {k} (trained: {have}); give "
            + option("--window", "window")
            + " as one of those, or train one (expertcache train-predictor)"
        )
    return root / f"window-{k}"


class Learned(Predictor):
    """ProMoE's learned predictor: MLP_i(gate input of layer i - k) -> layer i's top-k (default k = 2)."""

    name = "learned"
    reads = "directory"
    needs_model = True
    trained = True
    default_window = 2

    def __init__(self, ctx: PredictContext) -> None:
        super().__init__(ctx)
        directory = resolve_directory(ctx.path, ctx.window)
        self.meta, self.mlps, self.probe = load_predictor(directory)
        trained = int(self.meta["window"])
        if ctx.window is not None and ctx.window != trained:
            raise PredictorError(f"{directory}: trained for window {trained}, asked for window {ctx.window}")
        self.window = trained
        for what, have, want in (
            ("MoE layers", self.meta["num_layers"], ctx.num_layers),
            ("experts per layer", self.meta["num_experts"], ctx.num_experts),
        ):
            if have != want and ctx.path is None:
                raise PredictorError(
                    f"the bundled learned predictor is for the embedded model ({have} {what}, this one "
                    f"has {want}); train one (expertcache train-predictor --model MODEL --out DIR), "
                    "then pass --predictor DIR"
                )
            if have != want:
                raise PredictorError(
                    f"{directory}: trained for a model with {have} {what}, this one has {want}"
                )
        self.hidden_size = int(self.meta["hidden_size"])
        self.directory = directory
        self._on: dict[torch.device, dict[int, tuple]] = {}
        self._checked = False
        self._check_probe()  # at load, not at the first prediction: a generation under way would be lost
        if self.probe is None and ctx.routers is not None:  # said, not skipped in silence
            self.note = (
                f"{directory}: no probe (the routing it was trained on), so it is not checked to be this "
                "model's predictor; expertcache train-predictor writes one"
            )

    def _mlps(self, device) -> dict[int, tuple]:
        """Each target's MLP on ``device`` as its tensors ``(W1, b1, W2, b2)``: ``_run`` calls the two
        linear maps directly (the modules' call machinery took a third of a decode step's prediction)."""
        if device not in self._on:
            on = {}
            for t, m in self.mlps.items():
                m = copy.deepcopy(m).to(device)
                on[t] = (m[0].weight.detach(), m[0].bias.detach(), m[2].weight.detach(), m[2].bias.detach())
            self._on[device] = on
        return self._on[device]

    def _predict(self, source: int, target: int, gate_input) -> list[int]:
        if gate_input is None:
            return []
        import torch

        with torch.no_grad():
            return self._run(torch.as_tensor(gate_input), target)

    def _run(self, x, target: int) -> list[int]:
        if not self._checked:
            self._check_model(x)
        weights = self._mlps(x.device).get(target)
        if weights is None:
            return []
        import torch.nn.functional as F

        w1, b1, w2, b2 = weights  # make_mlp's Linear -> GELU -> Linear, as its modules compute it
        logits = F.linear(F.gelu(F.linear(x.reshape(-1, self.hidden_size).float(), w1, b1)), w2, b2)  # [T, E]
        index = logits.topk(min(self.top_k, logits.shape[-1]), dim=-1).indices  # [T, K]
        return rank_union(np.asarray(index.cpu().numpy()))

    def _check_probe(self) -> None:
        """Given the model's routers: their routing of the probe's inputs agrees with what the predictor
        was trained on (each router casts the inputs to its own device and dtype, as a gate input is)."""
        if self.probe is None or self.ctx.routers is None:
            return
        agree = topk_overlap(probe_routing(self.ctx.routers, self.hidden_size), self.probe)
        if agree < PROBE_AGREEMENT:
            raise PredictorError(
                f"{self.directory}: trained for another model (its routers agree with this "
                f"model's on {agree:.0%} of probe inputs); train one for it with train-predictor"
            )

    def _check_model(self, x: torch.Tensor) -> None:
        """Once, at the first gate input: its hidden size."""
        if x.shape[-1] != self.hidden_size:
            raise PredictorError(
                f"{self.directory}: trained for hidden size {self.hidden_size}, "
                f"the gate input has {x.shape[-1]}"
            )
        self._checked = True
