"""A model family is one record: everything the engine, the predictors and the test models need to know.

transformers 5.x holds a layer's experts in one ``...Experts`` module with fused tensors
(``gate_up_proj [E, 2F, H]``, ``down_proj [E, H, F]``; GPT-OSS transposed, with biases). Checkpoints
keep either one tensor per expert (``experts.{e}.gate_proj.weight``, Mixtral's ``w1/w2/w3``) or the
fused tensors (GPT-OSS, Granite-MoE's ``input_linear/output_linear``). A ``Family`` says, for each
slot tensor of one expert, which checkpoint tensors fill it (rows concatenated in order), how
non-expert checkpoint keys are renamed to the model's parameter names, where the MoE block keeps its
router (the gate-based predictors call it), how a random checkpoint of the family is configured, and
the shape of its tiny test model. Adding a family is adding one record to ``FAMILIES``; the fields
with a default (``renames``, ``pieces``, ``root``, ``outer``, ``layouts``, ``transposed_ok``,
``router_inputs``, ``router_batched``, ``dense_first``, ``min_tiny``) may be left out, every other is
required, so a forgotten one fails at import.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from expertcache.errors import ExpertcacheError, did_you_mean


@dataclass(frozen=True)
class Source:
    """A checkpoint tensor feeding (part of) a slot tensor: ``{block}`` and ``{e}`` are filled in."""

    key: str
    fused: bool = False  # the tensor holds every expert along dim 0: read row e only


@dataclass(frozen=True)
class Pieces:
    """A dense tensor kept whole on one side and in pieces along dim 0 on the other, named by key suffixes
    (after ``renames``): ``stored="pieces"``, the checkpoint holds ``pieces`` and the model ``whole``
    (Bailing's ``q/k/v_conv1d`` joined into ``conv1d``); ``stored="whole"``, the checkpoint holds ``whole``
    and the model ``pieces``, cut to the model's sizes (Lara's fused ``in_proj``)."""

    whole: str
    pieces: tuple[str, ...]
    stored: str = "pieces"

    def __post_init__(self) -> None:
        if self.stored not in ("pieces", "whole"):
            raise ValueError(f"Pieces.stored must be 'pieces' or 'whole', not {self.stored!r}")


@dataclass(frozen=True)
class Layout:
    """Another way a family's checkpoints store their experts (``block`` and ``sources`` as in ``Family``):
    a published checkpoint's, beside what transformers' ``save_pretrained`` writes (Qwen3.5-MoE's
    published experts are fused, transformers saves them one by one). The loader takes the record's own
    layout or the first of these whose first expert the checkpoint holds."""

    block: str
    sources: dict[str, tuple[Source, ...]]


@dataclass(frozen=True)
class Shape:
    """The sizes of a random checkpoint (``engine.random_checkpoint.make_checkpoint``)."""

    experts: int  # per MoE layer
    top_k: int
    intermediate: int  # an expert's
    hidden: int
    heads: int
    layers: int  # decoder layers, dense ones included (per-layer config lists: ``layer_types``)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclass(frozen=True)
class Tiny:
    """The family's tiny test model (``tools.tiny``): a few dozen kilobytes, built in well under a second."""

    layers: int  # decoder layers, dense ones included
    experts: int
    hidden: int = 32
    intermediate: int = 32


@dataclass(frozen=True, kw_only=True)
class Family:
    """One model family: its checkpoint layout, its router, its random config and its tiny test model."""

    name: str  # model_type in config.json
    block: str  # the MoE block's name in the checkpoint under model.layers.{l}
    sources: dict[str, tuple[Source, ...]]  # slot tensor name (the Experts parameter) -> its sources
    renames: tuple[tuple[str, str], ...] = ()  # checkpoint substring -> model substring (non-expert keys)
    pieces: tuple[Pieces, ...] = ()  # dense tensors stored in pieces, or whole where the model has pieces
    root: str = "model."  # the checkpoint's name for the model's ``model.`` (Nemotron-H's ``backbone.``)
    outer: str = ""  # an image-text checkpoint's prefix of its text model's other keys (``language_model.``)
    layouts: tuple[Layout, ...] = ()  # other layouts of the experts in this family's checkpoints
    # a fused expert tensor may be stored transposed (transformers 4's layout, Qwen3-VL-MoE's published
    # checkpoints): read transposed where its shape is the model's reversed, as transformers' own
    # ``Transpose(check_dims=True)`` for the family does (a square one is taken as it is, by both)
    transposed_ok: bool = False
    router: str  # the MoE block's attribute (transformers 5.x module) that holds its router
    # block attributes the router takes after the hidden states; such a router is called as its block
    # calls it, with hidden states [1, T, H] (AFMoE's takes the block's expert_bias)
    router_inputs: tuple[str, ...] = ()
    # the router takes hidden states [1, T, H] when it has router_inputs; False: [T, H] (LFM2-MoE's)
    router_batched: bool = True
    config: Callable[[Shape], dict[str, object]]  # a random checkpoint's config arguments of this family
    dense_first: int = 0  # dense layers before the MoE ones in a random checkpoint (what ``config`` sets)
    # a random checkpoint needs the tiny model's layers at least (hybrids: an attention layer among the
    # linear-attention or Mamba ones, which transformers' cache needs)
    min_tiny: bool = False
    tiny: Tiny

    def expert_keys(self, prefix: str, expert: int) -> dict[str, list[tuple[str, bool]]]:
        """Checkpoint keys of one expert, per slot tensor; ``prefix`` is ``model.layers.{l}``."""
        if prefix.startswith("model."):
            prefix = self.root + prefix.removeprefix("model.")
        block = f"{prefix}.{self.block}" if self.block else prefix  # Gemma 4's: the decoder layer
        return {
            name: [(s.key.format(block=block, e=expert), s.fused) for s in srcs]
            for name, srcs in self.sources.items()
        }

    @property
    def fused(self) -> bool:
        """Its checkpoints hold each projection's experts in one tensor (GPT-OSS, Granite): a published
        format that stores experts one by one (FP8, compressed-tensors) is not theirs."""
        return any(src.fused for srcs in self.sources.values() for src in srcs)

    @property
    def min_layers(self) -> int:
        """The fewest decoder layers a random checkpoint of the family runs with: its layers before the
        first MoE one and one MoE layer, or (``min_tiny``) the tiny model's."""
        return max(self.dense_first + 1, self.tiny.layers if self.min_tiny else 1)

    def variants(self) -> list[Family]:
        """The record as it is, then with each of its other ``layouts``, then as transformers 5 runs the
        experts (``save_pretrained(save_original_format=False)`` saves them so): each slot tensor fused,
        ``experts.gate_up_proj`` and ``experts.down_proj``, under the block's name in the model."""
        out = [self, *(replace(self, block=lay.block, sources=lay.sources) for lay in self.layouts)]
        if self.block:
            block = f".{self.block}."
            for old, new in self.renames:
                block = block.replace(old, new)
            # the whole checkpoint then has the model's names: nothing to rename
            fused = {name: (Source("{block}.experts." + name, fused=True),) for name in self.sources}
            saved = replace(self, block=block.strip("."), sources=fused, renames=())
            if not any((v.block, v.sources) == (saved.block, saved.sources) for v in out):
                out.append(saved)
        return out

    def rename(self, key: str) -> str:
        if key.startswith(self.root):
            key = "model." + key.removeprefix(self.root)
        elif self.outer and key.startswith(self.outer):  # an image-text checkpoint's text model's lm_head
            key = key.removeprefix(self.outer)
        for old, new in self.renames:
            key = key.replace(old, new)
        return key


def _per_expert(gate: str, up: str, down: str) -> dict[str, tuple[Source, ...]]:
    k = "{block}.experts.{e}.%s.weight"
    return {"gate_up_proj": (Source(k % gate), Source(k % up)), "down_proj": (Source(k % down),)}


# Config arguments that differ between families: what the expert count and widths are called, MLA dims.
def _local_experts(s: Shape) -> dict[str, object]:
    return dict(num_local_experts=s.experts, num_experts_per_tok=s.top_k, intermediate_size=s.intermediate)


def _gpt_oss(s: Shape) -> dict[str, object]:
    return {**_local_experts(s), "head_dim": s.head_dim, "layer_types": None}


def _num_experts(s: Shape) -> dict[str, object]:
    return dict(num_experts=s.experts, num_experts_per_tok=s.top_k, intermediate_size=s.intermediate)


def _qwen2_moe(s: Shape) -> dict[str, object]:
    moe = s.intermediate
    return {**_num_experts(s), "moe_intermediate_size": moe, "shared_expert_intermediate_size": 2 * moe}


def _qwen3_moe(s: Shape) -> dict[str, object]:
    return {**_num_experts(s), "moe_intermediate_size": s.intermediate, "head_dim": s.head_dim}


_DEEPSEEK_DENSE_FIRST = 1


def _deepseek_v2(s: Shape) -> dict[str, object]:
    """A dense first layer, one shared expert, MLA attention."""
    return dict(
        n_routed_experts=s.experts,
        num_experts_per_tok=s.top_k,
        moe_intermediate_size=s.intermediate,
        intermediate_size=2 * s.intermediate,
        n_shared_experts=1,
        first_k_dense_replace=_DEEPSEEK_DENSE_FIRST,
        kv_lora_rank=max(8, s.hidden // 4),
        q_lora_rank=None,
        qk_rope_head_dim=max(4, s.head_dim // 2),
        qk_nope_head_dim=max(4, s.head_dim // 2),
        v_head_dim=s.head_dim,
    )


def _deepseek_v3(s: Shape) -> dict[str, object]:
    return {**_deepseek_v2(s), "n_group": 1, "topk_group": 1}


def _ernie4_5_moe(s: Shape) -> dict[str, object]:
    """Every layer MoE (transformers' default makes the first dense), one shared expert."""
    return dict(
        moe_num_experts=s.experts,
        moe_k=s.top_k,
        moe_intermediate_size=s.intermediate,
        intermediate_size=2 * s.intermediate,
        moe_num_shared_experts=1,
        moe_layer_start_index=0,
    )


def _glm4_moe(s: Shape) -> dict[str, object]:
    """DeepSeek-V3's routing (grouped, a score-correction bias), a dense first layer, one shared expert."""
    return dict(
        n_routed_experts=s.experts,
        num_experts_per_tok=s.top_k,
        moe_intermediate_size=s.intermediate,
        intermediate_size=2 * s.intermediate,
        n_shared_experts=1,
        first_k_dense_replace=_DEEPSEEK_DENSE_FIRST,
        n_group=1,
        topk_group=1,
        head_dim=s.head_dim,
    )


def _hunyuan_v1_moe(s: Shape) -> dict[str, object]:
    return dict(
        num_experts=s.experts, moe_topk=s.top_k, intermediate_size=s.intermediate, head_dim=s.head_dim
    )


def _exaone_moe(s: Shape) -> dict[str, object]:
    return {**_glm4_moe(s), "num_experts": s.experts, "num_shared_experts": 1, "mlp_layer_types": None}


def _dots1(s: Shape) -> dict[str, object]:
    return {k: v for k, v in _glm4_moe(s).items() if k != "head_dim"}


def _solar_open(s: Shape) -> dict[str, object]:
    return dict(
        n_routed_experts=s.experts,
        num_experts_per_tok=s.top_k,
        moe_intermediate_size=s.intermediate,
        n_shared_experts=1,
        head_dim=s.head_dim,
    )


def _cohere2_moe(s: Shape) -> dict[str, object]:
    return {**_num_experts(s), "head_dim": s.head_dim, "layer_types": None, "mlp_layer_types": None}


def _granitemoeshared(s: Shape) -> dict[str, object]:
    return {**_local_experts(s), "shared_intermediate_size": 2 * s.intermediate}


def _deepseek_v32(s: Shape) -> dict[str, object]:
    """DeepSeek-V3 with the sparse-attention indexer (small: it keeps every key of a short prompt)."""
    return {
        **_deepseek_v3(s),
        "q_lora_rank": max(8, s.hidden // 4),  # an int here (V2/V3 take None)
        "index_n_heads": 2,
        "index_head_dim": max(8, s.head_dim),
        "index_topk": 64,
        "layer_types": None,
        "mlp_layer_types": None,
    }


def _glm4_moe_lite(s: Shape) -> dict[str, object]:
    return {**_deepseek_v3(s), "mlp_layer_types": None}


def _afmoe(s: Shape) -> dict[str, object]:
    return dict(
        num_experts=s.experts,
        num_experts_per_tok=s.top_k,
        moe_intermediate_size=s.intermediate,
        intermediate_size=2 * s.intermediate,
        num_dense_layers=_DEEPSEEK_DENSE_FIRST,
        num_shared_experts=1,
        head_dim=s.head_dim,
        layer_types=None,
    )


def _lfm2_moe(s: Shape) -> dict[str, object]:
    """Every layer MoE; short-convolution and attention layers alternate (convolution first); the
    expert bias on, as in transformers."""
    return {
        **_num_experts(s),
        "moe_intermediate_size": s.intermediate,
        "intermediate_size": 2 * s.intermediate,
        "num_dense_layers": 0,
        "use_expert_bias": True,
        "layer_types": ["conv" if i % 2 == 0 else "full_attention" for i in range(s.layers)],
    }


def _laguna(s: Shape) -> dict[str, object]:
    """transformers' default: the first layer dense, the others MoE with a shared expert."""
    return {
        **_qwen2_moe(s),
        "intermediate_size": 2 * s.intermediate,
        "head_dim": s.head_dim,
        "layer_types": None,
        "num_attention_heads_per_layer": None,
        "mlp_layer_types": None,
    }


def _jamba(s: Shape) -> dict[str, object]:
    """Every layer MoE; Mamba and attention layers alternate (Mamba first); no CUDA Mamba kernels."""
    return {
        **_num_experts(s),
        "expert_layer_period": 1,
        "expert_layer_offset": 0,
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "use_mamba_kernels": False,
    }


def _qwen3_next(s: Shape) -> dict[str, object]:
    """Gated-DeltaNet linear attention in three layers of four (transformers' default), small heads."""
    return {
        **_qwen2_moe(s),
        "head_dim": s.head_dim,
        "linear_key_head_dim": s.head_dim,
        "linear_value_head_dim": s.head_dim,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "layer_types": None,
    }


def _minimax_m2(s: Shape) -> dict[str, object]:
    return {**_local_experts(s), "head_dim": s.head_dim}


def _mellum(s: Shape) -> dict[str, object]:
    return {**_qwen3_moe(s), "layer_types": None, "mlp_layer_types": None}


def _mimo_v2_flash(s: Shape) -> dict[str, object]:
    """transformers' default: the first layer dense. Full attention only: its sliding layers double the
    key-value heads (a random checkpoint has as many as query heads, which leaves no query head per key
    head). The query and key heads are 1.5 times the value heads, as in the checkpoint (192 and 128), so
    that rotary's third of them (``partial_rotary_factor`` 0.334) is a whole even number of dimensions."""
    return {
        "n_routed_experts": s.experts,
        "num_experts_per_tok": s.top_k,
        "moe_intermediate_size": s.intermediate,
        "intermediate_size": 2 * s.intermediate,
        "head_dim": 3 * s.head_dim // 2,
        "v_head_dim": s.head_dim,
        "layer_types": ["full_attention"] * s.layers,
        "mlp_layer_types": None,
    }


def _flint(s: Shape) -> dict[str, object]:
    """Every layer MoE (transformers' default makes the first two dense), one shared expert."""
    return {
        **_qwen2_moe(s),
        "intermediate_size": 2 * s.intermediate,
        "head_dim": s.head_dim,
        "mlp_only_layers": [],
        "layer_types": None,
    }


def _kolibri1(s: Shape) -> dict[str, object]:
    return {**_qwen2_moe(s), "head_dim": s.head_dim, "layer_types": None}


def _hy_v3(s: Shape) -> dict[str, object]:
    """transformers' default: the first layer dense; one shared expert."""
    return {
        **_qwen3_moe(s),
        "intermediate_size": 2 * s.intermediate,
        "num_shared_experts": 1,
        "mlp_layer_types": None,
    }


def _glm_moe_dsa(s: Shape) -> dict[str, object]:
    """DeepSeek-V3.2's shape (MLA, the sparse-attention indexer keeping every key of a short prompt)."""
    return {
        **_deepseek_v32(s),
        "mlp_layer_types": None,
        "indexer_types": None,
    }


def _axk1(s: Shape) -> dict[str, object]:
    """DeepSeek-V3's shape; a norm after the MoE block's output."""
    return {**_deepseek_v3(s), "q_lora_rank": max(8, s.hidden // 4), "mlp_layer_types": None}


def _granitemoehybrid(s: Shape) -> dict[str, object]:
    """Mamba-2 and attention layers alternate (Mamba first), each with MoE experts and a shared MLP."""
    return {
        **_granitemoeshared(s),
        "layer_types": ["mamba" if i % 2 == 0 else "attention" for i in range(s.layers)],
        "mamba_n_heads": 8,
        "mamba_d_head": 2 * s.hidden // 8,
        "mamba_d_state": 16,
        "mamba_chunk_size": 16,
    }


def _bailing_hybrid(s: Shape) -> dict[str, object]:
    """DeepSeek-V3's MoE (MLA in the full-attention layers); with a dense first layer, linear-attention
    and full-attention layers alternate (``layer_group_size`` 2), small heads."""
    args = {k: v for k, v in _deepseek_v3(s).items() if k != "n_routed_experts"}
    return {**args, "num_local_experts": s.experts, "head_dim": s.head_dim, "layer_group_size": 2,
            "layer_types": None, "mlp_layer_types": None}  # fmt: skip


def _kimi_linear(s: Shape) -> dict[str, object]:
    """DeepSeek-V3's MoE (MLA in the full-attention layers), Kimi Delta Attention in the others; a dense
    first layer; small linear-attention heads."""
    args = {k: v for k, v in _deepseek_v3(s).items() if k != "n_routed_experts"}
    dense = _DEEPSEEK_DENSE_FIRST
    return {
        **args,
        "num_local_experts": s.experts,
        "linear_head_dim": s.head_dim,
        "linear_num_heads": s.heads,
        "layer_types": ["linear_attention" if i % 2 == 0 else "full_attention" for i in range(s.layers)],
        "mlp_layer_types": ["dense" if i < dense else "sparse" for i in range(s.layers)],
    }


def _lara_mini(s: Shape) -> dict[str, object]:
    """Qwen3-Next's shape: Gated-DeltaNet linear attention beside (sliding) attention layers."""
    return {**_qwen3_next(s), "layer_types": None}


def _dense_then(s: Shape) -> list[str]:
    """``mlp_layer_types`` of a dense first layer (``_DEEPSEEK_DENSE_FIRST``), then sparse (MoE) ones."""
    return ["dense"] * _DEEPSEEK_DENSE_FIRST + ["sparse"] * (s.layers - _DEEPSEEK_DENSE_FIRST)


def _axk2(s: Shape) -> dict[str, object]:
    """DeepSeek-V3.2's shape (MLA, the sparse-attention indexer keeping every key of a short prompt); a
    dense first layer."""
    return {
        **_deepseek_v32(s),
        "head_dim": s.head_dim,
        "mlp_layer_types": _dense_then(s),
    }


def _beam(s: Shape) -> dict[str, object]:
    """A dense first layer (transformers' default: three), grouped routing in one group; its experts'
    own gate (``_apply_gate``: the SiLU product in float32)."""
    return {
        **_qwen3_moe(s),
        "intermediate_size": 2 * s.intermediate,
        "n_group": 1,
        "topk_group": 1,
        "layer_types": None,
        "mlp_layer_types": _dense_then(s),
    }


def _hy_v4(s: Shape) -> dict[str, object]:
    """DeepSeek-V3.2's attention and routing with hyper-connections; a dense first layer (transformers'
    default), one shared expert; its experts clamp the gate and up products (``swiglu_limit``)."""
    return {
        **_deepseek_v32(s),
        "intermediate_size": 2 * s.intermediate,
        "head_dim": s.head_dim,
        "indexer_types": None,
    }


_NEMOTRON_FIRST = ("mamba", "attention")  # the tiny model's layers before its MoE ones


def _nemotron_h(s: Shape) -> dict[str, object]:
    """A Mamba-2 layer and an attention layer, then MoE ones (each of transformers' blocks holds one mixer:
    Mamba, attention, an MLP or the MoE); its experts have no gate (``relu2(up x)``), one shared expert."""
    return {
        "n_routed_experts": s.experts,
        "num_experts_per_tok": s.top_k,
        "moe_intermediate_size": s.intermediate,
        "moe_shared_expert_intermediate_size": s.intermediate,
        "intermediate_size": 2 * s.intermediate,
        "n_group": 1,
        "topk_group": 1,
        "head_dim": s.head_dim,
        "mamba_num_heads": 8,
        "mamba_head_dim": 2 * s.hidden // 8,
        "ssm_state_size": 16,
        "chunk_size": 16,
        "n_groups": 1,
        "layers_block_type": [*_NEMOTRON_FIRST, *["moe"] * (s.layers - len(_NEMOTRON_FIRST))],
    }


def _linear_then_full(s: Shape) -> list[str]:
    """Linear-attention layers, then one full-attention layer last (transformers' caches need one)."""
    return ["linear_attention"] * (s.layers - 1) + ["full_attention"]


def _qwen3_5_moe_text(s: Shape) -> dict[str, object]:
    """Qwen3.5-MoE's text model (the language model of its image-text checkpoints): Qwen3-Next's shape."""
    return {**_qwen3_next(s), "layer_types": _linear_then_full(s)}


def _gemma4_text(s: Shape) -> dict[str, object]:
    """Gemma 4's text model with its MoE block on (beside the dense MLP of every layer), small per-layer
    inputs and heads."""
    return {
        "enable_moe_block": True,
        "num_experts": s.experts,
        "top_k_experts": s.top_k,
        "moe_intermediate_size": s.intermediate,
        "intermediate_size": 2 * s.intermediate,
        "head_dim": s.head_dim,
        "global_head_dim": s.head_dim,
        "hidden_size_per_layer_input": 8,
        "vocab_size_per_layer_input": 300,
        "layer_types": None,
    }


def _minimax_m3_vl_text(s: Shape) -> dict[str, object]:
    return {
        **_local_experts(s),
        "shared_intermediate_size": s.intermediate,
        "dense_intermediate_size": 2 * s.intermediate,
        "head_dim": s.head_dim,
        "index_n_heads": 2,
        "index_head_dim": max(8, s.head_dim),
        "layer_types": None,
        "mlp_layer_types": None,
    }


def _dots3_note_text(s: Shape) -> dict[str, object]:
    """DeepSeek-V3.2's attention with sliding-window layers of their own shapes (``swa_*``: left out, they
    are the released model's, 64 heads of 256 over ranks of 1024, 150 MB for a tiny model's one such
    layer)."""
    mla = _deepseek_v3(s)
    return {
        **mla,
        "q_lora_rank": max(8, s.hidden // 4),
        "shared_experts_intermediate_size": s.intermediate,
        "head_dim": s.head_dim,
        "index_n_heads": 2,
        "index_head_dim": max(8, s.head_dim),
        "layer_types": None,
        "mlp_layer_types": _dense_then(s),
        "swa_num_attention_heads": s.heads,
        "swa_num_key_value_heads": s.heads,
        "swa_q_lora_rank": max(8, s.hidden // 4),
        "swa_kv_lora_rank": mla["kv_lora_rank"],
        "swa_head_dim": s.head_dim,
        "swa_qk_nope_head_dim": s.head_dim // 2,
        "swa_v_head_dim": s.head_dim,
    }


def _aria_text(s: Shape) -> dict[str, object]:
    return {
        "moe_num_experts": s.experts,
        "moe_topk": s.top_k,
        "intermediate_size": s.intermediate,
        "moe_num_shared_experts": 1,
        "head_dim": s.head_dim,
    }


def _inkling_text(s: Shape) -> dict[str, object]:
    """Every layer MoE with one shared expert, whose weight the router gives with the routed ones."""
    return {
        "n_routed_experts": s.experts,
        "num_experts_per_tok": s.top_k,
        "moe_intermediate_size": s.intermediate,
        "intermediate_size": 2 * s.intermediate,
        "n_shared_experts": 1,
        "head_dim": s.head_dim,
        "swa_num_attention_heads": s.heads,
        "swa_num_key_value_heads": s.heads,
        "swa_head_dim": s.head_dim,
        "layer_types": None,
        "mlp_layer_types": None,
    }


def _qwen3_vl_moe_text(s: Shape) -> dict[str, object]:
    """Qwen3-VL-MoE's text model (the language model of its image-text checkpoints): Qwen3-MoE's shape, with
    its multimodal rotary sections (temporal, height, width) fitted to the head (they share its half)."""
    half = s.head_dim // 2
    section = [half - 2 * (half // 4), half // 4, half // 4]
    rope = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": section,
        "mrope_interleaved": True,
    }
    return {**_qwen3_moe(s), "rope_parameters": rope}


def _glm4v_moe_text(s: Shape) -> dict[str, object]:
    """GLM-4.5V's text model: GLM-4-MoE's shape, rotary on half of each head, that half's multimodal
    sections fitted to it."""
    quarter = s.head_dim // 4
    section = [quarter - 2 * (quarter // 3), quarter // 3, quarter // 3]
    rope = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "mrope_section": section,
    }
    return {**_glm4_moe(s), "rope_parameters": rope}


def _hy_v4_vl_text(s: Shape) -> dict[str, object]:
    """Hy-V4-VL's text model: Hy-V4's shape, its multimodal rotary sections fitted to the rotary slice."""
    half = _hy_v4(s)["qk_rope_head_dim"] // 2
    section = [half - 2 * (half // 4), half // 4, half // 4]
    return {
        **_hy_v4(s),
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section},
    }


def _glm5_next_text(s: Shape) -> dict[str, object]:
    """GLM-5-Next's text model: KDA linear attention in every layer but the last, which is MLA without
    rotary and with the sparse-attention indexer (keeping every key of a short prompt); hyper-connections,
    a dense first layer, one shared expert; its experts clamp the gate and up products."""
    return {
        **_deepseek_v32(s),
        "num_key_value_heads": s.heads,  # MLA: one key and value per query head
        "qk_rope_head_dim": 0,
        "qk_nope_head_dim": s.head_dim,
        "v_head_dim": s.head_dim,
        "linear_head_dim": s.head_dim,
        "linear_num_heads": s.heads,
        "index_kpool": 16,
        "layer_types": _linear_then_full(s),
        "mlp_layer_types": _dense_then(s),
    }


def _muse_spark_text(s: Shape) -> dict[str, object]:
    """Muse Spark's text model: each MoE block narrows the hidden states (to half here) for its experts and
    widens them back, and its experts normalise each one's output (``has_post_expert_norm``); sliding
    attention layers with a full one last."""
    return {
        "num_local_experts": s.experts,
        "num_experts_per_tok": s.top_k,
        "moe_intermediate_size": s.intermediate,
        "moe_hidden_size": s.hidden // 2,
        "intermediate_size": 2 * s.intermediate,
        "head_dim": s.head_dim,
        "layer_types": None,
        "mlp_layer_types": None,
        "layer_rope_theta": None,
    }


def _qwen4_exp_text(s: Shape) -> dict[str, object]:
    """Qwen3-Next's shape with its attention indexer small (it keeps every key of a short prompt)."""
    return {
        **_qwen3_next(s),
        "layer_types": _linear_then_full(s),
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": max(8, s.head_dim),
        "indexer_budget": 256,
        "indexer_compress_ratio": 4,
    }


# the fused experts transformers 5 saves as they are: ``experts.gate_up_proj [E, 2F, H]``, ``down_proj``
_FUSED_EXPERTS = {
    name: (Source("{block}.experts." + name, fused=True),) for name in ("gate_up_proj", "down_proj")
}
_FUSED_MLP = Layout("mlp", _FUSED_EXPERTS)  # fused experts under mlp., as published
# linear attention's forget-gate tensors, kept by transformers in a module of their own (Bailing, Kimi)
_FORGET_GATE = tuple((f"self_attn.{t}", f"self_attn.forget_gate.{t}") for t in ("dt_bias", "A_log"))
# Kimi Delta Attention's forget gate (Kimi Linear, GLM-5-Next): two projections beside those tensors
_KDA_FORGET_GATE = (
    ("self_attn.f_a_proj.", "self_attn.forget_gate.f_a_proj."),
    ("self_attn.f_b_proj.", "self_attn.forget_gate.f_b_proj."),
    *_FORGET_GATE,
)
# linear attention's three short convolutions, one tensor in transformers (Bailing, Kimi Linear, GLM-5-Next)
_CONV_QKV = Pieces("self_attn.conv1d.weight", tuple(f"self_attn.{p}_conv1d.weight" for p in "qkv"))

_QWEN_STYLE = dict(block="mlp", sources=_per_expert("gate_proj", "up_proj", "down_proj"), router="gate")
_QWEN_FUSED = dict(_QWEN_STYLE, sources=_FUSED_EXPERTS)  # the same with the experts fused, as saved
# deepseek's first layer is dense, so its tiny model's 3 layers give 2 MoE layers, as the others have
_DEEPSEEK = dict(_QWEN_STYLE, dense_first=_DEEPSEEK_DENSE_FIRST, tiny=Tiny(layers=3, experts=6))
# Granite-MoE's fused ``input_linear`` / ``output_linear`` experts, its router under ``router.layer``
_GRANITE = dict(
    block="block_sparse_moe",
    sources={
        "gate_up_proj": (Source("{block}.input_linear.weight", fused=True),),
        "down_proj": (Source("{block}.output_linear.weight", fused=True),),
    },
    renames=(("block_sparse_moe.router.layer.weight", "block_sparse_moe.router.weight"),),
    router="router",
)

# Hy-V4's fused experts and the names its checkpoints give its hyper-connections and attention sinks
_HY_V4 = dict(
    _DEEPSEEK,
    sources=_FUSED_EXPERTS,
    renames=(
        (".hc_pre.hc_", ".hc_"),
        (".learnable_sink_param", ".sinks"),
        (".linear_gate", ".gate_proj"),
        *(
            (f".hc_{a}_layer.hc_{p}", f".{b}_hc.{p}")
            for a, b in (("attn", "attn"), ("mlp", "ffn"))
            for p in ("fn", "base", "scale")
        ),
        *((f".hc_head_{p}", f".hc_{p}") for p in ("fn", "base", "scale")),
    ),
)

FAMILIES: dict[str, Family] = {  # keyed by config.json's model_type
    "mixtral": Family(
        name="mixtral",
        block="block_sparse_moe",
        sources=_per_expert("w1", "w3", "w2"),
        renames=((".block_sparse_moe.", ".mlp."),),
        router="gate",
        config=_local_experts,
        tiny=Tiny(layers=2, experts=8),
    ),
    "qwen2_moe": Family(name="qwen2_moe", **_QWEN_STYLE, config=_qwen2_moe, tiny=Tiny(layers=2, experts=6)),
    "qwen3_moe": Family(name="qwen3_moe", **_QWEN_STYLE, config=_qwen3_moe, tiny=Tiny(layers=2, experts=6)),
    "olmoe": Family(name="olmoe", **_QWEN_STYLE, config=_num_experts, tiny=Tiny(layers=2, experts=6)),
    "deepseek_v2": Family(name="deepseek_v2", **_DEEPSEEK, config=_deepseek_v2),
    "deepseek_v3": Family(name="deepseek_v3", **_DEEPSEEK, config=_deepseek_v3),
    "gpt_oss": Family(
        name="gpt_oss",
        block="mlp",
        sources={
            name: (Source("{block}.experts." + name, fused=True),)
            for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
        },
        router="router",
        config=_gpt_oss,
        tiny=Tiny(layers=2, experts=8),
    ),
    "granitemoe": Family(
        name="granitemoe",
        **_GRANITE,
        config=_local_experts,
        tiny=Tiny(layers=2, experts=6),
    ),
    "ernie4_5_moe": Family(
        name="ernie4_5_moe",
        **_QWEN_STYLE,
        renames=((".mlp.moe_statics.", ".mlp.gate.moe_statics."),),
        config=_ernie4_5_moe,
        tiny=Tiny(layers=2, experts=6),
    ),
    "glm4_moe": Family(name="glm4_moe", **_DEEPSEEK, config=_glm4_moe),
    "hunyuan_v1_moe": Family(
        name="hunyuan_v1_moe", **_QWEN_STYLE, config=_hunyuan_v1_moe, tiny=Tiny(layers=2, experts=6)
    ),
    "dots1": Family(name="dots1", **_DEEPSEEK, config=_dots1),
    "phimoe": Family(
        name="phimoe",
        block="block_sparse_moe",
        sources=_per_expert("w1", "w3", "w2"),
        renames=((".block_sparse_moe.gate.", ".mlp.router."), (".block_sparse_moe.", ".mlp.")),
        router="router",
        config=_local_experts,
        tiny=Tiny(layers=2, experts=6),
    ),
    "minimax": Family(
        name="minimax",
        block="block_sparse_moe",
        sources=_per_expert("w1", "w3", "w2"),
        renames=((".block_sparse_moe.", ".mlp."),),
        router="gate",
        config=_gpt_oss,
        tiny=Tiny(layers=2, experts=6),
    ),
    "flex_olmo": Family(name="flex_olmo", **_QWEN_STYLE, config=_num_experts, tiny=Tiny(layers=2, experts=6)),
    "exaone_moe": Family(
        name="exaone_moe",
        **_DEEPSEEK,
        renames=((".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"),),
        config=_exaone_moe,
    ),
    "cohere2_moe": Family(
        name="cohere2_moe", **_QWEN_STYLE, config=_cohere2_moe, tiny=Tiny(layers=2, experts=6)
    ),
    "solar_open": Family(
        name="solar_open", **_QWEN_STYLE, config=_solar_open, tiny=Tiny(layers=2, experts=6)
    ),
    "granitemoeshared": Family(
        name="granitemoeshared",
        **_GRANITE,
        config=_granitemoeshared,
        tiny=Tiny(layers=2, experts=6),
    ),
    "deepseek_v32": Family(name="deepseek_v32", **_DEEPSEEK, config=_deepseek_v32),
    "glm4_moe_lite": Family(name="glm4_moe_lite", **_DEEPSEEK, config=_glm4_moe_lite),
    "afmoe": Family(
        name="afmoe", **dict(_DEEPSEEK, router="router"), router_inputs=("expert_bias",), config=_afmoe
    ),
    "lfm2_moe": Family(
        name="lfm2_moe",
        block="feed_forward",
        sources=_per_expert("w1", "w3", "w2"),
        router="gate",
        router_inputs=("expert_bias",),
        router_batched=False,
        config=_lfm2_moe,
        min_tiny=True,
        tiny=Tiny(layers=2, experts=6),
    ),
    "laguna": Family(
        name="laguna",
        **_DEEPSEEK,
        renames=(
            (".mlp.experts.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"),
            (".mlp.shared_expert.", ".mlp.shared_experts."),
        ),
        config=_laguna,
    ),
    "jamba": Family(
        name="jamba",
        **dict(_QWEN_STYLE, block="feed_forward", router="router"),
        config=_jamba,
        min_tiny=True,
        tiny=Tiny(layers=2, experts=6),
    ),
    "qwen3_next": Family(
        name="qwen3_next", **_QWEN_STYLE, config=_qwen3_next, min_tiny=True, tiny=Tiny(layers=4, experts=6)
    ),
    "granitemoe_swa": Family(
        name="granitemoe_swa",
        block="block_sparse_moe",
        sources=_FUSED_EXPERTS,
        router="router",
        config=_local_experts,
        tiny=Tiny(layers=2, experts=6),
    ),
    "minimax_m2": Family(
        name="minimax_m2",
        block="block_sparse_moe",
        sources=_per_expert("w1", "w3", "w2"),
        renames=((".block_sparse_moe.", ".mlp."),),
        router="gate",
        router_inputs=("e_score_correction_bias",),
        config=_minimax_m2,
        tiny=Tiny(layers=2, experts=6),
    ),
    "mimo_v2_flash": Family(
        name="mimo_v2_flash",
        **_DEEPSEEK,
        renames=(("self_attn.attention_sink_bias", "self_attn.sinks"),),
        config=_mimo_v2_flash,
    ),
    "flint": Family(
        name="flint",
        **_QWEN_STYLE,
        renames=(("self_attn.softmax_offset", "self_attn.sinks"),),
        config=_flint,
        tiny=Tiny(layers=2, experts=6),
    ),
    "kolibri1": Family(
        name="kolibri1",
        **_QWEN_STYLE,
        renames=(
            ("moe.router.expert_bias", "mlp.gate.e_score_correction_bias"),
            ("post_attn_norm", "post_self_attn_layernorm"),
            ("post_ffn_norm", "post_mlp_layernorm"),
        ),
        config=_kolibri1,
        tiny=Tiny(layers=2, experts=6),
    ),
    "hy_v3": Family(
        name="hy_v3",
        **_DEEPSEEK,
        renames=(
            ("mlp.router.gate.weight", "mlp.gate.weight"),
            ("mlp.expert_bias", "mlp.e_score_correction_bias"),
            ("mlp.shared_mlp.", "mlp.shared_experts."),
        ),
        router_inputs=("e_score_correction_bias",),
        config=_hy_v3,
    ),
    "glm_moe_dsa": Family(name="glm_moe_dsa", **_DEEPSEEK, config=_glm_moe_dsa),
    "axk1": Family(
        name="axk1",
        **_DEEPSEEK,
        renames=((".post_mlp_layernorm.", ".mlp.post_mlp_layernorm."),),
        config=_axk1,
    ),
    "granitemoehybrid": Family(
        name="granitemoehybrid",
        **_GRANITE,
        config=_granitemoehybrid,
        min_tiny=True,
        tiny=Tiny(layers=2, experts=6),
    ),
    "bailing_hybrid": Family(
        name="bailing_hybrid",
        **_DEEPSEEK,
        renames=(
            ("model.word_embeddings.", "model.embed_tokens."),
            (".attention.", ".self_attn."),
            ("self_attn.f_proj.", "self_attn.forget_gate.f_proj."),
            *_FORGET_GATE,
            (".self_attn.dense.", ".self_attn.o_proj."),
            (".mlp.gate.expert_bias", ".mlp.gate.e_score_correction_bias"),
        ),
        pieces=(_CONV_QKV,),
        config=_bailing_hybrid,
    ),
    "kimi_linear": Family(
        name="kimi_linear",
        **dict(_DEEPSEEK, block="block_sparse_moe", sources=_per_expert("w1", "w3", "w2")),
        renames=(*_KDA_FORGET_GATE, (".block_sparse_moe.", ".mlp.")),
        pieces=(_CONV_QKV,),
        config=_kimi_linear,
    ),
    "lara_mini": Family(
        name="lara_mini",
        **_QWEN_FUSED,
        renames=(("linear_attn.out_norm.", "linear_attn.norm."),),
        pieces=(
            Pieces(
                "linear_attn.in_proj.weight",
                tuple(f"linear_attn.in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")),
                stored="whole",
            ),
        ),
        config=_lara_mini,
        min_tiny=True,
        tiny=Tiny(layers=2, experts=6),
    ),
    "axk2": Family(
        name="axk2",
        **_DEEPSEEK,
        renames=(
            ("W_down", "mlp.fc1"),
            ("W_up", "mlp.fc2"),
            ("self_attn.q_b_proj.", "self_attn.q_gate_proj."),
        ),
        config=_axk2,
    ),
    "beam": Family(name="beam", **_DEEPSEEK, config=_beam),
    "hy_v4": Family(name="hy_v4", **_HY_V4, config=_hy_v4),
    "nemotron_h": Family(
        name="nemotron_h",
        block="mixer",
        sources={
            "up_proj": (Source("{block}.experts.{e}.up_proj.weight"),),
            "down_proj": (Source("{block}.experts.{e}.down_proj.weight"),),
        },
        root="backbone.",
        router="gate",
        config=_nemotron_h,
        dense_first=len(_NEMOTRON_FIRST),
        tiny=Tiny(layers=4, experts=6),
    ),
    "qwen3_5_moe_text": Family(
        name="qwen3_5_moe_text",
        **_QWEN_STYLE,
        layouts=(_FUSED_MLP,),  # the published Qwen3.5-MoE checkpoints'
        config=_qwen3_5_moe_text,
        tiny=Tiny(layers=2, experts=6),
    ),
    "gemma4_text": Family(
        name="gemma4_text",
        block="",
        sources=_FUSED_EXPERTS,
        router="router",
        config=_gemma4_text,
        tiny=Tiny(layers=2, experts=6),
    ),
    "minimax_m3_vl_text": Family(
        name="minimax_m3_vl_text",
        **_QWEN_FUSED,
        config=_minimax_m3_vl_text,
        tiny=Tiny(layers=2, experts=6),
    ),
    "dots3_note_text": Family(
        name="dots3_note_text", **_DEEPSEEK, layouts=(_FUSED_MLP,), config=_dots3_note_text
    ),
    "qwen3_vl_moe_text": Family(  # no causal-LM class in transformers: ``engine.causal`` makes one
        name="qwen3_vl_moe_text",
        **_QWEN_FUSED,
        transposed_ok=True,  # the published checkpoints' experts, [E, H, 2F] and [E, F, H]
        config=_qwen3_vl_moe_text,
        tiny=Tiny(layers=2, experts=6),
    ),
    "glm4v_moe_text": Family(  # no causal-LM class in transformers, as qwen3_vl_moe_text
        name="glm4v_moe_text",
        **_DEEPSEEK,
        layouts=(_FUSED_MLP,),  # its own class saves them fused (the image-text class one by one)
        config=_glm4v_moe_text,
    ),
    "hy_v4_vl_text": Family(  # no causal-LM class in transformers, as qwen3_vl_moe_text
        name="hy_v4_vl_text", **_HY_V4, config=_hy_v4_vl_text
    ),
    "glm5_next_text": Family(  # no causal-LM class in transformers, as qwen3_vl_moe_text
        name="glm5_next_text",
        **_DEEPSEEK,
        renames=(*_KDA_FORGET_GATE, (".hc_attn_", ".attn_hc."), (".hc_ffn_", ".ffn_hc.")),
        pieces=(_CONV_QKV,),
        config=_glm5_next_text,
    ),
    "muse_spark_text": Family(  # no causal-LM class in transformers, as qwen3_vl_moe_text
        name="muse_spark_text", **_QWEN_FUSED, config=_muse_spark_text, tiny=Tiny(layers=2, experts=6)
    ),
    "qwen4_exp_text": Family(
        name="qwen4_exp_text",
        **_QWEN_STYLE,
        layouts=(_FUSED_MLP,),
        config=_qwen4_exp_text,
        tiny=Tiny(layers=2, experts=6),
    ),
    "aria_text": Family(
        name="aria_text",
        block="mlp",
        sources={  # transposed ([E, H, 2F], [E, F, H]), gate and up concatenated, no biases
            "gate_up_proj": (Source("{block}.experts.fc1.weight", fused=True),),
            "down_proj": (Source("{block}.experts.fc2.weight", fused=True),),
        },
        router="router",
        config=_aria_text,
        tiny=Tiny(layers=2, experts=6),
    ),
    "inkling_text": Family(
        name="inkling_text",
        **_QWEN_FUSED,
        config=_inkling_text,
        tiny=Tiny(layers=2, experts=6),
    ),
    "mellum": Family(name="mellum", **_QWEN_STYLE, config=_mellum, tiny=Tiny(layers=2, experts=6)),
}


# transformers' MoE model types that do not run, each with why in a few words (docs/ENGINE.md says more)
_IMAGE_TEXT_NO_TEXT_CLASS = "an image-text (or audio) model whose text model transformers cannot build alone"
NOT_SUPPORTED: dict[str, str] = {
    # experts through ExpertsInterface
    "mistral4": "transformers maps it to no causal-LM class",
    "zaya": "its router carries state from layer to layer and routes to a skip expert",
    "deepseek_v4": "its tensor names need regular-expression renames, and its first layers route by token id",
    "inkling": "its config cannot be built with transformers' defaults (its text model inkling_text runs)",
    "inkling2": "its tensor names need regular-expression renames",
    "inkling2_loop": "it runs some layers several times a token",
    "minimax_m3_vl": "its image-text checkpoints lack the shared experts its text class has (its text model "
    "minimax_m3_vl_text runs)",
    "aria": "its image-text layout is not read yet (its text model aria_text runs)",
    "mistral_large4": "its checkpoints are in Mistral's own format, renamed and permuted by transformers",
    "deepseek_ocr2": _IMAGE_TEXT_NO_TEXT_CLASS,
    "diffusion_gemma": _IMAGE_TEXT_NO_TEXT_CLASS,
    "ernie4_5_vl_moe": _IMAGE_TEXT_NO_TEXT_CLASS,
    "qwen3_omni_moe": _IMAGE_TEXT_NO_TEXT_CLASS,
    "unlimited_ocr": _IMAGE_TEXT_NO_TEXT_CLASS,
    "openai_privacy_filter": "a token classifier, not a causal language model",
    # experts modules of their own (not ExpertsInterface)
    "llama4": "Llama 4's MoE block scales each token's input by its router score and runs every expert on "
    "every token, in a module of its own",
    "llama4_text": "Llama 4's MoE block scales each token's input by its router score and runs every expert "
    "on every token, in a module of its own",
    "dbrx": "its experts are one loop over a single [experts x width, hidden] tensor per projection, a "
    "module of its own",
    "jetmoe": "its attention is a mixture of experts too (JetMoE's MoA)",
    "longcat_flash": "it routes to zero-computation (identity) experts beside its own, in a module of its "
    "own",
    "doge": "its experts are a product-key memory of embeddings, not weight matrices",
    "step3p7": "image-text only, its experts a module of its own",
    "step3p5": "no causal-LM class in transformers, its experts a module of its own",
    "switch_transformers": "an encoder-decoder model, not a causal decoder",
    "nllb_moe": "an encoder-decoder model, not a causal decoder",
    "vitpose_backbone": "a vision backbone, not a language model",
}
# config attributes that say a model has routed experts (a config with none of them is a dense model's)
_EXPERT_COUNTS = (
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "moe_num_experts",
    "num_experts_per_tok",
)


def family_of(model_type: str) -> Family:
    """The family of a config's model_type, or a one-line error: why it does not run where that is known
    (``NOT_SUPPORTED``), that it is a dense model where transformers' default config of it has no experts,
    and the supported ones."""
    try:
        return FAMILIES[model_type]
    except KeyError:
        pass
    supported = (
        f"supported: {', '.join(sorted(FAMILIES))} (and image-text checkpoints whose text model is one)"
    )
    if model_type in NOT_SUPPORTED:
        raise ExpertcacheError(
            f"unsupported architecture {model_type!r}: {NOT_SUPPORTED[model_type]} (docs/ENGINE.md, families "
            f"not supported); {supported}"
        )
    for part in ("_text", "_thinker"):  # the text model of an image-text (or audio) family listed above
        parent = model_type.removesuffix(part)
        if parent != model_type and parent in NOT_SUPPORTED:
            why = _text_reason(model_type, parent)
            raise ExpertcacheError(
                f"unsupported architecture {model_type!r}, the text model of {parent}: {why} "
                f"(docs/ENGINE.md, families not supported); {supported}"
            )
    if _dense(model_type):
        raise ExpertcacheError(
            f"{model_type!r} is not a mixture-of-experts model (transformers' {model_type} has no routed "
            f"experts): expertcache offloads experts; {supported}"
        )
    hint = did_you_mean(repr(model_type), map(repr, [*FAMILIES, *NOT_SUPPORTED]), n=1)  # quoted as named
    raise ExpertcacheError(f"unsupported architecture {model_type!r}{hint}; {supported}")


def _text_reason(model_type: str, parent: str) -> str:
    """Why the text model of ``parent`` (in ``NOT_SUPPORTED``) does not run: no causal-LM class for it in
    transformers, else its parent's reason (an image-text family's text model: the same checkpoints)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return "transformers maps it to no causal-LM class"
    return NOT_SUPPORTED[parent]


def _dense(model_type: str) -> bool:
    """transformers knows the model type and its default config names no experts."""
    try:
        from transformers import AutoConfig

        config = AutoConfig.for_model(model_type)
    except Exception:  # unknown to this transformers, or a config that needs arguments: not known dense
        return False
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return not any(getattr(c, name, None) for c in (config, text) for name in _EXPERT_COUNTS)
