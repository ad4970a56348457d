"""The reuse policy (learned reuse prediction), ``train-policy``, and that every online policy decides only
on what it has seen (two traces that share a prefix get the same decisions on it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from expertcache.cache import Residency
from expertcache.cache.schedule import ORDERS, build_schedule
from expertcache.errors import ExpertcacheError, PolicyError
from expertcache.policy import POLICIES, PolicyContext, make_policy
from expertcache.policy.registry import parse_policy, policy_class
from expertcache.policy.reuse import DEFAULT_WEIGHTS, FEATURES, ReuseModel, load_weights
from expertcache.sim import simulate
from expertcache.sim.replay import policy_for
from expertcache.tools.train_policy import examples, fit, train_policy, write_weights
from expertcache.trace import Trace, synthesize
from expertcache.trace.default import default_trace


def _hits(schedule, name: str, capacity: int) -> list[bool]:
    """Each request's hit, in schedule order, through the policy object and ``Residency`` (as replay)."""
    policy = policy_for(schedule, name, capacity, 0)
    residency, clock = Residency(policy), policy.clock
    scores = schedule.group_scores if policy.observes else None
    L, per_layer, out = schedule.num_layers, schedule.per_layer, []
    for g, keys in enumerate(schedule.groups):
        rnd, layer = g // (per_layer * L), (g // per_layer) % L
        clock.round, clock.layer, clock.group = rnd, layer, g
        clock.token, clock.seq = int(schedule.round_token[rnd]), int(schedule.round_seq[rnd])
        missed = set()
        for chunk in residency.chunks(layer, keys):
            missed |= {key for key, _ in residency.admit(chunk, scores=None if scores is None else scores[g])}
        out += [key not in missed for key in keys]
    return out


def _prefix_pair() -> tuple[Trace, Trace, int]:
    """Two traces with the same first 100 tokens (prompt and decode) and different tokens after."""
    a = synthesize("sticky", tokens=160, layers=4, experts=8, top_k=2, seed=3, sequences=2, prompt_len=12)
    b = synthesize("sticky", tokens=160, layers=4, experts=8, top_k=2, seed=9, sequences=2, prompt_len=12)
    cut = 100  # in the second request's decode (a prompt is one step in layer order)
    join = {}
    for field in ("experts", "weights", "seq_id", "is_prefill"):
        x, y = getattr(a, field), getattr(b, field)
        join[field] = None if x is None else np.concatenate([x[:cut], y[cut:]])
    return a, Trace(num_experts=a.num_experts, **join), cut


ONLINE = [n for n in POLICIES if not policy_class(n).offline and not policy_class(n).needs_profile]


@pytest.mark.parametrize("order", ORDERS)
def test_online_policies_decide_the_shared_prefix_alike(order):
    """Only what has happened may decide: on the common prefix of two traces, every online policy hits and
    misses the same requests (OPT and Static, which read the whole trace, are the offline ones)."""
    a, b, cut = _prefix_pair()
    sa, sb = build_schedule(a, order), build_schedule(b, order)
    K = a.num_layers * a.num_experts
    # requests served while the prefix's tokens are: the rounds whose first token is before the cut
    rounds = int(np.searchsorted(sa.round_token, cut))
    assert rounds == int(np.searchsorted(sb.round_token, cut))
    n = int(np.searchsorted(sa.req_group, rounds * sa.per_layer * sa.num_layers))
    assert n == int(np.searchsorted(sb.req_group, rounds * sb.per_layer * sb.num_layers)) and n > 100
    assert "reuse" in ONLINE and "opt" not in ONLINE
    for name in ONLINE:
        low = K // 4 if name.endswith("-dist") else max(sa.max_group, 3)
        for cap in (low, K // 2):
            ha, hb = _hits(sa, name, cap), _hits(sb, name, cap)
            assert ha[:n] == hb[:n], (name, cap, order)
            if name == "lru" and cap == K // 2:
                assert ha[n:] != hb[n:]  # the traces do differ after the prefix


def test_model_features_and_labels_follow_the_rounds():
    m = ReuseModel(2, 3, 1, DEFAULT_WEIGHTS, lr=0.0)
    assert m.X.shape == (6, len(FEATURES)) and np.all(m.X[:, 1] == 0)  # nothing seen: no age-1 key
    m.observe([0, 4], [0.7, 1.0])
    m.advance(1, 1)
    age1 = m.X[:, FEATURES.index("age == 1")]
    assert age1.tolist() == [1, 0, 0, 0, 1, 0]
    assert m.X[0, FEATURES.index("score at last use")] == pytest.approx(0.7)
    assert m.X[0, FEATURES.index("requests, decay 1/2 per round")] == 1.0
    m.advance(3, 3)  # a round with no request: ages grow, counts decay
    assert m.X[:, FEATURES.index("age == 1")].sum() == 0
    assert m.X[0, FEATURES.index("requests, decay 1/2 per round")] == pytest.approx(0.5)
    assert tuple(m.w) == DEFAULT_WEIGHTS  # lr = 0: frozen


def test_the_compiled_model_equals_its_numpy_reference():
    """The kernels (``_reuse_jit``: predictions, learning step, waits and victim order) against the
    features written out in numpy (``ReuseModel.features``) and the formulas of the docstring."""
    tr = synthesize("sticky", tokens=60, layers=3, experts=8, top_k=2, seed=3, stickiness=0.5,
                    sequences=2, prompt_len=6)  # fmt: skip
    m = ReuseModel(3, 8, 2, DEFAULT_WEIGHTS, lr=0.5)
    rng = np.random.default_rng(0)
    for t in range(1, tr.num_tokens):
        ids = (np.arange(3)[:, None] * 8 + tr.experts[t - 1]).reshape(-1).tolist()
        m.observe(ids, rng.random(len(ids)).tolist())
        X, p, w, used = m.features(), m.p.copy(), m.w.copy(), m.used.astype(np.float64)
        assert np.allclose(p, m.predict(X), rtol=0, atol=1e-12)
        m.advance(t, t + (t % 5 == 0))  # every fifth round covers two tokens (a prompt step)
        assert np.allclose(m.w, w + 0.5 * X.T @ (used - p) / len(p), rtol=1e-12, atol=1e-14)
    ids = np.arange(0, 24, 2)
    H, L = 6, 3
    got, v, wait, lay = m.rank(ids, H, L)
    P = np.vstack([m.p[ids], m.predict(m.features(np.arange(1, H), ids)).reshape(H - 1, len(ids))])
    P = np.maximum(P, 1e-9)
    alive = np.cumprod(1 - P, axis=0)
    want = L * (alive[:-1].sum(axis=0) + alive[-1] / P[-1])  # L * (E[N] - 1)
    assert np.allclose(wait, want[np.searchsorted(ids, got)], rtol=1e-12)
    assert lay.tolist() == (got // 8).tolist() and np.array_equal(v, wait + lay)
    assert [(-a, -b, c) for a, b, c in zip(v, wait, got, strict=True)] == sorted(
        (-a, -b, c) for a, b, c in zip(v, wait, got, strict=True)
    )  # v descending, then wait descending, then key


def test_online_learning_moves_the_weights_toward_the_labels():
    m = ReuseModel(1, 4, 1, DEFAULT_WEIGHTS, lr=0.5)
    for r in range(1, 60):  # expert 0 every round, the others never
        m.observe([0], None)
        m.advance(r, r)
    assert m.p[0] > 0.8 and m.p[1:].max() < 0.05
    assert tuple(m.w) != DEFAULT_WEIGHTS


def test_prefetched_experts_are_not_counted_as_requested():
    ctx = PolicyContext(capacity=2, num_layers=1, num_experts=4, top_k=1)
    p = make_policy("reuse", ctx)
    p.on_request([(0, 1)])
    p.on_insert((0, 1))
    p.on_insert((0, 2))  # a prefetch: no request
    assert p.model.used.tolist() == [False, True, False, False]
    ctx.clock.round = 1
    assert p.victim((0, 3), set()) == (0, 2)  # the one never requested goes first
    assert p.victim((0, 3), {(0, 2)}) == (0, 1)


def test_victim_is_the_latest_expected_next_use_and_never_pinned():
    ctx = PolicyContext(capacity=3, num_layers=2, num_experts=2, top_k=1)
    p = make_policy("reuse", ctx)
    for r, keys in enumerate([[(0, 0), (1, 0)], [(0, 0), (1, 1)], [(0, 0)]]):
        ctx.clock.round = r
        for key in keys:
            p.on_request([key])
            if key not in p:
                if len(p) == 3:
                    p.on_evict(p.victim(key, {key}))
                p.on_insert(key)
            else:
                p.on_hit(key)
    ctx.clock.round, ctx.clock.layer = 3, 0
    live = [k for k in [(0, 0), (1, 0), (1, 1)] if k in p]
    p._sync()
    ids = np.array([k[0] * 2 + k[1] for k in live])
    due = p.waits(ids) + np.array([p._dist[0][i] for i in ids])  # D + wait, in layer visits
    want = live[int(np.argmax(due))]
    assert p.victim((0, 1), set()) == want
    assert p.victim((0, 1), {want}) == live[int(np.argsort(-due)[1])]  # the next one when it is pinned
    with pytest.raises(PolicyError, match="no evictable"):
        p.victim((0, 1), set(live))


def test_weights_files_round_trip_and_bad_ones_are_refused(tmp_path):
    report = train_policy([default_trace()], ["default"], orders=("flat",))
    path = tmp_path / "w.json"
    write_weights(report, path)
    assert load_weights(path) == tuple(report["weights"])
    name, params = parse_policy(f"reuse:weights={path},lr=0")
    assert params == {"weights": str(path), "lr": 0}
    ctx = PolicyContext(capacity=8, num_layers=4, num_experts=8, top_k=2)
    assert tuple(make_policy(name, ctx, **params).model.w) == pytest.approx(report["weights"])
    cases = {
        "missing.json": "cannot read weights",
        "text.json": "is not JSON",
        "other.json": "not a reuse weights file",
        "features.json": "other features",
        "short.json": f"must be {len(FEATURES)} finite numbers",
    }
    (tmp_path / "text.json").write_text("not json")
    (tmp_path / "other.json").write_text(json.dumps({"policy": "lru", "weights": []}))
    (tmp_path / "features.json").write_text(json.dumps({**report, "features": ["bias"]}))
    (tmp_path / "short.json").write_text(json.dumps({**report, "weights": [1.0, "x"]}))
    for file, message in cases.items():
        with pytest.raises(PolicyError, match=message):
            load_weights(tmp_path / file)
    with pytest.raises(PolicyError, match="lr must be"):
        make_policy("reuse", ctx, lr=-1)
    with pytest.raises(PolicyError, match="horizon must be"):
        make_policy("reuse", ctx, horizon=0)


def test_training_fits_the_examples_and_reports_held_out_scores():
    tr = synthesize("sticky", tokens=300, layers=3, experts=8, top_k=2, seed=1, stickiness=0.7)
    rounds = list(examples(tr, "flat"))
    assert len(rounds) == tr.num_tokens
    X = np.concatenate([x for x, _ in rounds])
    y = np.concatenate([y for _, y in rounds])
    assert y.sum() == (tr.experts >= 0).sum()  # each request is a positive label (distinct per round)
    w = fit(X, y)
    p = 1 / (1 + np.exp(-X @ w))
    base = -np.mean(y * np.log(y.mean()) + (1 - y) * np.log(1 - y.mean()))
    fitted = -np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))
    assert fitted < 0.8 * base  # sticky routing is predictable from the last round
    assert w[FEATURES.index("age == 1")] > 0
    other = synthesize("sticky", tokens=200, layers=3, experts=8, top_k=2, seed=2, stickiness=0.7)
    report = train_policy([tr], ["a"], ("flat",), [other], ["b"])
    assert report["test"]["log_loss"] < base and report["test"]["traces"] == ["b"]


@pytest.mark.parametrize("order", ORDERS)
def test_unknown_entries_are_no_examples_and_a_trace_of_nothing_known_is_refused(order):
    """A new user's trace with layers 3..5 unknown gave as many examples as the whole one, half of
    them labelled "not requested", and a trace of -1 alone trained to accuracy 1.0."""
    tr = synthesize("sticky", tokens=120, layers=4, experts=8, top_k=2, seed=3, stickiness=0.7)
    gap = tr.experts.copy()
    gap[:, 2:] = -1  # two layers unknown throughout
    gap[::5, 0, 1] = -1  # and one slot of layer 0 in every fifth token: that layer's round says nothing
    gapped = Trace(gap, 8, seq_id=tr.seq_id, is_prefill=tr.is_prefill)
    whole = sum(len(y) for _, y in examples(tr, order))
    rounds = list(examples(gapped, order))
    X = np.concatenate([x for x, _ in rounds])
    y = np.concatenate([y for _, y in rounds])
    assert len(X) == len(y) < whole / 2
    assert y.sum() == (np.where((gap >= 0).all(axis=2, keepdims=True), gap, -1) >= 0).sum() or order != "flat"
    base_whole = np.mean(np.concatenate([y for _, y in examples(tr, order)]))
    assert abs(y.mean() - base_whole) < 0.05  # the share of positives is not halved by the gaps
    nothing = Trace(np.full_like(tr.experts, -1), 8)
    with pytest.raises(ExpertcacheError, match="every entry is unknown"):
        train_policy([nothing], ["none"], (order,))
    with pytest.raises(ExpertcacheError, match="a single token has no past to learn from"):
        train_policy([Trace(tr.experts[:1], 8)], ["one"], (order,))


def test_reuse_runs_in_simulate_on_every_order_and_beats_lru_where_routing_is_sticky():
    tr = synthesize("sticky", tokens=400, layers=4, experts=16, top_k=2, seed=4, stickiness=0.6)
    for order in ORDERS:
        rows = {r.policy: r for r in simulate(tr, ["reuse", "lru"], [16], order)}
        assert rows["reuse"].misses < rows["lru"].misses, order
        assert rows["reuse"].opt_misses <= rows["reuse"].misses


def test_train_policy_command(tmp_path):
    out = tmp_path / "w.json"
    cmd = [sys.executable, "-m", "expertcache.cli", "train-policy", "default", "--order", "flat", "-o",
           str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "train: log-loss" in done.stdout and f"reuse:weights={out}" in done.stderr
    assert json.loads(out.read_text())["orders"] == ["flat"]
    sim = [sys.executable, "-m", "expertcache.cli", "sim", "default", "--policy", f"reuse:weights={out}",
           "--capacity", "24", "--json"]  # fmt: skip
    done = subprocess.run(sim, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)[0]["misses"] > 0
    bad = subprocess.run([*cmd[:4], "missing.npz"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "missing.npz" in bad.stderr
    bad = subprocess.run([*cmd[:-1], str(tmp_path / "no" / "w.json")], capture_output=True, text=True)
    assert bad.returncode == 2 and "cannot write" in bad.stderr


def test_the_fit_never_diverges_on_sticky_routing():
    """Plain Newton blew up here (log-loss 24, a bias of 1e10); with step halving the loss only falls."""
    tr = synthesize("sticky", tokens=1500, layers=4, experts=16, top_k=2, seed=0, stickiness=0.7,
                    sequences=4, prompt_len=32)  # fmt: skip
    report = train_policy([tr], ["sticky"])
    w = np.asarray(report["weights"])
    rate = report["train"]["base_rate"]
    base = -(rate * np.log(rate) + (1 - rate) * np.log(1 - rate))
    assert np.isfinite(w).all() and np.abs(w).max() < 100
    assert report["train"]["log_loss"] < 0.8 * base
    assert report["train"]["accuracy"] > 1 - rate  # better than always "not requested"


def test_parameters_are_checked_and_weights_can_be_given_in_memory(tmp_path):
    ctx = PolicyContext(capacity=8, num_layers=4, num_experts=8, top_k=2)
    for bad in (float("nan"), float("inf"), -0.1):
        with pytest.raises(PolicyError, match="lr must be a finite number"):
            make_policy("reuse", ctx, lr=bad)
    for bad in (2.5, 10**9, 0, True):
        with pytest.raises(PolicyError, match="horizon must be a whole number"):
            make_policy("reuse", ctx, horizon=bad)
    assert make_policy("reuse", ctx, horizon=4.0)._horizon == 4
    w = [0.5] * len(FEATURES)
    assert tuple(make_policy("reuse", ctx, weights=w).model.w) == tuple(w)
    for bad in ([True] * len(FEATURES), [1.0] * 3, [float("nan")] * len(FEATURES)):
        with pytest.raises(PolicyError, match="finite numbers"):
            make_policy("reuse", ctx, weights=bad)
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    with pytest.raises(PolicyError, match="'weights' is given twice"):  # not the last one silently
        parse_policy(f"reuse:weights={a},lr=0,weights={b}")
    name, params = parse_policy("reuse:weights=007,lr=0")
    assert params["weights"] == "007"  # a file name as written


def test_a_sweep_knows_a_weights_file_by_its_content(tmp_path):
    from expertcache.tools.sweep import Grid, sweep

    w = tmp_path / "w.json"
    write_weights(train_policy([default_trace()], ["default"], orders=("flat",)), w)
    grid = Grid(traces=("default",), policies=(f"reuse:weights={w}",), capacities=("25%",), orders=("flat",))
    first = sweep(grid, jobs=1, log=None)
    data = json.loads(w.read_text())
    data["weights"] = [x * 0.5 for x in data["weights"]]
    w.write_text(json.dumps(data))
    second = sweep(grid, jobs=1, log=None)
    assert first[0]["params"] != second[0]["params"] and "weights_sha=" in first[0]["params"]


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full here")
def test_train_policy_reports_a_failed_write_in_one_line():
    cmd = [sys.executable, "-m", "expertcache.cli", "train-policy", "default", "--order", "flat", "-o",
           "/dev/full"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "cannot write" in done.stderr


def test_training_samples_rounds_before_building_them(monkeypatch):
    from expertcache.tools import train_policy as tp

    tr = synthesize("zipf", tokens=400, layers=3, experts=8, top_k=2, seed=1)
    full = tp.train_policy([tr], ["z"], ("flat",))["examples"]
    assert full == 400 * 24
    monkeypatch.setattr(tp, "MAX_EXAMPLES", 2000)
    sampled = tp.train_policy([tr], ["z"], ("flat",))["examples"]
    assert sampled <= 2000 and sampled >= 2000 // 2  # every 5th round: 80 rounds of 24 experts


def test_without_numba_reuse_says_so_in_one_line(monkeypatch):
    import sys

    from expertcache.policy import reuse

    monkeypatch.setattr(reuse, "_JIT", None)
    import expertcache.policy

    monkeypatch.setitem(sys.modules, "expertcache.policy._reuse_jit", None)  # its import now fails
    monkeypatch.delattr(expertcache.policy, "_reuse_jit", raising=False)
    ctx = PolicyContext(capacity=4, num_layers=2, num_experts=4, top_k=1)
    with pytest.raises(PolicyError, match="reuse: its kernels need numba"):
        make_policy("reuse", ctx)
