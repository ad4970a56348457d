"""compressed-tensors checkpoints for the tests, written by compressed-tensors' own tools (no GPU, no data).

``write_compressed_tensors(src, out, ...)`` takes a full-precision checkpoint whose experts are stored one by
one (``...experts.{e}.gate_proj.weight``) and writes it as llm-compressor's data-free (round-to-nearest)
W4A16 / W8A16 recipes do: every linear layer's weight but the embeddings, norms, ``lm_head`` and the MoE
routers quantised with ``QuantizationConfig`` / ``apply_quantization_config``, min-max scales of each group
in the weight's own dtype (``calculate_qparams``, what llm-compressor's min-max observer gives), then
``ModelCompressor.compress_model`` and ``update_config``. compressed-tensors quantises ``nn.Linear`` modules,
and transformers' MoE experts are fused 3-D parameters, so the checkpoint's own names are rebuilt as a
tree of ``nn.Linear`` (the per-expert layout llm-compressor quantises and writes).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

# left in full precision, as llm-compressor's MoE recipes leave them: the output layer and the routers
IGNORE = ["lm_head", "re:.*mlp.gate$", "re:.*block_sparse_moe.gate$", "re:.*shared_expert_gate$"]


class _Node(nn.Module):
    pass


def _tree(state: dict[str, torch.Tensor]) -> nn.Module:
    """Modules named as the checkpoint's keys: each matrix but the embeddings' an ``nn.Linear``, the rest
    parameters."""
    root = _Node()
    for key, t in state.items():
        *path, leaf = key.split(".")
        linear = leaf == "weight" and t.ndim == 2 and not ("embed" in key or "norm" in key)
        last = path.pop() if linear else None
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, _Node())
            mod = getattr(mod, part)
        if linear:
            lin = nn.Linear(t.shape[1], t.shape[0], bias=False, dtype=t.dtype)
            lin.weight = nn.Parameter(t.clone(), requires_grad=False)
            mod.add_module(last, lin)
        else:
            mod.register_parameter(leaf, nn.Parameter(t.clone(), requires_grad=False))
    return root


def write_compressed_tensors(
    src: Path, out: Path, bits: int = 4, strategy: str = "group", group: int = 32, symmetric: bool = True
) -> Path:
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams, is_module_quantized

    src, out = Path(src), Path(out)
    state: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        state.update(load_file(str(f)))
    tree = _tree(state)
    weights = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy=strategy,
                               group_size=group if strategy == "group" else None, dynamic=False)  # fmt: skip
    config = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
        ignore=IGNORE,
        quantization_status=QuantizationStatus.INITIALIZED,
    )
    apply_quantization_config(tree, config)
    for module in tree.modules():
        if not is_module_quantized(module):
            continue
        w = module.weight  # min-max in the weight's own dtype, as llm-compressor's observer
        if strategy == "group":
            g = w.unflatten(-1, (w.shape[-1] // group, group))
            lo, hi = g.amin(-1), g.amax(-1)
        else:
            lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        scale, zero = calculate_qparams(lo, hi, module.quantization_scheme.weights)
        module.weight_scale.data.copy_(scale.to(module.weight_scale.dtype))
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero.to(module.weight_zero_point.dtype))
    compressor = ModelCompressor.from_pretrained_model(tree)
    compressor.compress_model(tree)
    out.mkdir(parents=True)
    for f in src.iterdir():  # config, tokenizer, generation config
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy2(f, out / f.name)
    compressed = {k: v.contiguous() for k, v in tree.state_dict().items()}
    save_file(compressed, str(out / "model.safetensors"), metadata={"format": "pt"})
    compressor.update_config(str(out))
    assert "quantization_config" in json.loads((out / "config.json").read_text())
    return out
