"""``sdpa_no_cudnn``: transformers' ``sdpa`` attention with cuDNN's backend left out of torch's choice.

On a GPU torch prefers cuDNN's fused attention where it can take the shapes (Hopper, bfloat16, heads
without grouping: Qwen1.5-MoE's). cuDNN builds and compiles a plan for every new shape, and decoding
gives every step a new key length: on an H200 (torch 2.11) the first call at each key length took 33 ms
with the driver's JIT cache warm and 0.4 s on a machine just started, against 0.04-0.06 ms for the flash
and memory-efficient backends, which need no plan (``bench/attention_gpu.py``; docs/BENCHMARKS.md, "Decode
attention on a GPU"). This implementation is transformers' own ``sdpa_attention_forward`` under
``torch.nn.attention.sdpa_kernel`` with the flash, memory-efficient and math backends allowed, in torch's
order: on a CPU the same backend as ``sdpa`` runs (the same bits); on a GPU one of those three.

It is registered with transformers' ``AttentionInterface`` (and its mask with ``AttentionMaskInterface``,
as ``sdpa``'s) under ``NAME`` the first time it is asked for (``register``), so that transformers loaded
with it, the engine's reference, computes the same attention: exactness is against that reference.

transformers' continuous batching (``expertcache serve``) takes attention implementations by name (sdpa,
eager, flash) and refuses this one: a server asked for it runs ``sdpa`` with cuDNN's attention switched
off in its process (``serve_without_cudnn``), which computes the same.
"""

from __future__ import annotations

NAME = "sdpa_no_cudnn"


def register() -> str:
    """Register ``NAME`` with transformers (once; later calls do nothing) and return it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if NAME in AttentionInterface._global_mapping:
        return NAME
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    allowed = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

    def sdpa_no_cudnn(module: torch.nn.Module, *args, **kwargs):
        with sdpa_kernel(allowed):
            return sdpa_attention_forward(module, *args, **kwargs)

    AttentionInterface.register(NAME, sdpa_no_cudnn)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME


def serve_without_cudnn(model) -> bool:
    """A model loaded with ``NAME`` made ready for transformers' continuous batching: ``sdpa`` by name,
    cuDNN's attention off for the whole process (the server's own). True if it was loaded with ``NAME``
    (its stats keep saying ``NAME``); False, nothing done, otherwise."""
    import torch

    if getattr(model.config, "_attn_implementation", None) != NAME:
        return False
    torch.backends.cuda.enable_cudnn_sdp(False)
    model.set_attn_implementation("sdpa")
    return True
