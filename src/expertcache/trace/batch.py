"""Many users from one stream: a trace's requests served together, as a server batches them.

``batch_requests`` turns a trace of requests recorded one at a time (each a prompt, then its generated
tokens; ``seq_id`` and ``is_prefill``) into the trace a server running ``concurrency`` of them at once
would record (``serve --record-trace``): forward steps (``step_id``) that each compute the next token of
every running request and the prompts of those joining, each token with its request (``seq_id``) and
phase (``is_prefill``). It is a closed loop, as ``bench/serve_load.py`` runs one: ``concurrency``
clients, client c sending its first request at step ``c * stagger`` and its next one as soon as the last
ends. Request r replays the trace's request ``r % S`` (S requests in the trace); a copy is a new request
(its own ``seq_id``), and with staggered starts no two copies of a request run in step with each other.

A step is laid out as transformers' continuous batching lays it out: the running requests' decode
tokens first (in the order they joined), then the prompts of the requests joining, in chunks when
``batch_tokens`` caps the step (a chunked prompt goes on in the next steps, before anything new joins).
That is the server's ``--schedule fifo``; with ``prompts-first`` (``serve.scheduling``) a step with
prompts to compute, after one that did not compute prompts alone, computes them alone, the decodes
sitting it out.
The routing of each token is the one recorded for it: experts and gate weights do not depend on what
else ran in the step (true of the model, which computes each token alone, up to floating-point order).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from expertcache.errors import ExpertcacheError, TraceError, arguments_checked, option, warn_notes
from expertcache.trace.trace import Trace, as_trace
from expertcache.units import whole_number

SCHEDULES = ("fifo", "prompts-first")  # which requests a step runs: the server's --schedule


def requests_of(trace: Trace) -> list[tuple[np.ndarray, int]]:
    """The trace's requests in order of first appearance: (their token rows, how many are prompt tokens).
    A request's rows must be its prompt tokens, then its generated tokens; a padded batch's left padding
    (``padding``) is no request's, and a server computes none: left out."""
    if trace.seq_id is None or trace.is_prefill is None:
        raise TraceError(
            f"{trace.source}: batching needs each token's request and phase ('seq_id' and 'is_prefill')"
        )
    if (trace.is_prefill == -1).any():
        raise TraceError(f"{trace.source}: batching needs every token's phase; 'is_prefill' has -1 entries")
    out = []
    seqs, first = np.unique(trace.seq_id, return_index=True)
    for seq in seqs[np.argsort(first, kind="stable")].tolist():
        own = trace.seq_id == seq
        rows = np.flatnonzero(own if trace.padding is None else own & (trace.padding == 0))
        phase = trace.is_prefill[rows]
        prompt = int(phase.sum())
        if prompt == 0 or not (phase[:prompt] == 1).all() or (phase[prompt:] == 1).any():
            raise TraceError(
                f"{trace.source}: request {seq} is not a prompt followed by generated tokens (batching "
                "replays each request as one)"
            )
        out.append((rows, prompt))
    return out


MAX_TOKENS = 20_000_000  # a batched trace's tokens at most: built step by step, request by request, in lists


# what an engine's run records of itself (``OffloadedModel.trace``): its cache, its policy and what it ranked
# or drew by, its miss path and costs, its predictor, its host level; a batched trace is another workload
RUN_META = frozenset({
    "capacity", "capacities", "memory", "policy", "policy_seed", "profile", "miss", "costs", "costs_measured",
    "predictor", "window", "predictor_needs_model", "deterministic", "prefetch_limit", "device",
    "host_capacity", "host_policy", "host_exclusive", "host_stage", "served_batch_tokens", "served_schedule",
})  # fmt: skip


def is_batched(trace: Trace) -> bool:
    """Steps recorded or laid out (``step_id``) that serve several requests at once, some of them: a
    served or ``trace batch`` trace, whose requests' own times are not its steps'."""
    if trace.step_id is None or trace.seq_id is None:
        return False
    starts = np.flatnonzero(np.r_[True, trace.step_id[1:] != trace.step_id[:-1]])
    seq = trace.seq_id.astype(np.int64)
    firsts = np.maximum.reduceat(seq, starts) != np.minimum.reduceat(seq, starts)
    return bool(firsts.any())


@arguments_checked
def batch_requests(
    trace: Trace,
    concurrency: int,
    requests: int | None = None,
    batch_tokens: int | None = None,
    stagger: int = 1,
    schedule: str = "fifo",
) -> Trace:
    """``trace``'s requests as a server runs ``concurrency`` of them at once (see the module docstring):
    ``requests`` in all (default: the trace's, or twice ``concurrency`` if more), ``batch_tokens`` a step
    at most (default: no cap; a prompt then joins whole), clients starting ``stagger`` steps apart, steps
    laid out by ``schedule`` (``SCHEDULES``)."""
    if schedule not in SCHEDULES:
        raise TraceError(
            f"{option('--schedule', 'schedule')} must be one of {', '.join(SCHEDULES)}, got {schedule!r}"
        )
    trace = as_trace(trace)
    named = {k: option(f"--{k.replace('_', '-')}", k) for k in ("concurrency", "stagger", "requests")}
    named["batch_tokens"] = option("--batch-tokens", "batch_tokens")
    try:
        whole_number(concurrency, named["concurrency"])
        whole_number(stagger, named["stagger"], 0)
        for name, value in (("requests", requests), ("batch_tokens", batch_tokens)):
            if value is not None:
                whole_number(value, named[name])
    except ExpertcacheError as e:
        raise TraceError(str(e)) from None
    if batch_tokens is not None and batch_tokens < concurrency:
        raise TraceError(
            f"{named['batch_tokens']} {batch_tokens} is below {named['concurrency']} {concurrency}: a step "
            "must hold the next token of every running request"
        )
    if is_batched(trace):  # a served run's steps (or another batch's): laid out again, said so
        warn_notes([
            f"{trace.source} is served already (its steps hold several requests each); its requests are "
            f"laid out again here, {concurrency} at a time, in place of its own steps"
        ])  # fmt: skip
    pool = requests_of(trace)
    total = requests if requests is not None else max(len(pool), 2 * concurrency)
    if total < 1:
        raise TraceError(f"{named['requests']} must be at least 1, got {total}")
    tokens = total * sum(len(r) for r, _ in pool) / len(pool)  # the batched trace's, about
    if tokens > MAX_TOKENS:  # found out at once, not by running out of memory (a step per client each)
        raise TraceError(
            f"{total} requests of {trace.source} (concurrency {concurrency}) would make a trace of about "
            f"{tokens:,.0f} tokens, more than {MAX_TOKENS:,}: give fewer requests or a lower concurrency"
        )
    rows_out: list[np.ndarray] = []
    seq_out: list[np.ndarray] = []
    step_out: list[np.ndarray] = []
    running: list[list[int]] = []  # [request, next row offset, prompt length, rows' index into pool]
    ready = [c * stagger for c in range(concurrency)]  # the step each client sends its next request at
    client_of: dict[int, int] = {}
    sent, step = 0, 0
    alone_last = False  # prompts-first: the step before computed prompts alone
    while sent < total or running:
        for c in range(concurrency):  # clients whose time has come send (one request each at a time)
            if sent < total and ready[c] is not None and ready[c] <= step:
                running.append([sent, 0, pool[sent % len(pool)][1], sent % len(pool)])
                client_of[sent] = c
                ready[c] = None
                sent += 1
        if not running:  # nobody has sent yet: the clients' starts are staggered
            step += 1
            continue
        budget = batch_tokens if batch_tokens is not None else np.iinfo(np.int64).max
        rows, seqs = [], []
        decoding = [r for r in running if r[1] >= r[2]]
        prompting = [r for r in running if r[1] < r[2]]
        alone = schedule == "prompts-first" and bool(prompting) and bool(decoding) and not alone_last
        alone_last = alone
        for r in prompting if alone else decoding + prompting:  # decodes first, then prompts (chunks)
            req, offset, prompt, which = r
            take = 1 if offset >= prompt else min(prompt - offset, budget)
            if take <= 0:
                continue
            src = pool[which][0]
            rows.append(src[offset : offset + take])
            seqs.append(np.full(take, req, dtype=np.int32))
            r[1] += take
            budget -= take
        rows_out.extend(rows)
        seq_out.extend(seqs)
        step_out.append(np.full(sum(len(x) for x in rows), len(step_out), dtype=np.int32))
        for r in [r for r in running if r[1] >= len(pool[r[3]][0])]:  # its last token computed: it ends
            running.remove(r)
            ready[client_of.pop(r[0])] = step + 1
        step += 1
    index = np.concatenate(rows_out)
    meta = {  # per-token metadata (a token's position, say) follows its token; a recorded run's own
        # (its cache, policy, predictor, costs) does not describe the new steps, and would be replayed
        k: v[index] if isinstance(v, np.ndarray) and v.ndim and len(v) == trace.num_tokens else v
        for k, v in trace.meta.items()
        if k not in RUN_META
    }
    source = Path(trace.source)  # whole: a plan made on the batched file finds it from any folder
    meta.update(
        batched_from=str(source.resolve()) if source.is_file() else trace.source, concurrency=concurrency,
        batched_requests=total, stagger=stagger, schedule=schedule,
    )  # fmt: skip
    if batch_tokens is not None:
        meta["batch_tokens"] = batch_tokens
    return Trace(
        experts=trace.experts[index],
        num_experts=trace.num_experts,
        weights=None if trace.weights is None else trace.weights[index],
        seq_id=np.concatenate(seq_out),
        is_prefill=trace.is_prefill[index],
        token_id=None if trace.token_id is None else trace.token_id[index],
        step_id=np.concatenate(step_out),
        meta=meta,
        source=f"{trace.source} x{concurrency}",
    )
