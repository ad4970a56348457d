"""Training the ``reuse`` eviction policy offline: its logistic model fitted on recorded routing.

The model (``policy/reuse.py``) predicts whether an expert is requested at its layer's next visit from
features of its past requests. Neither depends on the cache, so every (round, expert) of a trace is one
example: the features at the round's start and whether the round requested the expert. The examples of
all traces (in the given orders) are pooled and fitted by Newton's method on the log-loss with a small
ridge; the result is the policy's starting point (``--policy reuse:weights=FILE``), from which it goes on
learning online. The file also records the fit's log-loss and accuracy on the training examples, and on
held-out traces if given (``--test``).

No torch: this runs on traces alone.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from expertcache.cache.schedule import build_schedule
from expertcache.errors import ExpertcacheError
from expertcache.paths import write_output
from expertcache.policy.reuse import DEFAULT_WEIGHTS, FEATURES, ReuseModel
from expertcache.trace.trace import Trace, check_replayable

RIDGE = 1e-3  # per example, on every weight but the bias
ITERATIONS = 25
MAX_EXAMPLES = 4_000_000  # rounds are sampled evenly beyond this (memory: 88 bytes an example)


def examples(trace: Trace, order: str, every: int = 1) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(X [K, F], y [K]) per round of ``trace`` in ``order`` (every ``every``-th round): the model's
    features at the round's start and which experts the round requested, as the policy sees them
    (``on_request`` per group)."""
    s = build_schedule(trace, order)
    model = ReuseModel(s.num_layers, s.num_experts, s.top_k, DEFAULT_WEIGHTS, lr=0.0)
    scores = s.group_scores
    per_round = s.per_layer * s.num_layers
    E = s.num_experts
    # a layer whose round holds an unknown entry (-1) says nothing of its experts there: not "unused"
    known = np.repeat(~unknown_layers(trace, s), E, axis=1)  # [rounds, L * E]

    def example():
        keep = known[model.round]
        return model.X[keep], model.used[keep].astype(np.float64)

    for g, keys in enumerate(s.groups):
        rnd = g // per_round
        if rnd != model.round:
            if model.round % every == 0:
                yield example()
            model.advance(rnd, int(s.round_token[rnd]))
        if keys:
            sc = None if scores is None else [scores[g].get(k, 0.0) for k in keys]
            model.observe([layer * E + e for layer, e in keys], sc)
    if model.round % every == 0:
        yield example()


def unknown_layers(trace: Trace, schedule) -> np.ndarray:
    """Which layers of each round of ``schedule`` hold an unknown entry of ``trace``. -> bool [rounds, L]"""
    unknown = trace.experts < 0  # [T, L, K]
    if schedule.order == "rounds":  # round t * K + k: the k-th expert of every layer
        return unknown.transpose(0, 2, 1).reshape(-1, trace.num_layers)
    per_token = unknown.any(axis=2)  # [T, L]
    return np.logical_or.reduceat(per_token, schedule.round_token, axis=0)  # a round: its tokens


def _stack(traces: Sequence[Trace], orders: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Every example of the traces in the orders; beyond ``MAX_EXAMPLES``, every k-th round's, chosen
    before they are built (a long trace would not fit in memory otherwise)."""
    total = sum(tr.num_tokens * tr.num_layers * tr.num_experts for tr in traces) * len(orders)
    every = max(1, math.ceil(total / MAX_EXAMPLES))  # rounds <= tokens: at most MAX_EXAMPLES kept
    parts = [(X, y) for tr in traces for order in orders for X, y in examples(tr, order, every)]
    if not parts or not sum(len(y) for _, y in parts):
        raise ExpertcacheError("train-policy: the traces hold no rounds of known routing")
    return np.concatenate([X for X, _ in parts]), np.concatenate([y for _, y in parts])


def fit(X: np.ndarray, y: np.ndarray, iterations: int = ITERATIONS) -> np.ndarray:
    """Logistic regression by Newton's method with a ridge (``RIDGE`` per example, bias free) and step
    halving: a step that does not lower the penalised log-loss is halved until it does, so the fit never
    diverges (plain Newton does, on strongly separable features). -> [F]"""
    n, f = X.shape
    rate = min(max(y.mean(), 1e-6), 1 - 1e-6)
    w = np.zeros(f)
    w[0] = math.log(rate / (1 - rate))
    ridge = RIDGE * n * np.eye(f)
    ridge[0, 0] = 0.0

    def objective(w: np.ndarray) -> float:
        z = np.clip(X @ w, -30, 30)
        return float(np.sum(np.logaddexp(0.0, z) - y * z) + 0.5 * w @ ridge @ w)

    loss = objective(w)
    for _ in range(iterations):
        p = 1.0 / (1.0 + np.exp(-np.clip(X @ w, -30, 30)))
        grad = X.T @ (p - y) + ridge @ w
        hess = (X * (p * (1 - p))[:, None]).T @ X + ridge + 1e-9 * np.eye(f)
        step = np.linalg.solve(hess, grad)
        t = 1.0
        while t > 1e-6:
            trial = objective(w - t * step)
            if trial <= loss:
                break
            t /= 2
        else:
            break  # no step lowers the loss: converged as far as it goes
        w, loss = w - t * step, trial
        if np.abs(t * step).max() < 1e-7:
            break
    return w


def scores(X: np.ndarray, y: np.ndarray, w: np.ndarray) -> dict[str, float]:
    """Log-loss, accuracy at 0.5 and the base rate of y."""
    p = 1.0 / (1.0 + np.exp(-np.clip(X @ w, -30, 30)))
    eps = 1e-12
    loss = -float(np.mean(y * np.log(p + eps) + (1 - y) * np.log(1 - p + eps)))
    accuracy = float(np.mean((p >= 0.5) == (y >= 0.5)))
    return {"log_loss": loss, "accuracy": accuracy, "base_rate": float(y.mean())}


def train_policy(
    traces: Sequence[Trace],
    names: Sequence[str],
    orders: Sequence[str] = ("layer", "flat"),
    test: Sequence[Trace] = (),
    test_names: Sequence[str] = (),
) -> dict[str, object]:
    """Fit the reuse model on ``traces`` (in each of ``orders``) -> a weights file's content; ``names``
    (and ``test_names``) one per trace, as the report lists them."""
    for what, given in (("traces", traces), ("names", names), ("orders", orders), ("test", test),
                        ("test_names", test_names)):  # fmt: skip
        if isinstance(given, str | Trace) or not isinstance(given, Sequence):  # "layer" is not l, a, y...
            raise ExpertcacheError(f"train_policy's {what} is a list, got {given!r}")
    if len(names) != len(traces) or len(test_names) != len(test):
        raise ExpertcacheError(
            f"train_policy takes a name per trace: {len(traces)} traces and {len(names)} names, "
            f"{len(test)} test traces and {len(test_names)} test names"
        )
    if not all(isinstance(t, Trace) for t in (*traces, *test)):
        raise ExpertcacheError("train_policy's traces are Trace objects (expertcache.load_trace(path))")
    for t in (*traces, *test):
        check_replayable(t)
    if sum(t.num_tokens for t in traces) < 2:  # one step: no history, so nothing for the features to tell
        raise ExpertcacheError("train-policy: a single token has no past to learn from; give a longer trace")
    X, y = _stack(traces, orders)
    w = fit(X, y)
    report: dict[str, object] = {
        "policy": "reuse",
        "features": list(FEATURES),
        "weights": [round(float(x), 6) for x in w],
        "trained_on": list(names),
        "orders": list(orders),
        "examples": len(y),
        "train": scores(X, y, w),
    }
    if test:
        Xt, yt = _stack(test, orders)
        report["test"] = {**scores(Xt, yt, w), "traces": list(test_names), "examples": len(yt)}
    return report


def format_report(report: dict[str, object]) -> str:
    lines = [f"reuse model: {len(FEATURES)} weights from {report['examples']:,} examples "
             f"({', '.join(report['trained_on'])}; orders {', '.join(report['orders'])})"]  # fmt: skip
    for part in ("train", "test"):
        if part in report:
            r = report[part]
            lines.append(f"  {part}: log-loss {r['log_loss']:.4f}, accuracy {r['accuracy']:.4f} "
                         f"(requested at next visit: {r['base_rate']:.4f} of examples)")  # fmt: skip
    width = max(len(f) for f in FEATURES)
    lines += [f"  {name:<{width}}  {w:+.4f}" for name, w in zip(FEATURES, report["weights"], strict=True)]
    return "\n".join(lines)


def write_weights(report: dict[str, object], path: str | Path) -> None:
    write_output(path, json.dumps(report, indent=1) + "\n", "policy weights")
