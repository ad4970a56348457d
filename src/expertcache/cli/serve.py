"""``expertcache serve``: the OpenAI-compatible server, with every engine option of ``generate``."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from expertcache.cli.generate import add_model_args, load_model, load_plan
from expertcache.cli.util import lossy_note, output_option
from expertcache.config import KV_PAGE, SCHEDULES, SERVE_BATCH_TOKENS
from expertcache.errors import ExpertcacheError


def add_parser(sub) -> None:
    s = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (completions, chat, streaming, metrics)"
    )
    s.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)"
    )
    s.add_argument("--port", type=int, default=8000, help="(default 8000)")
    s.add_argument(
        "--api-key",
        metavar="KEY",
        help="every request but /health must carry 'Authorization: Bearer KEY' (default: "
        "$EXPERTCACHE_API_KEY, else none)",
    )
    s.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the model id clients ask for (default: embedded, or the --model given)",
    )
    s.add_argument(
        "--max-queue",
        type=int,
        default=64,
        metavar="N",
        help="requests running or waiting at most; more get 503 (default 64)",
    )
    s.add_argument(
        "--kv-cache-tokens", type=int, metavar="N",
        help="tokens the KV cache holds for all requests (default: max-queue x min(context, 2048), cut "
        "to what fits in memory)",
    )  # fmt: skip
    s.add_argument(
        "--max-batch-tokens", type=int, metavar="N",
        help="tokens one step computes at most: every running request's next token, then prompts in "
        f"chunks (default {SERVE_BATCH_TOKENS}, or a --plan's made with --concurrency)",
    )  # fmt: skip
    s.add_argument(
        "--schedule", metavar="{" + ",".join(SCHEDULES) + "}",
        help="which requests a step runs: fifo, transformers' order (every running request's next token, "
        "then new prompts); prompts-first, new prompts in a step of their own when one is waiting, for a "
        "shorter median time to first token (default fifo, or a --plan's made with --concurrency; "
        "docs/SERVE.md)",
    )  # fmt: skip
    s.add_argument(
        "--max-body",
        default="4MiB",
        metavar="SIZE",
        help="largest request body; larger ones get 413 before they are read (default 4MiB)",
    )
    s.add_argument(
        "--max-connections",
        type=int,
        metavar="N",
        help="connections open at once; beyond it the longest-idle is closed (default 4096, below the "
        "open-file limit)",
    )
    s.add_argument(
        "--header-timeout",
        default="10s",
        metavar="TIME",
        help="a connection must send its request's headers within this, else it is closed (default 10s)",
    )
    s.add_argument(
        "--body-timeout",
        default="30s",
        metavar="TIME",
        help="the request body must arrive within this of its headers, else 408 (default 30s)",
    )
    s.add_argument(
        "--idle-timeout",
        default="5s",
        metavar="TIME",
        help="an idle keep-alive connection is closed after this (default 5s)",
    )
    s.add_argument(
        "--allowed-host",
        action="append",
        metavar="NAME",
        help="a Host header name clients may use besides localhost, 127.0.0.1 and ::1 (repeat it; "
        "'*' for any, behind a proxy that checks it)",
    )
    s.add_argument(
        "--metrics-open", action="store_true", help="/metrics without the API key (it needs it by default)"
    )
    s.add_argument(
        "--docs", action="store_true", help="serve /docs, /redoc and /openapi.json (off by default)"
    )
    s.add_argument("--quiet", action="store_true", help="no access log or progress on stderr")
    s.add_argument(
        "--record-trace", metavar="FILE.npz",
        help="keep the routing of every step served (each token's request and phase) and write it as a "
        "trace when the server stops, for sim, timing, plan and doctor (memory grows with the tokens "
        "served: about 8 bytes x layers x top-k a token)",
    )  # fmt: skip
    output_option(s, "record_trace", "trace")
    add_model_args(s)
    s.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from expertcache.config import LOOPBACK_HOSTS, ServeConfig

    api_key = os.environ.get("EXPERTCACHE_API_KEY") if args.api_key is None else args.api_key
    if args.api_key is None and api_key is not None and not api_key.strip():
        raise ExpertcacheError(
            "EXPERTCACHE_API_KEY is set but empty: set it to the key clients must send, or unset it (an "
            "empty key would leave every endpoint open)"
        )
    batch_tokens, schedule, layout_note = _layout(args)
    config = ServeConfig(
        host=args.host, port=args.port, api_key=api_key,
        max_queue=args.max_queue, kv_tokens=args.kv_cache_tokens, batch_tokens=batch_tokens,
        schedule=schedule, max_body=args.max_body,
        max_connections=args.max_connections, header_timeout=args.header_timeout,
        body_timeout=args.body_timeout, idle_timeout=args.idle_timeout,
        allowed_hosts=tuple(args.allowed_host or ()), metrics_open=args.metrics_open, docs=args.docs,
        log_level="warning" if args.quiet else "info",
    )  # fmt: skip
    _check_port(args.host, args.port)  # before the model loads
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise ExpertcacheError("--served-model-name is empty: give the id clients ask for, or leave it out")
    from expertcache.engine.hub import model_label
    from expertcache.serve import run

    if config.kv_tokens is not None and config.kv_rounded != config.kv_tokens:
        print(
            f"note: --kv-cache-tokens {config.kv_tokens} rounded up to {config.kv_rounded} "
            "(the KV cache holds whole pages of 256 tokens)",
            file=sys.stderr,
        )
    if config.metrics_open and not config.api_key:
        print("note: --metrics-open changes nothing without an API key (--api-key): every endpoint is open",
              file=sys.stderr)  # fmt: skip
    if args.host not in LOOPBACK_HOSTS:
        if not config.api_key:
            print(
                f"note: serving on {args.host} without an API key: anyone who can reach it can use it",
                file=sys.stderr,
            )
        if config.host_names() is not None and not config.allowed_hosts:
            print(
                f"note: clients must name this server {', '.join(sorted(config.host_names()))} in their "
                "Host header; add the names they use with --allowed-host NAME",
                file=sys.stderr,
            )
    from expertcache.engine.hub import resolve_model
    from expertcache.engine.loader import read_config
    from expertcache.serve.batcher import check_batchable, kv_size

    try:
        local = resolve_model(args.model)
    except ExpertcacheError:  # not here yet (a download): checked once loaded
        local = None
    if local is not None:
        check_batchable(read_config(local))  # before the model loads
    model = load_model(args, record=bool(args.record_trace))
    try:  # what can still refuse it, before a line that says it serves
        model.tokenizer  # noqa: B018 (read now: a folder without one is refused here, not at a request)
        kv_tokens, kv_note = kv_size(model, config.max_queue, config.kv_tokens)  # one that fits, first
    except ExpertcacheError:
        model.close()
        raise
    if layout_note:
        print(layout_note, file=sys.stderr)
    if not args.quiet:  # what runs, as a plan or the options chose it
        kv = f", KV cache {kv_tokens} tokens" if kv_tokens else ""
        pages = kv_tokens // KV_PAGE if kv_tokens else None
        if pages is not None and pages < config.max_queue:  # each request holds a page at least
            kv += f" ({pages} pages of {KV_PAGE}: at most {pages} requests at once, the others wait)"
        print(f"serving {describe_run(model)}{kv}", file=sys.stderr)
    note = lossy_note(model.stats, model.miss.lossy)
    if note:
        print(note, file=sys.stderr)
    if kv_note:
        print(kv_note, file=sys.stderr)
    config = dataclasses.replace(config, kv_tokens=kv_tokens)
    name = args.served_model_name or (args.model if args.model else model_label(model.path))
    stopped = True  # run() raising means no loop was left running
    try:
        stopped = run(model, name, config)
    finally:
        if args.record_trace:
            _save_trace(model, args.record_trace, stopped, config)
        if stopped:
            model.close()
        else:  # closing the engine under a loop still computing would fail inside it
            print(
                "note: the generation loop was still running at exit; the engine was not closed",
                file=sys.stderr,
            )
    return 0


def _layout(args: argparse.Namespace) -> tuple[int, str, str | None]:
    """The steps' size cap and schedule: as given, else as a ``--plan`` made for requests served N at a
    time laid them out, else the defaults; and a note where a plan made so is taken or not followed."""
    made = load_plan(args).serving() if str(getattr(args, "plan", None) or "").strip() else None

    def given(value, otherwise):  # a value given (0 or "" too: refused by ServeConfig), or the other
        return otherwise if value is None else value

    if made is None:
        return given(args.max_batch_tokens, SERVE_BATCH_TOKENS), given(args.schedule, "fifo"), None
    planned_tokens = made["batch_tokens"] or SERVE_BATCH_TOKENS
    batch_tokens = given(args.max_batch_tokens, planned_tokens)
    schedule = given(args.schedule, made["schedule"])
    laid = f"steps of at most {planned_tokens} tokens, {made['schedule']}"
    if made.get("concurrency") is not None:
        laid += f", for {made['concurrency']} requests at a time (the server takes as many as come, up "
        laid += "to --max-queue)"
    else:  # a plan made on a served run's trace: as that server laid its steps out
        laid += ", as the server whose trace it was made on"
    note = None
    if (batch_tokens, schedule) != (planned_tokens, made["schedule"]):
        note = (
            f"note: the plan was made serving {laid}; this server's steps differ (at most {batch_tokens} "
            f"tokens, {schedule}), so its figures are not the plan's"
        )
    elif args.max_batch_tokens is None or args.schedule is None:
        note = f"note: serving as the plan was made: {laid} (--max-batch-tokens and --schedule give others)"
    return batch_tokens, schedule, note


def describe_run(model) -> str:
    """One line: the model, its expert memory, and the policy, miss path and predictor that run."""
    from expertcache.engine.hub import model_label

    total = model.num_layers * model.num_experts
    held = model.stats["parts"]  # a path's other parts beside the cache (batch's stream buffer)
    beside = "".join(f" + {p} {d['slots']} slots" for p, d in held.items() if p != "full" and len(held) > 1)
    parts = [
        f"{model_label(model.path)} on {model.device}: {model.capacity} of {total} experts{beside}",
        f"policy {model.cache_config.policy}", f"miss {model.miss.describe()}", f"prefetch {model.prefetch}",
    ]  # fmt: skip
    if model.plan is not None:
        parts.append(f"from plan {model.plan.file or ''}".rstrip())
    return ", ".join(parts)


def _save_trace(model, path: str, stopped: bool, config) -> None:
    """The served steps' routing, written as the server stops (a step still running is left out), with
    how the server laid its steps out (meta ``served_batch_tokens``, ``served_schedule``: a plan made on the
    trace serves so again)."""
    if not stopped:
        print(f"note: the generation loop was still running; {path} not written", file=sys.stderr)
        return
    try:
        trace = model.trace()
    except ExpertcacheError as exc:  # nothing was served
        print(f"note: {exc}; {path} not written", file=sys.stderr)
        return
    layout = {"served_batch_tokens": int(config.batch_tokens), "served_schedule": str(config.schedule)}
    trace = dataclasses.replace(trace, meta={**trace.meta, **layout})
    trace.save(path)
    print(f"trace of {trace.num_tokens} tokens written to {path}", file=sys.stderr)


def _check_port(host: str, port: int) -> None:
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ExpertcacheError(f"--host {host}: not an address of this machine ({exc.strerror})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as exc:
            raise ExpertcacheError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
