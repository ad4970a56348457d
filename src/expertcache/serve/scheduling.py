"""Which requests a step of the server's batch runs: transformers' FIFO order, or new prompts first.

transformers' continuous batching schedules with ``FIFOScheduler``: every decoding request first, then
waiting prompts while the step's token budget lasts. A prompt that arrives while a step runs therefore
waits for that step, then for a step that decodes every other request *and* prefills it: on two cores
with 16 clients, 11 ms for the decodes plus the prompt's own prefill, on top of the step it waited for.

``prompts-first`` (``PromptsFirst``) gives a step to the waiting prompts alone (and prompts split over
steps) when there are any, so a new request's first token comes out of a step that computes only
prompts; the next step is FIFO's whatever arrived meanwhile (decodes first, then any new prompts), so a
running request waits at most one prompts-only step between two of its tokens. vLLM's first scheduler
made the same choice (prefills ahead of decodes). What it can cost is the decoding requests' time per
token; at 16 clients on two cores it took about 30 % off the median time to first token, left the p99 as
it was, and cost nothing measurable in tokens a second or time per token (docs/BENCHMARKS.md).

Scheduling only changes which requests share a step; every request's tokens are the same either way
(float32 and greedy, as ``bench/serve_exactness.py`` checks).
"""

from __future__ import annotations

_NAME = "expertcache-prompts-first"  # its key in transformers' SCHEDULER_MAPPING


def scheduler_type(schedule: str) -> str:
    """The ``ContinuousBatchingConfig.scheduler_type`` of ``schedule`` (registered with transformers)."""
    if schedule == "fifo":
        return "fifo"
    from transformers.generation.continuous_batching.scheduler import SCHEDULER_MAPPING

    SCHEDULER_MAPPING[_NAME] = prompts_first_class()
    return _NAME


_CLASS = None


def prompts_first_class():
    """``PromptsFirst``, made once on first use (transformers' scheduler module is imported only then)."""
    global _CLASS
    if _CLASS is not None:
        return _CLASS
    from transformers.generation.continuous_batching.requests import RequestStatus
    from transformers.generation.continuous_batching.scheduler import FIFOScheduler

    class PromptsFirst(FIFOScheduler):
        """FIFO's scheduler, but a step with prompts waiting and none run in the step before runs them
        alone: decoding requests sit that step out."""

        def reset(self) -> None:
            super().reset()
            self.prompts_alone_last = False  # the step before ran prompts alone
            self.prompt_steps = 0  # steps given to prompts alone (for tests and benchmarks)

        def schedule_batch(self, token_budget: int, cache_budget: int):
            decoding, prompts = [], []
            for state in self.active_requests.values():
                if state.status == RequestStatus.DECODING:
                    decoding.append(state)
                elif state.status == RequestStatus.PREFILLING:  # a prompt split over steps
                    prompts.append(state)
            if not self.block_new_requests:
                prompts.extend(self._get_waiting_candidates())
            alone = bool(prompts) and bool(decoding) and not self.prompts_alone_last
            scheduled = None
            if alone:
                removed: set[str] = set()
                scheduled, failed, fast, q, kv = self._process_candidates(
                    prompts, token_budget, cache_budget, removed
                )
                self._cleanup_waiting_queue(removed)
                alone = bool(scheduled)  # no prompt fitted (the cache is full): FIFO's step instead
            self.prompts_alone_last = alone
            if alone:
                self.prompt_steps += 1
                return scheduled, fast, q, kv
            return super().schedule_batch(token_budget, cache_budget)

    _CLASS = PromptsFirst
    return _CLASS
