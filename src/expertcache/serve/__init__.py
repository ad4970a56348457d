"""An OpenAI-compatible server over an offloaded model: ``expertcache serve`` (see ``serve.app``)."""

from __future__ import annotations


def run(
    model,
    name: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    max_queue: int = 64,
    log_level: str = "info",
    kv_tokens: int | None = None,
) -> None:
    """Serve ``model`` until SIGINT or SIGTERM (in-flight requests are ended within a few seconds)."""
    import uvicorn

    from expertcache.serve.app import create_app

    app = create_app(model, name, api_key=api_key, max_queue=max_queue, kv_tokens=kv_tokens)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            """On SIGINT/SIGTERM, running requests end with an error event first, before uvicorn closes
            their connections: a client can tell a cut-off answer from a finished one."""
            batcher = getattr(app.state, "batcher", None)
            if batcher is not None:
                batcher.fail_all()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=3)
    Server(config).run()


__all__ = ["run"]
