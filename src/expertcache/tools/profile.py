"""``expertcache profile``: the machine's cost triple for a model, as one JSON file the planner reads.

For the model's own expert shape and dtype, with the engine's own code paths (``engine.calibrate``):

- the slow tier's transfer of one expert to the compute device, chunk by chunk (host RAM -> GPU, pinned,
  on a GPU; the memory-mapped checkpoint -> RAM on a CPU, or host RAM with ``--slow-tier host``);
- one expert's compute on the device, ``a + b * n`` for n tokens;
- the same on the host (the CPU, with torch's threads as configured);
- the rest of a decode step (attention, norms, router, embeddings, LM head), from an all-resident decode
  step minus its experts' compute, spread over the MoE layers.

What the machine does not have is declared: ``--device-bandwidth 25GB/s`` (and ``--device-latency``,
``--device-time A[,B]``, ``--dense-time``) or ``--device-profile FILE`` (a profile measured on the target
machine: its link and device figures). The profile says which figures were measured and which declared.
A declared device compute (``--device-time``) makes the host a second processor (``host_parallel``); a
CPU alone computes host work inline, also under a declared link (the engine's emulated one).
``expertcache plan --cost PROFILE.json`` and ``expertcache timing --cost`` read it.
"""

from __future__ import annotations

import datetime
import os
import platform

from expertcache.costs import PROFILE_FORMAT, CostModel
from expertcache.errors import ExpertcacheError
from expertcache.units import parse_duration, parse_rate

DEVICE_FIELDS = ("link_bandwidth", "link_latency", "expert_s", "expert_token_s", "dense_s", "step_s")
PROMPT = "def fibonacci(n):\n    "


def declared_fields(
    device_bandwidth: str | None = None,
    device_latency: str | None = None,
    device_time: str | None = None,
    dense_time: str | None = None,
    device_profile: str | None = None,
) -> dict[str, object]:
    """The cost fields the user declares (checked, with units), a device profile's first."""
    out: dict[str, object] = {}
    if device_profile:
        cost, _ = CostModel.load_profile(device_profile)
        data = cost.to_dict()
        out.update({k: data[k] for k in DEVICE_FIELDS})
    if device_bandwidth:
        out["link_bandwidth"] = parse_rate(device_bandwidth, "--device-bandwidth")
    if device_latency:
        out["link_latency"] = parse_duration(device_latency, "--device-latency")
    if device_time:
        parts = device_time.split(",")
        if len(parts) > 2:
            raise ExpertcacheError(f"--device-time {device_time!r} is TIME or TIME,PER_TOKEN")
        out["expert_s"] = parse_duration(parts[0], "--device-time")
        out["expert_token_s"] = parse_duration(parts[1], "--device-time") if len(parts) == 2 else 0.0
    if dense_time:
        out["dense_s"] = parse_duration(dense_time, "--dense-time")
        out["step_s"] = 0.0
    if "link_bandwidth" in out and "link_latency" not in out:  # a declared link: the default latency
        out["link_latency"] = CostModel().link_latency
    return out


def profile(
    path=None,
    *,
    device: str | None = None,
    dtype: str | None = None,
    slow_tier: str | None = None,
    declared: dict[str, object] | None = None,
    steps: int = 16,
) -> dict[str, object]:
    """Measure the model's costs on this machine (see the module); ``declared`` fields replace the
    measured ones. -> the profile (a JSON object)."""
    import torch

    from expertcache.engine.calibrate import calibrate
    from expertcache.engine.hub import model_label
    from expertcache.engine.offloaded import load

    declared = dict(declared or {})
    with load(
        path, "100%", device=device, dtype=dtype, slow_tier=slow_tier, progress=False, record=False
    ) as m:
        module = next(x for x in m.model.modules() if getattr(x, "_expertcache_layer", None) == 0)
        measured = calibrate(m, module)
        m.generate_text(PROMPT, 4)  # warm-up: every expert the prompt uses is resident from here
        g = m.generate_text(PROMPT, steps, min_new_tokens=steps)
        per_step = g.tpot_s
        experts = m.num_layers * m.top_k * measured.expert(1)
        dense = max(0.0, per_step - experts) / m.num_layers
        shape = {
            "name": model_label(m.path), "layers": m.num_layers, "experts": m.num_experts, "top_k": m.top_k,
            "expert_bytes": m.layout.nbytes, "dtype": str(m.dtype).removeprefix("torch."),
        }  # fmt: skip
        dev = str(m.device)
        tier = m.tier.name
    cost = CostModel.from_dict({"dense_s": dense, "step_s": 0.0}, measured)
    if declared:  # a declared device (its compute) is another processor than this host
        cost = CostModel.from_dict({**declared, "host_parallel": "expert_s" in declared}, cost)
    fields = [f for f in cost.to_dict() if f not in ("chunk_bytes", "wake_s", "submit_s", "dequant_s")]
    return {
        "format": PROFILE_FORMAT,
        "version": 1,
        "model": shape,
        "cost": cost.to_dict(),
        "measured": [f for f in fields if f not in declared and f != "host_parallel"],
        "declared": sorted(declared),
        "how": {
            "device": f"declared (host: {dev})" if "expert_s" in declared else dev,
            "slow_tier": tier,
            "link": "declared" if "link_bandwidth" in declared else f"{tier} -> {dev}, one expert in chunks",
            "decode_step_s": per_step,
            "steps": steps,
            "torch_threads": torch.get_num_threads(),
        },
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "gpu": torch.cuda.get_device_name() if dev.startswith("cuda") else None,
        },
        "versions": {"python": platform.python_version(), "torch": torch.__version__, **_versions()},
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("expertcache", "transformers"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


def format_profile(data: dict[str, object]) -> str:
    cost = CostModel.from_dict(data["cost"])
    shape = data["model"]
    lines = [
        f"model      {shape['name']}: {shape['layers']} MoE layers x {shape['experts']} experts, top-"
        f"{shape['top_k']}, {shape['expert_bytes'] / 2**20:.2f} MiB per expert ({shape['dtype']})",
        f"cost       {cost.describe()}",
        f"measured   {', '.join(data['measured'])}",
        f"declared   {', '.join(data['declared']) or 'nothing'}",
        f"how        {data['how']['link']}; device {data['how']['device']}; decode step "
        f"{data['how']['decode_step_s'] * 1e3:.3f} ms all resident",
    ]
    return "\n".join(lines)
