"""A sweep's grid: what ``expertcache sweep`` runs, from flags, a YAML or TOML file, or the API.

Every combination of the dimensions is a cell: traces x policies x seeds x orders x capacities, and with
``timing`` x miss paths x predictors (x windows) x link bandwidths x latencies. Values are checked here,
when the grid is made, so that a bad one is one line naming the file before any cell runs. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from expertcache.cache.schedule import ORDERS
from expertcache.config import MissConfig, PrefetchConfig
from expertcache.costs import CostModel, as_cost
from expertcache.errors import ExpertcacheError, first_line
from expertcache.policy.registry import parse_policy
from expertcache.predict.registry import trace_readers
from expertcache.sim.simulate import DEFAULT_POLICIES
from expertcache.trace.default import DEFAULT_TRACE
from expertcache.trace.trace import Trace
from expertcache.units import capacity_items, parse_duration, parse_rate

DEFAULT_CAPACITIES = tuple(f"{100 * i / 16:g}%" for i in range(1, 17))  # as `sim`: 16 even steps
GRID_SUFFIXES = (".yaml", ".yml", ".toml")
DIMENSIONS = ("traces", "policies", "capacities", "orders", "seeds", "timing")  # a grid file's keys


@dataclass(frozen=True)
class Timing:
    """The timing model's dimensions: miss paths, predictors (``none`` for no prefetching) and their
    windows (None: each predictor's own), link bandwidths and latencies (None: the cost model's); one
    cost model (a JSON file, default: ``CostModel()``) and one predictor trace (for ``token``, ``eam``)."""

    miss: tuple[str, ...] = ("fetch",)
    prefetch: tuple[str, ...] = ("none",)
    window: tuple[int | None, ...] = (None,)
    link_bandwidth: tuple[str | None, ...] = (None,)
    link_latency: tuple[str | None, ...] = (None,)
    cost: str | None = None
    predictor: str | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name not in ("cost", "predictor"):
                object.__setattr__(self, f.name, _items(getattr(self, f.name), f.name))
        for name in ("link_bandwidth", "link_latency"):  # text with its unit: a bare 20 is refused
            values = tuple(None if v is None else str(v) for v in getattr(self, name))
            object.__setattr__(self, name, values)
        for spec in self.miss:
            MissConfig(spec)
        for name in self.prefetch:
            PrefetchConfig(name)
        for w in self.window:
            if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
                raise ExpertcacheError(f"window {w!r} is not a number of layers (at least 1)")
        for bw in self.link_bandwidth:
            if bw is not None and str(bw).strip().lower() not in ("inf", "infinity"):
                parse_rate(bw, "link bandwidth")
        for lat in self.link_latency:
            if lat is not None:
                parse_duration(lat, "link latency")

    def check_used(self) -> None:
        """Every value is used by some cell: a window needs a predictor in the grid, a predictor trace a
        predictor that reads one (as for ``timing``). Checked once a grid file's values and the flags that
        replace them are merged (``sweep``), not on the file alone."""
        predictors = [PrefetchConfig(name).predictor for name in self.prefetch]
        swept = [name for name in predictors if name not in ("none", "auto", "recorded")]
        if any(w is not None for w in self.window) and not swept:
            raise ExpertcacheError(
                "a window sets the layers ahead of a predictor, and the grid has none: add predictors "
                "(--prefetch NAME, or prefetch: in the grid's timing)"
            )
        if self.predictor is not None and not trace_readers(swept):
            raise ExpertcacheError(
                f"predictor trace {self.predictor}: no predictor of the grid reads one (token and eam do; "
                f"the grid's: {', '.join(dict.fromkeys(predictors))})"
            )

    def cost_model(self, trace=None) -> CostModel:
        """The timing cells' costs; a profile for another model's shape than ``trace``'s is refused."""
        return as_cost(self.cost, trace) if self.cost else CostModel()


@dataclass(frozen=True)
class Grid:
    """What a sweep runs: every combination of these, as rows of one table. Capacities are expert counts
    (``24``), ranges (``8:96:8``), shares of all experts (``25%``) or ``all`` (top-k or 1 .. L*E), resolved
    per trace; ``default`` is the embedded trace; relative trace paths are read from ``base`` (the folder
    of ``source``, the grid file they were named in, if any), and so are the files a policy's parameters
    name (``reuse:weights=``) from ``policy_base``."""

    traces: tuple[str, ...] = ("default",)
    policies: tuple[str, ...] = DEFAULT_POLICIES
    capacities: tuple[str | int, ...] = DEFAULT_CAPACITIES
    orders: tuple[str, ...] = ("layer",)
    seeds: tuple[int, ...] = (0,)
    timing: Timing | None = None
    base: str = "."
    source: str | None = field(default=None, compare=False)
    policy_base: str = "."

    def __post_init__(self) -> None:
        for name in ("traces", "policies", "capacities", "orders", "seeds"):
            object.__setattr__(self, name, _items(getattr(self, name), name))
        names = (_trace_name(t, self.base) for t in self.traces)
        object.__setattr__(self, "traces", tuple(dict.fromkeys(names)))
        for spec in self.policies:
            parse_policy(str(spec))
        for order in self.orders:
            if order not in ORDERS:
                raise ExpertcacheError(f"order {order!r} is not one of {', '.join(ORDERS)}")
        for seed in self.seeds:
            if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
                raise ExpertcacheError(f"seed {seed!r} is not a whole number of at least 0")
        for item in self.capacities:
            capacity_items(item, 1, 1)  # the syntax; the values come per trace
        if not isinstance(self.timing, Timing | None):
            object.__setattr__(self, "timing", _timing_from(self.timing, self.base))
        if self.timing is not None and "layer" not in self.orders:
            raise ExpertcacheError("timing cells run in layer order (as the engine); add the order layer")

    @classmethod
    def load(cls, path: str | Path) -> Grid:
        """A grid from a YAML or TOML file; a problem is one ExpertcacheError naming the file."""
        path = Path(path)
        if path.suffix.lower() == ".npz":
            raise ExpertcacheError(
                f"{path} is a trace: give it as --trace {path} (the argument is a grid file)"
            )
        if path.suffix.lower() not in GRID_SUFFIXES:
            raise ExpertcacheError(f"{path}: a grid file is .yaml, .yml or .toml")
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ExpertcacheError(f"{path}: no such grid file") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ExpertcacheError(f"{path}: cannot read the grid ({first_line(e)})") from None
        data = _parse_grid_text(path, text)
        try:
            return cls.from_dict(data, base=str(path.parent), source=str(path), policy_base=str(path.parent))
        except ExpertcacheError as e:
            raise ExpertcacheError(f"{path}: {e}") from None

    @classmethod
    def from_dict(
        cls, data: object, base: str = ".", source: str | None = None, policy_base: str = "."
    ) -> Grid:
        """A grid from a mapping of the file's keys (``traces``, ``policies``, ..., ``timing``)."""
        if not isinstance(data, dict):
            raise ExpertcacheError(f"a grid is a mapping of {', '.join(DIMENSIONS)}")
        unknown = [k for k in data if k not in DIMENSIONS]
        if unknown:
            raise ExpertcacheError(f"unknown key {unknown[0]!r}; a grid has {', '.join(DIMENSIONS)}")
        return cls(**data, base=base, source=source, policy_base=policy_base)

    def with_overrides(self, **values: object) -> Grid:
        """This grid with some dimensions replaced (what command-line flags do to a grid file's);
        traces and policies given here read their files from the current directory. An unknown dimension
        is refused."""
        unknown = [k for k in values if k not in DIMENSIONS]
        if unknown:
            raise ExpertcacheError(f"unknown dimension {unknown[0]!r}; a grid has {', '.join(DIMENSIONS)}")
        given = {k: v for k, v in values.items() if v is not None}
        if "traces" in given:
            given["base"], given["source"] = ".", None
        if "policies" in given:
            given["policy_base"] = "."
        return replace(self, **given)

    def trace_path(self, name: str) -> Path:
        return DEFAULT_TRACE if name == "default" else Path(self.base) / name


def _parse_grid_text(path: Path, text: str) -> object:
    if path.suffix.lower() == ".toml":
        import tomllib

        try:
            return tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ExpertcacheError(f"{path}: not valid TOML ({first_line(e)})") from None
    import yaml

    try:
        return yaml.load(text, Loader=_grid_loader())  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark is not None else ""
        raise ExpertcacheError(
            f"{path}: not valid YAML ({where}{getattr(e, 'problem', None) or e})"
        ) from None


def _grid_loader():
    """YAML's safe loader, but for integers: YAML 1.1 reads ``4:12:4`` as a base-60 number (15124), and
    in a grid that is a capacity range, and ``010`` as octal; integers are plain decimals here, as in
    YAML 1.2."""
    import re

    import yaml

    class GridLoader(yaml.SafeLoader):
        pass

    int_tag = "tag:yaml.org,2002:int"
    GridLoader.yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in resolvers if tag != int_tag]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    GridLoader.add_implicit_resolver(int_tag, re.compile(r"^[-+]?[0-9]+$"), list("-+0123456789"))
    # and read in base 10: YAML 1.1's constructor takes a leading zero for octal (010 was 8)
    GridLoader.add_constructor(int_tag, lambda loader, node: int(loader.construct_scalar(node), 10))
    return GridLoader


def _trace_name(trace: object, base: str) -> str:
    """A grid's trace as its file: a path, ``default``, or a ``Trace`` read from a ``.npz`` (its path; the
    cells and their workers read it there). A trace made in memory is refused: save it first."""
    if not isinstance(trace, Trace):
        return str(trace)
    source = Path(trace.source)
    if source.suffix == ".npz" and source.is_file():
        if source.resolve() == Path(DEFAULT_TRACE).resolve():
            return "default"
        return str(source if source.is_absolute() or base == "." else source.resolve())
    raise ExpertcacheError(
        f"a sweep reads its traces from files (each cell, in its own worker): {trace!r} is not one; "
        "save it (trace.save('name.npz')) and give the path"
    )


def _items(value: object, name: str) -> tuple:
    """A dimension's values: one value or a list of them, repeats dropped, not empty."""
    items = list(value) if isinstance(value, list | tuple) else [value]
    for v in items:
        if isinstance(v, dict | list | tuple):
            raise ExpertcacheError(f"{name!r} takes a value or a list of values, not {v!r}")
    if not items:
        raise ExpertcacheError(f"{name!r} is empty")
    return tuple(dict.fromkeys(items))


def _timing_from(data: object, base: str) -> Timing | None:
    """A grid file's timing section: a mapping of ``Timing``'s fields (paths relative to ``base``), or
    true (the defaults) or false."""
    if isinstance(data, bool):
        return Timing() if data else None
    known = [f.name for f in fields(Timing)]
    if not isinstance(data, dict):
        raise ExpertcacheError(f"timing is true, false or a mapping of {', '.join(known)}")
    unknown = [k for k in data if k not in known]
    if unknown:
        raise ExpertcacheError(f"unknown key {unknown[0]!r} in timing; it has {', '.join(known)}")
    data = dict(data)
    for key in ("cost", "predictor"):
        if data.get(key) is not None and not isinstance(data[key], str):
            raise ExpertcacheError(f"timing: {key!r} is one file's path")
        if data.get(key) is not None:
            data[key] = str(Path(base) / data[key])
    return Timing(**data)
