"""``expertcache serve``: the OpenAI-compatible server, with every engine option of ``generate``."""

from __future__ import annotations

import argparse
import os
import sys

from expertcache.cli.generate import add_model_args, load_model
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
        help="/v1 requests must carry 'Authorization: Bearer KEY' (default: $EXPERTCACHE_API_KEY, else none)",
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
        help="tokens the KV cache holds for all requests (default: max-queue x min(context, 2048))",
    )  # fmt: skip
    s.add_argument("--quiet", action="store_true", help="no access log or progress on stderr")
    add_model_args(s)
    s.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    if not 0 < args.port < 65536:
        raise ExpertcacheError(f"--port must be in 1..65535, got {args.port}")
    if args.kv_cache_tokens is not None and args.kv_cache_tokens < 1:
        raise ExpertcacheError(f"--kv-cache-tokens must be at least 1, got {args.kv_cache_tokens}")
    if args.max_queue < 1:
        raise ExpertcacheError(f"--max-queue must be at least 1, got {args.max_queue}")
    _check_port(args.host, args.port)  # before the model loads
    from expertcache.engine.hub import model_label
    from expertcache.serve import run

    model = load_model(args, record=False)
    name = args.served_model_name or (args.model if args.model else model_label(model.path))
    key = args.api_key or os.environ.get("EXPERTCACHE_API_KEY")
    if args.host not in ("127.0.0.1", "localhost", "::1") and not key:
        print(
            f"note: serving on {args.host} without an API key: anyone who can reach it can use it",
            file=sys.stderr,
        )
    try:
        level = "warning" if args.quiet else "info"
        run(model, name, args.host, args.port, key, args.max_queue, level, args.kv_cache_tokens)
    finally:
        model.close()
    return 0


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
