"""compressed-tensors checkpoints for the tests, written on a CPU by compressed-tensors' own tools (no data).

compressed-tensors quantises ``nn.Linear`` modules and transformers' MoE experts are fused 3-D parameters,
so the checkpoint's own names (experts one by one) are rebuilt as a tree of ``nn.Linear``: the layout
llm-compressor quantises and writes (its data-free W4A16 of a tiny model gave the same bytes).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

# left in full precision, as llm-compressor's MoE recipes leave them: the output layer and the routers
# (``mlp.gate``; Mixtral's ``block_sparse_moe.gate``; Qwen2-MoE's one-row ``shared_expert_gate``)
IGNORE = ["lm_head", "re:.*mlp.gate$", "re:.*block_sparse_moe.gate$", "re:.*shared_expert_gate$"]


class _Node(nn.Module):
    pass


def _module(root: nn.Module, path: list[str]) -> nn.Module:
    for part in path:
        if not hasattr(root, part):
            root.add_module(part, _Node())
        root = getattr(root, part)
    return root


def _tree(state: dict[str, torch.Tensor]) -> nn.Module:
    """Modules named as the checkpoint's keys: each 2-D ``*.weight`` but the embeddings' and norms' an
    ``nn.Linear`` (with its ``*.bias``), every other tensor a parameter."""
    root = _Node()
    linears = [k for k, t in state.items() if k.endswith(".weight") and t.ndim == 2]
    linears = [k for k in linears if "embed" not in k and "norm" not in k]
    done = set()
    for key in linears:  # the Linears first, so that a router's other tensors land on its Linear
        *path, name, _ = key.split(".")
        w, b = state[key], state.get(key[: -len("weight")] + "bias")
        lin = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, dtype=w.dtype)
        lin.weight = nn.Parameter(w.clone(), requires_grad=False)
        if b is not None:
            lin.bias = nn.Parameter(b.clone(), requires_grad=False)
            done.add(key[: -len("weight")] + "bias")
        _module(root, path).add_module(name, lin)
        done.add(key)
    for key, t in state.items():
        if key not in done:
            *path, leaf = key.split(".")
            _module(root, path).register_parameter(leaf, nn.Parameter(t.clone(), requires_grad=False))
    return root


def write_compressed_tensors(
    src: Path, out: Path, bits: int = 4, strategy: str = "group", group: int = 32, symmetric: bool = True
) -> Path:
    """Write ``src`` (experts stored one by one) to ``out`` as compressed-tensors' data-free pack-quantized
    int weight-only checkpoint, with compressed-tensors' own tools only (llm-compressor's RTN W4A16/W8A16
    writes the same bytes): every Linear weight but ``lm_head``, the routers (``IGNORE``) and, for "group",
    one whose columns are not a multiple of ``group``; min-max scales in the weight's dtype."""
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
    ignore = list(IGNORE)
    if strategy == "group":
        ignore += [n for n, m in tree.named_modules() if isinstance(m, nn.Linear) and m.in_features % group]
    weights = QuantizationArgs(
        num_bits=bits,
        type="int",
        symmetric=symmetric,
        strategy=strategy,
        group_size=group if strategy == "group" else None,
        dynamic=False,
    )
    config = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
        ignore=ignore,
        quantization_status=QuantizationStatus.INITIALIZED,
    )
    apply_quantization_config(tree, config)
    for module in tree.modules():
        if not is_module_quantized(module):
            continue
        w = module.weight  # min-max in the weight's own dtype, as llm-compressor's min-max observer
        if strategy == "group":
            g = w.unflatten(-1, (w.shape[-1] // group, group))
            lo, hi = g.amin(-1), g.amax(-1)
        elif strategy == "channel":
            lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        else:
            lo, hi = w.amin().reshape(1), w.amax().reshape(1)
        scale, zero = calculate_qparams(lo, hi, module.quantization_scheme.weights)
        module.weight_scale.data.copy_(scale.to(module.weight_scale.dtype))
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero.to(module.weight_zero_point.dtype))
    compressor = ModelCompressor.from_pretrained_model(tree)
    compressor.compress_model(tree)

    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():  # config, tokenizer, generation config, ... (not the weights nor their index)
        if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy2(f, out / f.name)
    compressed = {k: v.contiguous() for k, v in tree.state_dict().items()}
    save_file(compressed, str(out / "model.safetensors"), metadata={"format": "pt"})
    compressor.update_config(str(out))
    return out
