"""HybriMoE: per layer, split the missed experts between host compute and transfers, scheduled greedily.

For each layer, once its router has chosen (Zhong et al., "HybriMoE: Hybrid CPU-GPU Scheduling and Cache
Management for Efficient MoE Inference"), three timelines are simulated: the device computes the cached
experts (heaviest first), the host computes uncached experts lightest first, and the link moves the
heaviest uncached expert to the device's queue. One uncached expert at a time goes where the makespan
``max(host, device)`` grows least: the lightest one to the host, or the heaviest over the link (it is
then computed on the device once it lands). Costs are the machine's (``CostModel``; the engine measures
them at load): device ``a + b * n``, host ``a + b * n``, a constant transfer per expert. Fetched
experts enter the cache; host-computed ones do not. Its cache policy is ``mrs`` (``policy/mrs.py``).
Exact, as ``host``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from expertcache.costs import CostModel
from expertcache.miss.base import FETCH, ON_HOST, CacheView, MissPath, Need, Route


class Hybrid(MissPath):
    name = "hybrid"
    needs_costs = True

    def decide(
        self, layer: int, needs: Sequence[Need], view: CacheView, hits: Sequence[Need] = ()
    ) -> list[Route]:
        c = self.costs()
        return [ON_HOST if h else FETCH for h in makespan_split(c, needs, hits)]


def makespan_split(
    c: CostModel, needs: Sequence[Need], hits: Sequence[Need] = (), moved: Sequence[bool] | None = None
) -> list[bool]:
    """HybriMoE's greedy schedule of a layer's missing ``needs`` beside its cached ``hits``: for each need,
    whether it runs on the host (else on the device, over the link unless ``moved`` says it needs no
    transfer: already in a buffer)."""
    transfer = c.demand_transfer_time()  # a fetched miss moves whole
    device = sum(c.expert(n.tokens) for n in hits)  # busy with the cached experts first
    host = link = 0.0
    order = sorted(range(len(needs)), key=lambda i: needs[i].tokens)  # lightest first
    lo, hi = 0, len(order) - 1
    on_host = [False] * len(needs)
    # the time to finish: both timelines in parallel, or one after the other on one processor
    end = max if c.host_parallel else lambda a, b: a + b
    while lo <= hi:
        light, heavy = needs[order[lo]], needs[order[hi]]
        to_host = end(host + c.host_expert(light.tokens), device)
        arrive = link + (transfer if moved is None or not moved[order[hi]] else 0.0)
        fetched = end(host, max(device, arrive) + c.expert(heavy.tokens))
        # a tie goes to the device, as in Fiddler's rule (``CostModel.host_pays``): a fetched expert enters
        # the cache and later steps hit it; on a CPU-only machine reading from the disk the two are the same
        # read and the same computation, and a tie sent every miss to the host (the cache stayed empty)
        if to_host < fetched and not math.isclose(to_host, fetched, rel_tol=1e-9):
            on_host[order[lo]] = True
            host += c.host_expert(light.tokens)
            lo += 1
        else:
            link, device = arrive, max(device, arrive) + c.expert(heavy.tokens)
            hi -= 1
    return on_host
