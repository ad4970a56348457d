"""A model family is one record (``engine.families.Family``): complete, and all a family needs to run.

- Every registered record has every field, and its parts fit together (sources filled in per expert, a
  router, a random config, a tiny shape); a record that leaves out a required field cannot be made.
- Every family's tiny model, built from its record, has the record's MoE layers, experts and routers,
  and runs through the engine with ``next-gate`` prefetching (which calls the routers the record names)
  at the minimum budget: tokens and logits identical to transformers' run of the same checkpoint.
"""

from __future__ import annotations

import dataclasses

import engine_fixtures
import pytest
import torch
from engine_fixtures import FAMILIES, TOP_K, assert_exact, engine_load, greedy, moe_layers

from expertcache.engine.families import FAMILIES as RECORDS
from expertcache.engine.families import Family, Shape, Tiny

IDS = torch.tensor([engine_fixtures.PROMPT])
_one_torch_thread = engine_fixtures._one_torch_thread
ckpt = engine_fixtures.ckpt
make_ckpt = engine_fixtures.make_ckpt
reference = engine_fixtures.reference
tokenizer_dir = engine_fixtures.tokenizer_dir

REQUIRED = [f.name for f in dataclasses.fields(Family) if f.default is dataclasses.MISSING]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_record_is_complete(family):
    rec = RECORDS[family]
    assert rec.name == family  # the key is config.json's model_type
    assert rec.block and rec.router
    assert {"gate_up_proj", "down_proj"} <= set(rec.sources)
    for sources in rec.sources.values():
        assert sources and all("{block}" in s.key and (s.fused or "{e}" in s.key) for s in sources)
    keys = rec.expert_keys("model.layers.1", 3)
    assert all(
        k.startswith(f"model.layers.1.{rec.block}.") and "{" not in k for ks in keys.values() for k, _ in ks
    )
    assert all(old and new and old != new for old, new in rec.renames)
    config = rec.config(
        Shape(experts=6, top_k=TOP_K, intermediate=32, hidden=32, heads=4, layers=rec.tiny.layers)
    )
    assert config and 6 in config.values() and TOP_K in config.values()
    assert isinstance(rec.tiny, Tiny) and rec.tiny.layers > rec.dense_first >= 0 and rec.tiny.experts > TOP_K


@pytest.mark.parametrize("field", REQUIRED)
def test_a_record_without_a_required_field_cannot_be_made(field):
    rec = RECORDS["mixtral"]
    given = {f.name: getattr(rec, f.name) for f in dataclasses.fields(Family) if f.name != field}
    with pytest.raises(TypeError, match=field):
        Family(**given)
    assert {"router", "config", "tiny", "sources"} <= set(REQUIRED)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_runs_from_its_record_with_next_gate_at_the_minimum_budget(family, ckpt, reference):
    from expertcache.engine.offloaded import model_info
    from expertcache.engine.routing import moe_routers

    path = ckpt(family)
    rec = RECORDS[family]
    info = model_info(path)
    assert info["family"] == family and info["top_k"] == TOP_K
    assert info["moe_layers"] == moe_layers(family) == rec.tiny.layers - rec.dense_first
    assert info["experts_per_layer"] == rec.tiny.experts
    want = reference(path, IDS)
    low = moe_layers(family) * TOP_K
    with engine_load(path, low, "lru-dist", prefetch="next-gate", link_latency="50us") as model:
        assert len(moe_routers(model.model)) == moe_layers(family)
        got = greedy(model, IDS)
        stats = model.stats
    assert_exact(got, want)
    assert stats["prefetch_issued"] > 0
