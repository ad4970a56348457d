"""``expertcache selftest``: the engine against transformers' own model, on this machine's device.

CI has no GPU, so a GPU user's machine is the first to run the CUDA paths (pinned host tier, transfer
stream and events, host experts on a thread beside the GPU, predictors on the device). The self-test
builds a tiny random model of every supported family in a temporary directory, generates greedily
through the engine under a matrix of budgets, policies, predictors and miss paths, and through
transformers on the same device with the experts implementation the engine's default kernel is exact
against (``grouped_mm`` where torch has it, else ``eager``: ``engine.kernels``), and compares tokens and
logits. A check passes with:

- tokens equal, logits bit-equal: float32 with experts computed on the device, or on a CPU-only
  machine wherever they are computed;
- tokens equal, |dlogit| <= 1e-5: split experts (two products and a sum instead of one product), and
  host-computed experts beside a GPU (the CPU rounds differently from the GPU);
- tokens equal: bfloat16 on CUDA (the logit difference is reported).

The matrix is not a cross product: every family runs every exact miss path once, and the policies,
predictors and budgets rotate over those runs, so each family, online policy, predictor that needs no
training run, budget (the policy's minimum, about half, all experts) and miss path appears at least
once; a few further checks cover the other slow tier, a padded batch, the predictor thread, an emulated
link, costs measured at load, a host level with staging and an exclusive one (three tiers), the dense
layers quantised at load (against transformers with the same layers quantised), checkpoints in FP8's and
MXFP4's layouts (against transformers dequantising them; tokens equal, |dlogit| <= 1e-5: the packed
kernels sum in their own order) and, on CUDA, bfloat16. ``quick`` runs one path per family.
"""

from __future__ import annotations

import gc
import re
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from expertcache.costs import CostModel
from expertcache.engine.families import FAMILIES, Shape, family_of
from expertcache.engine.offloaded import resolve_device
from expertcache.errors import ExpertcacheError, ExpertcacheWarning, first_line
from expertcache.miss.registry import parse_miss
from expertcache.policy import POLICIES, is_offline
from expertcache.policy.registry import min_capacity, parse_policy
from expertcache.tools.compare import Comparison, Run, compare, greedy, prompt_ids
from expertcache.tools.tiny import (
    PROMPT,
    PROMPT_B,
    SPECS,
    TINY_HEADS,
    TOP_K,
    make_tiny,
    make_tokenizer,
    moe_layers,
    total_experts,
)
from expertcache.units import true_or_false

BUDGETS = ("min", "half", "all")
# every exact miss path, by where it computes a missed expert (which sets the tolerance); hobbit is lossy
COMPUTES = {
    "fetch": "device", "host": "host", "hybrid": "host", "placement": "host", "split": "split",
    "batch": "host",
}  # fmt: skip
# each exact path's variants, with the budgets they rotate through
MISSES: dict[str, tuple[str, ...]] = {
    "fetch": BUDGETS,
    "host": BUDGETS,
    "hybrid": BUDGETS,
    "placement": BUDGETS,  # every layer's experts on the host, no slot at all
    "placement:first=1": BUDGETS,  # layer 0 on the host, the others cached
    "split:theta=0.5,buffer=1": BUDGETS,  # fits the minimum: half an expert's bottom, the tops of top-k
    "split:theta=0.3/0.7": ("half", "all"),  # a theta per layer: each layer's tops need room of their own
    "batch": ("half", "all"),  # cached, on the host or streamed (top-k + 1 slots at least)
}
# every predictor the engine runs ("learned" with an untrained predictor, token and eam from a trace
# the model recorded); oracle is simulator-only
PREFETCHES = ("none", "next-gate", "window", "adaptive", "learned", "token", "eam")
ONLINE = tuple(name for name in POLICIES if not is_offline(name))
CLOSE_ATOL = 1e-5
OWN_PACKING = {"int8": 8, "int4": 4}  # expertcache's packed checkpoints (``quantize --checkpoint``): bits
# bf16 attention on CUDA fails on the tiny MLA heads (rotary and plain parts of 4 dims each: "misaligned
# address", with cuDNN and with the memory-efficient kernel alike): every family with MLA attention gets
# heads of 16 dims in bf16 (``_shapes``); real checkpoints' heads are far larger
MLA_BF16_SHAPE: dict[str, int] = {"hidden": 64}
# figures that send some misses to the host and others over the link, whatever this machine measures
COSTS = CostModel(
    expert_s=1e-3, expert_token_s=1e-4, host_expert_s=2e-3, host_expert_token_s=1e-3,
    link_bandwidth=1e6, link_latency=0.0, expert_bytes=3000, chunk_bytes=None, dense_s=0.0, step_s=0.0,
)  # fmt: skip


@dataclass(frozen=True)
class Case:
    """One engine run to compare with the reference."""

    family: str
    policy: str = "lru"
    budget: str = "all"  # one of BUDGETS
    miss: str = "fetch"
    prefetch: str = "none"
    dtype: str = "float32"
    options: tuple[tuple[str, object], ...] = ()  # further ``load`` keywords (slow_tier, window, ...)
    batch: bool = False  # a left-padded batch of two prompts instead of one prompt
    # the checkpoint written packed first: in another tool's layout ("fp8", "mxfp4"), against transformers
    # dequantising it, or in expertcache's own ("int8", "int4": ``OWN_PACKING``), which transformers cannot
    # read, against the engine's own run of it with every expert resident (offloading changes no bit)
    packing: str | None = None

    @property
    def dense(self) -> str | None:
        """The dense layers' quantisation (``quantize_dense``), which the reference gets too."""
        return dict(self.options).get("quantize_dense")

    @property
    def attention(self) -> str | None:
        """transformers' attention implementation (``attention``), which the reference gets too."""
        return dict(self.options).get("attention")

    def label(self, capacity: int) -> str:
        share = 100 * capacity / total_experts(self.family)
        words = [self.family, self.policy, f"{share:.0f}%", self.miss, f"prefetch={self.prefetch}"]
        words += [] if self.dtype == "float32" else [_SHORT.get(self.dtype, self.dtype)]
        words += [] if self.packing is None else [f"checkpoint={self.packing}"]
        words += [f"{k}={v}" for k, v in self.options] + (["batch=2"] if self.batch else [])
        return " ".join(words)


_SHORT = {"bfloat16": "bf16", "float16": "fp16"}


@dataclass
class Check:
    """A case's result: what was compared and how it came out."""

    case: Case
    capacity: int
    expect: str
    atol: float | None  # None: tokens only
    comparison: Comparison | None = None
    error: str | None = None
    seconds: float = 0.0
    cause: BaseException | None = field(default=None, repr=False)  # the exception, for its traceback

    @property
    def passed(self) -> bool:
        return self.error is None and self.comparison is not None and self.comparison.within(self.atol)

    def line(self) -> str:
        """``PASS mixtral lru 25% fetch prefetch=none (tokens equal, max |dlogit| 0)``."""
        head = f"{'PASS' if self.passed else 'FAIL'} {self.case.label(self.capacity)}"
        if self.error is not None:
            return f"{head} (error: {self.error})"
        c = self.comparison
        tokens = "tokens equal"
        if not c.tokens_equal:
            row, pos = c.first_diff
            tokens = f"tokens differ at new token {pos} of row {row}"
        logits = f"max |dlogit| {_num(c.max_dlogit)}"
        if not self.passed:
            logits += f"; want {self.expect}"
        return f"{head} ({tokens}, {logits})"

    def to_dict(self) -> dict:
        c = self.comparison
        return {
            "passed": self.passed,
            "label": self.case.label(self.capacity),
            "family": self.case.family,
            "policy": self.case.policy,
            "budget": self.case.budget,
            "capacity": self.capacity,
            "total_experts": total_experts(self.case.family),
            "miss": self.case.miss,
            "prefetch": self.case.prefetch,
            "dtype": self.case.dtype,
            "options": dict(self.case.options),
            "batch": self.case.batch,
            "packing": self.case.packing,
            "expect": self.expect,
            "atol": self.atol,
            "tokens_equal": None if c is None else c.tokens_equal,
            "first_diff": None if c is None or c.first_diff is None else list(c.first_diff),
            "max_dlogit": None if c is None else _finite(c.max_dlogit),
            "error": self.error,
            "seconds": round(self.seconds, 3),
        }


@dataclass
class Report:
    """Every check of one self-test run."""

    device: str
    quick: bool
    checks: list[Check] = field(default_factory=list)
    seconds: float = 0.0
    device_lost: str | None = None  # the GPU's sticky error when it stopped answering, else None
    _held: object = field(default=None, repr=False)  # GPU tensors that cannot be freed once it is lost

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if not c.passed]

    @property
    def ok(self) -> bool:
        return bool(self.checks) and not self.failed

    def summary(self) -> str:
        """``selftest: 42 passed, 0 failed on cpu (torch 2.13.0, 38 s)``."""
        passed = len(self.checks) - len(self.failed)
        return (
            f"selftest: {passed} passed, {len(self.failed)} failed on {self.device} "
            f"(torch {torch.__version__}, {self.seconds:.0f} s)"
        )

    def to_dict(self) -> dict:
        import transformers

        return {
            "ok": self.ok,
            "passed": len(self.checks) - len(self.failed),
            "failed": len(self.failed),
            "device": self.device,
            "quick": self.quick,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "seconds": round(self.seconds, 2),
            "device_lost": self.device_lost,
            "checks": [c.to_dict() for c in self.checks],
        }


def selftest(
    device: str | None = None,
    *,
    quick: bool = False,
    families: Sequence[str] | None = None,
    log: Callable[[str], None] | None = None,
) -> Report:
    """Run the engine against transformers' own model on ``device`` (default: CUDA when present), for
    every family or those of ``families`` (their own checks and the further ones made of them).

    ``log`` receives each check's line as it ends. If the GPU stops answering (a sticky CUDA error),
    the remaining checks are reported as not run, ``device_lost`` says why, and garbage collection is
    switched off: freeing GPU memory would abort the process, which should exit (the CLI does).
    """
    true_or_false(quick, "quick")
    if families is not None:
        if isinstance(families, str) or not families:
            raise ExpertcacheError(f"families: a list of family names, got {families!r}")
        # model_type is lower case; "Mixtral" can only mean one family (as model synth reads it)
        families = [f.lower() if isinstance(f, str) and f.lower() in FAMILIES else f for f in families]
        for name in families:
            if name not in FAMILIES:  # why it does not run, or that it is dense, and the families there are
                try:
                    family_of(str(name))
                except ExpertcacheError as exc:
                    raise ExpertcacheError(f"selftest --family {name}: {exc}") from None
    dev = resolve_device(device)
    report = Report(_describe(dev), quick)
    start = time.perf_counter()
    from transformers.utils import logging as hf_logging

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread is fastest, and a loaded machine stays usable
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a bar per tiny model saved and loaded: the checks' lines only
    try:
        with tempfile.TemporaryDirectory(prefix="expertcache-selftest-") as tmp, warnings.catch_warnings():
            warnings.simplefilter("ignore", ExpertcacheWarning)  # its tiny models' notes: the checks report
            models = Models(Path(tmp), dev)
            for case in plan(dev, quick, families):
                check = _not_run(case, report.device_lost) if report.device_lost else run_check(models, case)
                if check.error is not None and report.device_lost is None:
                    report.device_lost = device_lost(dev)
                    if report.device_lost:
                        gc.disable()
                        report._held = models
                report.checks.append(check)
                if log is not None:
                    log(check.line())
    finally:
        torch.set_num_threads(threads)
        if bars:
            hf_logging.enable_progress_bar()
    report.seconds = time.perf_counter() - start
    return report


def device_lost(dev: torch.device) -> str | None:
    """After a failed check on CUDA: the GPU's error if it no longer answers, else None."""
    if dev.type != "cuda":
        return None
    try:
        torch.cuda.synchronize(dev)
    except Exception as exc:  # a sticky error: every later CUDA call fails the same way
        return first_line(exc)
    return None


def _not_run(case: Case, lost: str) -> Check:
    atol, expect = tolerance(case, torch.device("cuda"))
    return Check(case, capacity_of(case), expect, atol, error=f"not run: the GPU stopped answering ({lost})")


def _describe(dev: torch.device) -> str:
    return f"{dev} ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else str(dev)


def plan(device: torch.device, quick: bool = False, families: Sequence[str] | None = None) -> list[Case]:
    """The checks, in order: per family the plain path (every expert resident), then its miss paths (of
    ``families`` only, where given: their further checks too)."""
    cases = []
    for i, family in enumerate(FAMILIES):
        if families is None or family in families:
            cases.append(Case(family))
            cases += [_one_path(i, family)] if quick else _every_path(i, family)
    further = [] if quick else [c for c in _further(device) if families is None or c.family in families]
    return cases + further


def _one_path(i: int, family: str) -> Case:
    """--quick: family i's one miss path, with misses (the minimum or half), the i-th policy."""
    miss = list(MISSES)[i % len(MISSES)]
    return Case(family, ONLINE[i % len(ONLINE)], MISSES[miss][i % 2], miss, PREFETCHES[i % 2])


def _every_path(i: int, family: str) -> list[Case]:
    """Family i's every miss path; policies, predictors and budgets rotate so that each comes round."""
    cases = []
    for j, (miss, budgets) in enumerate(MISSES.items()):
        policy = ONLINE[(i * len(MISSES) + j) % len(ONLINE)]
        prefetch = PREFETCHES[(i + 2 * j) % len(PREFETCHES)]
        cases.append(Case(family, policy, budgets[(i + j) % len(budgets)], miss, prefetch))
    return cases


def _further(device: torch.device) -> list[Case]:
    """The other slow tier, a padded batch, the predictor thread, an emulated link, measured costs, bf16."""
    tier = (("slow_tier", "host" if device.type == "cpu" else "disk"),)
    cases = [
        Case("mixtral", "lru", "min", "fetch", "next-gate", options=tier),
        Case("qwen2_moe", "lfu", "half", "hybrid", "window", options=tier),
        Case("mixtral", "llru", "min", "fetch", "next-gate", batch=True),
        Case("deepseek_v3", "lru-dist", "min", "host", "next-gate", batch=True),
        Case("gpt_oss", "lru", "min", "fetch", "eam", options=(("predictor_thread", True),)),
        Case(
            "olmoe",
            "fifo",
            "half",
            prefetch="next-gate",
            options=(("link_latency", "30us"), ("chunking", False)),
        ),
        Case("granitemoe", "mrs", "min", "hybrid", options=(("costs", "measured"),)),
        Case("qwen2_moe", "tlfu", "half", "batch", "next-gate", batch=True),  # admission, bypass, streams
        # three tiers: a host level over the disk (pinned on CUDA), with prefetching and staging
        Case(
            "mixtral", "lru", "min", prefetch="next-gate", options=(("host_memory", "50%"), ("host_stage", 2))
        ),
        Case("qwen3_moe", "llru", "half", options=(("host_memory", "40%"), ("host_policy", "lfu"))),
        # the dense layers quantised at load (int8, exact against transformers with the same layers
        # quantised: on a GPU too, where the quantisers once rounded apart from the host's), and checkpoints
        # in other tools' layouts, computed by the packed kernels (Triton's on a GPU)
        Case("mixtral", "lru", "half", options=(("quantize_dense", "int8"),)),
        Case("qwen3_moe", "lru", "half", packing="fp8"),
        Case("gpt_oss", "lru", "half", packing="mxfp4"),
        Case("mixtral", "lru", "min", packing="int8"),
        Case("qwen3_moe", "lru", "half", prefetch="next-gate", packing="int4"),
        # an exclusive host level: hits' slots read while victims are copied down (a stream of its own on
        # CUDA, whose event the transfer into the slot waits for), over a slow link with prefetching
        Case(
            "mixtral",
            "lru",
            "min",
            prefetch="next-gate",
            options=(("host_memory", "50%"), ("host_exclusive", True), ("link_bandwidth", "50MB/s")),
        ),  # fmt: skip
    ]
    # sdpa without cuDNN's backend (engine.attention), against transformers loaded with it; on a GPU it is
    # the default (every CUDA case below runs it), and transformers' own sdpa, which may take cuDNN's
    # attention there, is asked for by name
    cases.append(
        Case("qwen2_moe", "lru", "half", prefetch="next-gate", options=(("attention", "sdpa_no_cudnn"),))
    )
    if device.type == "cuda":  # bf16: tokens equal
        cases.append(Case("qwen2_moe", "lru", "min", dtype="bfloat16", options=(("attention", "sdpa"),)))
        cases += [Case(f, "lru", "min", prefetch="next-gate", dtype="bfloat16") for f in FAMILIES]
        split = "split:theta=0.5,buffer=1"
        cases += [Case(f, "lcp", "half", split, dtype="bfloat16") for f in ("mixtral", "gpt_oss")]
    return cases


def tolerance(case: Case, device: torch.device) -> tuple[float | None, str]:
    """(atol, what a pass means) for a case on ``device``: 0 is bit-equal, None tokens only."""
    if case.dtype != "float32":
        return None, "tokens equal"
    computes = COMPUTES[parse_miss(case.miss)[0]]
    if case.packing in OWN_PACKING:  # against the engine's own run with every expert resident
        return 0.0, "tokens equal, logits bit-equal to every expert resident"
    # the packed kernels sum an expert's products in their own order, not transformers' dequantised one's
    if computes == "split" or (computes == "host" and device.type != "cpu") or case.packing is not None:
        return CLOSE_ATOL, f"tokens equal, |dlogit| <= {CLOSE_ATOL:g}"
    return 0.0, "tokens equal, logits bit-equal"


def capacity_of(case: Case) -> int:
    """Experts the case's budget holds: the policy's minimum, about half way to all, or all."""
    name, params = parse_policy(case.policy)
    low = min_capacity(name, moe_layers(case.family), params, min_room=TOP_K)
    high = total_experts(case.family)
    return {"min": low, "half": (low + high) // 2, "all": high}[case.budget]


def run_check(models: Models, case: Case) -> Check:
    """Run one case through the engine and compare it with the reference; any exception is a failure."""
    capacity = capacity_of(case)
    atol, expect = tolerance(case, models.device)
    check = Check(case, capacity, expect, atol)
    start = time.perf_counter()
    try:
        want = models.reference(case.family, case.dtype, case.batch, case.packing, case.dense, case.attention)
        check.comparison = compare(run_engine(models, case, capacity), want)
    except Exception as exc:  # a crash on this machine is a result to report, not bad input
        check.error, check.cause = f"{type(exc).__name__}: {first_line(exc)}", exc
    check.seconds = time.perf_counter() - start
    return check


def run_engine(models: Models, case: Case, capacity: int) -> Run:
    """Greedy tokens and logits of the engine for ``case`` at ``capacity`` experts."""
    from expertcache.engine import load
    from expertcache.policy.registry import policy_class

    kwargs = dict(case.options)
    if kwargs.pop("costs", None) != "measured":
        kwargs["costs"] = COSTS
    if policy_class(parse_policy(case.policy)[0]).needs_profile:
        kwargs["profile"] = models.trace(case.family)
    if case.prefetch in ("token", "eam"):
        kwargs["predictor"] = models.trace(case.family)
    elif case.prefetch == "learned":
        kwargs["predictor"] = models.learned(case.family, case.dtype)
    budget = capacity * models.slot_bytes(case.family, case.dtype, case.packing)
    path = models.path(case.family, case.dtype, case.packing)
    miss = per_layer(case.miss, moe_layers(case.family))
    with load(
        path, budget, case.policy, models.device, miss=miss, prefetch=case.prefetch, dtype=case.dtype,
        progress=False, **kwargs,
    ) as model:  # fmt: skip
        return greedy(model, *prompts(case.batch))


def per_layer(miss: str, layers: int) -> str:
    """A miss path written with one value per layer for two MoE layers (``split:theta=0.3/0.7``), its
    values repeated to a tiny model of ``layers`` MoE layers (Qwen3-Next's has four)."""
    return re.sub(
        r"=([\d.]+(?:/[\d.]+)+)", lambda m: "=" + "/".join((m.group(1).split("/") * layers)[:layers]), miss
    )


def prompts(batch: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return prompt_ids(PROMPT, PROMPT_B) if batch else prompt_ids(PROMPT)


class Models:
    """The tiny checkpoints of one run and what checks need of them, each built once when first asked."""

    def __init__(self, root: Path, device: torch.device) -> None:
        self.root, self.device = root, device
        self._built: dict[tuple, object] = {}

    def _once(self, key: tuple, build: Callable[[], object]):
        if key not in self._built:
            self._built[key] = build()
        return self._built[key]

    def tokenizer(self) -> Path:
        return self._once(("tokenizer",), lambda: make_tokenizer(self.root / "tokenizer"))

    def path(self, family: str, dtype: str = "float32", packing: str | None = None) -> Path:
        """The family's tiny checkpoint, or (``packing``) the same written packed: in another tool's layout,
        or in expertcache's own (``OWN_PACKING``)."""
        if packing is not None:
            from expertcache.tools.published import write_published
            from expertcache.tools.quantize import write_checkpoint

            out = self.root / f"{family}-{dtype}-{packing}"

            def write() -> Path:
                if packing in OWN_PACKING:
                    write_checkpoint(self.path(family, dtype), OWN_PACKING[packing], out, device="cpu")
                else:
                    write_published(self.path(family, dtype), packing, out)
                return out

            return self._once(("path", out), write)
        shapes = _shapes(family, dtype)
        out = self.root / (f"{family}-{dtype}" if shapes else family)
        return self._once(("path", out), lambda: make_tiny(out, family, self.tokenizer(), **shapes))

    def reference(
        self,
        family: str,
        dtype: str,
        batch: bool,
        packing: str | None = None,
        dense: str | None = None,
        attention: str | None = None,
    ) -> Run:
        """transformers' run of the checkpoint on the device, with the experts implementation of the
        default kernel (``engine.loader.load_reference``; another tool's layout dequantised), its dense
        layers quantised as the engine's where ``dense`` (``engine.dense.quantize_dense``), its attention
        ``attention`` (None: transformers' default, ``sdpa_no_cudnn`` in ``sdpa``'s place on a GPU)."""
        from expertcache.engine.loader import load_reference

        if packing in OWN_PACKING:  # transformers cannot read it: the engine with every expert resident
            key = ("own", family, dtype, batch, packing)
            return self._once(key, lambda: self._resident(family, dtype, batch, packing))

        def build():
            model = load_reference(self.path(family, dtype, packing), dtype, self.device, attention=attention)
            if dense is not None:
                from expertcache.engine.dense import quantize_dense

                quantize_dense(model, dense)
            return model

        model = self._once(("eager", family, dtype, packing, dense, attention), build)
        key = ("run", family, dtype, batch, packing, dense, attention)
        return self._once(key, lambda: greedy(model, *prompts(batch)))

    def _resident(self, family: str, dtype: str, batch: bool, packing: str) -> Run:
        from expertcache.engine import load

        path = self.path(family, dtype, packing)
        with load(path, "100%", device=self.device, dtype=dtype, progress=False, costs=COSTS) as model:
            return greedy(model, *prompts(batch))

    def slot_bytes(self, family: str, dtype: str, packing: str | None = None) -> int:
        """Bytes of one expert's slot, so that a budget is a whole number of experts."""

        def measure() -> int:
            with self._loaded(family, dtype, packing) as model:
                return model.layout.slot_bytes

        return self._once(("slot", family, dtype, packing), measure)

    def trace(self, family: str):
        """The model's routing of the second prompt (static's profile; token's and eam's table)."""

        def record():
            with self._loaded(family, "float32") as model:
                greedy(model, *prompt_ids(PROMPT_B))
                return model.trace()

        return self._once(("trace", family), record)

    def learned(self, family: str, dtype: str = "float32") -> Path:
        """An untrained learned predictor of window 1 (it predicts badly, and exactly as often)."""
        from expertcache.predict.learned import make_mlp, save_predictor

        def build() -> Path:
            layers, experts = moe_layers(family), SPECS[family]["experts"]
            hidden = {**SPECS[family], **_shapes(family, dtype)}["hidden"]
            with torch.random.fork_rng(devices=[]):  # the caller's random state stays as it was
                torch.manual_seed(0)
                mlps = {t: make_mlp(hidden, 16, experts) for t in range(1, layers)}
            meta = dict(window=1, hidden=16, num_layers=layers, num_experts=experts, hidden_size=hidden,
                        top_k=TOP_K)  # fmt: skip
            return save_predictor(self.root / f"learned-{family}-{dtype}", mlps, meta)

        return self._once(("learned", family, dtype), build)

    def _loaded(self, family: str, dtype: str, packing: str | None = None):
        from expertcache.engine import load

        return load(self.path(family, dtype, packing), "100%", device="cpu", dtype=dtype, progress=False)


def _shapes(family: str, dtype: str) -> dict[str, int]:
    return MLA_BF16_SHAPE if dtype == "bfloat16" and has_mla(family) else {}


def has_mla(family: str) -> bool:
    """Whether the family's tiny model has DeepSeek's latent attention (a rotary part of its own, whose
    tiny heads bf16 attention on CUDA cannot align), read from its config as ``tools.tiny`` builds it."""
    t = SPECS[family]
    shape = Shape(t["experts"], TOP_K, t["intermediate"], t["hidden"], TINY_HEADS, t["layers"])
    return bool(FAMILIES[family].config(shape).get("qk_rope_head_dim"))


def _num(x: float) -> str:
    return "0" if x == 0 else f"{x:.2g}"


def _finite(x: float) -> float | None:
    return x if x == x and abs(x) != float("inf") else None
