"""The server's generation loop: concurrent requests share the model and its expert cache.

Requests go to transformers' continuous batching (``model.init_continuous_batching``), which works with
the engine unchanged: the offloaded experts see a step's tokens of every running request flattened
together, as they see any batch, so one step's experts for the whole batch are requested together. A
request joins at a step boundary and leaves when it ends; nobody waits for a batch to finish.

Sampling is per request: the manager samples (``do_sample``) with per-request temperature, top-k and
top-p, and a greedy request is sampled with ``top_k=1``, which is the argmax (the tests check that a
greedy request's tokens equal ``expertcache generate``'s for the same prompt alone). transformers'
batching has one random stream for the whole batch, so a request with a ``seed`` is drawn by our own
last processor (``SeededSampler``) from a generator of its own, the way ``generate`` draws after
``torch.manual_seed``: its tokens do not depend on what else runs, and equal ``expertcache generate
--seed``'s for the same prompt alone.

CUDA graphs and asynchronous batching stay off: the offloaded experts run host-side cache logic on each
step's routing, which a captured graph would not replay.

One thread (``_dispatch``) reads the manager's results and hands each request its new text on the
server's event loop: detokenised incrementally (a window of the last tokens, so a long answer costs
linear time), cut at a stop string (held back while it may begin one), finished at eos, a stop string
or ``max_tokens``. A full queue is refused (``QueueFull``), a cancelled request
(a client that went away) leaves the batch at the next step.

Supervision: transformers' loop ends for good at the first exception in a step (it fails every request
it holds and drops every later one without a word). The dispatching thread watches it: when it dies, or
the dispatcher itself fails, every request still running gets an error piece naming an incident id
(the log has the traceback), and the loop is started afresh, up to ``MAX_RESTARTS`` times a minute;
past that the batcher is ``failed``, refuses new requests (``Unavailable``, HTTP 503) and says why in
``health()``. A request is never left waiting on a loop that is gone.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np

from expertcache.config import KV_PAGE
from expertcache.engine.generation import StopFinder
from expertcache.errors import ExpertcacheError, first_line
from expertcache.serve import scheduling, warpers
from expertcache.serve.schemas import GREEDY_BELOW
from expertcache.units import format_bytes

FINISHED = 3  # transformers' RequestStatus.FINISHED
FAILED = 4  # RequestStatus.FAILED
MAX_RESTARTS = 3  # restarts of the generation loop within RESTART_WINDOW before the batcher gives up
RESTART_WINDOW = 60.0
log = logging.getLogger("expertcache.serve")


def _unstarted(record: logging.LogRecord) -> bool:
    """transformers' warning that a loop stopped before it made its batch processor, left out."""
    return "Batch processor was not initialized" not in record.getMessage()


class QueueFull(ExpertcacheError):
    """More requests are waiting or running than the server takes (HTTP 503)."""


class Unavailable(ExpertcacheError):
    """The batcher takes no request now: stopping, or its generation loop failed for good (HTTP 503)."""


class Restarting(Unavailable):
    """The generation loop died and is about to start again: wait (``ready``) and submit again."""


@dataclass
class Piece:
    """What a request produced since the last piece: new text, the token count so far, and, at its end,
    why it ended (``stop`` for eos or a stop string, ``length`` for max_tokens)."""

    text: str
    tokens: int
    finish: str | None = None
    error: str | None = None
    shutdown: bool = False  # the error is the server stopping (HTTP 503), not a failure (500)


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
    text: str = ""  # the text of ``tokens`` up to the last complete character
    prefix: int = 0  # incremental detokenisation: tokens[prefix:read] gave the end of ``text``
    read: int = 0
    finder: StopFinder | None = None  # the stop strings, found as the text grows
    sent: int = 0  # characters of the text already handed out
    done: bool = False
    slot: int | None = None  # the request's generator in the SeededSampler
    restart: object = None  # transformers' state of its last restart after a pause for KV space (soft reset)


def _request_number(request_id: str) -> int:
    """The request's number in this server (``{run}-{n}``: n), what a recorded trace names it by."""
    try:
        return int(str(request_id).rsplit("-", 1)[-1])
    except ValueError:
        return 0


def _in_prompt(state) -> bool:
    """Whether a request's tokens in a step are its prompt's (a chunk of it): it has generated nothing yet.
    A request transformers paused for KV space comes back either restored (its generated tokens kept) or
    soft reset: a new request whose prompt has what it had generated folded in (``_true_initial_tokens``
    is its own prompt's length), its tokens recomputed or found in the prefix cache. Neither is a prompt
    step: counted as one, a request paused after 254 tokens had its first token at its restart."""
    own = getattr(state, "_true_initial_tokens", 0)
    return not state.generated_tokens and not (own and len(state.initial_tokens) > own)


class Batcher:
    """Continuous batching over an ``OffloadedModel``; ``submit`` a request, iterate over its pieces."""

    def __init__(
        self,
        model,
        max_queue: int = 64,
        metrics=None,
        kv_tokens: int | None = None,
        batch_tokens: int = 512,
        schedule: str = "fifo",
    ) -> None:
        """``kv_tokens``: the KV cache's size in tokens (default: ``max_queue`` requests of up to 2048
        tokens, or the context if shorter, cut to what fits: ``kv_size``); ``batch_tokens``: tokens one
        step computes at most (prefill chunks included). transformers' own defaults size the cache to most
        of the free memory, 14 GB for the 22 MB embedded model on a CPU: the server sizes it to what it
        serves."""
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
        page = KV_PAGE
        self.kv_tokens, note = kv_size(model, max_queue, kv_tokens)
        if note:
            log.warning("%s", note.removeprefix("note: "))
        try:
            self._cb = ContinuousBatchingConfig(
                per_request_processors=True, page_size=page, num_blocks=self.kv_tokens // page,
                max_batch_tokens=batch_tokens, use_cuda_graph=False, use_async_batching=False,
                auto_switch_to_flash=False, scheduler_type=scheduling.scheduler_type(schedule),
            )  # fmt: skip
        except TypeError:
            raise ExpertcacheError(
                "expertcache serve needs a transformers whose continuous batching takes per-request sampling "
                "(5.23 is tested): pip install -U transformers"
            ) from None
        self._generation_config = config
        from expertcache.engine.attention import NAME, serve_without_cudnn

        if serve_without_cudnn(model.model):  # transformers' continuous batching takes sdpa by name
            model.attention = NAME
        self.jobs: dict[str, Job] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._run = secrets.token_hex(3)  # request ids differ from one server process to the next
        self._running = True
        self.state, self.reason = "running", None  # running, restarting, stopping or failed; why
        self.restarts: list[float] = []  # when the generation loop was started again
        model.engine.step_source = self._step_tokens  # who each token of a step is (per-phase counts)
        self._start_loop()
        self._thread = threading.Thread(target=self._dispatch, name="expertcache-dispatch", daemon=True)
        self._thread.start()

    def _start_loop(self) -> None:
        """A new transformers manager (its KV cache, its thread) with our sampler, started."""
        from copy import deepcopy

        self.manager = self.model.model.init_continuous_batching(
            generation_config=self._generation_config, continuous_batching_config=deepcopy(self._cb)
        )
        warpers.install(self.manager)  # the same top-k and top-p, without two sorts of every row
        self.sampler = SeededSampler.install(self.manager)
        self.manager.start()

    def _step_tokens(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The engine's ``StepSource``: called as the step transformers just scheduled begins (on the
        generation thread), each token's request (the number in its id) and whether it is a prompt
        token, from the batch in the order its tokens were laid out; None if it cannot be read."""
        batch = getattr(getattr(getattr(self.manager, "batch_processor", None), "inputs_and_outputs", None),
                        "requests_in_batch", None)  # fmt: skip
        if not batch:
            return None
        seq, prompt = [], []
        for future in batch:
            n, state = future.query_length, future.state
            seq += [_request_number(state.request_id)] * n
            prompt += [_in_prompt(state)] * n
            if getattr(state, "_true_initial_tokens", 0):
                self._restarted(state)
        return np.asarray(seq, dtype=np.int32), np.asarray(prompt, dtype=bool)

    def _restarted(self, state) -> None:
        """Count a request's restart after a pause for KV space once (its first step; a restart's prompt
        may take several): a soft reset is a new state object, folded from the one before."""
        job = self.jobs.get(state.request_id)
        if job is not None and job.restart is not state:
            job.restart = state
            if self.metrics:
                self.metrics.restarted()

    def health(self) -> tuple[bool, str]:
        """(serving, why not): False while stopping or after the loop failed for good."""
        if self._running and not self._thread.is_alive():
            return False, "the dispatching thread stopped; restart the server"
        if self.state in ("running", "restarting"):
            return True, "ok"
        return False, self.reason or self.state

    # ------------------------------------------------------------------------------ requests
    def submit(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int | None = None,
        stop: tuple[str, ...] = (),
        seed: int | None = None,
    ) -> Job:
        """Queue a request; its pieces arrive on ``job.queue`` (use ``pieces``). Refused when full.
        ``seed`` (sampling only): the request's tokens are drawn from a generator of its own."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if self.state != "running":
                raise Unavailable(self.reason or f"the server is {self.state}")
            if not self._thread.is_alive():  # nobody would hand this request its results
                raise Unavailable("the dispatching thread stopped; restart the server")
            if len(self.jobs) >= self.max_queue:
                raise QueueFull(
                    f"the server is busy: {len(self.jobs)} request{'s' if len(self.jobs) != 1 else ''} "
                    "running or waiting"
                )
            job = Job(
                f"{self._run}-{next(self._ids)}", len(prompt_ids), max_tokens, stop, asyncio.Queue(), loop
            )
            job.finder = StopFinder(stop)
            self.jobs[job.id] = job
        greedy = temperature < GREEDY_BELOW
        # every request a slot: its rows are checked for non-finite scores, and a seeded one sampled
        job.slot = self.sampler.open(seed if seed is not None and not greedy else None)
        try:
            added = self.manager.add_request(
                prompt_ids,
                request_id=job.id,
                max_new_tokens=max_tokens,
                streaming=True,
                temperature=1.0 if greedy else float(temperature),
                top_k=1 if greedy else min(int(top_k or self.vocab), self.vocab),
                top_p=1.0 if greedy else float(top_p),
                seed_slot=-1 if job.slot is None else job.slot,
            )
        except Exception as exc:  # the loop's input queue full for 10 s, or the loop gone
            added, why = None, f"{type(exc).__name__}"
        else:
            why = "the generation loop is not taking requests"
        if added is None:  # transformers drops a request its stopped loop cannot take: say so instead
            with self._lock:
                self.jobs.pop(job.id, None)
            self.sampler.close(job.slot)
            if self._running and self.state in ("running", "restarting"):
                raise Restarting(f"{why}; the loop is starting again")
            raise Unavailable(f"{why}; try again shortly")
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
            self.sampler.close(job.slot)
            self.manager.cancel_request(job.id)
            job.loop.call_soon_threadsafe(job.queue.put_nowait, Piece("", len(job.tokens), error="cancelled"))
            if self.metrics:
                self.metrics.cancelled()
        if self.metrics:
            self.metrics.queued(len(self.jobs))

    def fail_all(self, message: str = "the server is shutting down", shutdown: bool = True) -> None:
        """End every request still running with an error piece (its client sees an error, not a quiet
        end), and take it out of the loop."""
        self._end(list(self.jobs.values()), self.manager, message, shutdown)

    def _end(self, jobs: list, manager, message: str, shutdown: bool) -> None:
        """Each of ``jobs`` not ended yet gets its last piece, an error, and leaves ``manager``'s loop."""
        for job in jobs:
            if job is not None and not job.done:
                self._hand(job, Piece("", len(job.tokens), error=message, shutdown=shutdown))
                try:
                    manager.cancel_request(job.id)
                except Exception:  # a loop that is gone has nothing to cancel
                    pass

    def stop_admitting(self, reason: str = "the server is shutting down") -> None:
        """Refuse new requests from now on (``Unavailable``); running ones go on."""
        with self._lock:
            if self.state == "running":
                self.state, self.reason = "stopping", reason

    def close(self, timeout: float = 5.0) -> bool:
        """Stop: requests still running end with an error piece, the loop stops after its current step.
        True when the loop's thread has ended (the engine may be closed under it)."""
        self.stop_admitting()
        self.fail_all()
        self._running = False
        self._thread.join(timeout)
        stopped = self._stop_loop(timeout)
        if stopped and self.model.engine.step_source == self._step_tokens:  # the model may serve again
            self.model.engine.step_source = None
        return stopped

    def _stop_loop(self, timeout: float) -> bool:
        manager = self.manager
        quiet = manager.batch_processor is None  # stopped as it started (a server that could not listen):
        if quiet:  # transformers warns that its processor was not made yet, which is no news here
            logging.getLogger("ContinuousBatchingLogger").addFilter(_unstarted)
        try:
            manager.stop(block=True, timeout=timeout, hard_stop=True)
        except Exception as exc:
            log.warning("stopping the generation loop: %s", exc)
        finally:
            if quiet:
                logging.getLogger("ContinuousBatchingLogger").removeFilter(_unstarted)
        return not manager.is_running()

    # ------------------------------------------------------------------------------ results
    def _dispatch(self) -> None:
        while self._running:
            try:
                out = self.manager.get_result(timeout=0.1)
                if out is None:
                    if self._running and self.state == "running" and not self.manager.is_running():
                        error = self.manager.background_thread_status.fatal_error
                        self._loop_failed(error or RuntimeError("the generation loop stopped"))
                    continue
                job = self.jobs.get(out.request_id)
                if job is None or job.done:
                    continue
                try:
                    self._update(job, out)
                except Exception as exc:  # a bad piece must not end the loop that serves everyone
                    incident = secrets.token_hex(4)
                    log.error("request %s failed (incident %s)", job.id, incident, exc_info=exc)
                    self._hand(job, Piece("", len(job.tokens), error=failed(incident)))
            except Exception as exc:
                self._loop_failed(exc)

    def _loop_failed(self, error: BaseException) -> None:
        """The generation loop (or this dispatcher) failed: start the loop again, then end every request
        the failed one held with an error; give up after ``MAX_RESTARTS`` within ``RESTART_WINDOW``.
        Requests that come meanwhile wait for the new loop (``ready``)."""
        incident = secrets.token_hex(4)
        log.error("the generation loop failed (incident %s)", incident, exc_info=error)
        with self._lock:
            if not self._running or self.state != "running":
                return self.fail_all(failed(incident), shutdown=False)
            self.state = "restarting"
            held = list(self.jobs.values())
        now = time.monotonic()
        self.restarts = [t for t in self.restarts if now - t < RESTART_WINDOW]
        old = self.manager
        self._stop_loop(5.0)
        state, reason = "running", None
        if len(self.restarts) >= MAX_RESTARTS:
            state = "failed"
            reason = (
                f"the generation loop failed {len(self.restarts) + 1} times within {RESTART_WINDOW:g} s "
                f"(last: incident {incident}); restart the server"
            )
        else:
            try:
                self._start_loop()
                self.restarts.append(now)
            except Exception as exc:
                state, reason = "failed", f"the generation loop could not start again: {exc}"
        self._end(held, old, failed(incident), shutdown=False)  # what the failed loop held
        with self._lock:
            self.state, self.reason = state, reason
        if state == "failed":
            log.error("%s", reason)
        else:
            log.warning("the generation loop was started again (%d in the last minute)", len(self.restarts))

    async def ready(self, timeout: float = 30.0) -> None:
        """Wait while the generation loop is dead and not yet started again (the dispatcher notices
        within 0.1 s, then restarts it): a request then goes to the new loop."""
        deadline = time.monotonic() + timeout
        while (
            time.monotonic() < deadline
            and self._thread.is_alive()
            and (self.state == "restarting" or self.state == "running" and not self.manager.is_running())
        ):
            await asyncio.sleep(0.05)

    def _update(self, job: Job, out) -> None:
        if job.slot is not None and job.slot in self.sampler.bad:  # the model's scores went NaN for it
            self._hand(job, Piece("", len(job.tokens), error=NOT_FINITE))
            self.manager.cancel_request(job.id)
            return
        now = time.perf_counter()
        new = list(out.generated_tokens)
        if len(new) > len(job.tokens):
            if job.first_token is None:
                job.first_token = now
                if self.metrics:
                    self.metrics.first_token(now - job.submitted, job.prompt_tokens)
            elif self.metrics and job.last_token is not None:
                self.metrics.next_tokens(now - job.last_token, len(new) - len(job.tokens))
            if self.metrics:
                self.metrics.tokens(len(new) - len(job.tokens))
            job.last_token = now
        job.tokens = new
        if out.status == FAILED or out.error:
            incident = secrets.token_hex(4)
            log.error("request %s failed (incident %s): %s", job.id, incident, out.error)
            self._hand(job, Piece("", len(new), error=failed(incident)))
            return
        finished = out.status == FINISHED
        self._detokenize(job, final=finished)
        text = job.text
        found, held = job.finder.feed(text)
        if found is not None:  # cut before the stop string; the request leaves the batch
            self._hand(job, Piece(text[job.sent : found], len(new), finish="stop"))
            self.manager.cancel_request(job.id)
            return
        if finished:
            reason = "length" if len(new) >= job.max_tokens else "stop"
            self._hand(job, Piece(text[job.sent :], len(new), finish=reason))
            return
        end = len(text) - held
        if end > job.sent:
            piece, job.sent = text[job.sent : end], end
            job.loop.call_soon_threadsafe(job.queue.put_nowait, Piece(piece, len(new)))

    def _detokenize(self, job: Job, final: bool) -> None:
        """Extend ``job.text`` with the new tokens' text, decoding only a window: the tokens since the
        last complete character plus the one before (so a leading space decodes as it does in context).
        A character whose bytes are still coming waits for the next token, unless this is the end."""
        decode = self.tokenizer.decode
        before = decode(job.tokens[job.prefix : job.read], skip_special_tokens=True)
        after = decode(job.tokens[job.prefix :], skip_special_tokens=True)
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            job.text += after[len(before) :]
            job.prefix, job.read = job.read, len(job.tokens)

    def _hand(self, job: Job, piece: Piece) -> None:
        """A request's last piece: it leaves the table of running requests."""
        job.done = True
        self.sampler.close(job.slot)
        with self._lock:
            self.jobs.pop(job.id, None)
        if self.metrics:
            self.metrics.finished(piece, len(self.jobs))
        job.loop.call_soon_threadsafe(job.queue.put_nowait, piece)


KV_SHARE = 0.5  # of the memory transformers' continuous batching may use: the KV cache's default at most


def check_batchable(config) -> None:
    """One line where transformers' continuous batching cannot run a model of ``config`` (its
    transformers config): its paged KV cache holds full and sliding attention layers only (no
    linear-attention, Mamba or convolution layers)."""
    from transformers.generation.continuous_batching.cache import (
        ATTN_TYPE_TO_ALLOCATOR,
        group_layers_by_attn_type,
    )

    try:
        group_layers_by_attn_type(config)
    except ValueError as exc:
        given = {str(t) for t in getattr(config, "layer_types", None) or ()}
        kinds = sorted(
            given - set(ATTN_TYPE_TO_ALLOCATOR) - {"moe", "mlp"}
        )  # (Nemotron-H's blocks list those)
        raise ExpertcacheError(
            f"serve batches requests with transformers' continuous batching, whose paged KV cache holds "
            f"attention layers only; {config.model_type}'s layers include "
            f"{' and '.join(kinds) + ' ones' if kinds else first_line(exc)}: 'expertcache generate' runs it"
        ) from None


def kv_size(model, max_queue: int, kv_tokens: int | None = None) -> tuple[int, str | None]:
    """The KV cache's size in tokens (whole pages) and a note when the default had to shrink.

    The default is ``max_queue`` requests of up to 2048 tokens (or the context if shorter), cut to what
    fits in ``KV_SHARE`` of the memory transformers' continuous batching allows itself (its own rule: on a
    CPU 60 % of the machine's memory, or its NUMA nodes', less what the process holds; on a GPU 80 % of
    the free memory), leaving the rest to the step's activations and masks: a 64-request default for
    Granite-3.1-1B in float32 would be 12.9 GB, and transformers' loop would fail at its first step. A
    size asked for (``kv_tokens``) that does not fit at all is an error, before anything starts."""
    page = KV_PAGE
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    context = int(getattr(config, "max_position_embeddings", None) or 2048)
    wanted = -(-(kv_tokens or max_queue * min(context, 2048)) // page) * page  # whole pages
    per_token = kv_bytes_per_token(config, model.dtype)
    allowed = batching_memory()
    if not per_token or allowed is None:
        return wanted, None
    if kv_tokens is not None:
        if wanted * per_token > allowed:
            raise ExpertcacheError(
                f"--kv-cache-tokens {kv_tokens} needs {format_bytes(wanted * per_token)} of KV cache, more "
                f"than the {format_bytes(allowed)} continuous batching may use on this machine: lower it"
            )
        return wanted, None
    room = int(allowed * KV_SHARE) // per_token // page * page
    if wanted <= room:
        return wanted, None
    if room < page:
        raise ExpertcacheError(
            f"no room for a KV cache: continuous batching may use {format_bytes(allowed)} on this machine, "
            f"and one page of {page} tokens takes {format_bytes(page * per_token)}"
        )
    note = (
        f"note: the KV cache holds {room} tokens ({format_bytes(room * per_token)}), what fits in the memory "
        f"left (--max-queue {max_queue} x {min(context, 2048)} tokens would take "
        f"{format_bytes(wanted * per_token)}); requests wait for room. Set --kv-cache-tokens to choose"
    )
    return room, note


def kv_bytes_per_token(config, dtype) -> int:
    """A token's keys and values over every layer (0 when the config does not say)."""
    layers = getattr(config, "num_hidden_layers", None)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else None)
    if not (layers and kv_heads and head_dim):
        return 0
    import torch

    return int(layers * 2 * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size())


def batching_memory() -> int | None:
    """The bytes transformers' continuous batching allows itself for its cache here (its own
    breakdown and share: 60 % on a CPU, 80 % on a GPU with per-request processors), or None."""
    try:
        from transformers.generation.continuous_batching.utils import get_device_and_memory_breakdown
    except ImportError:
        return None
    device, total, reserved, allocated = get_device_and_memory_breakdown()
    if not total:
        return None
    share = 0.6 if device.type in ("cpu", "mps") else 0.8
    return int((total - max(allocated, reserved)) * share)


NOT_FINITE = (
    "the model's outputs are not finite (NaN logits) for this request: the checkpoint's weights or config "
    "hold a NaN or an infinity, or the dtype overflows on it (try --dtype float32)"
)


def failed(incident: str) -> str:
    """A failed request's message: no raw exception text for the client, an id to find it in the log."""
    return f"generation failed (incident {incident}; the server log has the details)"


class SeededSampler:
    """The last per-request logits processor of transformers' batching: each row of a request with a
    seed is sampled here, from the request's own ``torch.Generator``, and replaced by a certainty
    (0 at the drawn token, -inf elsewhere) that the manager's own draw then keeps. The draw is
    ``generate``'s (softmax, one ``multinomial``), so a request alone gets ``generate``'s tokens for its
    seed. Rows without a seed pass through to the manager's shared random stream. Every request's rows
    (slot >= 0; padding rows have -1, and may be NaN by construction) are checked for NaN first: such a
    request's slot goes into ``bad`` (the dispatcher ends it with an error, where greedy decoding would
    stream token 0 for ever) and its row is made a certainty, so that the step's draw stays defined."""

    supported_kwargs = {"seed_slot": int}
    ignored_kwargs: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.generators: dict[int, object] = {}
        self.seeds: dict[int, int] = {}
        self.live: set[int] = set()  # the slots of requests not ended
        self.bad: set[int] = set()  # of those, the ones whose scores were NaN
        self._slots = itertools.count()

    @classmethod
    def install(cls, manager) -> SeededSampler:
        """Append to ``manager``'s processors; before ``manager.start()``, which sizes their arguments."""
        from transformers.generation.continuous_batching.cb_logits_processors import (
            ContinuousBatchingLogitsProcessor,
        )

        sampler = cls()
        ContinuousBatchingLogitsProcessor.register(cls)  # an ABC: a virtual subclass
        processors = manager.logit_processor
        processors.logits_processor.append(sampler)
        processors.tensors_required += 1
        processors.supported_keys.update(cls.supported_kwargs)
        processors.do_processing = True
        return sampler

    def open(self, seed: int | None = None) -> int:
        """A slot for a new request, sampled with ``seed`` (its generator is made on the logits' device)
        or by the manager's draw (None)."""
        slot = next(self._slots) % 2**31
        self.live.add(slot)
        if seed is not None:
            self.seeds[slot] = seed
        return slot

    def close(self, slot: int | None) -> None:
        if slot is not None:
            self.seeds.pop(slot, None)
            self.generators.pop(slot, None)
            self.live.discard(slot)
            self.bad.discard(slot)

    # the ContinuousBatchingLogitsProcessor interface
    def fill_defaults(self, int32_tensor) -> None:
        int32_tensor.fill_(-1)

    def prepare_tensor_args(self, requests_with_new_token) -> object:
        import torch

        slots = [r.state.logit_processor_kwargs.get("seed_slot", -1) for r in requests_with_new_token]
        return torch.tensor(slots, dtype=torch.int32)

    def __call__(self, scores, tensor_arg):
        import torch

        slots = tensor_arg[: scores.size(0)].tolist()
        # one reduction over the step's rows (no copy of them); padding rows (slot -1) are let be
        for row, is_nan in enumerate(torch.isnan(scores).any(dim=-1).tolist()):
            if is_nan and slots[row] >= 0:  # the dispatcher ends the request; its row drawn as a certainty
                self.bad.add(slots[row])
                scores[row].fill_(float("-inf"))
                scores[row, 0] = 0.0
        for row, slot in enumerate(slots):
            if slot < 0 or slot not in self.seeds or slot in self.bad:
                continue
            gen = self.generators.get(slot)
            if gen is None:
                gen = self.generators[slot] = torch.Generator(scores.device).manual_seed(self.seeds[slot])
            probs = torch.nn.functional.softmax(scores[row : row + 1], dim=-1)
            token = torch.multinomial(probs, num_samples=1, generator=gen)[0, 0]
            scores[row].fill_(float("-inf"))
            scores[row, token] = 0.0
        return scores
