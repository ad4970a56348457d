"""The shape of the code: imports only go downwards, and the simulator's side never needs torch.

Layers, lowest first: the common modules (errors, units, specs, the cost model, the lazy registry),
``trace``, ``policy``, ``miss`` (the miss paths' decisions), ``cache`` (the step logic engine and
simulator share), ``predict``, ``config`` (one frozen dataclass per domain), then ``sim`` and ``engine``
side by side (neither imports the other), ``tools`` (they run models), and last the CLI and the
package's ``__init__``. Every import in every module, at the top or inside a function, is checked.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "expertcache"

LAYERS = {
    "errors": 0,
    "units": 0,
    "paths": 0,
    "lazy": 0,
    "jit": 0,
    "workers": 0,
    "spec": 0,
    "costs": 0,
    "trace": 1,
    "policy": 2,
    "miss": 3,
    "cache": 4,
    "predict": 5,
    "config": 6,
    "plan": 6,
    "plugins": 6,
    "sim": 7,
    "engine": 7,
    "tools": 8,
    "serve": 9,
    "cli": 10,
    "__init__": 10,
    "__main__": 10,
}
SIDE_BY_SIDE = {("sim", "engine"), ("engine", "sim")}


def _part(module: str) -> str:
    """The layer name of a module path inside the package (``expertcache.cache.residency`` -> cache)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
    return [(line, m) for line, m in out if m == "expertcache" or m.startswith("expertcache.")]


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py"))


def test_every_package_has_a_layer() -> None:
    names = {
        _part("expertcache." + ".".join(p.relative_to(PACKAGE).with_suffix("").parts)) for p in _modules()
    }
    assert names <= set(LAYERS), f"give these a layer in LAYERS: {sorted(names - set(LAYERS))}"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_only_go_downwards(path: Path) -> None:
    here = _part("expertcache." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts))
    bad = []
    for line, module in _imports(path):
        there = _part(module)
        if (here, there) in SIDE_BY_SIDE or LAYERS[there] > LAYERS[here]:
            bad.append(f"line {line}: {module}")
    assert not bad, f"{here} imports upwards or sideways: {bad}"


_NO_TORCH = """
import sys
sys.modules["torch"] = None  # any import of torch now raises ImportError
sys.modules["transformers"] = None
import expertcache, expertcache.trace, expertcache.policy, expertcache.cache, expertcache.sim
import expertcache.miss, expertcache.config
import expertcache.predict  # the registry names predictors without importing them
from expertcache.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _run_without_torch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _NO_TORCH, *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    "args",
    [
        ["policies"],
        ["sim", "--policy", "lru", "--policy", "opt", "--capacity", "24", "48", "--json", "--jobs", "1"],
        ["timing", "--capacity", "24", "--json"],
        ["timing", "--capacity", "24", "--prefetch", "eam", "--json"],
        ["plan", "--capacity", "24", "--json"],
        ["doctor", "--capacity", "24", "--json"],
        ["trace", "info", "default"],
        ["sweep", "--policy", "lru", "opt", "--capacity", "25%", "--json", "--jobs", "1", "--quiet"],
    ],
    ids=lambda a: " ".join(a[:2]),
)
def test_simulator_commands_run_without_torch(args: list[str]) -> None:
    from expertcache.trace.default import DEFAULT_TRACE

    args = [str(DEFAULT_TRACE) if a == "default" else a for a in args]
    done = _run_without_torch(*args)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()
    if "--json" in args:
        json.loads(done.stdout)


def test_the_compiled_simulator_runs_without_torch(tmp_path: Path) -> None:
    from expertcache.sim import fast
    from expertcache.trace import synthesize

    big = tmp_path / "big.npz"  # 320k flat requests: above the compiled path's threshold
    synthesize("zipf", tokens=5000, layers=32, experts=8, top_k=2, seed=1).save(big)
    assert fast.MIN_REQUESTS <= 5000 * 32 * 2
    done = _run_without_torch(
        "sim", str(big), "--policy", "lfu", "--capacity", "64", "--order", "flat", "--json"
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)[0]["requests"] == 320_000


def test_trace_synth_runs_without_torch(tmp_path: Path) -> None:
    out = tmp_path / "z.npz"
    done = _run_without_torch("trace", "synth", "--kind", "zipf", "--tokens", "50", "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert out.is_file()
