"""A model family is one record (``engine.families.Family``): complete, and all a family needs to run.

- Every registered record has every field, and its parts fit together (sources filled in per expert, a
  router, a random config, a tiny shape); a record that leaves out a required field cannot be made.
- Every family's tiny model, built from its record, has the record's MoE layers, experts and routers,
  and runs through the engine with ``next-gate`` prefetching (which calls the routers the record names)
  at the minimum budget: tokens and logits identical to transformers' run of the same checkpoint.
- Every model of the installed transformers whose experts go through ``ExpertsInterface`` either runs
  (its own record, or its text model's) or is listed in docs/ENGINE.md with the reason it cannot.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

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
ENGINE_MD = Path(__file__).resolve().parents[1] / "docs" / "ENGINE.md"


def _transformers_models(chosen) -> dict[str, set[str]]:
    """transformers' model folders whose modeling files' texts ``chosen`` takes -> the model types their
    configs declare."""
    import transformers

    out = {}
    for folder in sorted((Path(transformers.__file__).parent / "models").iterdir()):
        if chosen([m.read_text() for m in folder.glob("modeling_*.py")]):
            types = set()
            for config in folder.glob("configuration_*.py"):
                types |= set(re.findall(r'^\s+model_type\s*=\s*"([^"]+)"', config.read_text(), re.M))
            out[folder.name] = types
    return out


def _through_interface(texts: list[str]) -> bool:
    """An ``...Experts`` module dispatched through ``ExpertsInterface`` (``@use_experts_implementation``)."""
    return any("@use_experts_implementation" in t for t in texts)


def _transformers_models_with_experts() -> dict[str, set[str]]:
    return _transformers_models(_through_interface)


def test_every_transformers_model_with_an_experts_module_runs_or_is_listed_with_why():
    """A transformers model runs if its own model type or its text model's has a record; the others are
    rows of ENGINE.md's table of those not supported, each with its reason. The section's counts are the
    installed transformers' when its version is the one the section names."""
    import transformers

    models = _transformers_models_with_experts()
    text = ENGINE_MD.read_text()
    head = re.search(r"^### Families of transformers (\S+) with an experts module not supported", text, re.M)
    assert head, "ENGINE.md lost its section of the families not supported"
    section = text[head.end() : text.index("\n### ", head.end())]  # the next section: MoE of their own
    rows = [line.split("|")[1].split("(")[0] for line in section.splitlines() if line.startswith("| `")]
    listed = {name for row in rows for name in re.findall(r"`([a-z0-9_]+)`", row)}  # not the notes
    running = {folder for folder, types in models.items() if types & set(RECORDS)}
    missing = sorted(set(models) - running - listed)
    why = "add a record, or a row saying why not"
    assert not missing, f"transformers {transformers.__version__}: {why}: {missing}"
    assert listed <= {t for types in models.values() for t in types} | set(models), listed - set(models)
    assert not (listed & set(RECORDS)), "a family that runs is listed as not supported"
    if transformers.__version__.startswith(head.group(1) + "."):
        line = f"transformers {head.group(1)} has {len(models)} model types"
        assert line in " ".join(section.split()), line
        assert f"The other {len(set(models) - running) + len(listed & running)}:" in section


def _transformers_moe_of_their_own() -> dict[str, set[str]]:
    """Folders whose modeling code defines a mixture-of-experts module of its own (a class named
    ...Experts, ...Moe, ...MoE or ...SparseMoe...) without ``ExpertsInterface``."""
    moe = re.compile(r"^class \w*(Experts|SparseMoe|MoE|Moe)\w*\(", re.M)
    return _transformers_models(lambda texts: any(map(moe.search, texts)) and not _through_interface(texts))


def test_every_moe_model_of_its_own_is_listed_with_why_and_refused_so():
    from expertcache.engine.families import NOT_SUPPORTED, family_of
    from expertcache.errors import ExpertcacheError

    text = ENGINE_MD.read_text()
    head = text.index("### MoE families of transformers")
    section = text[head : text.index("\n## ", head)]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    listed = {name for row in rows for name in re.findall(r"`([a-z0-9_]+)`", row)}
    models = _transformers_moe_of_their_own()
    missing = sorted(f for f, types in models.items() if not ({f} | types) & listed)
    assert not missing, f"list in ENGINE.md with why: {missing}"
    assert not (listed & set(RECORDS))
    other = text[text.index("### Families of transformers") : head]  # the ExpertsInterface ones' table
    listed |= {n for line in other.splitlines() if line.startswith("| `")
               for n in re.findall(r"`([a-z0-9_]+)`", line.split("|")[1].split("(")[0])}  # fmt: skip
    assert listed == set(NOT_SUPPORTED), listed ^ set(NOT_SUPPORTED)  # each refused with its reason
    for model_type, why in NOT_SUPPORTED.items():
        with pytest.raises(ExpertcacheError, match=f"^unsupported architecture '{model_type}': "):
            family_of(model_type)
        assert why and "\n" not in why


def test_the_text_model_of_a_family_not_supported_is_refused_with_a_reason():
    """Each text (or thinker) model transformers names for a family of ``NOT_SUPPORTED`` got a bare
    "unsupported architecture" with a did-you-mean of its parent, itself refused, or for diffusion_gemma_text
    "not a mixture-of-experts model" (its default config has no experts; a checkpoint's has): a new user's
    trial. Each now gives its parent and a reason: no causal-LM class, else its parent's."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from expertcache.engine.families import FAMILIES as RUNS
    from expertcache.engine.families import NOT_SUPPORTED, family_of
    from expertcache.errors import ExpertcacheError

    texts = {
        t: p
        for t in CONFIG_MAPPING_NAMES
        for p in (t.removesuffix("_text"), t.removesuffix("_thinker"))
        if p != t and p in NOT_SUPPORTED and t not in RUNS and t not in NOT_SUPPORTED  # llama4_text: its own
    }
    assert {"diffusion_gemma_text", "qwen3_omni_moe_thinker", "inkling2_text"} <= set(texts), texts
    for model_type, parent in texts.items():
        why = (
            NOT_SUPPORTED[parent]
            if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
            else "transformers maps it to no causal-LM class"
        )
        with pytest.raises(ExpertcacheError) as err:
            family_of(model_type)
        assert str(err.value).startswith(
            f"unsupported architecture '{model_type}', the text model of {parent}: {why} (docs/ENGINE.md"
        ), err.value


@pytest.mark.parametrize("family", FAMILIES)
def test_every_record_is_complete(family):
    rec = RECORDS[family]
    assert rec.name == family  # the key is config.json's model_type
    assert rec.router and (rec.block or family == "gemma4_text")  # Gemma 4's experts: the decoder layer's
    first = {"gate_up_proj", "up_proj"} & set(rec.sources)  # up alone: experts without a gate (Nemotron-H)
    assert "down_proj" in rec.sources and len(first) == 1
    for sources in rec.sources.values():
        assert sources and all("{block}" in s.key and (s.fused or "{e}" in s.key) for s in sources)
    keys = rec.expert_keys("model.layers.1", 3)
    # the checkpoint's names (Nemotron-H's under backbone.; Gemma 4's experts directly in the layer)
    block = f"{rec.root}layers.1." + (f"{rec.block}." if rec.block else "")
    assert all(k.startswith(block) and "{" not in k for ks in keys.values() for k, _ in ks)
    assert all(old and new and old != new for old, new in rec.renames)
    config = rec.config(
        Shape(experts=6, top_k=TOP_K, intermediate=32, hidden=32, heads=4, layers=rec.tiny.layers)
    )
    assert config and 6 in config.values() and TOP_K in config.values()
    assert isinstance(rec.tiny, Tiny) and rec.tiny.layers > rec.dense_first >= 0 and rec.tiny.experts > TOP_K


def test_the_cross_products_run_one_family_of_each_layout_router_and_layer_numbering():
    """``engine_fixtures.PATH_FAMILIES``: a family left out of the miss-path, tier and copy-plan cross
    products stores and routes its experts as the family that stands for it, whose MoE layers are
    numbered alike; the families that differ in any of these stand for themselves."""
    from engine_fixtures import PATH_FAMILIES, REPRESENTS, path_signature

    def kinds(rec):
        return {name: tuple(src.fused for src in srcs) for name, srcs in rec.sources.items()}

    assert set(REPRESENTS) == set(FAMILIES) and set(REPRESENTS.values()) == set(PATH_FAMILIES)
    for family, stands in REPRESENTS.items():
        a, b = RECORDS[family], RECORDS[stands]
        assert kinds(a) == kinds(b) and (a.router, a.router_inputs) == (b.router, b.router_inputs), family
        assert (a.dense_first > 0) == (b.dense_first > 0) and a.transposed_ok == b.transposed_ok, family
    # each of these differs from every other family in what a miss path sees: each runs itself
    apart = ["mixtral", "deepseek_v3", "gpt_oss", "granitemoe", "phimoe", "afmoe", "lfm2_moe", "nemotron_h"]
    apart += ["gemma4_text", "qwen3_vl_moe_text", "muse_spark_text"]
    assert len({REPRESENTS[f] for f in apart}) == len(apart)
    assert len({path_signature(f) for f in apart}) == len(apart)
    if os.environ.get("EXPERTCACHE_TEST_ALL_FAMILIES") != "1":
        assert len(PATH_FAMILIES) < len(FAMILIES) / 2  # what keeps the test command within its time


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


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_runs_saved_as_transformers_runs_it(family, ckpt, reference, tmp_path):
    """``save_pretrained(save_original_format=False)`` writes the experts as transformers 5 holds them
    (fused ``experts.gate_up_proj`` / ``down_proj`` under the block's name in the model, every name the
    model's): refused before ("checkpoint lacks expert tensor ...experts.0.gate_proj.weight")."""
    import shutil

    from safetensors import safe_open

    from expertcache.engine.loader import load_reference

    path = ckpt(family)
    saved = tmp_path / "saved"
    load_reference(path).save_pretrained(saved, save_original_format=False)
    for f in path.iterdir():  # the tokenizer's files beside it
        if not (saved / f.name).exists() and f.suffix != ".safetensors":
            shutil.copy(f, saved / f.name)
    keys = sum((list(safe_open(str(f), "pt").keys()) for f in saved.glob("*.safetensors")), [])
    assert not any(re.search(r"\.experts\.0\.", k) for k in keys)  # fused: not one by one
    with engine_load(saved, moe_layers(family) * TOP_K, "lru") as model:
        got = greedy(model, IDS)
    assert_exact(got, reference(path, IDS))


# -- what some families need beyond a record's names -------------------------------------------------------
def _every_kernel(path, capacity: int, compiled: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine on a CPU in each kernel at ``capacity`` experts: eager and grouped bit-exact against
    transformers' eager and grouped_mm, the compiled kernel (not bit-equal to any; ``compiled``: where it
    runs) with the grouped kernel's tokens; returns the grouped_mm reference run."""
    from expertcache.engine.loader import load_reference

    runs = {}
    for kernel, experts in (("eager", "eager"), ("grouped", "grouped_mm")):
        runs[kernel] = greedy(load_reference(path, experts=experts), IDS)
        with engine_load(path, capacity, "lru", kernel=kernel, device="cpu") as model:
            assert_exact(greedy(model, IDS), runs[kernel])
    if compiled:
        with engine_load(path, capacity, "lru", kernel="compiled", device="cpu") as model:
            assert greedy(model, IDS)[0].tolist() == runs["grouped"][0].tolist()
    return runs["grouped"]


def test_a_familys_own_gate_is_applied_by_every_kernel(make_ckpt, tmp_path):
    """Hunyuan-V4 clamps its experts' gate and up products (``swiglu_limit``, its ``_apply_gate``): with a
    limit small enough to bite, every kernel gives transformers' output, which differs from the unclamped
    model's."""
    from expertcache.engine.loader import load_reference

    src = make_ckpt("hy_v4")
    tight = engine_fixtures.with_config(src, tmp_path / "tight", swiglu_limit=0.02)
    want = _every_kernel(tight, moe_layers("hy_v4") * TOP_K)
    assert not torch.equal(want[1], greedy(load_reference(src, experts="grouped_mm"), IDS)[1])


def test_experts_without_a_gate_run_in_every_kernel_and_are_refused_packed_in_one_line(
    ckpt, tmp_path, capsys
):
    """Nemotron-H's experts are ``down(relu2(up x))``, no gate: exact in each kernel; packing them (the
    packed and low-precision formats hold a gate projection) is refused before any work."""
    from expertcache.cli import main

    path = ckpt("nemotron_h")
    _every_kernel(path, moe_layers("nemotron_h") * TOP_K)
    capsys.readouterr()  # transformers' progress bars
    for extra in (
        ["--bits", "8", "--checkpoint", str(tmp_path / "q")],
        ["--format", "fp8", "--checkpoint", str(tmp_path / "f8")],
        ["--bits", "8", "--out", str(tmp_path / "copies")],
    ):
        assert main(["quantize", str(path), *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert "need a gate projection" in err and "up_proj" in err and "\n" not in err
    assert not any((tmp_path / d).exists() for d in ("q", "f8", "copies"))  # refused before writing


def test_transposed_experts_without_biases_run_in_every_path(ckpt, reference, tmp_path):
    """Aria's experts are transposed like GPT-OSS's ([E, H, 2F]) but with gate and up concatenated and no
    biases: exact in the eager and grouped kernels (split experts: ``tests/test_miss.py``, every family),
    and its int8 checkpoint within int8's rounding of the full model (the packed kernels' transposed path
    without biases)."""
    from expertcache.cli import main

    path = ckpt("aria_text")
    low = moe_layers("aria_text") * TOP_K
    want = _every_kernel(path, low, compiled=False)  # (the compiled kernel reads [out, in] matrices only)
    assert main(["quantize", str(path), "--bits", "8", "--checkpoint", str(tmp_path / "int8")]) == 0
    with engine_load(tmp_path / "int8", low, "lru") as model:
        got = greedy(model, IDS)
    assert got[0].tolist() == want[0].tolist()
    assert torch.allclose(got[1], want[1], atol=0.05), (got[1] - want[1]).abs().max()


def _rewrite(src, dst, change):
    """A copy of checkpoint ``src`` at ``dst`` whose tensors ``change(dict)`` edits in place."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        tensors = load_file(f)
        change(tensors)
        save_file(tensors, f, metadata={"format": "pt"})
    return dst


def test_dense_tensors_kept_in_pieces_are_checked_in_one_line(make_ckpt, tmp_path):
    """Bailing's linear attention stores three convolutions that transformers joins (a missing one: the
    joined tensor is named as lacking); Lara's stores one projection that transformers cuts in four (rows
    that do not add up: named with both counts)."""
    from expertcache.engine import load
    from expertcache.errors import ExpertcacheError

    def drop_k(t):
        del t["model.layers.0.attention.k_conv1d.weight"]

    def shorten(t):
        key = "model.layers.0.linear_attn.in_proj.weight"
        t[key] = t[key][:-1].clone()

    bailing = _rewrite(make_ckpt("bailing_hybrid"), tmp_path / "bailing", drop_k)
    with pytest.raises(ExpertcacheError, match=r"lacks tensor model\.layers\.0\.self_attn\.conv1d\.weight"):
        load(bailing, progress=False)
    lara = _rewrite(make_ckpt("lara_mini"), tmp_path / "lara", shorten)
    with pytest.raises(ExpertcacheError, match=r"in_proj\.weight has \d+ rows, not the \d+ of .*in_proj_qkv"):
        load(lara, progress=False)


def test_an_image_text_checkpoint_runs_its_text_model(tokenizer_dir, reference, tmp_path):
    """Qwen3.5-MoE is published as an image-text model (``model_type`` qwen3_5_moe, a vision tower beside
    the language model under ``model.language_model.``): the engine runs its text model, exact against
    transformers' causal-LM class of the same checkpoint; an image-text model whose text model is not a
    supported family is refused in one line naming both."""
    import json
    import shutil

    from transformers import AutoConfig, AutoModelForImageTextToText

    from expertcache.engine import load
    from expertcache.engine.offloaded import model_info
    from expertcache.errors import ExpertcacheError

    text_family = RECORDS["qwen3_5_moe_text"]
    shape = Shape(experts=6, top_k=TOP_K, intermediate=32, hidden=32, heads=4, layers=2)
    text = {
        **dict(
            vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4
        ),
        **dict(pad_token_id=0, bos_token_id=0, eos_token_id=0),
        **text_family.config(shape),
    }
    vision = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=32)
    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen3_5_moe", text_config=text, vision_config=vision)
    path = tmp_path / "vl"
    AutoModelForImageTextToText.from_config(config).save_pretrained(str(path))
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, path / f.name)
    assert json.loads((path / "config.json").read_text())["model_type"] == "qwen3_5_moe"

    info = model_info(path)
    assert info["family"] == "qwen3_5_moe_text" and info["moe_layers"] == 2 and info["top_k"] == TOP_K
    with engine_load(path, 2 * TOP_K, "lru-dist", prefetch="next-gate", link_latency="50us") as model:
        got = greedy(model, IDS)
        assert model.stats["misses"] > 0 and model.stats["prefetch_issued"] > 0
    assert_exact(got, reference(path, IDS))

    # the published checkpoints' layout: each layer's experts fused (transformers saves them one by one)
    fused = tmp_path / "fused"
    shutil.copytree(path, fused)

    def fuse(t):
        for layer in range(2):
            pre = f"model.language_model.layers.{layer}.mlp.experts"
            per = [{p: t.pop(f"{pre}.{e}.{p}_proj.weight") for p in ("gate", "up", "down")} for e in range(6)]
            t[f"{pre}.gate_up_proj"] = torch.stack([torch.cat([x["gate"], x["up"]]) for x in per])
            t[f"{pre}.down_proj"] = torch.stack([x["down"] for x in per])

    from safetensors.torch import load_file, save_file

    for f in fused.glob("*.safetensors"):
        tensors = load_file(f)
        fuse(tensors)
        save_file(tensors, f, metadata={"format": "pt"})
    with engine_load(fused, 2 * TOP_K, "lru") as model:
        assert_exact(greedy(model, IDS), reference(fused, IDS))

    # its text model alone (the text config), its tensors still under the image-text names
    alone = tmp_path / "alone"
    shutil.copytree(path, alone)
    full = json.loads((path / "config.json").read_text())
    (alone / "config.json").write_text(json.dumps({**full["text_config"], "dtype": full.get("dtype")}))
    with engine_load(alone, 2 * TOP_K, "lru") as model:
        assert_exact(greedy(model, IDS), reference(path, IDS))

    # its packed checkpoint keeps the packing at the top of the config: the text model reads it
    from expertcache.cli import main

    assert main(["quantize", str(path), "--bits", "8", "--checkpoint", str(tmp_path / "int8")]) == 0
    with engine_load(tmp_path / "int8", 2 * TOP_K, "lru") as model:
        assert (
            model.stats["expert_format"].startswith("int8") and greedy(model, IDS)[0].shape[1] > IDS.shape[1]
        )

    cfg = json.loads((path / "config.json").read_text())
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    cfg["model_type"] = "mistral_large4"  # its text model not supported, built as its own
    cfg["text_config"]["model_type"] = "qwen3_5_moe_text"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ExpertcacheError, match=r"^mistral_large4: its text model: unsupported architecture 'mistral_large4"
    ):
        load(bad, progress=False)
    cfg["model_type"] = "qwen3_5_moe"  # a text config without its model_type: the image-text model's own
    del cfg["text_config"]["model_type"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with engine_load(bad, 2 * TOP_K, "lru") as model:
        assert_exact(greedy(model, IDS), reference(path, IDS))


# image-text models whose text model transformers gives no causal-LM class (``engine.causal`` makes one):
# the outer model_type -> its text record and a tiny vision tower
_NO_CAUSAL_LM = {
    "qwen3_vl_moe": ("qwen3_vl_moe_text", dict(deepstack_visual_indexes=[], temporal_patch_size=1)),
    "glm4v_moe": ("glm4v_moe_text", dict(temporal_patch_size=1, image_size=16)),
    "hy_v4_vl": ("hy_v4_vl_text", dict(num_hidden_layers=1, num_attention_heads=2, max_image_size=16)),
    "glm5_next": (
        "glm5_next_text",
        dict(temporal_patch_size=1, image_size=16, projection_intermediate_size=32),
    ),
    "muse_spark": ("muse_spark_text", dict(num_hidden_layers=1, num_attention_heads=2)),
}
# the image-text config's own sizes, beside its text and vision configs (Muse Spark's audio tower)
_OUTER = {
    "muse_spark": dict(
        audio_config=dict(hidden_sizes=[8] * 4, depths=[1] * 4, out_hidden_size=32),
        out_hidden_size=32,
        projector_hidden_size=32,
    )
}


def _image_text_checkpoint(outer: str, tokenizer_dir, out, intermediate: int = 32):
    """A tiny image-text checkpoint of ``outer`` (``_NO_CAUSAL_LM``) as transformers saves it."""
    import shutil

    from transformers import AutoConfig, AutoModelForImageTextToText

    record, vision = _NO_CAUSAL_LM[outer]
    shape = Shape(experts=6, top_k=TOP_K, intermediate=intermediate, hidden=32, heads=4, layers=3)
    text = {
        **dict(vocab_size=300, hidden_size=32, num_hidden_layers=3, num_attention_heads=4),
        **dict(num_key_value_heads=2, pad_token_id=0, bos_token_id=0, eos_token_id=0),
        **RECORDS[record].config(shape),
    }
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32) | vision
    vision |= dict(patch_size=4, spatial_merge_size=1)
    torch.manual_seed(0)
    config = AutoConfig.for_model(outer, text_config=text, vision_config=vision, **_OUTER.get(outer, {}))
    AutoModelForImageTextToText.from_config(config).save_pretrained(str(out))
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, out / f.name)
    return config


@pytest.mark.parametrize("outer", sorted(_NO_CAUSAL_LM))
def test_an_image_text_model_whose_text_model_has_no_causal_lm_class_runs_its_text_model(
    outer, tokenizer_dir, reference, tmp_path
):
    """Qwen3-VL-MoE's and GLM-4.5V's text models have no causal-LM class in transformers: the engine runs
    each with an output head of its own (``engine.causal``), exact against transformers' image-text class
    on the same text (tokens and logits), its output head tied as the image-text config says."""
    import json

    from transformers import AutoModelForImageTextToText

    from expertcache.engine.causal import reference_class
    from expertcache.engine.offloaded import model_info

    path = tmp_path / outer
    config = _image_text_checkpoint(outer, tokenizer_dir, path)
    assert json.loads((path / "config.json").read_text())["model_type"] == outer
    assert reference_class(config) is AutoModelForImageTextToText  # the oracle: transformers' own class
    info = model_info(path)
    assert info["family"] == _NO_CAUSAL_LM[outer][0] and info["moe_layers"] >= 2
    least = TOP_K * info["moe_layers"]  # ``lru-dist``'s: each layer's top-k resident together
    with engine_load(path, least, "lru-dist", prefetch="next-gate", link_latency="50us") as model:
        assert type(model.model).__name__.endswith("TextForCausalLM")
        head, embed = model.model.lm_head.weight, model.model.model.embed_tokens.weight
        tied = getattr(config, "tie_word_embeddings", None)  # Muse Spark's says it in its text config only
        tied = config.get_text_config().tie_word_embeddings if tied is None else tied
        ties = bool(
            getattr(AutoModelForImageTextToText._model_mapping[type(config)], "_tied_weights_keys", None)
        )
        assert (head.data_ptr() == embed.data_ptr()) == (bool(tied) and ties)
        got = greedy(model, IDS)
        assert model.stats["misses"] > 0 and model.stats["prefetch_issued"] > 0
    assert_exact(got, reference(path, IDS))


def test_muse_spark_s_head_stays_untied_whatever_its_configs_say(tokenizer_dir, reference, tmp_path):
    """Muse Spark's image-text class ties no weights (no ``_tied_weights_keys``): a checkpoint whose text
    config asks for a tied head still has its own, and the engine keeps it (it tied it, and its tokens
    differed from transformers')."""
    import json

    path = tmp_path / "muse"
    _image_text_checkpoint("muse_spark", tokenizer_dir, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["text_config"]["tie_word_embeddings"] = True
    (path / "config.json").write_text(json.dumps(cfg))
    with engine_load(path) as model:
        assert model.model.lm_head.weight.data_ptr() != model.model.model.embed_tokens.weight.data_ptr()
        got = greedy(model, IDS)
    assert_exact(got, reference(path, IDS))


def _transposed_copy(path, out):
    """``path`` with every fused expert tensor stored transposed (``[E, H, 2F]``, ``[E, F, H]``), as
    checkpoints written for transformers 4 store them."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(path, out)
    for f in out.glob("*.safetensors"):
        tensors = load_file(f)
        tensors = {
            k: t.transpose(1, 2).contiguous() if ".mlp.experts." in k and t.dim() == 3 else t
            for k, t in tensors.items()
        }
        save_file(tensors, f, metadata={"format": "pt"})
    return out


def test_qwen3_vl_moe_s_head_is_untied_its_packed_checkpoint_runs_and_its_transposed_experts_are_read(
    tokenizer_dir, reference, make_ckpt, tmp_path
):
    """Qwen3-VL-MoE's text config alone would tie the output head, its image-text config does not (the
    engine follows the image-text one: the exactness test above fails otherwise); an int8 packed
    checkpoint of it runs. The published checkpoints' experts, written for transformers 4, are stored
    transposed: read transposed as transformers reads them (exact, from the disk tier's exact reads and
    from host memory), packed into the same int8 checkpoint; another family's transposed experts are
    refused in one line."""
    from safetensors.torch import load_file

    from expertcache.cli import main
    from expertcache.engine import load
    from expertcache.errors import ExpertcacheError

    path = tmp_path / "vl"  # no expert matrix square (a square one cannot be told transposed)
    config = _image_text_checkpoint("qwen3_vl_moe", tokenizer_dir, path, intermediate=24)
    assert config.get_text_config().tie_word_embeddings and not config.tie_word_embeddings
    assert main(["quantize", str(path), "--bits", "8", "--checkpoint", str(tmp_path / "int8")]) == 0
    with engine_load(tmp_path / "int8", 2 * TOP_K, "lru") as model:
        assert model.stats["expert_format"].startswith("int8")
        assert greedy(model, IDS)[0].shape[1] > IDS.shape[1]

    old = _transposed_copy(path, tmp_path / "transposed")
    want = reference(path, IDS)
    assert_exact(reference(old, IDS), want)  # transformers transposes them back at load
    for tier in ("disk", "host"):
        with engine_load(old, 2 * TOP_K, "lru", slow_tier=tier) as model:
            got = greedy(model, IDS)
            assert model.stats["misses"] > 0
        assert_exact(got, want)
    assert main(["quantize", str(old), "--bits", "8", "--checkpoint", str(tmp_path / "int8t")]) == 0
    packed, packed_t = (load_file(next((tmp_path / d).glob("*.safetensors"))) for d in ("int8", "int8t"))
    assert packed.keys() == packed_t.keys() and all(torch.equal(packed[k], packed_t[k]) for k in packed)

    other = _transposed_copy(make_ckpt("minimax_m3_vl_text"), tmp_path / "other")
    transposed = r"gate_up_proj stores each expert transposed \(\(32, 64\); the model takes \(64, 32\)\)"
    with pytest.raises(ExpertcacheError, match=transposed + ", as checkpoints written for transformers 4 do"):
        load(other, progress=False)


def test_a_random_checkpoint_too_shallow_for_its_family_is_refused_and_gemma4_s_fits_its_tokenizer(
    tmp_path, monkeypatch
):
    """``model synth``'s checkpoints run: a family's layers before its first MoE one and a hybrid's
    attention layer need layers (one line when too few, before anything is written); Gemma 4's per-layer
    inputs are sized to the tokenizer's vocabulary (the embedded model's 4096 tokens here)."""
    from expertcache.engine import load
    from expertcache.engine.random_checkpoint import make_checkpoint
    from expertcache.errors import ExpertcacheError

    for family, layers, least in (
        ("nemotron_h", 2, 3),
        ("lara_mini", 1, 2),
        ("qwen3_next", 3, 4),
        ("deepseek_v3", 1, 2),
    ):
        with pytest.raises(
            ExpertcacheError, match=rf"^{family} needs at least {least} layers \(.*\), got {layers}$"
        ):
            make_checkpoint(tmp_path / family, family, layers=layers, hidden=32, experts=4, intermediate=32)
        assert not (tmp_path / family).exists()
    # model_type is lower case: "Mixtral" can only mean one family; a typo gets the nearest
    assert make_checkpoint(
        tmp_path / "cased", "Mixtral", layers=2, hidden=32, experts=4, intermediate=32
    ).is_dir()
    with pytest.raises(ExpertcacheError, match=r"^unsupported family 'mixtrl' \(did you mean 'mixtral'\?\)"):
        make_checkpoint(tmp_path / "typo", "mixtrl")
    # a family transformers has and the engine cannot run: its reason, as model info gives it
    with pytest.raises(
        ExpertcacheError, match=r"^unsupported family 'llama4': Llama 4's MoE block .*not supported\)$"
    ):
        make_checkpoint(tmp_path / "l4", "llama4")
    # a head of an odd size: refused before transformers (which refuses it for some families only, and
    # for the others writes a model its rotary embeddings then fail on)
    for family in ("qwen3_moe", "mixtral"):
        with pytest.raises(ExpertcacheError, match=r"^hidden 36 over heads 4 is 9 values a head: rotary"):
            make_checkpoint(tmp_path / "odd", family, hidden=36, heads=4, experts=4, intermediate=32)
    import transformers

    def refuse(*args, **kwargs):
        raise ValueError("head_dim must divide hidden_size")

    monkeypatch.setattr(transformers.AutoConfig, "for_model", refuse)  # transformers' own check, wrapped
    with pytest.raises(
        ExpertcacheError, match=r"^qwen3_moe: transformers refuses these sizes \(head_dim must"
    ):
        make_checkpoint(tmp_path / "odd", "qwen3_moe", hidden=32, heads=4, experts=4, intermediate=32)
    monkeypatch.undo()
    for kwargs, needle in (
        (dict(hidden="64"), "hidden must be a whole number, got '64'"),
        (dict(heads=0), "heads must be at least 1, got 0"),
        (dict(kv_heads=3), "heads 4 is not a multiple of kv_heads 3"),
        (dict(dtype="fp8"), "dtype must be one of float32, bfloat16, float16, got 'fp8'"),
        (dict(seed=-1), "seed must be at least 0, got -1"),
        (dict(max_shard_size="5 parsecs"), "max_shard_size '5 parsecs' is not a size"),
        (dict(max_shard_size="1.5GB"), "max_shard_size '1.5GB' is not a size"),
    ):  # the Python API's own checks (``model synth`` parses its flags before): one line, nothing written
        with pytest.raises(ExpertcacheError, match=re.escape(needle)):
            make_checkpoint(tmp_path / "bad", "mixtral", **kwargs)
        assert not (tmp_path / "bad").exists()
    path = make_checkpoint(
        tmp_path / "gemma4", "gemma4_text", layers=2, hidden=32, experts=4, intermediate=32
    )
    with load(path, expert_memory="50%", progress=False) as model:
        out = model.generate(torch.tensor([[4000, 17, 3999, 1024]]), max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 7)


def test_a_synthesized_models_first_position_is_not_all_zero(tmp_path):
    """A new user's trial: the tokenizer's padding token is its BOS, transformers leaves the padding row
    of the input embedding at 0, so every random model gave the first position all-zero logits, and
    `quality` counted it as bit-identical and agreeing between two unrelated models."""
    import json

    from safetensors.torch import load_file

    from expertcache.engine.random_checkpoint import make_checkpoint

    out = make_checkpoint(tmp_path / "m", "mixtral", layers=2, hidden=32, experts=4, intermediate=32)
    weights = {}
    for f in out.glob("*.safetensors"):
        weights.update(load_file(f))
    emb = next(v for k, v in weights.items() if k.endswith("embed_tokens.weight"))
    pad = json.loads((out / "config.json").read_text())["pad_token_id"]
    assert emb[pad].abs().sum() > 0 and emb[pad].std() == pytest.approx(emb[pad + 1].std(), rel=0.5)
