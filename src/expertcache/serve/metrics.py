"""``GET /metrics``: the server's and the expert cache's work in Prometheus' text format (prometheus-client).

Request, token and latency figures are updated as requests run; the cache's counters (hits, misses per
layer, bytes moved, stall, prefetch accuracy and waste) are read from the engine's statistics at each
scrape by a custom collector, so serving pays nothing for them between scrapes.
"""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# latency buckets from 1 ms to a minute: TPOT of a cached expert to TTFT of a long prompt over a slow link
# seconds; fine from 5 to 250 ms, where a CPU's decode steps and first tokens fall, to tell one step from two
BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25, 0.5, 1,
    2.5, 5, 10, 30, 60,
)  # fmt: skip
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Metrics:
    def __init__(self, model) -> None:
        self.registry = r = CollectorRegistry()
        p = "expertcache_"
        self.requests = Counter(p + "requests", "HTTP requests answered", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter(
            p + "prompt_tokens", "prompt tokens read (of requests whose first token came)", registry=r
        )
        self.generated = Counter(
            p + "generated_tokens", "tokens generated, whatever became of the request", registry=r
        )
        self.finishes = Counter(
            p + "finished_requests", "generations ended, by reason", ["reason"], registry=r
        )
        self.cancels = Counter(p + "cancelled_requests", "generations cancelled (client gone)", registry=r)
        self.restarts = Counter(
            p + "kv_restarted_requests",
            "requests paused for KV space and restarted with what they had generated folded into their "
            "prompt (a soft reset: those tokens are read again)",
            registry=r,
        )
        self.ttft = Histogram(p + "ttft_seconds", "time to first token", buckets=BUCKETS, registry=r)
        self.tpot = Histogram(
            p + "tpot_seconds", "time per output token after the first", buckets=BUCKETS, registry=r
        )
        self.queue = Gauge(p + "requests_in_flight", "requests running or waiting in the batch", registry=r)
        r.register(_CacheCollector(model))
        self.kv: Gauge | None = None  # the KV cache's size, where the server knows it (``kv_size``)

    def kv_size(self, tokens: int) -> None:
        """The KV cache's size in tokens, where the server knows it (it sizes it to what fits); made once,
        set at each start of the app."""
        if self.kv is None:
            self.kv = Gauge(
                "expertcache_kv_cache_tokens", "tokens the KV cache holds", registry=self.registry
            )
        self.kv.set(tokens)

    # called by the batcher (its thread) and the app
    def queued(self, n: int) -> None:
        self.queue.set(n)

    def first_token(self, seconds: float, prompt_tokens: int) -> None:
        self.ttft.observe(seconds)
        self.prompt_tokens.inc(prompt_tokens)

    def tokens(self, n: int) -> None:
        """Tokens the model generated for a request, as they come (cancelled and failed requests too)."""
        self.generated.inc(n)

    def next_tokens(self, seconds: float, tokens: int) -> None:
        for _ in range(tokens):
            self.tpot.observe(seconds / tokens)

    def finished(self, piece, in_flight: int) -> None:
        self.finishes.labels(piece.finish or "error").inc()
        self.queue.set(in_flight)

    def cancelled(self) -> None:
        self.cancels.inc()

    def restarted(self) -> None:
        self.restarts.inc()

    def answered(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def text(self) -> bytes:
        return generate_latest(self.registry)


class _CacheCollector:
    """The expert cache's counters, read from ``model.stats`` when scraped."""

    def __init__(self, model) -> None:
        self.model = model

    def collect(self):
        s = self.model.stats
        p = "expertcache_cache_"
        for name, key, what in (
            ("hits", "hits", "expert requests served from the cache"),
            ("misses", "misses", "expert requests that missed the cache"),
            ("bytes_moved", "bytes_transferred", "bytes moved from the slow tier"),
            ("stall_seconds", "stall_s", "compute time spent waiting for experts"),
            ("host_computed", "host_computed", "missed experts computed on the host"),
            ("filled", "filled", "host-computed experts moved into the cache in the background"),
            ("prefetch_issued", "prefetch_issued", "experts prefetched"),
            ("prefetch_used", "prefetch_used", "prefetched experts used before eviction"),
            ("prefetch_evicted", "prefetch_evicted", "prefetched experts evicted before their layer"),
            ("prefetch_cancelled", "prefetch_cancelled", "prefetches cancelled (waste avoided)"),
        ):
            yield CounterMetricFamily(p + name, what, value=float(s[key]))
        driver = self.model.driver  # tokens / steps = the mean batch a step computed, in tokens
        yield CounterMetricFamily("expertcache_steps", "forward steps run", value=float(driver.steps))
        yield CounterMetricFamily("expertcache_step_tokens", "their tokens", value=float(driver.tokens))
        phased = (  # prefill: steps holding a prompt token (under continuous batching, beside decode tokens)
            (p + "hits_by_phase", "hits", "expert requests served from the cache, per phase"),
            (p + "misses_by_phase", "misses", "expert requests that missed the cache, per phase"),
            (p + "host_computed_by_phase", "host_computed", "missed experts computed on the host, per phase"),
            (p + "stall_seconds_by_phase", "stall_s", "compute time spent waiting for experts, per phase"),
            ("expertcache_steps_by_phase", "steps", "forward steps run: prefill steps hold a prompt token"),
            ("expertcache_step_tokens_by_phase", "tokens", "tokens computed: prompt, generated (decode)"),
        )  # fmt: skip
        for name, key, what in phased:
            family = CounterMetricFamily(name, what, labels=["phase"])
            for phase, counts in s["phases"].items():
                family.add_metric([phase], float(counts[key]))
            yield family
        layers = CounterMetricFamily(p + "layer_misses", "misses per MoE layer", labels=["layer"])
        for layer, misses in enumerate(s["misses_by_layer"]):
            layers.add_metric([str(layer)], float(misses))
        yield layers
        yield GaugeMetricFamily(
            p + "capacity_experts", "experts the cache holds", value=s["capacity_experts"]
        )
        if "host_requests" in s:  # three tiers: the host level below the cache (``cache.tiers``)
            h = "expertcache_host_level_"
            for name, key, what in (
                ("hits", "host_hits", "the cache's transfers served from the host level's memory"),
                ("misses", "host_misses", "the cache's transfers the host level read from the disk first"),
                ("bypassed", "host_bypassed", "transfers read straight through (every host key pinned)"),
                ("staged", "host_staged", "predicted experts read into the host level early"),
                ("demoted", "host_demoted", "exclusive: the cache's victims copied down into the host level"),
                (
                    "returned",
                    "host_returned",
                    "exclusive: hits whose transfer was dropped, back in the level",
                ),
                ("dropped", "host_dropped", "exclusive: the cache's victims the host level had no room for"),
                ("slot_waits", "host_slot_waits", "exclusive: decisions that waited for a hit's slot"),
                ("disk_reads", "disk_reads", "experts read from the disk"),
                ("disk_read_seconds", "disk_read_s", "time spent reading experts from the disk"),
                ("disk_read_errors", "disk_read_errors", "reads from the disk that failed (retried or left)"),
            ):
                yield CounterMetricFamily(h + name, what, value=float(s[key]))
            yield GaugeMetricFamily(
                h + "capacity_experts", "experts the host level holds", value=s["host_capacity"]
            )
        # ProMoE's measures of the prediction (the share of prefetches used is prefetch_used / issued)
        for name, key, what in (
            ("accuracy", "accuracy", "ProMoE's accuracy: the share of chosen experts that were predicted"),
            ("fetchrate", "fetchrate", "ProMoE's fetchrate: of the predicted experts chosen, those resident"),
            ("goodpred", "goodpred", "ProMoE's goodpred: accuracy x fetchrate"),
        ):
            value = math.nan if s[key] is None else float(s[key])  # NaN: nothing predicted yet
            yield GaugeMetricFamily(p + "prefetch_" + name, what, value=value)
        moved = CounterMetricFamily(
            p + "part_transfers",
            "demand transfers into each part of the cache (batch: full, and its stream buffer, where an "
            "expert already in the buffer moves nothing: part_reused); misses = these + part_reused + "
            "host_computed between steps",
            labels=["part"],
        )
        for part, count in s["part_misses"].items():
            moved.add_metric([part], float(count))
        yield moved
        for name, what in (
            ("part_prefetches", "speculative transfers (prefetches) into each part of the cache, as queued"),
            ("part_cancelled", "of the part's prefetches, those dropped before they moved"),
            ("part_fills", "host-computed experts moved into each part of the cache in the background"),
            ("part_reused", "missed experts found in a part other than the cache's own (no transfer)"),
        ):
            family = CounterMetricFamily(p + name, what, labels=["part"])
            for part, count in s.get(name, {}).items():
                family.add_metric([part], float(count))
            yield family
        mem = s.get("memory") or {}
        for name, key, what in (
            ("resident_bytes", "rss", "the server's resident memory (VmRSS)"),
            ("anonymous_bytes", "rss_anon", "its anonymous share: slots, dense weights, activations"),
            ("checkpoint_cached_bytes", "page_cache", "the checkpoint's bytes in the page cache"),
        ):
            if mem.get(key) is not None:
                yield GaugeMetricFamily("expertcache_memory_" + name, what, value=float(mem[key]))
