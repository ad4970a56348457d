"""Where each supported model family keeps its experts, in the checkpoint and in the model.

transformers 5.x holds a layer's experts in one ``...Experts`` module with fused tensors
(``gate_up_proj [E, 2F, H]``, ``down_proj [E, H, F]``; GPT-OSS transposed, with biases). Checkpoints
keep either one tensor per expert (``experts.{e}.gate_proj.weight``, Mixtral's ``w1/w2/w3``) or the
fused tensors (GPT-OSS, Granite-MoE's ``input_linear/output_linear``). A ``Family`` says, for each
slot tensor of one expert, which checkpoint tensors fill it (rows concatenated in order), and how
non-expert checkpoint keys are renamed to the model's parameter names.
"""

from __future__ import annotations

from dataclasses import dataclass

from expertcache.errors import ExpertcacheError


@dataclass(frozen=True)
class Source:
    """A checkpoint tensor feeding (part of) a slot tensor: ``{block}`` and ``{e}`` are filled in."""

    key: str
    fused: bool = False  # the tensor holds every expert along dim 0: read row e only


@dataclass(frozen=True)
class Family:
    name: str  # model_type in config.json
    block: str  # the MoE block's name in the checkpoint under model.layers.{l}
    sources: dict[str, tuple[Source, ...]]  # slot tensor name (the Experts parameter) -> its sources
    renames: tuple[tuple[str, str], ...] = ()  # checkpoint substring -> model substring (non-expert keys)

    def expert_keys(self, prefix: str, expert: int) -> dict[str, list[tuple[str, bool]]]:
        """Checkpoint keys of one expert, per slot tensor; ``prefix`` is ``model.layers.{l}``."""
        block = f"{prefix}.{self.block}"
        return {
            name: [(s.key.format(block=block, e=expert), s.fused) for s in srcs]
            for name, srcs in self.sources.items()
        }

    def rename(self, key: str) -> str:
        for old, new in self.renames:
            key = key.replace(old, new)
        return key


def _per_expert(block: str, gate: str, up: str, down: str, renames=()) -> dict[str, object]:
    k = "{block}.experts.{e}.%s.weight"
    return dict(
        block=block,
        sources={
            "gate_up_proj": (Source(k % gate), Source(k % up)),
            "down_proj": (Source(k % down),),
        },
        renames=renames,
    )


_QWEN_STYLE = _per_expert("mlp", "gate_proj", "up_proj", "down_proj")

FAMILIES: dict[str, Family] = {
    "mixtral": Family(
        "mixtral", **_per_expert("block_sparse_moe", "w1", "w3", "w2", ((".block_sparse_moe.", ".mlp."),))
    ),
    "qwen2_moe": Family("qwen2_moe", **_QWEN_STYLE),
    "qwen3_moe": Family("qwen3_moe", **_QWEN_STYLE),
    "olmoe": Family("olmoe", **_QWEN_STYLE),
    "deepseek_v2": Family("deepseek_v2", **_QWEN_STYLE),
    "deepseek_v3": Family("deepseek_v3", **_QWEN_STYLE),
    "gpt_oss": Family(
        "gpt_oss",
        block="mlp",
        sources={
            name: (Source("{block}.experts." + name, fused=True),)
            for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
        },
    ),
    "granitemoe": Family(
        "granitemoe",
        block="block_sparse_moe",
        sources={
            "gate_up_proj": (Source("{block}.input_linear.weight", fused=True),),
            "down_proj": (Source("{block}.output_linear.weight", fused=True),),
        },
        renames=(("block_sparse_moe.router.layer.weight", "block_sparse_moe.router.weight"),),
    ),
}


def family_of(model_type: str) -> Family:
    """The family of a config's model_type, or a one-line error listing the supported ones."""
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise ExpertcacheError(
            f"unsupported architecture {model_type!r}; supported: {', '.join(sorted(FAMILIES))}"
        ) from None
