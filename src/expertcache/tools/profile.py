"""``expertcache profile``: the machine's cost triple for a model, as one JSON file the planner reads.

For the model's own expert shape and dtype, with the engine's own code paths (``engine.calibrate``):

- the slow tier's transfer of one expert to the compute device, chunk by chunk (host RAM -> GPU, pinned,
  on a GPU; on a CPU the checkpoint read from the disk -> RAM, its memory map with ``--slow-tier
  mapped``, or host RAM with ``--slow-tier host``);
- one expert's compute on the device, ``a + b * n`` for n tokens;
- the same on the host (the CPU, with torch's threads as configured);
- the rest of a decode step (attention, norms, router, embeddings, LM head), from an all-resident decode
  step minus its experts' compute, spread over the MoE layers;
- per precision, for each low-precision copy ``expertcache quantize`` has made of the model (int8, int4,
  int2): its bytes, its transfer from its file to the device, and the device time it takes beyond a
  full expert's: int2's expansion (HQQ), or for int8 and int4, which the packed kernels compute from their
  bytes, what they take more than the full expert for one token (none when they are faster)
  (``dequant_s`` in the cost model is int4's, HOBBIT's default, or the only one measured).

What the machine does not have is declared: ``--device-bandwidth 25GB/s`` (and ``--device-latency``,
``--device-time A[,B]``, ``--dense-time``) or ``--device-profile FILE`` (a profile measured on the target
machine: its link and device figures). The profile says which figures were measured and which declared.
A declared device compute (``--device-time``) makes the host a second processor (``host_parallel``); a
CPU alone computes host work inline, also under a declared link (the engine's emulated one).
``expertcache plan --cost PROFILE.json`` and ``expertcache timing --cost`` read it.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import warnings
from pathlib import Path

from expertcache.costs import FULL_FORMATS, PROFILE_FORMAT, PROFILE_VERSION, CostModel
from expertcache.errors import ExpertcacheError, ExpertcacheWarning, option
from expertcache.units import format_bytes, parse_duration, parse_rate, whole_number

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
        cost, _ = CostModel.load_profile(device_profile)  # its shape is checked against the model's
        data, given = cost.to_dict(), _given_fields(device_profile)
        # the figures the file gives: the rest stay this machine's (a file of one field declared five, the
        # others the default model's, a Mixtral expert over PCIe)
        out.update({k: data[k] for k in DEVICE_FIELDS if k in given})
        if not out:
            raise ExpertcacheError(
                f"--device-profile {device_profile} gives none of the device's figures "
                f"({', '.join(DEVICE_FIELDS)})"
            )
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
        out["link_latency"] = CostModel().link_latency  # listed as declared: 20 us, the model's default
    return out


def _given_fields(path: str) -> set[str]:
    """The cost fields a file gives: a profile's measured and declared ones, a cost model's own keys."""
    data = json.loads(Path(path).read_text(encoding="utf-8-sig"))  # read and checked by load_profile
    if data.get("format") == PROFILE_FORMAT:
        return {*data.get("measured", ()), *data.get("declared", ())}
    return set(data)


def profile(
    path=None,
    *,
    device: str | None = None,
    dtype: str | None = None,
    slow_tier: str | None = None,
    declared: dict[str, object] | None = None,
    steps: int = 16,
    device_profile_shape: dict | None = None,
    fit_overheads: bool = False,
) -> dict[str, object]:
    """Measure the model's costs on this machine (see the module); ``declared`` fields replace the
    measured ones. -> the profile (a JSON object)."""
    import torch

    from expertcache.engine.calibrate import calibrate
    from expertcache.engine.hub import model_label
    from expertcache.engine.offloaded import load

    steps = whole_number(steps, option("--steps", "steps"), 2)  # decode steps a dense time is measured over
    if declared is not None and not isinstance(declared, dict):
        raise ExpertcacheError(f"declared is a dict of cost fields (link_bandwidth=...), got {declared!r}")
    declared = dict(declared or {})
    if fit_overheads and declared:
        raise ExpertcacheError(
            f"{option('--fit-overheads', 'fit_overheads')} fits the engine of this machine against this "
            f"machine's figures, and {', '.join(sorted(declared))} declared are another's: fit on the "
            "machine itself, or leave it out"
        )
    if device_profile_shape is not None:  # before loading: a device profile of another model is refused
        _check_shape(path, device_profile_shape)
    with load(
        path, "100%", device=device, dtype=dtype, slow_tier=slow_tier, progress=False, record=False
    ) as m:
        module = next(x for x in m.model.modules() if getattr(x, "_expertcache_layer", None) == 0)
        measured, unsteady = _steadier(calibrate(m, module), calibrate(m, module))
        m.generate_text(PROMPT, 4)  # warm-up: every expert the prompt uses is resident from here
        # the decode step twice, as the expert costs: the quicker (noise only adds), and said when they
        # disagree (a busy 2-core VM's profile gave a step of 14 ms against about 2 ms quiet)
        runs = [m.generate_text(PROMPT, steps, min_new_tokens=steps).tpot_s for _ in range(2)]
        per_step = min(runs)
        if per_step > 0 and max(runs) / per_step > UNSTEADY:
            unsteady.append(f"decode step {1e3 * runs[0]:.3g} and {1e3 * runs[1]:.3g} ms")
        experts = m.num_layers * m.top_k * measured.expert(1)
        if per_step > 0 and experts > per_step:  # a decode step's experts alone slower than the whole step:
            # calibrated while the process started (a busy 2-core VM's first 2-6 calls of an expert took
            # 30 ms each, then 45 us, and both calibrations fell in them): once more, warm now
            again, _ = _steadier(calibrate(m, module), calibrate(m, module))
            measured, _ = _steadier(measured, again)
            experts = m.num_layers * m.top_k * measured.expert(1)
            if experts > per_step:
                unsteady.append(
                    f"the experts of a decode step {1e3 * experts:.3g} ms, more than the whole step "
                    f"{1e3 * per_step:.3g} ms (dense left at 0)"
                )
        dense = max(0.0, per_step - experts) / m.num_layers
        shape = {
            "name": model_label(m.path), "layers": m.num_layers, "experts": m.num_experts, "top_k": m.top_k,
            "expert_bytes": m.layout.nbytes, "dtype": str(m.dtype).removeprefix("torch."),
            # a packed checkpoint's slots hold gate_up_proj.q and its scales: the matrices are its shapes'
            "gated": "gate_up_proj" in (m.packed.shapes if m.packed is not None else m.layout.names),
            "expert_format": m.stats["expert_format"],  # float32, bfloat16, or a packed format: int8 ...
        }  # fmt: skip
        dev = str(m.device)
        tier = m.tier.name
        precisions = low_precision_costs(m, module, measured.expert(1))
    base = {"dense_s": dense, "step_s": 0.0}
    timed_ones = {name: p for name, p in precisions.items() if "dequant_s" in p}
    if timed_ones:
        low = timed_ones.get("int4") or next(iter(timed_ones.values()))
        base["dequant_s"] = low["dequant_s"]
    cost = CostModel.from_dict(base, measured)
    if declared:  # a declared device (its compute) is another processor than this host
        cost = CostModel.from_dict({**declared, "host_parallel": "expert_s" in declared}, cost)
    fit = None
    if fit_overheads:  # the engine's own overheads, fitted on a run of this machine
        cost, fit = fitted_overheads(path, cost, per_step, device=device, dtype=dtype, slow_tier=slow_tier)
        unsteady += fit["unsteady"]
    # step_s is 0: the rest of a step is measured (or declared) as dense_s; host_read_s is measured on the
    # disk and mapped tiers (calibrate: one expert read into memory), 0 elsewhere (reading a profile
    # without it gives it the tier's transfer: costs.host_reads_of)
    skip = ("chunk_bytes", "step_s", "wake_s") + (() if fit else ("submit_s", "host_submit_s"))
    if fit:  # a figure a busy machine left at 0 is not a measurement
        skip += tuple(
            f for f, part in (("submit_s", "transfer"), ("host_submit_s", "host")) if not fit[part]["fitted"]
        )
    skip += () if cost.host_read_s else ("host_read_s",)
    if not cost.disk_read_s:  # measured on the disk tier (and with a host level) only
        skip += ("disk_read_s",)
    if not cost.demote_s:  # measured on a CPU only (a GPU copies down on a stream of its own)
        skip += ("demote_s",)
    fields = [f for f in cost.to_dict() if f not in skip]
    return {
        "format": PROFILE_FORMAT,
        "version": PROFILE_VERSION,
        "model": shape,
        "cost": cost.to_dict(),
        "measured": [
            f
            for f in fields
            if f not in declared and f != "host_parallel" and (f != "dequant_s" or timed_ones)
        ],
        "precisions": precisions,
        "declared": sorted(k for k in declared if k != "step_s"),
        "how": {
            "device": f"declared (host: {dev})" if "expert_s" in declared else dev,
            "slow_tier": tier,
            "link": "declared" if "link_bandwidth" in declared else f"{tier} -> {dev}, one expert in chunks",
            "decode_step_s": per_step,
            "steps": steps,
            # two calibrations, each measurement's quicker kept; where they disagreed by more than
            # UNSTEADY, which
            "calibrations": 2,
            "unsteady": unsteady,
            "torch_threads": torch.get_num_threads(),
            "fit": fit,  # submit_s fitted on an engine run (--fit-overheads), or None
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


UNSTEADY = 1.5  # two calibrations this far apart: the machine was busy, say so


FIT_BUDGET = "50%"  # the expert memory of the run the overheads are fitted on (misses and hits both)
FIT_TOKENS = 32
HOST_FIT_MISS = "placement"  # every layer's experts on the host: the run that fits host_submit_s
FIT_PAIRS = 3  # runs of each kind, each after an all-resident one: the median pair's figure is kept


def fitted_overheads(
    path, cost: CostModel, resident_step_s: float, **load_options
) -> tuple[CostModel, dict[str, object]]:
    """``cost`` with the engine's own overheads fitted on runs of it on this machine: ``submit_s``, its
    work a transfer (its bookkeeping, the hand-off to its worker, the wake-up after a wait), on runs at
    ``FIT_BUDGET`` (every miss fetched); then ``host_submit_s``, its work an expert computed on the host
    (the expert's tokens gathered and handed over, its output weighted and placed), on runs with every
    layer's experts on the host (``placement``). Each such run is paired with an all-resident run of the
    same prompt and tokens just before it, and the figure is fitted so that the timing model's TPOT of
    the run, replayed at its own cache, exceeds its all-resident TPOT by what the engine's did (the model
    grows nearly linearly with each figure: a few secant steps). The pairing takes the machine's speed of
    the moment, and the dense time the profile measured, out of the fit: fitted against the model's TPOT
    alone, a profile whose all-resident step was measured in a busy second fitted nothing. ``FIT_PAIRS``
    pairs each, the median pair's figure kept (noise moves a difference either way); where the figures
    disagree by more than ``UNSTEADY``x, or a run decoded faster than its all-resident pair, the machine
    was busy: said in ``unsteady``. ``wake_s`` stays 0: fitted beside ``submit_s`` on TPOT and
    stall a token (``bench/validate_timing.py``'s 2 x 2 solve), the pair predicted a 25 % run 24 % high on
    the 2-core VM, ``submit_s`` alone (fitted before the runs were paired) 2-8 % high and a 50 % run 3-13 %
    low, where a profile without it is 22-27 % low. ``resident_step_s`` (the profile's own all-resident
    step) is kept for the record."""
    from expertcache.engine.offloaded import load

    unsteady: list[str] = []

    def run(budget: str, miss: str, base: CostModel) -> tuple:
        with warnings.catch_warnings():  # the fit's own runs: their notes (an unused expert memory under
            warnings.simplefilter("ignore", ExpertcacheWarning)  # placement) are not the caller's
            with load(
                path, budget, prefetch="none", miss=miss, costs=base, progress=False, **load_options
            ) as m:
                g = m.generate_text(PROMPT, FIT_TOKENS, min_new_tokens=FIT_TOKENS)
                return g.tpot_s, m.trace(), g.stats["misses"], g.stats.get("host_computed", 0)

    def fitted(field: str, budget: str, miss: str, base: CostModel) -> dict[str, object]:
        pairs = [(run("100%", "fetch", base), run(budget, miss, base)) for _ in range(FIT_PAIRS)]
        fits, floors = [], []
        for resident, target in pairs:
            floors.append(_model_tpot(base, field, 0.0, resident[1], "fetch"))  # the model's all resident
            fits.append(_fit_overhead(base, field, target[1], floors[-1] + target[0] - resident[0], miss))
        keep = sorted(range(FIT_PAIRS), key=lambda i: fits[i][0])[FIT_PAIRS // 2]  # the median pair
        value, unfitted, matched = fits[keep]
        resident, target = pairs[keep]
        quicker = [i for i, (r, t) in enumerate(pairs) if t[0] < 0.9 * r[0]]
        if quicker:  # fewer experts resident, yet quicker: a busy second
            r, t = pairs[quicker[0]]
            unsteady.append(
                f"decode step at {budget} under {miss} {1e3 * t[0]:.3g} ms, quicker than all resident in the "
                f"same round ({1e3 * r[0]:.3g} ms)" + (f": {field} not fitted" if value == 0 else "")
            )
        values = [f[0] for f in fits]
        if min(values) > 0 and max(values) / min(values) > UNSTEADY:
            unsteady.append(
                f"{field} fitted {', '.join(f'{v * 1e6:.0f}' for v in values)} us (the median kept)"
            )
        return {
            "value": value, "fitted": not (quicker and value == 0), "budget": budget, "miss": miss,
            "misses": target[2], "host_computed": target[3],
            "engine": {"tpot_s": target[0], "resident_tpot_s": resident[0]},
            "model": {"tpot_s": matched, "tpot_unfitted_s": unfitted, "resident_tpot_s": floors[keep]},
            "pairs": values,
        }  # fmt: skip

    transfer = fitted("submit_s", FIT_BUDGET, "fetch", cost)
    cost = dataclasses.replace(cost, submit_s=transfer["value"], wake_s=0.0)
    host = fitted("host_submit_s", "100%", HOST_FIT_MISS, cost)
    cost = dataclasses.replace(cost, host_submit_s=host["value"])
    fit = {
        "budget": FIT_BUDGET, "tokens": FIT_TOKENS, "submit_s": transfer["value"], "wake_s": 0.0,
        "misses": transfer["misses"], "engine": transfer["engine"], "model": transfer["model"],
        "host_submit_s": host["value"], "host": host, "transfer": transfer,
        "resident_step_s": resident_step_s,
        "unsteady": unsteady,
    }  # fmt: skip
    return cost, fit


def _model_tpot(cost: CostModel, field: str, value: float, trace, miss: str) -> float:
    """The timing model's TPOT of ``trace`` (a run, replayed at its own cache and miss path) with ``field``
    of ``cost`` at ``value`` (the fit's own replays: no notes to the caller)."""
    from expertcache.sim.timing import RECORDED, run_timing

    changed = dataclasses.replace(cost, **{field: value})
    return run_timing(trace, RECORDED, miss=miss, cost=changed).tpot_s or 0.0


def _fit_overhead(cost: CostModel, field: str, trace, tpot: float, miss: str) -> tuple[float, float, float]:
    """The value of ``field`` (``submit_s`` or ``host_submit_s``) at which the timing model's TPOT of
    ``trace`` (replayed at the run's own cache and miss path) is ``tpot``: (it, the model's TPOT with it
    at 0, with it)."""

    def model_tpot(value: float) -> float:
        return _model_tpot(cost, field, value, trace, miss)

    # the model's TPOT grows with either, nearly linearly (waits that overlap make it not quite): a few
    # secant steps from 0 and 50 us
    base = model_tpot(0.0)
    points = [(0.0, base), (50e-6, model_tpot(50e-6))]
    for _ in range(4):
        (x0, y0), (x1, y1) = points[-2:]
        if y1 == y0 or abs(y1 - tpot) <= 1e-3 * tpot:
            break
        x2 = max(0.0, x1 + (tpot - y1) * (x1 - x0) / (y1 - y0))
        points.append((x2, model_tpot(x2)))
    if base >= tpot:  # the model is no quicker than the run without it
        return 0.0, base, base
    return points[-1][0], base, points[-1][1]


def _steadier(a: CostModel, b: CostModel) -> tuple[CostModel, list[str]]:
    """Of two calibrations, each measurement's quicker one (noise only adds), and the figures on which
    they disagree by more than ``UNSTEADY``x: a machine busy with something else (a new user's profile on a
    busy 2-core VM gave 2131 us a token for the expert one run and 1.9 us the next). A measurement's
    figures are taken together (an expert's fixed and per-token times, the link's rate and latency, the
    reads of the host path and the disk tier); on a CPU the host's computation is the device's one
    measurement (``calibrate``), taken with it."""
    figures = {
        "expert, 1 token": lambda c: c.expert(1),
        "expert, 16 tokens": lambda c: c.expert(16),
        "transfer": lambda c: c.transfer_time(),
        "host expert, 1 token": lambda c: c.host_expert(1),
        "disk read": lambda c: c.disk_read_s,  # the disk tier's (0 elsewhere: never compared)
        "copy down": lambda c: c.demote_s,  # a CPU's (one run measured 7994 us against 74-88 us)
    }
    unsteady = []
    for name, of in figures.items():
        x, y = of(a), of(b)
        if min(x, y) > 0 and max(x, y) / min(x, y) > UNSTEADY:
            unsteady.append(f"{name} {1e3 * x:.3g} and {1e3 * y:.3g} ms")
    compute = ("expert_s", "expert_token_s")
    host = ("host_expert_s", "host_expert_token_s")
    measurements = [  # the fields of one measurement, and the time that says which run was quieter
        (compute + (() if a.host_parallel else host), lambda c: c.expert(1) + c.expert(16)),
        (host if a.host_parallel else (), lambda c: c.host_expert_s + c.host_expert_token_s),
        (("host_read_s", "disk_read_s"), lambda c: c.host_read_s + c.disk_read_s),
        (("link_bandwidth", "link_latency"), lambda c: c.transfer_time()),
        (("demote_s",), lambda c: c.demote_s),
    ]
    kept = {f: getattr(a if of(a) <= of(b) else b, f) for fields, of in measurements for f in fields}
    return dataclasses.replace(a, **kept), unsteady


def _check_shape(path, shape: dict) -> None:
    from expertcache.engine.offloaded import model_info

    info = model_info(path)
    have = (info["moe_layers"], info["experts_per_layer"], info["top_k"])
    want = (shape.get("layers"), shape.get("experts"), shape.get("top_k"))
    if have != want:
        raise ExpertcacheError(
            f"the device profile is for {shape.get('name', 'a model')} ({want[0]} MoE layers x {want[1]} "
            f"experts, top-{want[2]}); this model has {have[0]} x {have[1]}, top-{have[2]}"
        )


def low_precision_costs(m, module, full_s: float) -> dict[str, dict[str, float]]:
    """Each low-precision copy of the model that exists (``expertcache quantize``): its bytes per expert,
    its transfer to the device (from its file, in the engine's chunks) and the device time it takes beyond
    a full expert's ``full_s`` for one token: HQQ's expansion, or what the packed kernels take more (none
    when they are faster)."""
    import statistics
    import time

    import torch

    from expertcache.engine.memory import SlotPool
    from expertcache.engine.quantized import (
        Dequantizer,
        QuantSource,
        find_copy,
        packed_of,
        quant_layout,
        read_meta,
    )
    from expertcache.errors import ExpertcacheError

    def timed(fn) -> float:
        fn()
        runs = []
        for _ in range(5):
            if m.device.type == "cuda":
                torch.cuda.synchronize(m.device)
            t0 = time.perf_counter()
            fn()
            if m.device.type == "cuda":
                torch.cuda.synchronize(m.device)
            runs.append(time.perf_counter() - t0)
        return statistics.median(runs)

    out = {}
    for bits in (8, 4, 2):
        try:
            path = find_copy(m.path, bits, 64)
        except ExpertcacheError:
            continue
        meta = read_meta(path)
        layout = quant_layout(meta)
        packed = packed_of(meta, m.dtype)
        source = QuantSource(path, layout, pin=m.device.type == "cuda")
        views = SlotPool(layout, 1, m.device).views[0]
        chunks = layout.chunks(m.chunk_bytes)
        out[f"int{bits}"] = {
            "bytes": layout.nbytes,
            "transfer_s": timed(
                lambda s=source, v=views, cs=chunks: [s.copy_chunk((0, 0), v, c) for c in cs]
            ),
        }
        if packed is not None:  # computed from its packed bytes: nothing is expanded
            from expertcache.engine.packed import PackedKernels

            kernels = PackedKernels(packed)
            x = torch.randn(1, packed.shapes["down_proj"][0 if not packed.transposed else 1], device=m.device)
            x = x.to(m.dtype)
            [source.copy_chunk((0, 0), views, c) for c in chunks]
            compute = timed(lambda k=kernels, v=views, x=x: k.expert(module, v, x))
            out[f"int{bits}"]["compute_s"] = compute
            out[f"int{bits}"]["dequant_s"] = max(0.0, compute - full_s)
        else:
            try:
                expand = Dequantizer(meta, m.dtype)  # HQQ's copies need hqq
            except ExpertcacheError as exc:
                out[f"int{bits}"]["skipped"] = str(exc)
                continue
            out[f"int{bits}"]["dequant_s"] = timed(lambda e=expand, v=views: e(v))
    return out


def _figure(fit: dict, part: str, field: str) -> str:
    """A fitted figure, or that a busy machine left it unfitted (0 taken, not listed as measured)."""
    if not fit.get(part, {}).get("fitted", True):
        return "not fitted (a run quicker than its all-resident pair: the machine was busy; 0 taken)"
    return f"{fit[field] * 1e6:.0f} us"


def _above(fit: dict) -> str:
    """A fitted run's TPOT above its all-resident pair's, the engine's and the model's without the figure."""
    engine, model = fit["engine"], fit["model"]
    if "resident_tpot_s" not in engine:  # a profile fitted before the runs were paired
        run, unfitted = engine["tpot_s"] * 1e3, model["tpot_unfitted_s"] * 1e3
        return f": TPOT {run:.3f} ms run, {unfitted:.3f} ms by the model without it"
    ran = engine["tpot_s"] - engine["resident_tpot_s"]
    unfitted = model["tpot_unfitted_s"] - model["resident_tpot_s"]
    return (
        f": a token {ran * 1e3:+.3f} ms against all resident run just before, {unfitted * 1e3:+.3f} ms by "
        "the model without it"
    )


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
        f"{shape['top_k']}, {format_bytes(shape['expert_bytes'])} per expert ({shape['dtype']}"
        + (f"; stored {fmt}" if (fmt := shape.get("expert_format", shape["dtype"])) != shape["dtype"] else "")
        + ")",
        f"cost       {cost.describe()}",
        f"measured   {', '.join(data['measured'])}",
        f"declared   {', '.join(data['declared']) or 'nothing'}",
        (
            f"fitted     submit_s {_figure(fit, 'transfer', 'submit_s')} on runs at {fit['budget']} "
            f"({fit['misses']} misses){_above(fit)}"
            + (
                f"; host_submit_s {_figure(fit, 'host', 'host_submit_s')} on runs with every expert on the "
                f"host ({h['host_computed']} computed there){_above(h)}"
                if (h := fit.get("host"))
                else ""
            )
            if (fit := data["how"].get("fit"))
            else "not here   submit_s, host_submit_s, wake_s: the engine's own work a transfer and an expert "
            "computed on the host, and its wake-up after a transfer (0: a plan under misses comes out "
            "optimistic on a CPU"
            + ("" if data["declared"] else "; --fit-overheads fits the first two on runs")
            + ")"
        ),
        "precisions "
        + (
            "; ".join(
                f"{name}: {format_bytes(p['bytes'])}, transfer {p['transfer_s'] * 1e3:.3f} ms, "
                + (
                    f"not timed ({p['skipped']})"
                    if "skipped" in p
                    else f"packed compute {p['compute_s'] * 1e3:.3f} ms ({p['dequant_s'] * 1e3:.3f} ms more "
                    "than a full expert)"
                    if "compute_s" in p
                    else f"expand {p['dequant_s'] * 1e3:.3f} ms"
                )
                for name, p in data["precisions"].items()
            )
            or (
                f"full only (the experts are stored {shape['expert_format']}: hobbit's copies are made from "
                "a full-precision checkpoint)"
                if shape.get("expert_format", "float") not in FULL_FORMATS
                else "full only (no low-precision copies: expertcache quantize makes them)"
                if shape.get("gated", True)
                else "full only (experts without a gate projection have no low-precision copies)"
            )
        ),
        f"how        link: {data['how']['link']}; device: {data['how']['device']}; host experts "
        f"{'beside the device' if cost.host_parallel else 'inline (the device is this CPU)'}; "
        f"an all-resident decode step measured here: {data['how']['decode_step_s'] * 1e3:.3f} ms",
    ]
    if data["how"].get("unsteady"):
        lines.append(f"unsteady   {unsteady_line(data)}")
    return "\n".join(lines)


def unsteady_line(data: dict) -> str:
    """What a profile's unsteady measurements were and what it kept: of two calibrations the quicker, of
    the fit's three runs (``--fit-overheads``) the median (it said "two calibrations" of three fitted
    values, and "the quicker" of the median: a new user's trial)."""
    return (
        "measurements disagreed (" + "; ".join(data["how"]["unsteady"]) + "): the machine was busy; of two "
        "calibrations the quicker is kept, of the three fit runs the median; profile again when it is quiet"
    )
