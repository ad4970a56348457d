"""The key-value cache grown in place (``engine.kv``).

- ``GrowingLayer`` holds what transformers' ``DynamicLayer`` holds after any sequence of updates, crops,
  batch selections and resets, and returns it; its buffer is copied only when it fills.
- The engine converts a generation's cache on a CPU, and its tokens and logits stay bit-identical to
  transformers' (whose cache concatenates), with the buffer refilled at every few tokens too.
"""

from __future__ import annotations

import engine_fixtures
import pytest
import torch
from engine_fixtures import assert_exact, engine_load, greedy
from transformers.cache_utils import DynamicLayer

from expertcache.engine import kv
from expertcache.engine.kv import GrowingLayer

IDS = torch.tensor([engine_fixtures.PROMPT])
_one_torch_thread = engine_fixtures._one_torch_thread
ckpt = engine_fixtures.ckpt
make_ckpt = engine_fixtures.make_ckpt
tokenizer_dir = engine_fixtures.tokenizer_dir


def _states(tokens: int, seed: int, heads: int = 3, dim: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(2, heads, tokens, dim, generator=g).to(torch.bfloat16)
    return k, torch.randn(2, heads, tokens, dim + 2, generator=g).to(torch.bfloat16)  # values wider (MLA)


def test_a_growing_layer_holds_and_returns_what_a_dynamic_layer_does():
    plain, growing = DynamicLayer(), GrowingLayer()
    steps = [7, 1, 1, 300, 1, "crop", 1, 250, "select", 1, "reset", 3, 1]
    for i, step in enumerate(steps):
        if step == "crop":
            plain.crop(-5), growing.crop(-5)
        elif step == "select":
            idx = torch.tensor([1])
            plain.batch_select_indices(idx), growing.batch_select_indices(idx)
        elif step == "reset":
            plain.reset(), growing.reset()
        else:
            k, v = _states(step, i)
            if plain.is_initialized and plain.keys.shape[0] == 1:
                k, v = k[:1], v[:1]
            want, got = plain.update(k, v), growing.update(k, v)
            for w, g in zip(want, got, strict=True):
                assert g.shape == w.shape and g.dtype == w.dtype and torch.equal(g, w), step
        assert growing.get_seq_length() == plain.get_seq_length(), step
        if step == "reset":
            assert growing._key_room is None and growing._value_room is None  # the memory freed


def test_after_a_crop_the_next_rows_are_written_in_place():
    """The one difference seen from outside (docs/ENGINE.md): keys kept from before a crop change."""
    layer = GrowingLayer()
    layer.update(*_states(4, 0))
    kept, _ = layer.update(*_states(1, 1))
    before = kept.clone()
    layer.crop(-2)
    new, _ = _states(2, 2)
    keys, _ = layer.update(new, _states(2, 2)[1])
    assert torch.equal(keys[..., 3:, :], new) and torch.equal(kept[..., :3, :], before[..., :3, :])
    assert torch.equal(kept[..., 3:, :], new)  # written over in place


def test_a_step_writes_its_rows_in_place_until_the_room_fills():
    layer = GrowingLayer()
    layer.update(*_states(10, 0))
    room = layer._key_room
    assert room.shape[-2] == kv.ROOM_TOKENS
    for i in range(kv.ROOM_TOKENS - 10):
        keys, _ = layer.update(*_states(1, i + 1))
        assert layer._key_room is room and keys.data_ptr() == room.data_ptr()
    keys, _ = layer.update(*_states(1, 999))  # full: a larger buffer, the rows copied once
    assert layer._key_room is not room and keys.shape[-2] == kv.ROOM_TOKENS + 1
    assert layer._key_room.shape[-2] >= (kv.ROOM_TOKENS + 1) * 5 // 4


@pytest.mark.parametrize("family", ["granitemoe", "qwen3_moe", "deepseek_v3", "gpt_oss", "jamba"])
@pytest.mark.parametrize("attention", [None, "eager"])
def test_the_engine_grows_its_cache_in_place_with_the_same_bits(family, attention, ckpt, monkeypatch):
    """The room set to 3 tokens: a new buffer every few steps, prefill and decode alike."""
    from transformers import DynamicCache

    from expertcache.engine.loader import load_reference

    monkeypatch.setattr(kv, "ROOM_TOKENS", 3)
    path = ckpt(family)
    ref = load_reference(path, device="cpu", experts=engine_fixtures.REFERENCE, attention=attention)
    want = greedy(ref, IDS)
    seen = []
    grow = kv.grow

    def spy(cache):
        grow(cache)
        seen.extend(type(layer) for layer in getattr(cache, "layers", ()))

    monkeypatch.setattr("expertcache.engine.runtime.grow", spy)
    with engine_load(path, 2 * engine_fixtures.TOP_K, slow_tier="disk", attention=attention) as m:
        got = greedy(m, IDS)
        assert_exact(got, want)
        if engine_fixtures.DEVICE == "cpu":
            assert GrowingLayer in seen
            cache = DynamicCache(config=m.model.config)
            m(IDS, cache=cache, use_cache=True)
            assert any(type(layer) is GrowingLayer for layer in cache.layers)
