"""Prefetch where it pays, on-demand elsewhere: the governor that switches a predictor on and off.

Prefetching saves at most the stall that on-demand caching waits for, and it costs on the compute side:
the predictor's own work, the bookkeeping of every speculative transfer, copies that compete with the
compute for memory bandwidth (and, in Python, for the interpreter lock), wrong guesses that take the link
from demand transfers and evict useful experts. Which side wins depends on the machine, the model, the
budget, the slow tier and the predictor: on the development VM the same learned predictor cut the stall
of the embedded model by 85 % and made its TPOT 6-25 % worse. So the governor measures it, step by step,
and keeps prefetching on only while it measurably pays:

1. **Bound.** The first ``warm`` decode steps run without prefetching; their stall's share of a step is
   the most prefetching could save. Under ``margin`` prefetching cannot pay ``margin``: it is not tried
   (at 100 % of the experts, or with a fast slow tier, nothing is ever predicted).
   **Screen.** In the last ``shadow`` of those steps the predictor runs in shadow: its predictions are
   scored (``ExpertCache.shadow``: guesses that would move an expert, hits the router then chose) and
   nothing moves. With prefetching a step's transfers would be the on-demand ones less the hits plus
   every guess; when moving those at the on-demand steps' cost of a transfer takes the link more than
   ``CLEAR_LOSS`` longer than a whole on-demand step, prefetching cannot pay and is not probed (a
   near-chance predictor on a disk: a probe's steps took twice as long). The wrong guesses' evictions
   are not counted, so the screen errs on the side of probing.
2. **Probe.** Decode steps then alternate in blocks of ``block`` with prefetching on and off, starting on.
   A step's time runs from its start to the next decode step's start (what a user waits per token; the
   step before a new request is not counted, nor the first step of each block, which inherits the
   previous block's cache). Steps of different sizes (batch rows) are not compared.
3. **Decide.** Once each side has ``min_samples`` steps, prefetching is kept when its mean step is
   shorter than on-demand's by more than ``margin`` plus twice the means' standard error, dropped as soon
   as it is not shorter by ``margin`` minus one standard error (on-demand is the safe side: retreat on
   less evidence than it takes to adopt), and otherwise measured on, to ``max_samples`` each (then: kept
   if shorter by more than ``margin``). Means, not medians: what prefetching saves is mostly in the
   few steps that miss (a median step often misses nothing), and mean step time is TPOT. A step longer
   than 4 times the median of both sides counts as 4 times it, so one hiccup of the machine cannot
   decide. After the first on-block, prefetching is dropped at once when the predictor's own time per
   step exceeds the on-demand stall it could remove; from the first counted step of that block on, when
   its steps are clearly longer (by over ``CLEAR_LOSS`` at two standard errors; one step counted as
   uncertain as one on-demand step) than the latest on-demand ones: a probe of a clear loss costs two
   steps (where each wrong guess is a disk read, a step with prefetching can take twice as long).
4. **Hold** the decision for ``hold`` decode steps, doubled each time a probe confirms it (up to
   ``max_hold``), then probe again: the cache warms, requests and the machine's load change.

Prefill steps follow the held decision (off while measuring) and are not measured. The decisions depend
on time, so the engine's are wall-clock measurements: a trace recorded from it holds the predictions of
the steps that predicted, and the timing simulator replays exactly those (``--prefetch recorded``). In the
timing simulator the same governor runs on virtual time, deterministically.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from expertcache.errors import ExpertcacheError

WARM, PROBE, HOLD = "warm", "probe", "hold"
CLEAR_LOSS = 0.25  # in the first on-block, prefetching this much slower than on-demand is dropped at once


@dataclass(frozen=True)
class GovernorSettings:
    """The governor's constants (see the module's text); the defaults are those the engine uses."""

    margin: float = 0.03  # the least share of a step that prefetching must save to be kept
    warm: int = 12  # decode steps measured without prefetching first (and before each later probe)
    shadow: int = 4  # the last of those in which the predictor runs in shadow, to score it
    block: int = 4  # decode steps per probing block (the first of each is not counted)
    min_samples: int = 9  # counted steps per side before a decision may be taken
    max_samples: int = 36  # counted steps per side after which a decision is taken
    hold: int = 128  # decode steps a first decision is kept
    max_hold: int = 4096  # the longest hold, after confirming probes

    def __post_init__(self) -> None:
        if not 0 <= self.margin < 1:
            raise ExpertcacheError(f"governor margin must be in [0, 1), got {self.margin}")
        if self.block < 2:
            raise ExpertcacheError(
                f"governor blocks need at least 2 steps (one is not counted), got {self.block}"
            )
        if not 0 <= self.shadow <= self.warm:
            raise ExpertcacheError(f"governor shadow steps must be in [0, warm], got {self.shadow}")
        for name in ("warm", "min_samples", "hold"):
            if getattr(self, name) < 1:
                raise ExpertcacheError(f"governor {name} must be at least 1, got {getattr(self, name)}")
        if self.max_samples < self.min_samples or self.max_hold < self.hold:
            raise ExpertcacheError("governor: max_samples >= min_samples and max_hold >= hold are required")


@dataclass(frozen=True)
class LinkCounts:
    """Totals so far of the transfers (``Transport``) and of the shadow predictions
    (``ExpertCache.shadow``): what the warm-up's screen reads."""

    busy_s: float = 0.0
    active_s: float = 0.0
    transfers: int = 0
    guesses: int = 0
    hits: int = 0


@dataclass(frozen=True)
class _Sample:
    tokens: int
    seconds: float
    stall: float
    predictor: float
    busy: float = 0.0
    active: float = 0.0
    transfers: int = 0
    guesses: int = 0
    hits: int = 0
    shadow: bool = False  # the predictor ran in shadow


def _change(gain: float) -> str:
    """A step's relative change in words: ``gain`` > 0 is shorter."""
    return f"{gain:.1%} shorter" if gain >= 0 else f"{-gain:.1%} longer"


def describe(summary: dict[str, object]) -> str:
    """A governor's ``summary()`` in words, for the CLI's one-line reports."""
    decided = summary["state"] == HOLD
    state = ("on" if summary["prefetching"] else "off") if decided else "not yet decided"
    steps = int(summary["steps_on"]) + int(summary["steps_off"])  # type: ignore[call-overload]
    return f"while it pays: {state}, {summary['reason']}; {summary['steps_on']} of {steps} steps predicted"


class PrefetchGovernor:
    """Decides, at the start of every forward step, whether the predictor runs (``begin_step``)."""

    def __init__(self, clock: Callable[[], float], settings: GovernorSettings | None = None) -> None:
        self.clock, self.settings = clock, settings or GovernorSettings()
        self.state = WARM
        self.on = False  # the decision held
        self.steps = [0, 0]  # forward steps run without / with prefetching
        self.probes = 0  # probes finished
        self.reason = "measuring on-demand first"
        self.figures: dict[str, float | int | None] = {}  # the last decision's measurements
        self.screen: dict[str, float] = {}  # the last warm-up's shadow score of the predictor
        self.history: list[tuple[int, bool, str]] = []  # (decode step, prefetching, why)
        self._decode = 0  # decode steps begun
        self._hold = self.settings.hold
        self._left = 0  # decode steps of the hold still to go
        self._at = 0  # decode steps into the current probe
        self._off: deque[_Sample] = deque(maxlen=self.settings.warm)  # the latest on-demand steps
        self._probe: tuple[list[_Sample], list[_Sample]] = ([], [])  # (off, on) of this probe
        self._prev: tuple[float, bool, int, float, float, bool, LinkCounts, bool] | None = None
        self.shadow = False  # this step: predict without prefetching, to score the predictor

    # -- the driver's call -------------------------------------------------------------------------
    def begin_step(
        self, prefill: bool, tokens: int, stall_s: float, predictor_s: float, link: LinkCounts | None = None
    ) -> bool:
        """A step of ``tokens`` tokens starts; ``stall_s`` and ``predictor_s``: the totals so far of the
        compute's waits for transfers and of its time in the predictor; ``link`` those of the transfers
        and of the shadow predictions. True: predict and prefetch in this step; else ``shadow`` says
        whether to predict without prefetching, only to score the predictor."""
        now = self.clock()
        link = link or LinkCounts()
        if self._prev is not None and not prefill:  # the previous step ends where this decode step starts
            start, arm, ptokens, pstall, ppred, counted, plink, pshadow = self._prev
            if counted:
                pred = predictor_s - ppred
                seconds = now - start - (0.0 if arm else pred)  # a shadow step's predictor is not on-demand
                moved = [getattr(link, f) - getattr(plink, f) for f in ("busy_s", "active_s", "transfers")]
                scored = (link.guesses - plink.guesses, link.hits - plink.hits)
                self._record(arm, _Sample(ptokens, seconds, stall_s - pstall, pred, *moved, *scored, pshadow))
        arm, counted = (self.on, False) if prefill else self._next_decode()
        self.shadow = (
            not prefill and self.state == WARM and len(self._off) >= self.settings.warm - self.settings.shadow
        )
        self.steps[arm] += 1
        self._prev = (now, arm, tokens, stall_s, predictor_s, counted, link, self.shadow)
        return arm

    # -- what it reports ---------------------------------------------------------------------------
    def summary(self) -> dict[str, object]:
        """The decision, why, and the measurements behind it (for ``stats`` and the CLI)."""
        return {
            "prefetching": self.on,
            "state": self.state,
            "reason": self.reason,
            "steps_on": self.steps[1],
            "steps_off": self.steps[0],
            "probes": self.probes,
            **self.figures,
            **self.screen,
        }

    # -- the states --------------------------------------------------------------------------------
    def _next_decode(self) -> tuple[bool, bool]:
        """This decode step's side and whether it is counted; moves the state on."""
        s = self.settings
        self._decode += 1
        if self.state == WARM:
            return False, True
        if self.state == HOLD:
            self._left -= 1
            if self._left > 0:
                return self.on, not self.on  # on-demand steps keep the stall's share up to date
            if not self.on:
                self.state = WARM  # the bound is checked again on the latest on-demand steps
                self._off.clear()
                return False, True
            self._start_probe()
        # probing: blocks on, off, on, ...; the first step of each block is not counted
        at = self._at
        self._at += 1
        return (at // s.block) % 2 == 0, at % s.block != 0

    def _record(self, arm: bool, sample: _Sample) -> None:
        s = self.settings
        if not arm:
            self._off.append(sample)
        if self.state == WARM:
            if len(self._off) >= s.warm:
                self._after_warm()
            return
        if self.state != PROBE:
            return
        self._probe[arm].append(sample)
        if self._at % s.block == 0:  # a block has ended
            self._test()
        elif arm and self._at < s.block:  # inside the first on-block: each step may show a clear loss
            self._clearly_worse(self._probe[1])

    def _after_warm(self) -> None:
        warm = list(self._off)
        share = self._stall_share(warm)
        if share is not None and share < self.settings.margin:
            self._decide(False, f"on-demand waits {share:.1%} of a step for transfers: no more to save")
            self.figures = {"stall_share": round(share, 4)}
        elif not self._screened_out(warm):
            self._start_probe()

    def _screened_out(self, warm: list[_Sample]) -> bool:
        """The predictor's shadow score against the link. With prefetching, every wrong guess is one
        transfer more (and an eviction): a step's transfers are then the on-demand ones less the hits
        plus every guess, and the worker alone moves the wrong guesses (a waiting thread takes only what
        a layer waits for). At the on-demand steps' cost of a transfer (the link's active time per
        transfer; a single thread's time per transfer for the worker), when that takes longer than
        ``CLEAR_LOSS`` more than a whole on-demand step, prefetching cannot pay, and it is not probed:
        where each wrong guess is a disk read a probe's steps take up to twice as long."""
        n = len(warm)
        shadowed = [x for x in warm if x.shadow]
        guesses = statistics.fmean(x.guesses for x in shadowed) if shadowed else 0.0
        hits = statistics.fmean(x.hits for x in shadowed) if shadowed else 0.0
        transfers = sum(x.transfers for x in warm) / n
        busy, active = sum(x.busy for x in warm) / n, sum(x.active for x in warm) / n
        step = statistics.fmean(x.seconds for x in warm)
        self.screen = {
            "shadow_guesses_per_step": round(guesses, 2), "shadow_hits_per_step": round(hits, 2),
            "transfers_per_step": round(transfers, 2), "link_active_per_step_s": active,
        }  # fmt: skip
        if guesses <= 0 or transfers <= 0 or step <= 0:
            return False
        wrong = guesses - hits
        link = max(wrong * busy, (transfers - hits + guesses) * active) / transfers
        self.screen["link_with_prefetch_s"] = link
        if link <= (1 + CLEAR_LOSS) * step:
            return False
        why = (f"in shadow, {wrong:.0f} of its {guesses:.0f} guesses a step were wrong: with prefetching "
               f"the link would move for {link * 1e3:.1f} ms a step, on-demand steps take "
               f"{step * 1e3:.1f} ms")  # fmt: skip
        self._decide(False, why)
        self.figures = {"off_step_s": step, "off_stall_s": statistics.fmean(x.stall for x in warm)}
        return True

    def _start_probe(self) -> None:
        self.state, self._at, self._probe = PROBE, 0, ([], [])
        self.reason = "measuring steps with and without prefetching, in alternating blocks"

    def _test(self) -> None:
        s = self.settings
        off, on = self._probe
        if self._at == s.block and on and (self._predictor_costs_more(on) or self._clearly_worse(on)):
            return  # after the first on-block
        tokens = _common_size(off, on)
        if tokens is None:
            if len(off) + len(on) >= 4 * s.max_samples:  # sizes never met: nothing to compare
                self._decide(False, "no two steps of one size to compare")
            return
        off = [x for x in off if x.tokens == tokens]
        on = [x for x in on if x.tokens == tokens]
        if min(len(off), len(on)) < s.min_samples:
            return
        a, b = _capped(off, on)
        t_off, t_on = statistics.fmean(a), statistics.fmean(b)
        if t_off <= 0:
            self._decide(False, "on-demand steps take no time: nothing to save", off, on)
            return
        gain = (t_off - t_on) / t_off
        err = math.hypot(_mean_error(a), _mean_error(b)) / t_off
        last = min(len(off), len(on)) >= s.max_samples
        if gain - 2 * err > s.margin or (last and gain > s.margin):
            self._decide(True, f"prefetching makes a step {_change(gain)}", off, on)
        elif gain + err < s.margin or last:  # quicker to go back to on-demand, the safe side
            why = f"prefetching makes a step {_change(gain)}" + (
                f", less than the {s.margin:.0%} it must save" if gain > 0 else ""
            )
            self._decide(False, why, off, on)

    def _predictor_costs_more(self, on: list[_Sample]) -> bool:
        """Drop prefetching when the predictor's own time per step exceeds the stall of the latest
        on-demand steps of the same size: what it could remove at best."""
        tokens = statistics.mode(x.tokens for x in on)
        stall = _mean([x.stall for x in self._off if x.tokens == tokens])
        cost = statistics.fmean(x.predictor for x in on if x.tokens == tokens)
        if stall is None or cost <= stall:
            return False
        why = (f"the predictor takes {cost * 1e3:.2f} ms a step, more than the {stall * 1e3:.2f} ms "
               "on-demand waits for transfers")  # fmt: skip
        self._decide(False, why, [x for x in self._off if x.tokens == tokens], on)
        return True

    def _clearly_worse(self, on: list[_Sample]) -> bool:
        """Drop prefetching within its first block when its steps are longer than the latest on-demand
        steps of the same size by more than ``CLEAR_LOSS``, even at two standard errors: a re-probe then
        costs a block at most, not a whole probe. Checked from its first counted step on (a single step
        counts as uncertain as one on-demand step): where wrong guesses cost a disk read each, every step
        spent measuring is expensive."""
        tokens = statistics.mode(x.tokens for x in on)
        off = [x for x in self._off if x.tokens == tokens]
        on = [x for x in on if x.tokens == tokens]
        if len(off) < 2 or not on:
            return False
        a, b = _capped(off, on)
        t_off = statistics.fmean(a)
        loss = (statistics.fmean(b) - t_off) / t_off if t_off > 0 else 0.0
        err_on = _mean_error(b) if len(b) > 1 else statistics.stdev(a)
        if loss - 2 * math.hypot(_mean_error(a), err_on) / max(t_off, 1e-12) <= CLEAR_LOSS:
            return False
        self._decide(False, f"prefetching makes a step {_change(-loss)}", off, on)
        return True

    def _decide(self, on: bool, why: str, off=None, on_samples=None) -> None:
        s = self.settings
        if self.history and self.history[-1][1] == on:  # confirmed: look again later
            self._hold = min(2 * self._hold, s.max_hold)
        else:
            self._hold = s.hold
        if off is not None:
            self.probes += 1
            self.figures = {
                "off_step_s": _mean([x.seconds for x in off]),
                "on_step_s": _mean([x.seconds for x in on_samples]),
                "off_stall_s": _mean([x.stall for x in off]),
                "on_stall_s": _mean([x.stall for x in on_samples]),
                "predictor_s": _mean([x.predictor for x in on_samples]),
                "samples": min(len(off), len(on_samples)),
            }
        self.on, self.reason, self.state, self._left = on, why, HOLD, self._hold
        self.history.append((self._decode, on, why))

    @staticmethod
    def _stall_share(samples: list[_Sample]) -> float | None:
        if not samples:
            return None
        seconds = statistics.fmean(x.seconds for x in samples)
        return statistics.fmean(x.stall for x in samples) / seconds if seconds > 0 else None


def _common_size(off: list[_Sample], on: list[_Sample]) -> int | None:
    """The step size (tokens) with the most steps on the side that has fewer of it."""
    sizes = {x.tokens for x in off} & {x.tokens for x in on}
    if not sizes:
        return None
    return max(sizes, key=lambda t: min(sum(x.tokens == t for x in off), sum(x.tokens == t for x in on)))


def _capped(off: list[_Sample], on: list[_Sample]) -> tuple[list[float], list[float]]:
    """Both sides' step seconds, a step longer than 4 times the median of both counted as 4 times it
    (one hiccup of the machine cannot decide)."""
    cap = 4 * statistics.median(x.seconds for x in off + on)
    return [min(x.seconds, cap) for x in off], [min(x.seconds, cap) for x in on]


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _mean_error(values: list[float]) -> float:
    """Standard error of the mean of ``values``."""
    if len(values) < 2:
        return math.inf
    return statistics.stdev(values) / math.sqrt(len(values))
