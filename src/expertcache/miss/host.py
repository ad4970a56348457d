"""Fiddler: compute a missed expert on the host when that beats moving it.

A missed expert needed by ``n`` tokens of the step runs where its weights lie (the host) when
``t_host(n) < t_transfer + t_device(n)``, and is fetched whole otherwise (Fiddler, Kamahori et al.,
"Fiddler: CPU-GPU Orchestration for Fast Inference of Mixture-of-Experts Models"); ``t_host`` is
``CostModel.host_expert``: the computation, and the expert's read into host memory where the slow tier is
not host memory (``host_read_s``: the disk tier reads it at every use). Decode steps route one
token per expert, so on a slow link a miss is computed on the host; prefill steps route many, so the
transfer pays. A host-computed expert does not enter the cache (Fiddler keeps a static set on the GPU:
``--policy static --profile TRACE`` with a prefetch, or ``fill``), unless ``fill=1``: then it is also
moved into the cache in the background (a speculative transfer), so that later steps hit. Exact: the
host runs the same operations (on a CPU engine, the same kernels on the same bytes).
"""

from __future__ import annotations

from collections.abc import Sequence

from expertcache.miss.base import (
    FETCH,
    ON_HOST,
    ON_HOST_FILL,
    CacheView,
    MissContext,
    MissPath,
    MissPathError,
    Need,
    Route,
)


class Host(MissPath):
    name = "host"
    needs_costs = True

    def __init__(self, ctx: MissContext, *, fill: int = 0) -> None:
        super().__init__(ctx)
        if fill not in (0, 1):
            raise MissPathError(f"host: fill is 0 or 1, got {fill!r}")
        self.on_host = ON_HOST_FILL if fill else ON_HOST

    def decide(
        self, layer: int, needs: Sequence[Need], view: CacheView, hits: Sequence[Need] = ()
    ) -> list[Route]:
        c = self.costs()
        transfer = c.demand_transfer_time()  # a fetched miss moves whole
        return [self.on_host if c.host_pays(n.tokens, transfer) else FETCH for n in needs]

    def fills(self) -> bool:
        return self.on_host is ON_HOST_FILL

    def describe(self) -> str:
        return "host:fill=1" if self.on_host is ON_HOST_FILL else "host"
