"""MoEpic's split experts: cache the top segment of many experts, move the bottom segment on use.

Each expert is cut vertically (Hu et al., "Accelerating Mixture-of-Expert Inference with Adaptive Expert
Split Mechanism" (MoEpic), Sec. 3): its first ``theta`` of intermediate neurons form the top segment,
the rest the bottom. The cache holds top segments (the ``top`` part, under the user's policy: MoEpic's
own is ``lcp``), so about ``1 / theta`` times as many experts fit; a buffer of bottom segments (the
``bottom`` part, ``buffer`` slots under LRU) receives the bottoms the current and the next layers need
(memory left over once every expert's top fits goes to more bottom slots, which then keep bottoms for
later steps). On use, a cached top segment is computed while its bottom moves in; an expert whose top is
not cached is moved whole (both segments). The prefetcher asks for the bottom when the top is cached,
the whole expert otherwise. ``theta`` is one fraction for every layer, or one per layer
(``0.4/0.5/...``; then each layer gets a share of the top budget V_i, equal or in proportion to
``weights`` (one per layer: MoEpic's configurator's per-layer VRAM budgets), and holds ``C_i = V_i /
(theta_i * expert)`` top segments, under the ``-dist`` form of the policy). Mathematically exact: an
expert's output is the sum of its segments' (the neurons are independent), computed as two matrix
products and one addition, so the rounding differs from the whole product's; tokens equal the
reference's in the tests, logits within ~1e-6.
"""

from __future__ import annotations

from collections.abc import Sequence

from expertcache.miss.base import (
    DEVICE,
    CacheView,
    MissContext,
    MissPath,
    MissPathError,
    Need,
    PartSpec,
    Route,
)

TOP, BOTTOM = "top", "bottom"
SPLIT = Route(DEVICE, (TOP, BOTTOM))


class Split(MissPath):
    name = "split"
    laid_out = ("buffer",)

    def __init__(
        self, ctx: MissContext, *, theta: object = 0.5, buffer: int | None = None, weights: object = None
    ) -> None:
        super().__init__(ctx)
        L = ctx.num_layers
        thetas = theta if isinstance(theta, list) else [theta]
        if len(thetas) not in (1, L) or not all(isinstance(t, int | float) and 0 < t < 1 for t in thetas):
            raise MissPathError(
                f"split: theta must be a fraction in (0, 1), or one per layer ({L}) as 0.4/0.5/..., "
                f"got {theta!r}"
            )
        self.thetas = tuple(float(t) for t in thetas)
        self.per_layer = len(self.thetas) > 1
        if weights is not None:
            ws = weights if isinstance(weights, list) else [weights]
            if (
                len(ws) != L
                or not self.per_layer
                or not all(isinstance(w, int | float) and w > 0 for w in ws)
            ):
                raise MissPathError(
                    f"split: weights are one positive number per layer ({L}) as 1/2/..., with one theta per "
                    f"layer, got {weights!r}"
                )
            weights = tuple(float(w) for w in ws)
        self.weights = weights
        if buffer is None:
            buffer = 2 * ctx.top_k  # the bottoms of one layer, and of the next being prefetched
        if not isinstance(buffer, int) or buffer < 1:
            raise MissPathError(
                f"split: buffer must be a whole number of bottom segments >= 1, got {buffer!r}"
            )
        self.buffer = buffer

    def parts(self) -> list[PartSpec]:
        top = tuple((0.0, t) for t in self.thetas)
        bottom = tuple((t, 1.0) for t in self.thetas)
        return [
            PartSpec(TOP, "segment", segment=top),
            PartSpec(BOTTOM, "segment", segment=bottom, policy="lru", min_room=1, shared=True),
        ]

    def capacities(self, budget: int, slot_bytes: dict[str, object]) -> dict[str, object]:
        """The buffer first (sized for the largest bottom), the rest to top segments."""
        bottom, top = slot_bytes[BOTTOM], slot_bytes[TOP]
        bottom = max(bottom) if isinstance(bottom, list) else bottom  # a shared buffer's slots: the largest
        L, E = self.ctx.num_layers, self.ctx.num_experts
        buffer = min(self.buffer, L * E)
        rest = max(0, budget - buffer * bottom)
        if not isinstance(top, list):  # never more slots than keys
            tops = min(L * E, rest // top)
            left = rest - tops * top
        else:  # bytes per layer: equal, or in proportion to the weights
            w = self.weights or (1.0,) * len(top)
            shares = [int(rest * x / sum(w)) for x in w]
            tops = [min(E, share // t) for share, t in zip(shares, top, strict=True)]
            left = rest - sum(n * t for n, t in zip(tops, top, strict=True))
        # memory left once every top fits: more bottom slots, which then keep bottoms for later steps
        return {TOP: tops, BOTTOM: min(L * E, buffer + left // bottom)}

    def hit(self, layer: int) -> Route:
        return SPLIT

    def decide(
        self, layer: int, needs: Sequence[Need], view: CacheView, hits: Sequence[Need] = ()
    ) -> list[Route]:
        return [SPLIT] * len(needs)  # the whole expert: its top enters the cache, its bottom the buffer

    def describe(self) -> str:
        theta = "/".join(f"{t:g}" for t in self.thetas)
        weights = "" if self.weights is None else ",weights=" + "/".join(f"{w:g}" for w in self.weights)
        return f"split:theta={theta},buffer={self.buffer}{weights}"
