"""Experts computed where their weights lie: on the host, from the slow tier (Fiddler, HybriMoE, the
``--cpu-moe`` placement of llama.cpp and kTransformers).

The hidden states of the expert's tokens go to the host, the expert runs there with the same
operations as on the device (``parts.expert_output``), and its output comes back. With a GPU the host
works on a thread of its own beside the device (``submit`` returns at once; ``result`` waits, and the
wait is ``host_wait_s``); on a CPU-only machine host and device are the same processor, and host
experts run inline when their result is asked for. On a CPU engine the result is bit-identical to the
device's: the same kernels on the same bytes. On a GPU it rounds as the CPU does.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from expertcache.engine.parts import expert_output
from expertcache.policy.base import Key


class HostExperts:
    """Runs experts on the host from the slow tier's weights; one at a time, in submission order."""

    def __init__(self, tier, device: torch.device) -> None:
        self.tier, self.device = tier, device
        self.threaded = device.type != "cpu"
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="expertcache-host") if self.threaded else None
        self.busy_s = 0.0  # host time spent computing experts
        self.wait_s = 0.0  # device-side time spent waiting for host results
        self.computed = 0

    def submit(self, module, key: Key, x: torch.Tensor) -> Future | tuple:
        """Start computing expert ``key`` on tokens x [T, H] (on the device); ``result`` gives [T, H]."""
        if self._pool is None:
            return (module, key, x)
        return self._pool.submit(self._run, module, key, x.to("cpu", non_blocking=False))

    def result(self, handle: Future | tuple) -> torch.Tensor:
        start = time.perf_counter()
        if isinstance(handle, tuple):
            out = self._run(*handle)
        else:
            out = handle.result().to(self.device, non_blocking=False)
        if self._pool is not None:
            self.wait_s += time.perf_counter() - start
        return out

    def _run(self, module, key: Key, x: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        with torch.inference_mode():
            out = expert_output(module, self.tier.host_views(key), x)
        self.busy_s += time.perf_counter() - start
        self.computed += 1
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
