"""The cache's own work per layer, without any computation (issue: models larger than memory).

    PYTHONPATH=bench .venv/bin/python bench/driver_cpu.py [--budget 100%] [--steps 200] [--slow-tier host]
        [--model PATH] [--kernel grouped|eager]

The embedded model (or ``--model``) loaded at ``--budget`` (no prefetching, no warm-up generation); its
step driver is then called as the engine calls it, with a fixed seeded routing (top-k experts a layer,
one token a step) and no expert computed: ``begin_step``, then per layer ``layer`` (needs, routes,
admission, transfers), then what the kernel asks before computing: the eager kernel every unit's slot
views, the grouped one the layer's batches and its slot ids (the slot table looked up with the routing),
then ``end_layer``. Prints the microseconds per layer: the minimum and the median of 9 runs
of ``--steps`` steps (the minimum is the least disturbed by other work on the machine). At 100 % every
expert is a hit: what the engine adds to a model that fits.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget", default="100%", help="expert memory (default 100%%)")
    p.add_argument("--steps", type=int, default=200, help="decode steps a run (default 200)")
    p.add_argument("--slow-tier", default="host", choices=("host", "mapped", "disk"),
                   help="where the experts wait (default host: a miss is a copy from memory)")  # fmt: skip
    p.add_argument("--model", help="checkpoint folder (default: the embedded model)")
    p.add_argument("--kernel", default="grouped", choices=("grouped", "eager"),
                   help="the engine's experts kernel (default grouped)")  # fmt: skip
    args = p.parse_args()
    if args.steps < 1:
        p.error("--steps must be at least 1")
    torch.set_num_threads(1)
    import expertcache

    m = expertcache.load(args.model, expert_memory=args.budget, device="cpu", prefetch="none", progress=False,
                         warmup=False, slow_tier=args.slow_tier, kernel=args.kernel)  # fmt: skip
    driver, transport, engine = m.engine.driver, m.engine.transport, m.engine
    layers, experts, k = m.num_layers, m.num_experts, m.top_k
    rng = np.random.default_rng(0)
    routes = [[rng.choice(experts, size=k, replace=False).reshape(1, k) for _ in range(layers)]
              for _ in range(args.steps)]  # fmt: skip
    weights = np.full((1, k), 1 / k, dtype=np.float32)
    hidden = torch.zeros(1, m.config.hidden_size)
    grouped = engine.table is not None

    def run() -> float:
        start = time.perf_counter()
        for s in range(args.steps):
            driver.begin_step(np.array([s % 100], dtype=np.int32), False, 10**6)
            for layer in range(layers):
                work = driver.layer(layer, routes[s][layer], weights, hidden)
                if grouped:  # as Engine._grouped asks before a decode step's one grouped computation
                    if driver.cache.inflight:
                        list(work.batches())
                    engine.table.host[layer, routes[s][layer][0]].tolist()
                else:
                    for key, part in work.units():
                        transport.views(key, part)
                driver.end_layer(layer)
        return (time.perf_counter() - start) / (args.steps * layers) * 1e6

    run()
    runs = [run() for _ in range(9)]
    best, median = min(runs), statistics.median(runs)
    misses = m.cache.stats.to_dict()["misses"]
    print(
        f"{args.model or 'embedded'}, top-{k}, {args.kernel} kernel, {args.budget}, {args.slow_tier} tier: "
        f"{best:.1f} us a layer (median {median:.1f}), "
        f"{misses} misses in all"
    )
    m.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
