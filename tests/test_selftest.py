"""``expertcache selftest``: it passes here, reports a broken comparison as a failure, covers the matrix.

The self-test runs on the CPU in CI (``--device cpu --quick``); its CUDA half runs on a user's GPU. A
failing check is a result (exit 1), bad input is exit 2 with one line.
"""

from __future__ import annotations

import gc
import json
import os
import re

import pytest
import torch

import expertcache
from expertcache.cli import main
from expertcache.engine.families import FAMILIES
from expertcache.miss import MISS_PATHS, parse_miss
from expertcache.predict import PREDICTORS
from expertcache.predict.registry import predictor_class
from expertcache.tools import selftest as st
from expertcache.tools.compare import Comparison, compare

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
SUMMARY = re.compile(r"^selftest: (\d+) passed, (\d+) failed on cpu \(torch \S+, \d+ s\)$")


def _lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith(("PASS ", "FAIL "))]


# ------------------------------------------------------------------------------------------------
# The command
# ------------------------------------------------------------------------------------------------
def test_quick_selftest_passes_on_the_cpu(capsys):
    assert main(["selftest", "--device", "cpu", "--quick"]) == 0
    out, err = capsys.readouterr()
    lines = _lines(err)
    cases = st.plan(CPU, quick=True)
    assert len(lines) == len(cases) and all(line.startswith("PASS ") for line in lines)
    assert lines[0] == "PASS mixtral lru 100% fetch prefetch=none (tokens equal, max |dlogit| 0)"
    m = SUMMARY.match(out.strip())
    assert m and (int(m[1]), int(m[2])) == (len(cases), 0)


def _perturbed(monkeypatch, family: str = "olmoe") -> None:
    """The engine's run of ``family`` with misses gets token 3 of row 0 and one logit changed."""
    real = st.run_engine

    def run(models, case, capacity):
        seq, logits = real(models, case, capacity)
        if case.family == family and case.budget != "all":
            seq, logits = seq.clone(), logits.clone()
            seq[0, -3] += 1  # new token 3 of 6
            logits[2, 0, 7] += 0.5
        return seq, logits

    monkeypatch.setattr(st, "run_engine", run)


# the reporting tests run the quick plan of a few families (every family's quick run is the test above)
FEW = ("mixtral", "olmoe", "qwen2_moe")


def _few_families(monkeypatch) -> None:
    real = st.plan
    monkeypatch.setattr(
        st,
        "plan",
        lambda device, quick=False, families=None: [c for c in real(device, quick) if c.family in FEW],
    )


def test_a_broken_comparison_is_a_failure_with_exit_1(monkeypatch, capsys):
    _perturbed(monkeypatch)
    _few_families(monkeypatch)
    assert main(["selftest", "--device", "cpu", "--quick"]) == 1
    out, err = capsys.readouterr()
    failed = [line for line in _lines(err) if line.startswith("FAIL ")]
    assert len(failed) == 1 and failed[0].startswith("FAIL olmoe ")
    assert "tokens differ at new token 3 of row 0" in failed[0] and "max |dlogit| 0.5" in failed[0]
    m = SUMMARY.match(out.strip())
    assert m and int(m[2]) == 1


def test_json_is_one_object_with_every_check(monkeypatch, capsys):
    _perturbed(monkeypatch)
    _few_families(monkeypatch)
    assert main(["selftest", "--device", "cpu", "--quick", "--json"]) == 1
    out, err = capsys.readouterr()
    assert _lines(err) == []  # --json: nothing but the object
    report = json.loads(out)
    assert {"ok", "passed", "failed", "device", "quick", "torch", "transformers", "seconds", "checks"} <= set(
        report
    )
    assert report["ok"] is False and report["device"] == "cpu" and report["quick"] is True
    assert report["failed"] == 1 and report["passed"] == len(report["checks"]) - 1
    assert {c["family"] for c in report["checks"]} == set(FEW) and len(report["checks"]) == 2 * len(FEW)
    keys = {"passed", "label", "family", "policy", "budget", "capacity", "total_experts", "miss", "prefetch"}
    keys |= {
        "dtype",
        "options",
        "batch",
        "packing",
        "expect",
        "atol",
        "tokens_equal",
        "first_diff",
        "max_dlogit",
    }
    keys |= {"error", "seconds"}
    assert report["device_lost"] is None
    for check in report["checks"]:
        assert set(check) == keys
    (bad,) = [c for c in report["checks"] if not c["passed"]]
    assert bad["family"] == "olmoe" and bad["tokens_equal"] is False and bad["first_diff"] == [0, 3]
    assert bad["max_dlogit"] == pytest.approx(0.5) and bad["atol"] == 0.0


def test_an_engine_error_is_a_failed_check_not_a_crash(monkeypatch, capsys):
    def boom(models, case, capacity):
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore lines")

    monkeypatch.setattr(
        st, "plan", lambda device, quick=False, families=None: [st.Case("mixtral", budget="min")]
    )
    monkeypatch.setattr(st, "run_engine", boom)
    assert main(["selftest", "--device", "cpu"]) == 1
    (line,) = _lines(capsys.readouterr().err)
    assert line == (
        "FAIL mixtral lru 12% fetch prefetch=none "
        "(error: RuntimeError: CUDA error: an illegal memory access was encountered)"
    )


def test_a_gpu_that_stops_answering_ends_the_run_with_a_report(monkeypatch, capsys):
    cases = [st.Case("mixtral", budget="min"), st.Case("olmoe"), st.Case("gpt_oss", miss="host")]

    def boom(models, case, capacity):
        raise RuntimeError("CUDA error: misaligned address")

    def exit_now(code):
        raise SystemExit(code)

    monkeypatch.setattr(st, "plan", lambda device, quick=False, families=None: cases)
    monkeypatch.setattr(st, "run_engine", boom)
    monkeypatch.setattr(st, "device_lost", lambda dev: "CUDA error: misaligned address")
    monkeypatch.setattr(os, "_exit", exit_now)  # the CLI leaves at once: freeing GPU memory would abort
    try:
        with pytest.raises(SystemExit) as exc:
            main(["selftest", "--device", "cpu", "--json"])
    finally:
        gc.enable()
    assert exc.value.code == 1
    report = json.loads(capsys.readouterr().out)
    assert report["device_lost"] == "CUDA error: misaligned address" and report["failed"] == 3
    first, *rest = report["checks"]
    assert first["error"] == "RuntimeError: CUDA error: misaligned address"
    assert all(c["error"].startswith("not run: the GPU stopped answering") for c in rest)


def test_cuda_without_a_gpu_is_one_line_and_exit_2(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["selftest", "--device", "cuda", "--quick"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith("expertcache: error: device cuda was asked for") and "sees no GPU" in err


def test_bad_device_name_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["selftest", "--device", "tpu"])
    assert exc.value.code == 2


def test_python_api_is_lazy_and_returns_the_report(monkeypatch, capfd):
    from transformers.utils import logging as hf_logging

    monkeypatch.setattr(
        st, "plan", lambda device, quick=False, families=None: [st.Case("qwen3_moe", "lfu", "min", "host")]
    )
    seen: list[str] = []
    hf_logging.enable_progress_bar()
    report = expertcache.selftest("cpu", log=seen.append)
    assert "Writing model shards" not in capfd.readouterr().err  # no bar per tiny model saved
    assert hf_logging.is_progress_bar_enabled()  # the caller's setting, back
    assert expertcache.selftest is st.selftest
    assert report.ok and [c.line() for c in report.checks] == seen
    assert seen == ["PASS qwen3_moe lfu 17% host prefetch=none (tokens equal, max |dlogit| 0)"]
    assert report.summary().startswith("selftest: 1 passed, 0 failed on cpu (torch ")


# ------------------------------------------------------------------------------------------------
# The matrix and what a pass means
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", [CPU, CUDA], ids=["cpu", "cuda"])
def test_default_plan_covers_every_family_policy_predictor_budget_and_exact_path(device):
    cases = st.plan(device)
    assert {c.family for c in cases} == set(FAMILIES)
    assert {c.policy for c in cases} >= set(st.ONLINE)
    engine_predictors = {n for n in PREDICTORS if not predictor_class(n).sim_only}
    assert {c.prefetch for c in cases} == {"none"} | engine_predictors
    assert {c.budget for c in cases} == set(st.BUDGETS)
    assert {c.miss for c in cases} == set(st.MISSES)
    exact = {name for name, cls in MISS_PATHS.items() if not cls.lossy}
    assert {parse_miss(c.miss)[0] for c in cases} == exact == set(st.COMPUTES)
    for family in FAMILIES:  # every family runs every path
        assert {c.miss for c in cases if c.family == family} == set(st.MISSES)
    # linear in the families (each: the plain path and every miss path), not the cross product of
    # families, policies, predictors and budgets (20: the further checks, the two attentions' included)
    assert len(cases) <= len(FAMILIES) * (2 + len(st.MISSES)) + 20
    assert any(dict(c.options).get("host_stage") for c in cases)  # three tiers, staging included
    assert any(dict(c.options).get("host_exclusive") for c in cases)  # and an exclusive host level
    assert any(c.dense == "int8" for c in cases)  # dense layers quantised at load
    assert {c.packing for c in cases} == {None, "fp8", "mxfp4", "int8", "int4"}  # other tools' and our own
    bf16 = [c for c in cases if c.dtype == "bfloat16"]
    assert ({c.family for c in bf16} == set(FAMILIES)) is (device.type == "cuda")


def test_quick_plan_covers_every_family_and_exact_path():
    cases = st.plan(CPU, quick=True)
    assert {c.family for c in cases} == set(FAMILIES)
    assert {c.miss for c in cases} == set(st.MISSES)
    assert {c.prefetch for c in cases} == {"none", "next-gate"}
    assert len(cases) == 2 * len(FAMILIES)


@pytest.mark.parametrize(
    "case, device, atol",
    [
        (st.Case("mixtral", miss="fetch"), CPU, 0.0),
        (st.Case("mixtral", miss="fetch"), CUDA, 0.0),
        (st.Case("mixtral", miss="hybrid"), CPU, 0.0),  # on a CPU the host is the device
        (st.Case("mixtral", miss="host"), CUDA, st.CLOSE_ATOL),  # the CPU rounds differently
        (st.Case("mixtral", miss="placement:first=1"), CUDA, st.CLOSE_ATOL),
        (st.Case("mixtral", miss="split:theta=0.3/0.7"), CPU, st.CLOSE_ATOL),  # two products and a sum
        (st.Case("mixtral", dtype="bfloat16"), CUDA, None),  # tokens only
        (st.Case("qwen3_moe", packing="fp8"), CPU, st.CLOSE_ATOL),  # the packed kernels' own sums
        (st.Case("mixtral", packing="int8"), CUDA, 0.0),  # against the engine's own run, all resident
        (st.Case("mixtral", options=(("quantize_dense", "int8"),)), CUDA, 0.0),  # as the reference's
    ],
)
def test_tolerance(case, device, atol):
    assert st.tolerance(case, device)[0] == atol


def test_quantised_dense_layers_other_tools_checkpoints_and_an_attention_pass_on_the_cpu(tmp_path):
    """The full plan's checks of ``--quantize-dense`` (against transformers with the same layers
    quantised, bit for bit), of FP8 and MXFP4 checkpoints (against transformers dequantising them), of
    expertcache's own int8 and int4 checkpoints (offloaded against all resident, bit for bit: transformers
    cannot read them; the self-test did not check them, a new user's trial) and of
    ``--attention sdpa_no_cudnn`` (against transformers loaded with it; on a GPU, where it is the default,
    transformers' own sdpa in bf16 too)."""
    models = st.Models(tmp_path, CPU)
    cases = [c for c in st.plan(CPU) if c.dense or c.packing or c.attention]
    assert len(cases) == 6
    for case in cases:
        check = st.run_check(models, case)
        assert check.passed, check.line()
        assert ("checkpoint=" in check.line()) is (case.packing is not None)
    ran = {key[-1]: m.config._attn_implementation for key, m in models._built.items() if key[0] == "eager"}
    assert ran["sdpa_no_cudnn"] == "sdpa_no_cudnn"  # the reference ran it, not transformers' default
    gpu = [c for c in st.plan(torch.device("cuda")) if c.attention]  # on a GPU sdpa_no_cudnn is the default
    assert [(c.dtype, c.attention) for c in gpu] == [("float32", "sdpa_no_cudnn"), ("bfloat16", "sdpa")]


def test_every_family_with_latent_attention_gets_heads_bf16_attention_can_align_on_a_gpu(tmp_path):
    """On an H200 the bfloat16 check of ``deepseek_v32`` ended the run with "misaligned address" (its MLA
    heads' rotary part was 4 values); the shape comes from the family's record, not a list of names, so
    each MLA family, today's and tomorrow's, gets heads of 16 values in bf16 (8 rotary), and no other."""
    mla = [f for f in FAMILIES if st.has_mla(f)]
    assert {"deepseek_v2", "deepseek_v3", "deepseek_v32", "glm4_moe_lite", "kimi_linear"} <= set(mla)
    assert "mixtral" not in mla and "qwen3_moe" not in mla
    for family in FAMILIES:
        assert st._shapes(family, "float32") == {}
        assert st._shapes(family, "bfloat16") == (st.MLA_BF16_SHAPE if family in mla else {})
    models = st.Models(tmp_path, CPU)
    config = json.loads((models.path("deepseek_v32", "bfloat16") / "config.json").read_text())
    assert config["hidden_size"] == 64 and config["qk_rope_head_dim"] == 8
    case = st.Case("deepseek_v32", "lru", "min", prefetch="next-gate", dtype="bfloat16")
    check = st.run_check(models, case)
    assert check.passed, check.line()


def test_a_logit_difference_alone_fails_a_bit_exact_check():
    case = st.Case("gpt_oss", "lru", "min")
    atol, expect = st.tolerance(case, CPU)
    check = st.Check(case, 2, expect, atol, comparison=Comparison(True, None, 2.4e-7))
    assert not check.passed
    assert check.line() == (
        "FAIL gpt_oss lru 12% fetch prefetch=none "
        "(tokens equal, max |dlogit| 2.4e-07; want tokens equal, logits bit-equal)"
    )
    split = st.Case("gpt_oss", "lru", "min", "split:theta=0.5,buffer=1")
    close = st.Check(split, 2, "", st.CLOSE_ATOL, comparison=Comparison(True, None, 2.4e-7))
    assert close.passed


def test_compare_finds_the_first_differing_token_and_the_largest_logit_difference():
    seq = torch.tensor([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6]])  # prompt of 2, 4 new tokens
    logits = torch.zeros(4, 2, 5)
    other_seq, other_logits = seq.clone(), logits.clone()
    other_seq[0, 5], other_seq[1, 4] = 9, 9  # row 1 differs first (new token 2), row 0 later
    other_logits[3, 1, 2] = -0.25
    c = compare((seq, logits), (other_seq, other_logits))
    assert c == Comparison(False, (1, 2), 0.25)
    assert compare((seq, logits), (seq, logits)) == Comparison(True, None, 0.0)
    assert not compare((seq, logits), (seq[:, :-1], logits[:-1])).tokens_equal


def test_per_layer_miss_paths_get_a_value_for_each_of_a_family_s_moe_layers():
    """The self-test's ``split:theta=0.3/0.7`` is written for two MoE layers; Qwen3-Next's tiny model has
    four, and a theta per layer must name each (it ran and failed before)."""
    from expertcache.tools.selftest import per_layer, plan
    from expertcache.tools.tiny import moe_layers

    assert per_layer("split:theta=0.3/0.7", 4) == "split:theta=0.3/0.7/0.3/0.7"
    assert per_layer("split:theta=0.3/0.7,weights=2/3", 3) == "split:theta=0.3/0.7/0.3,weights=2/3/2"
    assert per_layer("split:theta=0.5,buffer=1", 4) == "split:theta=0.5,buffer=1"
    for case in plan(torch.device("cpu")):
        miss = per_layer(case.miss, moe_layers(case.family))
        for values in (v for v in miss.replace(",", ":").split(":") if "/" in v):
            assert len(values.split("=")[1].split("/")) == moe_layers(case.family), (case.family, miss)


def test_selftest_runs_the_families_asked_for(capsys):
    """`selftest --family NAME ...` (it had no way to pick: "unrecognized arguments", every family ran)."""
    cpu = torch.device("cpu")
    chosen = st.plan(cpu, families=["qwen3_moe", "mixtral"])
    assert {c.family for c in chosen} == {"qwen3_moe", "mixtral"}
    assert len(chosen) < len(st.plan(cpu)) and chosen == [
        c for c in st.plan(cpu) if c.family in {"qwen3_moe", "mixtral"}
    ]
    assert main(["selftest", "--quick", "--family", "olmoe", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["checks"] and {c["family"] for c in report["checks"]} == {"olmoe"}
    assert (
        main(["selftest", "--family", "mixtrall"]) == 2
    )  # the families there are, listed, the nearest named
    assert (
        "unsupported architecture 'mixtrall' (did you mean 'mixtral'?); supported: "
        in capsys.readouterr().err
    )
    assert main(["selftest", "--quick", "--family", "OLMoE", "--json"]) == 0  # model_type is lower case
    assert {c["family"] for c in json.loads(capsys.readouterr().out)["checks"]} == {"olmoe"}
    assert main(["selftest", "--family", "dbrx"]) == 2  # why it does not run
    assert (
        "selftest --family dbrx: unsupported architecture 'dbrx': its experts are" in capsys.readouterr().err
    )
