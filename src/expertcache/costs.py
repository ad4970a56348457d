"""The cost model: what one forward step costs on a machine, in seconds and bytes. Torch-free.

Shared by the timing simulator (which advances virtual time by these costs) and the miss paths (which
decide by them: Fiddler's and HybriMoE's host compute, for instance, compares ``host_expert(n)`` with
``transfer_time(bytes) + expert(n)``). The engine measures one for its own machine at warm-up
(``engine.calibrate``); ``bench/cost_triples.py`` measures the figures of any machine.
"""

from __future__ import annotations

import json
import math
import numbers
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np

from expertcache.errors import ExpertcacheError, first_line, option, warn_notes
from expertcache.paths import not_json_kind, write_output
from expertcache.units import format_bytes, parse_duration, parse_rate, parse_size

PROFILE_FORMAT = "expertcache-profile"  # what ``expertcache profile`` writes: a cost model and its model
PROFILE_VERSION = 1  # the profile files this version reads and writes
MAX_CHUNKS = 4096  # chunks per expert the timing model follows one by one (a chunk of 1 B ran out of memory)
AUTO = "auto"  # chunk_bytes: an expert's three weight matrices, about a third of it each, where that pays
AUTO_CHUNKS = 3


def chunks_pay(data_s: float, latency_s: float, chunks: int = AUTO_CHUNKS) -> bool:
    """Whether speculative transfers should move in ``chunks`` chunks rather than whole, for a transfer
    of ``data_s`` seconds of data (bytes / bandwidth) and ``latency_s`` per chunk (a link's latency, or a
    copy's fixed cost: a read request, a thread's bookkeeping). Chunks add ``chunks - 1`` latencies to
    every speculative transfer; they shorten a demand transfer's wait behind one (half of it on average)
    by at most ``1 - 1/chunks`` of that. So they can pay only when ``(1 - 1/n) T / 2 > (n - 1) lat``, with
    ``T = lat + data``: ``T > 2 n lat``, i.e. for three chunks when the data takes more than 5 latencies.
    On the development VM an emulated 2 GB/s + 50 us link moving the embedded model's 184 KB experts
    (92 us of data) was 9 % slower with prefetching in chunks than without (interleaved, 8 runs each)."""
    return data_s + latency_s > 2 * chunks * latency_s


@dataclass(frozen=True)
class CostModel:
    """Costs of one forward step, in seconds and bytes. The defaults: a Mixtral-8x7B expert in fp16
    (3 x 4096 x 14336 x 2 bytes) over PCIe 4.0 x16, with compute times of a recent GPU at batch 1, and
    host compute as measured for that expert in bf16 on the 16-core Xeon of an H100 machine
    (``bench/results/cost_triples_h100.json``)."""

    dense_s: float | tuple[float, ...] = 0.25e-3  # per MoE layer: attention, norms, router (or one per layer)
    expert_s: float = 0.35e-3  # a: an expert's fixed time (reading its weights)
    expert_token_s: float = 2e-6  # b: its time per token routed to it
    step_s: float = 0.5e-3  # per forward step: embeddings and LM head
    link_bandwidth: float = 25e9  # bytes/s (inf: free transfers but for the latency)
    link_latency: float = 20e-6  # seconds per chunk
    expert_bytes: int = 352_321_536
    chunk_bytes: int | None | str = AUTO  # at most this per chunk; None: one chunk per expert
    wake_s: float = 0.0  # compute resumes this long after a transfer it waited for lands (thread wake-up)
    submit_s: float = 0.0  # compute time the engine spends issuing one transfer (bookkeeping, hand-off)
    # compute time the engine spends on one expert computed on the host, beyond its read and computation
    # (its tokens gathered and handed over, its output weighted and placed): a host expert's submit_s
    host_submit_s: float = 0.0
    host_expert_s: float = 5.06e-3  # a: an expert's fixed time computed on the host (reading its weights)
    host_expert_token_s: float = 63e-6  # b: its host time per token
    # r: reading the expert into host memory before the host computes it, at every use (a host-computed
    # expert enters no cache): 0 where the host computes from the weights where they lie (the host tier);
    # from the disk tier, its read from the disk (a profile of the disk or mapped tier: ``load_profile``)
    host_read_s: float = 0.0
    # d: with a host level (``cache.tiers``), reading one whole expert from the disk into host memory, a
    # host-level miss: each chunk of its transfer reads its share before crossing the link (a profile on
    # the disk tier)
    disk_read_s: float = 0.0
    # x: with an exclusive host level, the compute thread's time to copy the device's victim down into it
    # (on a CPU a copy of one expert in memory; 0 on a GPU, whose copy down runs on a stream of its own)
    demote_s: float = 0.0
    dequant_s: float = 0.0  # device time to expand a low-precision copy before computing with it
    host_parallel: bool = True  # the host computes beside the device (False: the same processor, inline)
    weight_bits: int = 16  # bits per weight of a whole expert (its low-precision copies are sized from it)

    def __post_init__(self) -> None:
        for f in fields(self):  # True is not 1 byte, nor 1 s; numpy's numbers are numbers
            value = getattr(self, f.name)
            if f.name == "host_parallel":
                if not isinstance(value, bool):
                    raise ExpertcacheError(f"cost: host_parallel must be True or False, got {value!r}")
            elif isinstance(value, bool):
                raise ExpertcacheError(f"cost: {f.name} must be a number or a string with a unit, not True")
            elif isinstance(value, numbers.Integral) and not isinstance(value, int):
                object.__setattr__(self, f.name, int(value))
            elif isinstance(value, numbers.Real) and not isinstance(value, int | float):
                object.__setattr__(self, f.name, float(value))
        for f in fields(self):  # a value with a unit ("25GB/s", "2ms", "336MiB"), as a JSON file gives it
            value = getattr(self, f.name)
            if isinstance(value, str) and not (f.name == "chunk_bytes" and value == AUTO):
                object.__setattr__(self, f.name, _parse_field(f.name, value))
            elif f.name == "dense_s" and isinstance(value, list | tuple) and any(map(_is_text, value)):
                object.__setattr__(self, f.name, _parse_field(f.name, list(value)))
        if isinstance(self.dense_s, list | tuple):
            object.__setattr__(self, "dense_s", tuple(float(d) for d in self.dense_s))
            if not self.dense_s:
                raise ExpertcacheError("cost: dense_s must be a time or a non-empty list of times")
        for name in _TIMES:
            _check_time(name, getattr(self, name))
        for d in self.dense_s if isinstance(self.dense_s, tuple) else (self.dense_s,):
            _check_time("dense_s", d)
        bandwidth = self.link_bandwidth
        if isinstance(bandwidth, bool) or not isinstance(bandwidth, int | float) or not bandwidth > 0:  # NaN
            raise ExpertcacheError(
                "cost: link_bandwidth must be a positive rate (bytes a second, or a string such as "
                f"'25GB/s'), got {self.link_bandwidth!r}"
            )
        if not isinstance(self.weight_bits, int) or self.weight_bits not in (16, 32):
            raise ExpertcacheError(f"cost: weight_bits must be 16 or 32, got {self.weight_bits!r}")
        if not isinstance(self.expert_bytes, int) or self.expert_bytes < 1:
            raise ExpertcacheError(
                f"cost: expert_bytes must be a positive integer, got {self.expert_bytes!r}"
            )
        chunk = self.chunk_bytes
        if chunk not in (None, AUTO) and (not isinstance(chunk, int) or chunk < 1):
            raise ExpertcacheError(
                f"cost: chunk_bytes must be a positive integer, 'auto' or null, got {self.chunk_bytes!r}"
            )
        if chunk not in (None, AUTO) and self.expert_bytes / chunk > MAX_CHUNKS:
            raise ExpertcacheError(
                f"cost: chunks of {chunk} bytes cut an expert of {self.expert_bytes} bytes into "
                f"{-(-self.expert_bytes // chunk)} chunks; at most {MAX_CHUNKS} (chunks of at least "
                f"{-(-self.expert_bytes // MAX_CHUNKS)} bytes)"
            )

    # -- what the simulator asks ----------------------------------------------------------------
    def dense(self, layer: int) -> float:
        return self.dense_s[layer] if isinstance(self.dense_s, tuple) else self.dense_s

    def expert(self, tokens: int) -> float:
        """Compute time of one expert given ``tokens`` tokens."""
        return self.expert_s + self.expert_token_s * tokens

    def host_expert(self, tokens: int) -> float:
        """Time of one expert computed on the host, given ``tokens`` tokens: its read into host memory
        (``host_read_s``, from a slow tier that is not host memory) and its computation."""
        return self.host_read_s + self.host_expert_s + self.host_expert_token_s * tokens

    def host_pays(self, tokens: int, transfer: float | None = None) -> bool:
        """Fiddler's rule: computing the expert's ``tokens`` on the host takes less than moving it
        (``transfer``, default a whole expert) and computing it on the device. A tie goes to the device:
        on a CPU-only machine the two are the same measurement plus the same read, and which side of a
        rounding error a sum falls on must not decide (it flipped per run and per token count). The
        engine's own work for either (``submit_s``, ``host_submit_s``) prices the time, not this choice:
        two fitted figures of the same order and noisy, weighed here, decided between re-reading every miss
        from the disk and caching it (a new user's trial: 2x the TPOT on the disk tier)."""
        device = (self.demand_transfer_time() if transfer is None else transfer) + self.expert(tokens)
        host = self.host_expert(tokens)
        return host < device and not math.isclose(host, device, rel_tol=1e-9)

    def unpriced_work(self, transfers: bool = True, host: bool = True, budget: bool = False) -> str | None:
        """A note where these are a CPU's costs (``host_parallel`` False) and leave at 0 the engine's own
        work for what the prediction pays: ``transfers`` (``submit_s``), experts computed on the host
        (``host_submit_s``); None where nothing is unpriced. ``budget``: the note says a budget named from
        the prediction comes out low too (the doctor's). On the 2-core CPU that work was 20-190 us a
        miss, and a doctor's ladder without it named 12.5 % for a server that ran 1.86x there
        (BENCHMARKS.md, the doctor's budget ladder against the server)."""
        asked = (
            ("submit_s", "a transfer", "--issue-time", transfers),
            ("host_submit_s", "an expert computed on the host", "--host-issue-time", host),
        )
        zero = [a[:3] for a in asked if a[3] and not getattr(self, a[0])]
        if self.host_parallel or not zero:
            return None
        names, whats, flags = zip(*zero, strict=True)
        it = "them" if len(zero) == 2 else "it"
        return (
            f"{UNPRICED_WORK} for {' or '.join(whats)} ({', '.join(names)} 0): where that work is not small "
            "the predicted TPOT under misses comes out optimistic"
            + (", and the budget named low" if budget else "")
            + f" (profile --fit-overheads fits {'both' if len(zero) == 2 else 'it'}; {' and '.join(flags)} "
            f"declare{'' if len(zero) == 2 else 's'} {it})"
        )

    def chunk_sizes(self, nbytes: int | None = None) -> list[int]:
        """Bytes of each chunk of a transfer of ``nbytes`` (default: one whole expert). Chunks are at most
        ``chunk_bytes`` (auto: a third of a whole expert, its three matrices, where ``chunks_pay`` says so
        for a whole expert over this link; else one chunk); None: one chunk."""
        nbytes = self.expert_bytes if nbytes is None else int(nbytes)
        size = self.chunk_bytes or nbytes
        if size == AUTO:  # resolved here, so that a changed expert_bytes keeps its thirds
            pays = chunks_pay(self.expert_bytes / self.link_bandwidth, self.link_latency)
            size = -(-self.expert_bytes // AUTO_CHUNKS) if pays else nbytes
        full, rest = divmod(nbytes, size)
        return [size] * full + ([rest] if rest else [])

    def chunk_times(self, nbytes: int | None = None) -> list[float]:
        """Link seconds of each chunk of a transfer: latency + bytes / bandwidth."""
        return [self.link_latency + b / self.link_bandwidth for b in self.chunk_sizes(nbytes)]

    def transfer_time(self, nbytes: int | None = None) -> float:
        """Link seconds of a whole transfer of ``nbytes`` (default: one expert), all its chunks."""
        return sum(self.chunk_times(nbytes))

    def demand_transfer_time(self, nbytes: int | None = None) -> float:
        """Link seconds of a demand transfer of ``nbytes`` (default: one expert): one chunk, latency +
        bytes / bandwidth, as the engine and the timing model move it (nothing speculative for it to let
        pass); what a miss path pricing a fetch against the host weighs."""
        nbytes = self.expert_bytes if nbytes is None else int(nbytes)
        return self.link_latency + nbytes / self.link_bandwidth

    @property
    def transfer_s(self) -> float:
        """Link seconds of one whole expert, all its chunks."""
        return self.transfer_time()

    # -- construction, files ---------------------------------------------------------------------
    @classmethod
    def from_measurements(
        cls,
        dense_s: float | Sequence[float],
        expert_samples: Sequence[tuple[int, float]],
        step_s: float,
        link_bandwidth: float,
        link_latency: float,
        expert_bytes: int,
        chunk_bytes: int | None | str = AUTO,
    ) -> CostModel:
        """A cost model from measured times; ``expert_samples`` are (tokens, seconds) of expert calls,
        fitted by least squares to ``a + b * tokens`` (b = 0 from one token count)."""
        a, b = fit_linear(expert_samples)
        dense = dense_s if isinstance(dense_s, int | float) else tuple(dense_s)
        return cls(dense, a, b, step_s, link_bandwidth, link_latency, expert_bytes, chunk_bytes)

    def to_dict(self) -> dict[str, object]:
        out = asdict(self)
        out["dense_s"] = list(self.dense_s) if isinstance(self.dense_s, tuple) else self.dense_s
        return out

    def save(self, path: str | Path) -> None:
        """Write the model as JSON (an infinite bandwidth as the string "inf")."""
        data = self.to_dict()
        if math.isinf(self.link_bandwidth):
            data["link_bandwidth"] = "inf"
        write_output(path, json.dumps(data, indent=2) + "\n", "cost model")

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        """Read a JSON cost model: any subset of the fields, times as seconds or "1ms", rates as
        bytes/s or "16GB/s", sizes as bytes or "336MiB"; problems are one line naming the field. A
        profile (``expertcache profile``) reads as its cost model."""
        return cls.load_profile(path)[0]

    @classmethod
    def load_profile(cls, path: str | Path) -> tuple[CostModel, dict | None]:
        """A cost model file or a profile (``expertcache profile``): the costs, and the profile's model
        shape (``layers``, ``experts``, ``top_k``, ...; None for a plain cost model)."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8-sig"))
        except OSError as e:
            raise ExpertcacheError(f"{path}: cannot read cost model ({e.strerror or e})") from None
        except ValueError as e:
            kind = not_json_kind(path)
            if kind is not None:
                raise ExpertcacheError(
                    f"{path} is {kind}, not a cost model or a profile (expertcache profile writes one)"
                ) from None
            raise ExpertcacheError(f"{path}: not JSON ({first_line(e)})") from None
        if not isinstance(data, dict):
            raise ExpertcacheError(f"{path}: a cost model is a JSON object of fields")
        return cls.from_data(data, path)

    @classmethod
    def from_data(cls, data: dict, path: str | os.PathLike) -> tuple[CostModel, dict | None]:
        """``load_profile`` of a file's object ``data`` (``path`` names it in messages): a cost model's
        fields, or a profile (``expertcache.profile``'s result) -> the costs and the profile's model shape."""
        shape, profile = None, None
        if isinstance(data.get("format"), str) and data["format"] != PROFILE_FORMAT:  # another file of ours
            what = (
                "a plan (expertcache plan's: give it as --plan)"
                if data["format"] == "expertcache-plan"
                else (f"a file of format {data['format']!r}")
            )
            raise ExpertcacheError(
                f"{path} is {what}, not a cost model or a profile (expertcache profile writes one)"
            )
        if "tpot_s" in data and isinstance(data.get("cost"), dict):  # timing --json's result (a user's trial:
            # a line listing its 60 keys as unknown fields)
            raise ExpertcacheError(
                f"{path} is a timing result (expertcache timing --json), not a cost model or a profile: the "
                "cost model it ran on is its 'cost' object (expertcache profile writes one)"
            )
        if data.get("format") == PROFILE_FORMAT:  # a profile: its cost model
            if data.get("version") != PROFILE_VERSION:
                raise ExpertcacheError(
                    f"{path}: a profile of version {data.get('version')!r}; this expertcache reads version "
                    f"{PROFILE_VERSION} (expertcache profile writes one)"
                )
            shape = data.get("model")
            if not isinstance(shape, dict):  # without it, a profile of another model would pass unchecked
                raise ExpertcacheError(
                    f"{path}: a profile without its 'model' object (the model it measured)"
                )
            for key in ("layers", "experts", "top_k"):
                v = shape.get(key)
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    raise ExpertcacheError(
                        f"{path}: the profile's model.{key} must be a whole number, got {v!r}"
                    )
            profile, data = data, data.get("cost")
            if not isinstance(data, dict):
                raise ExpertcacheError(f"{path}: a profile without its 'cost' object")
        try:
            cost = cls.from_dict(data)
        except ExpertcacheError as e:
            raise ExpertcacheError(f"{path}: {e}") from None
        return (cost if profile is None else host_reads_of(profile, cost)), shape

    @classmethod
    def from_dict(cls, data: dict[str, object], base: CostModel | None = None) -> CostModel:
        """``base`` (default: the defaults) with the given fields, parsed as ``load`` does."""
        known = sorted(f.name for f in fields(cls))
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ExpertcacheError(f"cost: unknown field(s) {', '.join(unknown)}; known: {', '.join(known)}")
        parsed = {name: _parse_field(name, value) for name, value in data.items()}
        return replace(base or cls(), **parsed)

    def describe(self) -> str:
        """One line: every cost, and what one expert's transfer takes; the default costs named as such (a
        new user read a Mixtral expert's 876 ms a token, given no costs, as the embedded model's)."""
        default = replace(self, chunk_bytes=CostModel().chunk_bytes) == CostModel()
        dense = (
            "/".join(f"{d * 1e3:g}" for d in self.dense_s) if isinstance(self.dense_s, tuple)
            else f"{self.dense_s * 1e3:g}"
        )  # fmt: skip
        chunks = len(self.chunk_sizes())
        said = "the defaults, a Mixtral-8x7B expert over PCIe 4 to a GPU (--cost PROFILE.json prices yours): "
        return (
            (said if default else "")
            + f"dense {dense} ms/layer | expert {self.expert_s * 1e3:g} ms + {self.expert_token_s * 1e6:g} "
            f"us/token | step {self.step_s * 1e3:g} ms | link {self.link_bandwidth / 1e9:g} GB/s + "
            f"{self.link_latency * 1e6:g} us/chunk | expert {format_bytes(self.expert_bytes)} in "
            f"{chunks} chunk{'s' if chunks > 1 else ''}: {self.transfer_s * 1e3:.3g} ms"
            + (f" | wake {self.wake_s * 1e6:g} us" if self.wake_s else "")
            + (f" | issue {self.submit_s * 1e6:g} us/transfer" if self.submit_s else "")
            + f" | host expert {self.host_expert_s * 1e3:g} ms + {self.host_expert_token_s * 1e6:g} us/token"
            + (f" + read {self.host_read_s * 1e3:g} ms" if self.host_read_s else "")
            + (f" + issue {self.host_submit_s * 1e6:g} us" if self.host_submit_s else "")
            + ("" if self.host_parallel else " (inline)")
            + (f" | dequant {self.dequant_s * 1e6:g} us" if self.dequant_s else "")
            + (f" | disk read {self.disk_read_s * 1e3:g} ms" if self.disk_read_s else "")
            + (f" | copy down {self.demote_s * 1e6:g} us" if self.demote_s else "")
        )


# the start of ``CostModel.unpriced_work``'s note: a plan says it once, not once a run of its search
UNPRICED_WORK = "these costs are a CPU's and price none of the engine's own work"

_TIMES = (
    "expert_s", "expert_token_s", "step_s", "link_latency", "wake_s", "submit_s", "host_submit_s",
    "host_expert_s", "host_expert_token_s", "host_read_s", "disk_read_s", "demote_s", "dequant_s",
)  # fmt: skip

# slow tiers whose experts the host reads into memory before computing them (``DiskTier.host_views``):
# ``expertcache profile`` writes the tier as ``how.slow_tier``
READ_TIERS = ("disk", "mapped")


def as_cost(cost: CostModel | dict | str | os.PathLike | None, trace=None) -> CostModel:
    """A cost model as the Python API takes it: a ``CostModel``, a dict of its fields (as ``from_dict``
    reads them), the path of a cost model or a profile (``load``), or None for the defaults. A profile
    measured for another model's shape than ``trace``'s (a ``Trace``) is refused (``check_shape``)."""
    if cost is None:
        return CostModel()
    if isinstance(cost, CostModel):
        return cost
    if isinstance(cost, dict) and cost.get("format") == PROFILE_FORMAT:  # a profile (expertcache.profile's)
        model, shape = CostModel.from_data(cost, "the profile given")
        if trace is not None:
            check_shape("the profile given", shape, trace)
        return model
    if isinstance(cost, dict):
        return CostModel.from_dict(cost)
    if isinstance(cost, str | os.PathLike):
        model, shape = CostModel.load_profile(cost)
        if trace is not None:
            check_shape(cost, shape, trace)
            note = size_note(cost, model, trace)
            if note is not None:
                warn_notes([note])
        return model
    raise ExpertcacheError(
        "cost must be a CostModel, a dict of its fields or the path of a cost model or profile, got "
        f"{type(cost).__name__} {cost!r}"
    )


FULL_FORMATS = ("float32", "bfloat16", "float16")  # experts stored at full precision (a profile's model)


def check_low_precision(path: str | os.PathLike, shape: dict | None, misses) -> None:
    """A profile of a model whose experts are stored packed (int8, int4, mxfp4, fp8) has no low-precision
    copies for a miss path to serve (the engine refuses hobbit there): timing it would predict a run that
    cannot happen."""
    fmt = (shape or {}).get("expert_format", "float32")
    lossy = [m for m in misses if str(m).split(":")[0] == "hobbit"]
    if fmt not in FULL_FORMATS and lossy:
        raise ExpertcacheError(
            f"profile {path} is of a model whose experts are stored {fmt}: {lossy[0]} serves low-precision "
            "copies, which are made from a full-precision checkpoint (profile that one)"
        )


def check_shape(
    path: str | os.PathLike,
    shape: dict | None,
    trace=None,
    have: tuple | None = None,
    what: str = "",
    hint="",
) -> None:
    """A profile (``path``, its model ``shape``) measured for another model's shape than ``trace``'s
    (or ``have``: layers, experts, top-k of ``what``, a model) is refused in one line: its expert size and
    times are another model's."""
    if shape is None:  # a plain cost model: no shape to hold it to
        return
    if trace is not None:
        have, what = (trace.num_layers, trace.num_experts, trace.top_k), f"trace {trace.source}"
    want = (shape.get("layers"), shape.get("experts"), shape.get("top_k"))
    if have != want:
        raise ExpertcacheError(
            f"profile {path} is for {shape.get('name', 'a model')} ({want[0]} MoE layers x {want[1]} "
            f"experts, top-{want[2]}); {what} has {have[0]} x {have[1]}, top-{have[2]}{hint}"
        )


def profile_tier(path: str | os.PathLike | dict) -> str | None:
    """The slow tier a profile (``path``, or its object) measured the engine on (``how.slow_tier``: disk,
    mapped or host), or None (a plain cost model, or a profile without it)."""
    try:
        data = path if isinstance(path, dict) else json.loads(Path(path).read_text(encoding="utf-8-sig"))
    except (OSError, ValueError):
        return None
    how = data.get("how") if isinstance(data, dict) and data.get("format") == PROFILE_FORMAT else None
    tier = how.get("slow_tier") if isinstance(how, dict) else None
    return tier if isinstance(tier, str) else None


def size_note(path: str | os.PathLike, cost: CostModel, trace) -> str | None:
    """A cost model or profile (``path``) whose expert size is not that of the experts the run that
    recorded ``trace`` moved (``trace.meta["expert_bytes"]``, an engine's): another model of the same
    shape, or the same model in another dtype. Its times are then not that run's: said, not refused."""
    moved = trace.meta.get("expert_bytes")
    if not isinstance(moved, int) or isinstance(moved, bool) or moved == cost.expert_bytes:
        return None
    return (
        f"{path} prices experts of {cost.expert_bytes} bytes; the run recorded in {trace.source} moved "
        f"experts of {moved} (another model or dtype): its times are not that run's"
    )


def host_reads_of(profile: dict, cost: CostModel) -> CostModel:
    """``cost``, a profile's, with the host's read of each expert it computes (``host_read_s``) where the
    profile's slow tier is read into memory first (the disk tier, the mapped one) and gives none: there
    the engine reads a host-computed expert from the tier at every use, as a transfer reads it. A CPU
    engine's transfer is that read (the profile's measured link, ``how.link``: "disk -> cpu"); on a GPU it
    adds the copy to the device, a bound on the read. Without a measured link (a declared one replaced
    it) the read is not known and stays 0. A Granite-shaped model at 25 % on the disk tier was planned
    with host compute at 216 ms a token, read-free, and measured 626-880 ms, against fetching's 436-491."""
    if cost.host_read_s or read_tier_link(profile) is None:
        return cost
    return replace(cost, host_read_s=cost.demand_transfer_time())


def read_tier_link(profile: dict) -> str | None:
    """The tier a profile measured its link by reading (disk, mapped), where it measured the link so; else
    None. Such a link is a read of the tier, not a copy from host memory."""
    how = profile.get("how") if isinstance(profile.get("how"), dict) else {}
    measured = profile.get("measured") if isinstance(profile.get("measured"), list) else []
    tier = how.get("slow_tier")
    return tier if tier in READ_TIERS and "link_bandwidth" in measured else None


def fit_linear(samples: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """Least squares ``seconds = a + b * tokens`` over (tokens, seconds) samples, a and b at least 0
    (b = 0 when every sample has one token count). Where the free fit puts one below 0, the best fit
    with it at 0: a slope of 0 (more tokens measured no slower, on a busy machine) fits the mean, an
    intercept of 0 the line through the origin."""
    tokens = np.asarray([s[0] for s in samples], dtype=np.float64)
    secs = np.asarray([s[1] for s in samples], dtype=np.float64)
    if len(secs) == 0:
        raise ExpertcacheError("cost: no timings to fit")
    if np.ptp(tokens) == 0:
        return max(float(secs.mean()), 0.0), 0.0
    b, a = (float(v) for v in np.polyfit(tokens, secs, 1))
    if b < 0:
        return max(float(secs.mean()), 0.0), 0.0
    if a < 0:
        return 0.0, max(float(tokens @ secs / (tokens @ tokens)), 0.0)
    return a, b


def _is_text(value: object) -> bool:
    return isinstance(value, str)


def _check_time(name: str, value: float) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
        raise ExpertcacheError(
            f"cost: {name} must be a non-negative number of seconds (or a string such as '2ms'), "
            f"got {value!r}"
        )


def _parse_field(name: str, value: object) -> object:
    """One JSON value of a cost field: numbers as they are, strings with units through the parsers."""
    what = f"cost field {name!r}"
    if name == "host_parallel":
        if not isinstance(value, bool):
            raise ExpertcacheError(f"{what}: expected true or false, got {value!r}")
        return value
    if isinstance(value, bool):
        raise ExpertcacheError(f"{what}: expected a number or a string with a unit, got {value}")
    if name == "dense_s" and isinstance(value, list):
        return tuple(_parse_field(name, v) for v in value)
    if name == "chunk_bytes" and (value is None or value == AUTO):
        return value
    if isinstance(value, str) and name == "link_bandwidth" and value.strip().lower() in ("inf", "infinity"):
        return math.inf
    if name == "weight_bits":
        if not isinstance(value, int) or isinstance(value, bool):
            raise ExpertcacheError(f"{what}: expected 16 or 32, got {value!r}")
        return value
    if name in ("expert_bytes", "chunk_bytes"):
        size = parse_size(value, what) if isinstance(value, str | int | float) else None
        if size is None or size != int(size):
            raise ExpertcacheError(f"{what}: expected a whole number of bytes, got {value!r}")
        return int(size)
    if isinstance(value, int | float):
        return _plausible(what, name, float(value))
    if not isinstance(value, str):
        raise ExpertcacheError(f"{what}: expected a number or a string with a unit, got {value!r}")
    if name != "link_bandwidth":
        return parse_duration(value, what)
    return parse_rate(value, what)


# a bare number is in base units (seconds, bytes a second), as ``profile`` writes them; one far outside
# what a machine measures was most likely meant in another unit (16 for 16 GB/s, 5 for 5 us): refused.
# A whole expert's read from a slow disk may take seconds (336 MiB at 100 MB/s: 3.4 s); nothing else does.
_BARE_LONGEST_S = 1.0
_BARE_LONGEST_READ_S = 60.0
_BARE_SLOWEST_RATE = 1e6


def _plausible(what: str, name: str, value: float) -> float:
    if name == "link_bandwidth" and 0 < value < _BARE_SLOWEST_RATE:
        raise ExpertcacheError(
            f"{what}: {value:g} would be {value:g} bytes a second; a bare number is bytes a second, so give "
            f'the unit ("{value:g}GB/s")'
        )
    longest = _BARE_LONGEST_READ_S if name in ("disk_read_s", "host_read_s") else _BARE_LONGEST_S
    if name != "link_bandwidth" and value >= longest:
        raise ExpertcacheError(
            f"{what}: {value:g} would be {value:g} s; a bare number is seconds, so give the unit "
            f'("{value:g}us", "{value:g}ms", or "{value:g}s" if it is)'
        )
    return value


def check_dense_layers(cost: CostModel, layers: int) -> None:
    """Per-layer dense times are one a layer of the model: one line naming where they came from."""
    if isinstance(cost.dense_s, tuple) and len(cost.dense_s) != layers:
        given = option("--dense-time (or a cost file's dense_s)", "the cost's dense_s")
        raise ExpertcacheError(
            f"cost: {given} has {len(cost.dense_s)} times for a model of {layers} layers (give one for all "
            "layers, or one per layer)"
        )


def quantized_bytes(nbytes: int, bits: int, base_bits: int = 16, group: int = 64) -> int:
    """Bytes of a group-wise ``bits``-bit copy of ``nbytes`` of ``base_bits``-bit weights: the packed
    weights plus a 16-bit scale and zero per ``group`` weights (how ``expertcache quantize`` stores them)."""
    weights = nbytes * 8 // base_bits
    return -(-weights * bits // 8) + -(-weights // group) * 4
