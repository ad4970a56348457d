"""The causal language model of a config: transformers' own class, or a text model with an output head.

The engine runs a checkpoint as transformers' causal-LM class for its config (``AutoModelForCausalLM``).
Several image-text families have a text model (``Qwen3VLMoeTextModel``) and no causal-LM class for it:
transformers computes their text only inside the image-text class, which adds a vision tower. For those
``causal_lm_class`` makes one: the text model under ``model.``, an output head ``lm_head`` (tied to the
embeddings where the config ties them), and logits for the last ``logits_to_keep`` positions; the
decoder layers, routers and experts are transformers' own modules. On text alone it computes what the
image-text class computes (its text-only positions are the text model's defaults): the tests check
tokens and logits against ``AutoModelForImageTextToText``'s run of the same checkpoint.

``reference_class`` is the class transformers itself loads a checkpoint with (the exactness oracle).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import torch


def causal_lm_class(config) -> type:
    """A class with ``from_config`` and ``from_pretrained`` for ``config`` (a text model's):
    ``AutoModelForCausalLM`` where transformers has a causal-LM class for it, else ``text_lm_class``'s; a
    one-line error where neither exists."""
    from transformers import AutoModelForCausalLM

    from expertcache.errors import ExpertcacheError

    kind = type(config)
    if kind in AutoModelForCausalLM._model_mapping:
        return AutoModelForCausalLM
    try:
        return text_lm_class(kind)
    except KeyError:
        raise ExpertcacheError(
            f"{config.model_type}: transformers has neither a causal-LM class nor a text model for it"
        ) from None


@functools.cache
def text_lm_class(kind: type) -> type:
    """The causal-LM class made for the text model transformers maps the config class ``kind`` to
    (``AutoModel``); KeyError where it maps none. Made once per config class: its models share a class."""
    from transformers import AutoModel, GenerationMixin, PreTrainedModel
    from transformers.modeling_outputs import CausalLMOutputWithPast

    fields = {f.name for f in dataclasses.fields(CausalLMOutputWithPast)}  # the cache, hidden states ...

    text_model = AutoModel._model_mapping[kind]
    # the cache's name in the text model's forward: ``cache`` (transformers 5.24 on), ``past_key_values``
    cache_name = "cache" if "cache" in inspect.signature(text_model.forward).parameters else "past_key_values"
    pretrained = next(
        c for c in text_model.__mro__[1:] if issubclass(c, PreTrainedModel) and c is not PreTrainedModel
    )

    class TextForCausalLM(pretrained, GenerationMixin):
        config_class = kind
        base_model_prefix = "model"
        _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
        # transformers decides whether a class's experts implementation can be set by looking for the
        # decorator in the class's module source; this module has none, the text model's experts have it
        _can_set_experts_implementation_cached_value = True

        def __init__(self, config) -> None:
            super().__init__(config)
            self.model = text_model(config)
            self.vocab_size = config.vocab_size
            self.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            self.post_init()

        @classmethod
        def from_config(cls, config, **kwargs):  # as ``AutoModelForCausalLM.from_config`` is called
            return cls._from_config(config, **kwargs)

        def get_input_embeddings(self):
            return self.model.get_input_embeddings()

        def set_input_embeddings(self, value) -> None:
            self.model.set_input_embeddings(value)

        def forward(
            self, input_ids=None, cache=None, labels=None, logits_to_keep=0, **kwargs
        ) -> CausalLMOutputWithPast:
            """The text model on everything it is given (mask, positions, the cache under the name its
            forward takes, ...), then the head on the last ``logits_to_keep`` positions (0: all), and with
            ``labels`` the causal-LM loss, as transformers' causal-LM classes do."""
            if cache is not None:
                kwargs[cache_name] = cache
            out = self.model(input_ids=input_ids, **kwargs)
            hidden = out.last_hidden_state
            keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
            logits = _head_scaling(self.lm_head(hidden[:, keep, :]), self.config)
            loss = None if labels is None else self.loss_function(logits, labels, self.vocab_size, **kwargs)
            rest = {k: v for k, v in out.items() if k in fields and k not in ("logits", "loss")}
            return CausalLMOutputWithPast(loss=loss, logits=logits, **rest)

    name = text_model.__name__.removesuffix("Model") + "ForCausalLM"
    TextForCausalLM.__name__ = TextForCausalLM.__qualname__ = name
    return TextForCausalLM


def reference_class(config) -> type:
    """The class transformers loads a checkpoint of ``config`` (its own, outer config) with: its causal-LM
    class, else its image-text class (text in, text out), else ``causal_lm_class`` of its text model."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    kind = type(config)
    if kind in AutoModelForCausalLM._model_mapping:
        return AutoModelForCausalLM
    if kind in AutoModelForImageTextToText._model_mapping:
        return AutoModelForImageTextToText
    return causal_lm_class(config.get_text_config())


def _head_scaling(logits: torch.Tensor, config) -> torch.Tensor:
    """The logits as the image-text class finishes them: Muse Spark's scale them by its text config's
    ``output_multiplier``, then caps them softly at ``final_logit_softcapping`` (``cap * tanh(x / cap)``)."""
    scale = getattr(config, "output_multiplier", None)
    if scale is not None:
        logits = logits * scale
    cap = getattr(config, "final_logit_softcapping", None)
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits
