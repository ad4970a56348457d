"""Batch: a step's missed experts served by token count, with the cache's admission test and a stream buffer.

Made for steps of many tokens (a batch of requests, a prompt), where a layer needs many experts at once,
each with its own number of tokens. For each missing expert with ``n`` of the step's tokens:

- **where** it is computed: on the host when ``host_expert(n) < transfer + expert(n)`` (Fiddler's rule,
  by the token count: a cold expert of one token is cheaper on the host, one of 30 tokens over the link;
  on a CPU-only engine the host is the slow tier itself, computing straight from the mapped
  checkpoint, and the cost model says what a read of it costs), on the device otherwise;
- **whether it enters the cache**: only if the policy admits it (``Policy.admits``: under ``tlfu``, its
  token-weighted frequency exceeds (1 + margin) times that of the expert it would evict: twice, by
  default). Admitted experts computed on the
  host are also moved into the cache in the background (``fill``); admitted ones computed on the device
  are fetched into it. The others bypass the cache: computed on the host, or **streamed** through a
  small buffer of ``buffer`` slots (a part of the budget, LRU) that never evicts a cached expert. When a
  layer needs most of its experts and the host is slow, every miss is streamed: the layer's experts move
  in order and each is computed as it lands while the next moves (MoE-Lightning's pipeline, at the
  buffer's depth), chosen per step by the cost model.

Under a policy that admits everything (LRU, say) nothing bypasses: it is Fiddler's rule with fills.
Exact: every expert is computed whole from its own weights, wherever it runs.
"""

from __future__ import annotations

from collections.abc import Sequence

from expertcache.miss.base import (
    DEVICE,
    FETCH,
    FULL,
    FULL_PART,
    ON_HOST,
    ON_HOST_FILL,
    CacheView,
    MissContext,
    MissPath,
    MissPathError,
    Need,
    PartSpec,
    Route,
)
from expertcache.miss.hybrid import makespan_split

STREAM = "stream"
STREAMED = Route(DEVICE, (STREAM,))
SPLITS = ("each", "makespan")


class Batch(MissPath):
    name = "batch"
    laid_out = ("buffer",)
    needs_costs = True

    def __init__(
        self, ctx: MissContext, *, buffer: int | None = None, fill: int = 1, split: str = "each"
    ) -> None:
        super().__init__(ctx)
        self.buffer_given = buffer is not None
        if buffer is None:
            buffer = 2 * ctx.top_k  # a token's experts of one layer streaming, and the next's
        if not isinstance(buffer, int) or buffer < 1:
            raise MissPathError(f"batch: buffer must be a whole number of experts >= 1, got {buffer!r}")
        if fill not in (0, 1):
            raise MissPathError(f"batch: fill is 0 or 1, got {fill!r}")
        if split not in SPLITS:
            raise MissPathError(f"batch: split is {' or '.join(SPLITS)}, got {split!r}")
        self.buffer, self.fill, self.split = buffer, fill, split

    def parts(self) -> list[PartSpec]:
        return [FULL_PART, PartSpec(STREAM, policy="lru", min_room=1, shared=True)]

    def capacities(self, budget: int, slot_bytes: dict[str, object]) -> dict[str, object]:
        """The stream buffer (``buffer`` slots at most, a quarter of the memory at most, and what the cache
        leaves over a token's experts; one at least), the rest to the cache: top-k + 1 slots at least."""
        slots, k = budget // slot_bytes[FULL], self.ctx.top_k
        buffer = self.granted = max(1, min(self.buffer, slots - k, slots // 4))
        return {STREAM: buffer, FULL: max(0, slots - buffer)}

    def capacity_notes(self, capacities: dict[str, object]) -> list[str]:
        got, total = capacities[STREAM], self.ctx.num_layers * self.ctx.num_experts
        if capacities[FULL] < total <= capacities[FULL] + got:  # the buffer took what the cache needed
            return [
                f"batch: the expert memory holds every expert, but its stream buffer takes {got} slot(s), so "
                f"the cache holds {capacities[FULL]} of {total} and misses; with nothing to offload, the "
                "default miss path (fetch) keeps them all"
            ]
        if got >= self.buffer or not self.buffer_given:
            return []
        return [
            f"batch: a stream buffer of {got} experts, not the {self.buffer} asked for (buffer=): at most a "
            "quarter of the memory, and what the cache leaves over a layer's top-k"
        ]

    def policy_notes(self, policy, capacities: dict[str, object]) -> list[str]:
        if getattr(policy, "selective", False) or not capacities.get(STREAM):
            return []
        return [
            f"batch: policy {policy.name} admits every expert, so nothing bypasses the cache and the stream "
            f"buffer's {capacities[STREAM]} slot(s) go unused (a policy that may refuse one, such as tlfu, "
            "streams; fetch gives the cache them all)"
        ]

    def decide(
        self, layer: int, needs: Sequence[Need], view: CacheView, hits: Sequence[Need] = ()
    ) -> list[Route]:
        c = self.costs()
        transfer = c.demand_transfer_time()  # a fetched or streamed miss moves whole
        streaming = [view.present(STREAM, n.key) for n in needs]  # already in the buffer: no transfer
        asked = [n.key for n, s in zip(needs, streaming, strict=True) if not s]
        admitted = dict(zip(asked, view.admits(FULL, asked), strict=True))
        if self.split == "makespan":
            hosted = makespan_split(c, needs, hits, streaming)
        else:
            hosted = [c.host_pays(n.tokens, transfer) for n in needs]
        on_host = ON_HOST_FILL if self.fill else ON_HOST
        routes: list[Route] = []
        for n, streamed, host in zip(needs, streaming, hosted, strict=True):
            if host:
                routes.append(on_host if not streamed and admitted[n.key] else ON_HOST)
            elif streamed:
                routes.append(STREAMED)
            else:
                routes.append(FETCH if admitted[n.key] else STREAMED)
        return routes

    def describe(self) -> str:
        fill = "" if self.fill else ",fill=0"
        split = "" if self.split == "each" else f",split={self.split}"
        # the buffer laid out (a memory's quarter at most), where one was: what ran, and replays the same
        return f"batch:buffer={getattr(self, 'granted', self.buffer)}{fill}{split}"
