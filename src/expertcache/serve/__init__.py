"""An OpenAI-compatible server over an offloaded model: ``expertcache serve`` (see ``serve.app``)."""

from __future__ import annotations

import logging
import signal

from expertcache.config import ServeConfig
from expertcache.errors import ExpertcacheError


def run(model, name: str, config: ServeConfig | None = None) -> bool:
    """Serve ``model`` under the id ``name`` until SIGINT or SIGTERM; True when its generation loop
    stopped (the engine may be closed). On the signal the server stops admitting requests, ends the
    running ones with an error event, stops the loop after its current step and returns (exit 0)."""
    import uvicorn

    from expertcache.serve.app import create_app
    from expertcache.serve.batcher import check_batchable
    from expertcache.serve.connections import (
        connection_cap,
        guarded_protocol,
        quiet_accept_errors,
        raise_file_limit,
    )

    config = config or ServeConfig()
    check_batchable(model.model.config)  # before the server starts: its loop is made at startup
    app = create_app(model, name, config)
    cap = connection_cap(config.max_connections, raise_file_limit())

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            """Requests still running end with an error event first, before uvicorn closes their
            connections (a client can tell a cut-off answer from a finished one); the signal is not
            raised again after the shutdown, so a clean stop exits 0."""
            batcher = getattr(app.state, "batcher", None)
            if batcher is not None:
                batcher.stop_admitting()
                batcher.fail_all()
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True

        async def startup(self, sockets=None) -> None:
            import asyncio

            quiet_accept_errors(asyncio.get_running_loop())
            try:
                await super().startup(sockets)
            except SystemExit:  # uvicorn's own exit: the application did not start, or no socket
                self.failed = "application" if self.lifespan.should_exit else "listen"
                raise

    protocol = guarded_protocol(cap, config.header_timeout_s, linger=config.body_timeout_s)
    uv = uvicorn.Config(
        app, host=config.host, port=config.port, log_level=config.log_level, log_config=_log_config(),
        http=protocol, timeout_keep_alive=config.idle_timeout_s, timeout_graceful_shutdown=3,
        server_header=False,
    )  # fmt: skip
    logging.getLogger("uvicorn.access").addFilter(_no_query)
    server = Server(uv)
    try:
        server.run()
    except SystemExit:  # one line and exit 2, as every error, not uvicorn's exit 3 (it logged why above)
        failed = getattr(server, "failed", None)
        if failed == "listen":  # the port was checked free before the model loaded: taken since?
            raise ExpertcacheError(
                f"cannot listen on {config.host}:{config.port} (uvicorn's error above): it was free before "
                "the model loaded, so another process has taken it since"
            ) from None
        if failed == "application":
            raise ExpertcacheError("the server's application did not start (its error above)") from None
        raise
    return getattr(app.state, "loop_stopped", True)


def _log_config() -> dict:
    """uvicorn's logging with the access log on stderr too (stdout is for results, and a server has
    none), and the server's own messages (``expertcache.serve``: failures with their incident ids)."""
    from copy import deepcopy

    from uvicorn.config import LOGGING_CONFIG

    config = deepcopy(LOGGING_CONFIG)
    config["handlers"]["access"]["stream"] = "ext://sys.stderr"
    config["loggers"]["expertcache"] = {"handlers": ["default"], "level": "INFO", "propagate": False}
    return config


def _no_query(record: logging.LogRecord) -> bool:
    """The access log without query strings: a key sent as ``?api_key=...`` is not written to it."""
    if isinstance(record.args, tuple) and len(record.args) >= 3 and isinstance(record.args[2], str):
        args = list(record.args)
        path, query, _ = args[2].partition("?")
        args[2] = path + ("?..." if query else "")
        record.args = tuple(args)
    return True


__all__ = ["ServeConfig", "run"]
