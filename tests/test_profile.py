"""``expertcache profile``: the cost triple measured with the engine's own paths, declared figures for
what the machine lacks, and the profile read back by ``plan`` and ``timing`` (a profile of another
model's shape refused)."""

from __future__ import annotations

import json

import engine_fixtures
import pytest
from engine_fixtures import SPECS, TOP_K, moe_layers

from expertcache.cli import main
from expertcache.costs import CostModel
from expertcache.errors import ExpertcacheError
from expertcache.trace import synthesize

_one_torch_thread = engine_fixtures._one_torch_thread
ckpt = engine_fixtures.ckpt
make_ckpt = engine_fixtures.make_ckpt
tokenizer_dir = engine_fixtures.tokenizer_dir


def test_profile_measures_a_model_and_plan_reads_it(ckpt, tmp_path, capsys):
    path = ckpt("mixtral")
    out = tmp_path / "profile.json"
    argv = ["profile", "--model", str(path), "--device", "cpu", "--steps", "4", "-o", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "measured" in printed and "declared   nothing" in printed
    data = json.loads(out.read_text())
    L, E = moe_layers("mixtral"), SPECS["mixtral"]["experts"]
    assert (data["model"]["layers"], data["model"]["experts"], data["model"]["top_k"]) == (L, E, TOP_K)
    assert data["declared"] == [] and {"expert_s", "link_bandwidth", "dense_s"} <= set(data["measured"])
    cost = CostModel.load(out)
    assert (
        cost.expert_bytes == data["model"]["expert_bytes"]
        and cost.expert_s + cost.expert_token_s > 0  # one token's time (the fixed part alone may be 0)
        and cost.link_bandwidth > 0
    )
    assert cost.host_parallel is False  # a CPU alone: host work runs inline
    # the disk tier (a CPU's default): a host-computed expert is read first, at every use, as a transfer
    # (calibrate measures that read: the profile lists it, where PLAN.md said it wrote 0)
    assert data["how"]["slow_tier"] == "disk" and "host_read_s" in data["measured"]
    # (the same sum, latency plus bytes over bandwidth, computed in another order: equal to rounding)
    assert cost.host_read_s == pytest.approx(cost.transfer_time(), rel=1e-12) and cost.host_read_s > 0
    # a trace of the model's shape plans with it; another shape is refused
    same = tmp_path / "same.npz"
    synthesize("sticky", tokens=200, layers=L, experts=E, top_k=TOP_K, seed=1).save(same)
    assert main(["plan", "--trace", str(same), "--cost", str(out), "--capacity", str(L * TOP_K)]) == 0
    capsys.readouterr()
    other = tmp_path / "other.npz"
    synthesize("sticky", tokens=200, layers=L + 1, experts=E, top_k=TOP_K, seed=1).save(other)
    for cmd in ("plan", "timing", "doctor", "sweep"):  # sweep and the API took it in silence
        assert main([cmd, "--trace", str(other), "--cost", str(out), "--capacity", str(E)]) == 2, cmd
        err = capsys.readouterr().err
        assert f"({L} MoE layers x {E} experts" in err and len(err.strip().splitlines()) == 1, err
    import expertcache

    for call in (
        lambda: expertcache.simulate_timing(str(other), E, cost=str(out)),
        lambda: expertcache.make_plan(str(other), E, cost=str(out), methods=["shared"]),
        lambda: expertcache.diagnose(str(other), E, cost=str(out)),
        lambda: expertcache.step_bounds(str(other), E, cost=str(out)),
    ):
        with pytest.raises(ExpertcacheError, match=f"MoE layers x {E} experts, top-{TOP_K}\\); trace"):
            call()
    assert expertcache.simulate_timing(str(same), E, cost=str(out)).tpot_s > 0


def test_declared_figures_replace_measured_ones(ckpt, tmp_path, capsys):
    path = ckpt("mixtral")
    out = tmp_path / "gpu.json"
    argv = [
        "profile", "--model", str(path), "--device", "cpu", "--steps", "2", "-o", str(out),
        "--device-bandwidth", "25GB/s", "--device-time", "0.35ms,2us", "--dense-time", "0.25ms",
    ]  # fmt: skip
    assert main(argv) == 0
    capsys.readouterr()
    data = json.loads(out.read_text())
    assert {"link_bandwidth", "link_latency", "expert_s", "expert_token_s", "dense_s"} <= set(
        data["declared"]
    )
    assert "host_expert_s" in data["measured"] and "link_bandwidth" not in data["measured"]
    cost = CostModel.load(out)
    assert cost.link_bandwidth == 25e9 and cost.expert_s == 0.35e-3 and cost.host_parallel is True
    # a profile of the target machine declares its figures for another
    again = tmp_path / "again.json"
    argv = ["profile", "--model", str(path), "--device", "cpu", "--steps", "2", "-o", str(again)]
    assert main([*argv, "--device-profile", str(out)]) == 0
    capsys.readouterr()
    assert CostModel.load(again).link_bandwidth == 25e9
    # a declared link alone (the engine's emulated one): the CPU still computes host work inline
    link = tmp_path / "link.json"
    assert main([*argv[:-1], str(link), "--device-bandwidth", "1GB/s"]) == 0
    capsys.readouterr()
    assert CostModel.load(link).host_parallel is False and CostModel.load(link).link_bandwidth == 1e9


def test_a_device_profile_declares_only_the_figures_it_gives(ckpt, tmp_path, capsys):
    """A file of one field declared five, the other four the default model's (a Mixtral expert over PCIe)
    in place of this machine's measurements; a file of none declared them all."""
    one, none = tmp_path / "one.json", tmp_path / "none.json"
    one.write_text(json.dumps({"link_bandwidth": "16GB/s"}))
    none.write_text("{}")
    out = tmp_path / "p.json"
    argv = ["profile", "--model", str(ckpt("mixtral")), "--device", "cpu", "--steps", "2", "-o", str(out)]
    assert main([*argv, "--device-profile", str(one)]) == 0
    capsys.readouterr()
    data = json.loads(out.read_text())
    assert set(data["declared"]) == {"link_bandwidth", "link_latency"}  # the latency: the link's default
    assert {"expert_s", "dense_s"} <= set(data["measured"]) and data["cost"]["link_bandwidth"] == 16e9
    assert data["cost"]["expert_s"] != CostModel().expert_s
    out.unlink()
    assert main([*argv, "--device-profile", str(none)]) == 2
    assert "gives none of the device's figures" in capsys.readouterr().err and not out.exists()


def test_a_device_profile_of_another_model_is_refused(ckpt, make_ckpt, tmp_path, capsys):
    other = tmp_path / "other.json"
    argv = [
        "profile",
        "--model",
        str(make_ckpt("qwen2_moe")),
        "--device",
        "cpu",
        "--steps",
        "2",
        "-o",
        str(other),
    ]
    assert main(argv) == 0
    capsys.readouterr()
    argv = ["profile", "--model", str(ckpt("mixtral")), "--device", "cpu", "--device-profile", str(other)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "the device profile is for" in err and err.count("\n") == 1


def test_profile_bad_input_is_one_line_before_any_work(tmp_path, capsys):
    plan = tmp_path / "plan.json"  # a plan where a cost model goes: named (a new user got 30 field names)
    plan.write_text(json.dumps({"format": "expertcache-plan", "version": 1, "capacity": 24}))
    odd = tmp_path / "odd.json"
    odd.write_text(json.dumps({"link_bandwidth": "25GB/s", "speed": 1, "colour": 2}))
    timed = tmp_path / "timed.json"  # timing --json's result: its 60 keys were listed as unknown fields
    assert main(["timing", "--capacity", "24", "--json"]) == 0
    timed.write_text(capsys.readouterr().out)
    for argv, words in [
        (["timing", "--miss", "host", "--cost", str(timed)], "timed.json is a timing result (expertcache"),
        (
            ["profile", "--device-profile", str(plan)],
            "plan.json is a plan (expertcache plan's: give it as --plan)",
        ),
        (["timing", "--cost", str(plan)], "not a cost model or a profile"),
        (
            ["timing", "--cost", str(odd)],
            "unknown field(s) colour, speed; known: chunk_bytes, demote_s, dense_s,",
        ),
        (["profile", "--device-bandwidth", "25"], "needs a unit"),
        (["profile", "--device-time", "1ms,2us,3"], "is TIME or TIME,PER_TOKEN"),
        (["profile", "-o", str(tmp_path / "no" / "p.json")], "does not exist"),
        (["profile", "--steps", "1"], "--steps must be at least 2"),
        (["profile", "--device-profile", str(tmp_path / "missing.json")], "cannot read cost model"),
    ]:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1, err


def test_profile_measures_each_low_precision_copy_that_exists(ckpt, tmp_path, capsys):
    path = ckpt("mixtral")
    assert main(["quantize", str(path), "--bits", "4"]) == 0
    capsys.readouterr()
    out = tmp_path / "p.json"
    assert main(["profile", "--model", str(path), "--device", "cpu", "--steps", "2", "-o", str(out)]) == 0
    assert "precisions int4:" in capsys.readouterr().out
    data = json.loads(out.read_text())
    int4 = data["precisions"]["int4"]  # packed: computed from its bytes, its time beyond a full expert's
    assert 0 < int4["bytes"] < data["model"]["expert_bytes"] / 3 and int4["compute_s"] > 0
    assert int4["dequant_s"] >= 0
    assert data["cost"]["dequant_s"] == int4["dequant_s"] and "dequant_s" in data["measured"]


def test_a_packed_model_s_profile_says_what_it_stores_and_refuses_to_time_hobbit(ckpt, tmp_path, capsys):
    """A new user's int8 checkpoint was profiled as float32 experts without a gate projection, and
    timing --miss hobbit then predicted 6353 low-precision misses the engine refuses to run."""
    packed = tmp_path / "int8"
    assert main(["quantize", str(ckpt("mixtral")), "--bits", "8", "--checkpoint", str(packed)]) == 0
    capsys.readouterr()
    out = tmp_path / "p.json"
    assert main(["profile", "--model", str(packed), "--device", "cpu", "--steps", "2", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "; stored int8)" in text and "the experts are stored int8: hobbit's copies are made from" in text
    shape = json.loads(out.read_text())["model"]
    assert shape["gated"] is True and shape["expert_format"] == "int8"
    trace = tmp_path / "t.npz"
    synthesize("zipf", tokens=60, layers=shape["layers"], experts=shape["experts"], top_k=TOP_K).save(trace)
    assert main(["timing", "--trace", str(trace), "--cost", str(out), "--miss", "hobbit"]) == 2
    assert "whose experts are stored int8: hobbit serves low-precision copies" in capsys.readouterr().err
    assert main(["timing", "--trace", str(trace), "--cost", str(out)]) == 0


def test_profile_leaves_out_a_copy_it_cannot_read(ckpt, tmp_path, capsys, monkeypatch):
    """int2 copies are HQQ's: without hqq the profile says so for them and times the others."""
    import sys

    from expertcache.tools.quantize import quantize_model

    path = ckpt("mixtral")
    quantize_model(path, bits=(4, 2), progress=False)
    monkeypatch.setitem(sys.modules, "hqq.core.quantize", None)  # as if hqq were not installed
    out = tmp_path / "p.json"
    assert main(["profile", "--model", str(path), "--device", "cpu", "--steps", "2", "-o", str(out)]) == 0
    assert "int2 copies of the experts need the optional hqq" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert "skipped" in data["precisions"]["int2"] and data["precisions"]["int4"]["compute_s"] > 0
    assert data["cost"]["dequant_s"] == data["precisions"]["int4"]["dequant_s"]


def test_two_calibrations_that_disagree_are_said_and_the_quieter_is_kept():
    # a new user's profile on a busy machine gave the expert 2131 us a token one run, 1.9 us the next
    from expertcache.tools.profile import _steadier

    quiet = CostModel(expert_s=1e-4, expert_token_s=2e-6)
    busy = CostModel(expert_s=1e-4, expert_token_s=2e-3)
    for a, b in ((quiet, busy), (busy, quiet)):
        kept, unsteady = _steadier(a, b)
        assert kept == quiet and [u.split(" ms")[0].rsplit(" ", 3)[0] for u in unsteady] == [
            "expert, 1 token",
            "expert, 16 tokens",
        ]
    kept, unsteady = _steadier(quiet, CostModel(expert_s=1.1e-4, expert_token_s=2e-6))
    assert kept == quiet and unsteady == []
    # a copy down of 7994 us in one run against 74-88 us in others went unsaid
    calm, busy = CostModel(demote_s=8e-5, disk_read_s=2e-3), CostModel(demote_s=8e-3, disk_read_s=2e-3)
    kept, unsteady = _steadier(busy, calm)
    assert kept == calm and [u.split(" ")[0:2] for u in unsteady] == [["copy", "down"]]
    # each measurement's quicker run, not one whole calibration: the quieter disk read and the quieter
    # expert came from different runs (the whole run with the less total time kept the slower expert)
    one = CostModel(expert_s=3e-4, expert_token_s=2e-6, disk_read_s=2e-3, host_read_s=2e-3, demote_s=1e-4)
    two = CostModel(expert_s=1e-4, expert_token_s=2e-6, disk_read_s=3e-3, host_read_s=3e-3, demote_s=2e-4)
    kept, _ = _steadier(one, two)
    assert (kept.expert_s, kept.disk_read_s, kept.host_read_s, kept.demote_s) == (1e-4, 2e-3, 2e-3, 1e-4)
    # on a CPU the host computes as the device: one measurement, taken whole from the same run
    cpu = {"host_parallel": False}
    one = CostModel(expert_s=3e-4, host_expert_s=3e-4, host_expert_token_s=1e-6, **cpu)
    two = CostModel(expert_s=1e-4, host_expert_s=1e-4, host_expert_token_s=5e-6, **cpu)
    kept, _ = _steadier(one, two)
    assert (kept.expert_s, kept.host_expert_s, kept.host_expert_token_s) == (1e-4, 1e-4, 5e-6)


def test_a_decode_step_measured_twice_keeps_the_quicker_and_says_when_they_disagree(
    ckpt, tmp_path, monkeypatch
):
    """A new user's profile on a busy VM measured the all-resident decode step at 14 ms against about 2 ms
    quiet, once, and said nothing: the plans made from it were 7x off."""
    import dataclasses

    from expertcache.engine.offloaded import OffloadedModel
    from expertcache.tools.profile import profile

    real, steps = OffloadedModel.generate_text, []

    def busy_second(self, *args, **kwargs):
        g = real(self, *args, **kwargs)
        if kwargs.get("min_new_tokens"):  # the decode step's runs
            steps.append(g.tpot_s)
            if len(steps) == 2:  # the machine got busy
                return dataclasses.replace(g, tpot_s=10 * g.tpot_s + 1e-3)
        return g

    monkeypatch.setattr(OffloadedModel, "generate_text", busy_second)
    data = profile(ckpt("mixtral"), device="cpu", steps=4)
    assert len(steps) == 2 and data["how"]["decode_step_s"] == steps[0]
    assert any(u.startswith("decode step ") for u in data["how"]["unsteady"])


def test_fit_overheads_fits_submit_s_on_a_run_and_the_fitted_model_matches_its_tpot(ckpt, tmp_path, capsys):
    """A profile left the engine's own work a transfer at 0, and plans on a CPU came out 22-27 % fast."""
    out = tmp_path / "fitted.json"
    argv = ["profile", "--model", str(ckpt("mixtral")), "--device", "cpu", "--steps", "4"]
    assert main([*argv, "--fit-overheads", "-o", str(out)]) == 0
    assert "fitted     submit_s " in capsys.readouterr().out
    data = json.loads(out.read_text())
    fit = data["how"]["fit"]
    assert fit["submit_s"] >= 0 and fit["wake_s"] == 0 and fit["misses"] > 0
    # a fit a busy machine left at 0 (each of its runs quicker than its pair) is not listed as measured
    assert data["cost"]["submit_s"] == fit["submit_s"] and ("submit_s" in data["measured"]) == (
        fit["submit_s"] > 0
    )

    def above(side: dict) -> float:  # a run's TPOT above its all-resident pair's
        return side["tpot_s"] - side["resident_tpot_s"]

    if fit["submit_s"] > 0:  # fitted: the model's TPOT of the run exceeds all resident by the run's excess
        assert above(fit["model"]) == pytest.approx(above(fit["engine"]), abs=0.02 * fit["engine"]["tpot_s"])
    # the engine's own work an expert computed on the host, fitted on a run computing every one there
    host = fit["host"]
    assert host["miss"] == "placement" and host["host_computed"] > 0 and host["misses"] > 0
    assert data["cost"]["host_submit_s"] == fit["host_submit_s"] == host["value"] >= 0
    assert ("host_submit_s" in data["measured"]) == host["fitted"]
    if host["value"] > 0:
        assert above(host["model"]) == pytest.approx(
            above(host["engine"]), abs=0.02 * host["engine"]["tpot_s"]
        )
    for declared in (["--device-bandwidth", "25GB/s"], ["--dense-time", "0.05ms"]):  # another's figures
        assert main([*argv, "--fit-overheads", *declared]) == 2
        assert "declared are another's: fit on the machine itself" in capsys.readouterr().err
    assert main(argv) == 0 and "--fit-overheads fits the first two on runs" in capsys.readouterr().out


def test_a_fit_on_a_busy_machine_is_said_and_an_impossible_one_fits_nothing(ckpt, monkeypatch):
    """A busy machine's profile measured the all-resident step at 24.5 ms and its run at 50 % at 15.6 ms
    (impossible: misses add time), and fitted without a word; two runs' fits of 54 and 0.5 ms neither.
    Each run is now paired with an all-resident one just before it: quicker than its pair, it fits 0."""
    import dataclasses

    from expertcache.engine.offloaded import OffloadedModel
    from expertcache.tools.profile import profile

    real, calls = OffloadedModel.generate_text, []

    def quick_at_50(self, *args, **kwargs):
        g = real(self, *args, **kwargs)
        if self.capacity < self.num_layers * self.num_experts:  # the fit's runs
            calls.append(1)
            return dataclasses.replace(g, tpot_s=g.tpot_s / 100)
        return g

    monkeypatch.setattr(OffloadedModel, "generate_text", quick_at_50)
    data = profile(ckpt("mixtral"), device="cpu", steps=4, fit_overheads=True)
    fit, cost, unsteady = data["how"]["fit"], data["cost"], data["how"]["unsteady"]
    assert len(calls) == 6  # three runs at 50 % fetching, three with every expert on the host
    assert fit["submit_s"] == 0 == cost["submit_s"] and fit["host_submit_s"] == 0 == cost["host_submit_s"]
    for field in ("submit_s", "host_submit_s"):
        assert any("quicker than all resident" in u and f": {field} not fitted" in u for u in unsteady)
        assert field not in data["measured"]  # 0 taken, not a measurement
    assert not fit["transfer"]["fitted"] and not fit["host"]["fitted"]
    from expertcache.tools.profile import format_profile

    assert format_profile(data).count("not fitted (a run quicker than its all-resident pair") == 2


def test_a_fit_held_at_zero_is_the_best_fit_with_it_at_zero():
    """More tokens measured faster (a busy machine) clamped the slope to 0 but kept the free fit's
    intercept, 3.29 ms for samples of 3 and 1 ms; the best fit with a slope of 0 is their mean."""
    from expertcache.costs import fit_linear

    assert fit_linear([(1, 0.003), (8, 0.001)]) == pytest.approx((0.002, 0.0))
    a, b = fit_linear([(1, 0.0001), (16, 0.01)])  # a free intercept below 0: the line through the origin
    assert a == 0.0 and b == pytest.approx((0.0001 + 16 * 0.01) / (1 + 16 * 16))
    assert fit_linear([(1, 0.001), (16, 0.0032)]) == pytest.approx((0.001 - 0.0022 / 15, 0.0022 / 15))


def test_an_expert_calibrated_slower_than_the_whole_step_is_calibrated_again(ckpt, monkeypatch):
    """A new user's profile on a busy 2-core VM: the first 2-6 calls of an expert took about 30 ms each
    (torch's threads starting), then 45 us; both calibrations fell in that start, agreed, and the profile
    wrote the expert 1000x too slow and the dense time 0, unsaid. A decode step's experts slower than the
    whole step now calibrate again, and are said where they still are."""
    import dataclasses

    from expertcache.engine import calibrate as cal
    from expertcache.tools import profile as prof

    real, calls = cal.calibrate, []

    def starting(m, module):
        got = real(m, module)
        calls.append(got)
        if len(calls) <= 2:  # the process's start: every expert slower than any decode step here
            return dataclasses.replace(got, expert_s=10.0, expert_token_s=0.0)
        return dataclasses.replace(got, expert_s=1e-9, expert_token_s=0.0)  # warm (the figures chosen)

    monkeypatch.setattr(cal, "calibrate", starting)
    data = prof.profile(ckpt("mixtral"), device="cpu", steps=4)
    assert len(calls) == 4 and data["cost"]["expert_s"] == 1e-9 and data["cost"]["dense_s"] > 0
    assert not any(u.startswith("the experts of a decode step") for u in data["how"]["unsteady"])
    monkeypatch.setattr(
        cal, "calibrate", lambda m, module: dataclasses.replace(real(m, module), expert_s=10.0)
    )
    data = prof.profile(ckpt("mixtral"), device="cpu", steps=4)  # slow every time: said
    assert any(u.startswith("the experts of a decode step") for u in data["how"]["unsteady"])


def test_the_unsteady_line_says_what_each_kind_of_measurement_kept():
    """It said "two calibrations disagreed ... the quicker of each is kept" of a fit's three values, whose
    median is kept (a new user's trial)."""
    from expertcache.tools.profile import unsteady_line

    line = unsteady_line({"how": {"unsteady": ["host_submit_s fitted 301, 271, 190 us (the median kept)"]}})
    assert line.startswith("measurements disagreed (host_submit_s fitted 301, 271, 190 us (the median kept))")
    assert "of two calibrations the quicker is kept, of the three fit runs the median" in line
    assert "two calibrations disagreed" not in line
