"""The engine's costs on this machine, measured at load: what the cost-based miss paths decide by.

HybriMoE measures its costs at warm-up, and so does the engine when a miss path needs them (``host``,
``hybrid``) and none were given (``load(..., costs=CostModel(...))``): with the first MoE layer's module
and expert 0 (any expert has the same shapes), it times

- the transfer of one whole expert from the slow tier into a device buffer outside the cache, chunk by
  chunk as the transfer worker moves it, the emulated link's time included when one is set;
- the expert's computation on the device, ``a + b * n``, from token counts 1 and 16 (after a warm-up);
- the same on the host, from the slow tier's weights (``a + b * n``);
- the host's read of an expert it computes (``host_read_s``): on the ``disk`` and ``mapped`` tiers the
  expert is read from the checkpoint at every use (on a CPU, the transfer's read).

Medians of a few repetitions. On a CPU-only machine the device and the host are the same processor: the
device's measurement serves for both (computing in place then always beats copying first, by the copy),
and the host's work runs inline (``host_parallel`` false): the timing model adds it to the compute clock
instead of a second timeline.
"""

from __future__ import annotations

import itertools
import statistics
import time

import torch

from expertcache.cache.transfers import SPECULATIVE
from expertcache.costs import AUTO_CHUNKS, READ_TIERS, CostModel, fit_linear
from expertcache.engine.kernels import first_matrix
from expertcache.engine.memory import SlotPool
from expertcache.engine.parts import expert_output
from expertcache.engine.store import copy_bytes

TOKENS = (1, 16)
REPEATS = 5


def _median(fn, device: torch.device, repeats: int = REPEATS) -> float:
    fn()  # warm-up: allocator, kernels, page faults
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def chunk_costs(worker, part, keys, chunks: int = AUTO_CHUNKS) -> tuple[float, float]:
    """``(data seconds, seconds per chunk)`` of moving one expert on this machine, through ``worker``
    into slot 0 of its pool ``part`` (free at load): speculative transfers of the distinct experts
    ``keys`` (a read of the same bytes twice may find them in a cache), each moved whole and in
    ``chunks`` chunks in turn after one warm-up of each; the medians' difference per extra chunk is a
    chunk's fixed cost (a read request, the worker's bookkeeping), the rest the data's time. What
    ``costs.chunks_pay`` decides by when no emulated link says. The worker is left unchunked, its byte
    count at zero."""
    target = worker.parts[part]
    layout, device = target.pool.layout, target.pool.device
    third = -(-layout.nbytes // chunks)
    n_chunks = len(layout.chunks(third))

    def move(key, chunk_bytes) -> float:
        worker.chunk_bytes = chunk_bytes
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        worker.wait(worker.submit(key, 0, SPECULATIVE, part))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    steal, worker.steal = worker.steal, False  # prefetches' chunks go through the worker's loop
    try:
        move(keys[0], None), move(keys[0], third)  # warm-up: allocator, first faults
        whole, parted = [], []
        for key in keys:
            whole.append(move(key, None))
            if n_chunks > 1:
                parted.append(move(key, third))
    finally:
        worker.chunk_bytes, worker.bytes_moved, worker.steal = None, 0, steal
    one = statistics.median(whole)
    if n_chunks < 2:
        return one, 0.0
    latency = max(0.0, (statistics.median(parted) - one) / (n_chunks - 1))
    return max(0.0, one - latency), latency


def calibrate(model, module) -> CostModel:
    """A ``CostModel`` of ``model``'s machine (an ``OffloadedModel`` being built), from ``module`` (an
    Experts module of it) and expert (0, 0)."""
    device, layout, tier, link = model.device, model.layout, model.tier, model.link
    key = (0, 0)
    pool = SlotPool(layout, 1, device)
    scratch = pool.views[0]
    flat = pool.buffer[0].view(torch.uint8).numpy() if device.type == "cpu" else None  # as the worker
    plan = layout.chunks(model.chunk_bytes)
    packed = getattr(model, "packed", None)  # a packed checkpoint: its slots are bytes; the shapes its own
    shapes = packed.shapes if packed is not None else dict(zip(layout.names, layout.shapes, strict=True))
    hidden = shapes[first_matrix(module)][-1 if not module.is_transposed else 0]

    # a different expert each time, as misses are: one 3 MiB expert of a Granite-shaped model read from
    # the disk again and again took 4.8, 3.1-3.4, then 2.5-2.6 ms here, distinct ones 2.4-2.6 ms
    L, E = model.num_layers, model.num_experts
    keys = itertools.cycle([(layer, (3 * layer + 1) % E) for layer in range(L)])

    def move() -> None:
        at = next(keys)
        for chunk in plan:
            tier.copy_chunk(at, scratch, chunk, flat)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()

    transfer = copied = _median(move, device, 3)
    if link is not None:  # the emulated link's time for the same chunks, beyond the copy itself
        transfer = max(transfer, sum(link.duration(sum(p[3] for p in chunk)) for chunk in plan))
    with torch.inference_mode():
        dev, host = [], []
        for n in TOKENS:
            x = torch.randn(n, hidden, dtype=model.dtype, device=device)
            dev.append((n, _median(lambda x=x: expert_output(module, scratch, x), device)))
            if device.type != "cpu":
                xh = x.to("cpu")
                run = lambda xh=xh: expert_output(module, tier.host_views(key), xh)  # noqa: E731
                host.append((n, _median(run, torch.device("cpu"))))
    a, b = fit_linear(dev)
    # the host computes from the slow tier: on the disk and mapped tiers it reads the expert at every use
    # (``DiskTier.host_views``; a host-computed expert never enters the cache), on a CPU the same read a
    # transfer makes, beside a GPU a read into host memory
    read = 0.0
    cpu = torch.device("cpu")
    if tier.name in READ_TIERS:
        read = copied if device.type == "cpu" else _median(lambda: tier.host_views(next(keys)), cpu, 3)
    # with a host level (``StackTier``), a miss of it reads the expert from the disk first
    disk_read = demote = 0.0
    if tier.name == "stack":
        disk_read = _median(lambda: tier.disk.host_views(next(keys)), cpu, 3)
        read = 0.0  # the host computes from the host level, or from a read the transfer makes anyway
    if device.type == "cpu":  # an exclusive host level's copy down: one expert's bytes in memory, from a
        # slot and to a slot not touched lately, as a victim's and a host slot are (a copy between the same
        # two slots again and again runs from the processor's cache: 125 against 374 us in a run, 3 MiB)
        n = max(2, min(16, (64 << 20) // layout.slot_bytes))
        src, dst = (SlotPool(layout, n, cpu).buffer.view(torch.uint8).numpy() for _ in range(2))
        src.fill(1), dst.fill(0)
        turn = itertools.count()
        demote = _median(lambda: copy_bytes(dst[(i := next(turn) % n)], src[(i + n // 2) % n]), cpu, 5)
        del src, dst
    # on a CPU the host is the device: one measurement serves both, so that two noisy timings of the same
    # work do not decide (at random) between computing in place and copying first
    ha, hb = fit_linear(host) if host else (a, b)
    return CostModel(
        expert_s=a,
        expert_token_s=b,
        host_expert_s=ha,
        host_expert_token_s=hb,
        host_read_s=read,
        disk_read_s=disk_read if tier.name == "stack" else read if tier.name == "disk" else 0.0,
        demote_s=demote,
        link_bandwidth=layout.nbytes / max(transfer, 1e-9),
        link_latency=0.0,
        expert_bytes=layout.nbytes,
        chunk_bytes=None,
        host_parallel=device.type != "cpu",
        weight_bits=8 * torch.empty((), dtype=model.dtype).element_size(),
    )
