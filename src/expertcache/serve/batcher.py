"""The server's generation loop: concurrent requests share the model and its expert cache.

Requests go to transformers' continuous batching (``model.init_continuous_batching``), which works with
the engine unchanged: the offloaded experts see a step's tokens of every running request flattened
together, as they see any batch, so one step's experts for the whole batch are requested together. A
request joins at a step boundary and leaves when it ends; nobody waits for a batch to finish.

Sampling is per request: the manager samples (``do_sample``) with per-request temperature, top-k and
top-p, and a greedy request is sampled with ``top_k=1``, which is the argmax (the tests check that a
greedy request's tokens equal ``expertcache generate``'s for the same prompt alone). Per-request seeds
are not supported by transformers' batching: a sampled request is not reproducible under concurrency.

One thread (``_dispatch``) reads the manager's results and hands each request its new text on the
server's event loop: detokenised, cut at a stop string (held back while it may begin one), finished
at eos, a stop string or ``max_tokens``. A full queue is refused (``QueueFull``), a cancelled request
(a client that went away) leaves the batch at the next step.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from expertcache.engine.generation import held_back
from expertcache.errors import ExpertcacheError

FINISHED = 3  # transformers' RequestStatus.FINISHED
FAILED = 4  # RequestStatus.FAILED


class QueueFull(ExpertcacheError):
    """More requests are waiting or running than the server takes (HTTP 503)."""


@dataclass
class Piece:
    """What a request produced since the last piece: new text, the token count so far, and, at its end,
    why it ended (``stop`` for eos or a stop string, ``length`` for max_tokens)."""

    text: str
    tokens: int
    finish: str | None = None
    error: str | None = None


@dataclass
class Job:
    id: str
    prompt_tokens: int
    max_tokens: int
    stop: tuple[str, ...]
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    submitted: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    last_token: float | None = None
    tokens: list[int] = field(default_factory=list)
    sent: int = 0  # characters of the text already handed out
    done: bool = False


class Batcher:
    """Continuous batching over an ``OffloadedModel``; ``submit`` a request, iterate over its pieces."""

    def __init__(
        self, model, max_queue: int = 64, metrics=None, kv_tokens: int | None = None, batch_tokens: int = 512
    ) -> None:
        """``kv_tokens``: the KV cache's size in tokens (default: ``max_queue`` requests of up to 2048
        tokens, or the context if shorter); ``batch_tokens``: tokens one step computes at most (prefill
        chunks included). transformers' own defaults size the cache to most of the free memory, 14 GB
        for the 22 MB embedded model on a CPU: the server sizes it to what it serves."""
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        self.model, self.tokenizer, self.metrics = model, model.tokenizer, metrics
        self.max_queue = max_queue
        self.vocab = int(model.config.vocab_size)
        eos = model.tokenizer.eos_token_id
        pad = model.tokenizer.pad_token_id if model.tokenizer.pad_token_id is not None else eos
        # the defaults are placeholders (every request passes its own); temperature and top-p must not
        # be None or 1.0 here, or transformers creates no per-request processor for them
        config = GenerationConfig(
            do_sample=True,
            temperature=0.5,
            top_k=self.vocab,
            top_p=0.5,
            eos_token_id=eos,
            pad_token_id=pad,
            max_new_tokens=1,
        )
        context = int(getattr(model.config, "max_position_embeddings", None) or 2048)
        self.kv_tokens = kv_tokens or max_queue * min(context, 2048)
        page = 256
        try:
            cb = ContinuousBatchingConfig(
                per_request_processors=True, page_size=page, num_blocks=-(-self.kv_tokens // page),
                max_batch_tokens=batch_tokens,
            )  # fmt: skip
        except TypeError:
            raise ExpertcacheError(
                "expertcache serve needs a transformers whose continuous batching takes per-request sampling "
                "(5.23 is tested): pip install -U transformers"
            ) from None
        self.manager = model.model.init_continuous_batching(
            generation_config=config, continuous_batching_config=cb
        )
        self.jobs: dict[str, Job] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._running = True
        self.manager.start()
        self._thread = threading.Thread(target=self._dispatch, name="expertcache-dispatch", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------ requests
    def submit(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int | None = None,
        stop: tuple[str, ...] = (),
    ) -> Job:
        """Queue a request; its pieces arrive on ``job.queue`` (use ``pieces``). Refused when full."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if len(self.jobs) >= self.max_queue:
                raise QueueFull(f"the server is busy: {len(self.jobs)} requests running or waiting")
            job = Job(f"r{next(self._ids)}", len(prompt_ids), max_tokens, stop, asyncio.Queue(), loop)
            self.jobs[job.id] = job
        greedy = temperature == 0
        self.manager.add_request(
            prompt_ids,
            request_id=job.id,
            max_new_tokens=max_tokens,
            streaming=True,
            temperature=1.0 if greedy else float(temperature),
            top_k=1 if greedy else int(top_k or self.vocab),
            top_p=1.0 if greedy else float(top_p),
        )
        if self.metrics:
            self.metrics.queued(len(self.jobs))
        return job

    async def pieces(self, job: Job) -> AsyncIterator[Piece]:
        """The request's pieces as they come; leaving early (a client gone) cancels the request."""
        try:
            while True:
                piece = await job.queue.get()
                yield piece
                if piece.finish is not None or piece.error is not None:
                    return
        finally:
            self.cancel(job)

    def cancel(self, job: Job) -> None:
        with self._lock:
            gone = self.jobs.pop(job.id, None)
        if gone is not None and not job.done:
            job.done = True
            self.manager.cancel_request(job.id)
            job.loop.call_soon_threadsafe(job.queue.put_nowait, Piece("", len(job.tokens), error="cancelled"))
            if self.metrics:
                self.metrics.cancelled()
        if self.metrics:
            self.metrics.queued(len(self.jobs))

    def fail_all(self, message: str = "the server is shutting down") -> None:
        """End every request still running with an error piece (its client sees an error, not a quiet end)."""
        for job in list(self.jobs.values()):
            if job is not None and not job.done:
                self._hand(job, Piece("", len(job.tokens), error=message))

    def close(self, timeout: float = 5.0) -> None:
        """Stop: requests still running are ended (their clients get an error piece)."""
        self.fail_all()
        self._running = False
        self.manager.stop(block=True, timeout=timeout)
        self._thread.join(timeout)

    # ------------------------------------------------------------------------------ results
    def _dispatch(self) -> None:
        while self._running:
            out = self.manager.get_result(timeout=0.1)
            if out is None:
                continue
            job = self.jobs.get(out.request_id)
            if job is None or job.done:
                continue
            try:
                self._update(job, out)
            except Exception as exc:  # a bad piece must not end the loop that serves everyone
                self._hand(job, Piece("", len(job.tokens), error=f"generation failed: {exc}"))

    def _update(self, job: Job, out) -> None:
        now = time.perf_counter()
        new = list(out.generated_tokens)
        if len(new) > len(job.tokens):
            if job.first_token is None:
                job.first_token = now
                if self.metrics:
                    self.metrics.first_token(now - job.submitted)
            elif self.metrics and job.last_token is not None:
                self.metrics.next_tokens(now - job.last_token, len(new) - len(job.tokens))
            job.last_token = now
        job.tokens = new
        if out.status == FAILED or out.error:
            self._hand(job, Piece("", len(new), error=f"generation failed: {out.error}"))
            return
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        hits = [text.find(s) for s in job.stop if s in text]
        if hits:  # cut before the stop string; the request leaves the batch
            self._hand(job, Piece(text[job.sent : min(hits)], len(new), finish="stop"))
            self.manager.cancel_request(job.id)
            return
        if out.status == FINISHED:
            reason = "length" if len(new) >= job.max_tokens else "stop"
            self._hand(job, Piece(text[job.sent :], len(new), finish=reason))
            return
        end = len(text) - held_back(text, job.stop)
        while end > job.sent and text[end - 1] == "\ufffd":  # a character whose bytes are still coming
            end -= 1
        if end > job.sent:
            piece, job.sent = text[job.sent : end], end
            job.loop.call_soon_threadsafe(job.queue.put_nowait, Piece(piece, len(new)))

    def _hand(self, job: Job, piece: Piece) -> None:
        """A request's last piece: it leaves the table of running requests."""
        job.done = True
        with self._lock:
            self.jobs.pop(job.id, None)
        if self.metrics:
            self.metrics.finished(piece, len(self.jobs))
        job.loop.call_soon_threadsafe(job.queue.put_nowait, piece)
