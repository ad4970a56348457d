"""Policies, predictors and miss paths of the user's own, outside the package (``expertcache.plugins``):
registered from Python or named by EXPERTCACHE_PLUGINS, they work by name wherever the package's own do
(a new user could only edit the installed package's registries)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import expertcache as ec
from expertcache.errors import ExpertcacheError
from expertcache.plugins import _loaded, load_plugins
from expertcache.policy.registry import POLICIES
from expertcache.predict.registry import PREDICTORS

PLUGIN = '''
"""A most-recently-used eviction policy and a predictor of the last step's experts, the user's own."""
import expertcache
from user_classes import MRU, LastStep

expertcache.register_policy(MRU)
expertcache.register_predictor(LastStep)
'''


def _cli(tmp_path: Path, *argv: str, plugins: str = "users_plugin") -> subprocess.CompletedProcess:
    env = {**os.environ, "EXPERTCACHE_PLUGINS": plugins}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(Path(__file__).parent), *sys.path])
    return subprocess.run(
        [sys.executable, "-m", "expertcache", *argv], env=env, capture_output=True, text=True, timeout=300,
        cwd=tmp_path,
    )  # fmt: skip


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """The plugin module in ``tmp_path``, imported here as EXPERTCACHE_PLUGINS would; unregistered after."""
    (tmp_path / "users_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "users_plugin", raising=False)
    assert load_plugins("users_plugin") == ["users_plugin"]
    assert load_plugins(["users_plugin"]) == []  # a list of names too (it failed on .split); loaded once
    with pytest.raises(ExpertcacheError, match="load_plugins: module names"):
        load_plugins([3])
    yield tmp_path
    POLICIES.pop("users-mru", None)
    POLICIES.pop("users-mru-dist", None)
    PREDICTORS._paths.pop("users-last-step", None)
    PREDICTORS._loaded.pop("users-last-step", None)
    _loaded.discard("users_plugin")


def test_a_plugins_policy_runs_alike_in_the_engine_the_simulator_and_the_command_line(plugin):
    with ec.load(expert_memory="30%", policy="users-mru", prefetch="none") as model:
        model.generate_text("def read_config(path):", 16)
        stats, trace = model.stats, model.trace()
    (row,) = ec.simulate(trace, ["users-mru"], [stats["capacity_experts"]])
    assert row.policy == "users-mru" and (row.hits, row.misses) == (stats["hits"], stats["misses"])
    (lru,) = ec.simulate(trace, ["lru"], [stats["capacity_experts"]])
    assert lru.misses != row.misses  # not LRU under another name
    path = plugin / "run.npz"
    trace.save(path)
    done = _cli(plugin, "sim", str(path), "--policy", "users-mru", "--capacity", str(row.capacity), "--json")
    assert done.returncode == 0, done.stderr
    (cli_row,) = json.loads(done.stdout)
    assert (cli_row["policy"], cli_row["misses"]) == ("users-mru", row.misses)
    listed = _cli(plugin, "policies")
    assert "users-mru      online  A most-recently-used eviction policy, the user's own." in listed.stdout
    swept = _cli(plugin, "sweep", "--trace", str(path), "--policy", "users-mru", "lru", "--capacity", "24",
                 "32", "--jobs", "2", "--json")  # fmt: skip
    assert swept.returncode == 0, swept.stderr
    assert {r["policy"] for r in json.loads(swept.stdout)} == {"users-mru", "lru"}


def test_a_plugins_policy_has_a_per_layer_split_the_planner_lays_out(plugin, capsys):
    """A user's policy had no -dist form, so the planner refused it ("a policy with a -dist form");
    registered, NAME-dist is the package's Dist over it, planned, run and replayed as the package's own."""
    from functools import partial

    from expertcache.policy.dist import Dist

    split = POLICIES["users-mru-dist"]
    assert (
        isinstance(split, partial) and split.func is Dist and split.keywords["inner"] is POLICIES["users-mru"]
    )
    trace = ec.default_trace()
    plan = ec.make_plan(trace, "30%", policy="users-mru", methods=["uniform"])
    assert plan.policy_spec == "users-mru-dist:budgets=5/5/5/5/4/4"
    layered = ec.simulate(trace, [plan.policy_spec], [28])[0]
    with ec.load(expert_memory="30%", policy="users-mru-dist:budgets=5/5/5/5/4/4", prefetch="none") as model:
        model.generate_text("def read_config(path):", 16)
        stats, run = model.stats, model.trace()
    (row,) = ec.simulate(run, ["users-mru-dist:budgets=5/5/5/5/4/4"], [28])
    assert (row.hits, row.misses) == (stats["hits"], stats["misses"]) and layered.misses > 0
    listed = _cli(plugin, "policies")
    assert "users-mru-dist online  per-layer split of users-mru: A most-recently-used" in listed.stdout


def test_a_policy_registered_without_its_split_or_whose_split_name_is_taken():
    from expertcache.policy.lru import LRU

    alone = type("Alone", (LRU,), {"name": "users-alone"})
    try:
        assert ec.register_policy(dist=False)(alone) is alone
        assert "users-alone" in POLICIES and "users-alone-dist" not in POLICIES
        # its reason is the registration's, not eam's ("it decides over every layer's experts at once")
        with pytest.raises(
            ExpertcacheError, match=r"users-alone has no per-layer split \(it was registered "
        ):
            ec.simulate(ec.default_trace(), ["users-alone-dist"], [24])
        clash = type("Clash", (LRU,), {"name": "lru-x"})
        POLICIES["lru-x-dist"] = POLICIES["lru-dist"]
        with pytest.raises(
            ExpertcacheError, match="'lru-x-dist', Clash's per-layer split, is taken: .*dist=False"
        ):
            ec.register_policy(clash)
        assert "lru-x" not in POLICIES
        with pytest.raises(ExpertcacheError, match="dist must be True or False, got 'no'"):
            ec.register_policy(alone, dist="no")
    finally:
        for name in ("users-alone", "lru-x", "lru-x-dist"):
            POLICIES.pop(name, None)


def test_a_plugins_own_refusal_names_it_and_a_policy_of_any_keyword_takes_them():
    """A plugin's PolicyError from its __init__ came without the policy's name (the package's own name
    themselves); a policy taking ``**kwargs`` was said to take a parameter ``kw`` and refused every one."""
    from expertcache.errors import PolicyError
    from expertcache.policy.lru import LRU

    def picky(self, ctx, mode=1):
        if mode not in (1, 2):
            raise PolicyError(f"mode must be 1 or 2, got {mode!r}")
        LRU.__init__(self, ctx)

    def anything(self, ctx, **kw):
        self.kw = kw
        LRU.__init__(self, ctx)

    mode = type("Mode", (LRU,), {"name": "users-mode", "__init__": picky})
    free = type("Free", (LRU,), {"name": "users-free", "__init__": anything})
    try:
        ec.register_policy(mode), ec.register_policy(free)
        with pytest.raises(ExpertcacheError, match="policy 'users-mode': mode must be 1 or 2, got 3"):
            ec.simulate(ec.default_trace(), ["users-mode:mode=3"], [24])
        (got,) = ec.simulate(ec.default_trace(), ["users-free:a=1,b=2"], [24])
        (lru,) = ec.simulate(ec.default_trace(), ["lru"], [24])
        assert got.misses == lru.misses
    finally:
        for name in ("users-mode", "users-mode-dist", "users-free", "users-free-dist"):
            POLICIES.pop(name, None)


def test_a_plugins_predictor_runs_in_the_engine_and_its_run_replays(plugin):
    from expertcache.config import PrefetchConfig

    with ec.load(
        expert_memory="30%", prefetch=PrefetchConfig("users-last-step", deterministic=True)
    ) as model:
        model.generate_text("def read_config(path):", 16)
        stats, trace = model.stats, model.trace()
    assert stats["prefetch_issued"] > 0 and trace.meta["predictor"] == "users-last-step"
    fast = {"link_bandwidth": "1000TB/s", "link_latency": "0us"}
    for prefetch in ("recorded", "users-last-step"):  # replayed, or run again on the trace
        result = ec.simulate_timing(trace, "recorded", prefetch=prefetch, cost=fast)
        assert (result.hits, result.misses) == (stats["hits"], stats["misses"])
    assert "users-last-step" in _cli(plugin, "predictors").stdout


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (
            "raise RuntimeError('no licence')",
            "plugin bad_plugin (EXPERTCACHE_PLUGINS) cannot be imported: RuntimeError: no licence",
        ),  # fmt: skip
        (
            "import expertcache\nfrom expertcache.policy.lru import LRU\n\n@expertcache.register_policy\n"
            "class Mine(LRU):\n    pass\n",
            "policy Mine: set its own name, the one commands and rows use "
            "(name = 'my-policy': lower-case letters, digits, '.', '_' or '-') (it inherits 'lru')",
        ),
        (
            "import expertcache\nfrom expertcache.policy.lru import LRU\n\n@expertcache.register_policy\n"
            "class Mine(LRU):\n    name = 'fifo'\n",
            "policy name 'fifo' is taken: give Mine another name",
        ),
        (
            "import expertcache\nexpertcache.register_predictor(dict)\n",
            "a predictor to register is a subclass of Predictor (expertcache.predict.base), got "
            "<class 'dict'>",
        ),
    ],  # fmt: skip
)
def test_a_plugin_that_cannot_be_used_is_one_line(tmp_path, source, message):
    (tmp_path / "bad_plugin.py").write_text(textwrap.dedent(source))
    done = _cli(tmp_path, "policies", plugins="bad_plugin")
    assert done.returncode == 2 and done.stdout == ""
    said = (
        message if "cannot be imported" in message else f"plugin bad_plugin (EXPERTCACHE_PLUGINS): {message}"
    )
    assert done.stderr == f"expertcache: error: {said}\n"


def test_a_missing_plugin_module_is_one_line_naming_it(tmp_path):
    done = _cli(tmp_path, "sim", "default", plugins="not_there, users_plugin")
    assert done.returncode == 2 and done.stderr == (
        "expertcache: error: plugin not_there (EXPERTCACHE_PLUGINS) cannot be imported: No module named "
        "'not_there' (is its folder on PYTHONPATH?)\n"
    )


def test_registering_the_same_class_twice_is_no_error(plugin):
    mru = ec.POLICIES["users-mru"]
    assert ec.register_policy(mru) is mru
    with pytest.raises(ExpertcacheError, match="'users-mru' is taken"):
        ec.register_policy(type("Other", (mru,), {"name": "users-mru"}))


def test_a_miss_path_of_ones_own_is_taken_by_name(monkeypatch):
    from expertcache.miss.host import Host
    from expertcache.miss.registry import MISS_PATHS

    class MyHost(Host):
        """The host path under a name of the user's own."""

        name = "users-host"

    monkeypatch.delitem(MISS_PATHS, "users-host", raising=False)
    assert ec.register_miss(MyHost) is MyHost
    try:
        trace = ec.default_trace()
        mine, theirs = (ec.simulate_timing(trace, 24, miss=m) for m in ("users-host", "host"))
        assert (mine.hits, mine.misses, mine.tpot_s) == (theirs.hits, theirs.misses, theirs.tpot_s)
        with pytest.raises(ExpertcacheError, match="predictor name 'recorded' is taken"):
            ec.register_predictor(type("Rec", (ec.PREDICTORS["eam"],), {"name": "recorded"}))
    finally:
        MISS_PATHS.pop("users-host", None)


def test_a_policy_that_says_none_when_full_is_taken_as_no_victim_not_as_room(plugin):
    """The documented MRU returned None when every resident key was pinned, and the cache read None as
    room: the timing model overfilled the cache (at 2 experts, 1337 misses where 21817 is right) and the
    engine failed with a KeyError. A None from a full cache is now the policy's ``no_victim``, in the
    simulator, the timing model and the engine alike, as the package's own policies raise it."""
    from user_classes import MRU

    from expertcache.errors import PolicyError
    from expertcache.policy.base import PolicyContext, no_victim

    class Raising(MRU):
        name = "users-mru-raising"

        def victim(self, incoming, pinned):
            got = super().victim(incoming, pinned)
            if got is None and len(self.keys) >= self.capacity:
                raise no_victim(self, incoming)
            return got

    ec.register_policy(Raising)
    try:
        trace = ec.default_trace()
        runs = [
            ec.simulate_timing(trace, 2, cache=name, prefetch="oracle")
            for name in ("users-mru", Raising.name)
        ]
        assert [(r.misses, r.cache["prefetch_skipped"]) for r in runs] == [(21817, 20480)] * 2
        split = ec.make_policy(
            "users-mru-dist:budgets=2/1", PolicyContext(capacity=3, num_layers=2, num_experts=4)
        )
        for key in ((0, 0), (0, 1)):
            split.on_insert(key)
        with pytest.raises(PolicyError, match="no evictable expert for \\(0, 2\\)"):
            split.victim((0, 2), {(0, 0), (0, 1)})
        assert split.victim((1, 0), set()) is None  # layer 1 has room
        pf = ec.PrefetchConfig("next-gate", deterministic=True)
        with ec.load(expert_memory="10%", policy="users-mru", prefetch=pf) as model:
            model.generate_text("def read_config(path):", 24)  # a KeyError before
            stats, run = model.stats, model.trace()
        assert stats["prefetch_skipped"] > 0
        again = ec.PrefetchConfig("recorded", deterministic=True)
        replayed = ec.simulate_timing(run, "recorded", cache="users-mru", prefetch=again)
        assert (replayed.hits, replayed.misses) == (stats["hits"], stats["misses"])
    finally:
        POLICIES.pop(Raising.name, None)
        POLICIES.pop(f"{Raising.name}-dist", None)


@pytest.mark.parametrize("bad", [[16], [-1, 4], [2.0]])
def test_a_predictor_that_names_no_expert_is_one_clear_error_in_the_simulator_and_the_engine(bad):
    """A user's predictor returning expert 16 of 16 'prefetched' experts that do not exist in the timing
    model (issued 8196, used 0, at exit 0) and was an IndexError in the engine."""
    from user_classes import LastStep

    from expertcache.predict.base import PredictContext

    class Wrong(LastStep):
        name = "users-wrong"

        def _predict(self, source, target, gate_input):
            return list(bad)

    message = (
        r"predictor users-wrong predicted experts \[.*\] for layer \d+: layers are whole numbers 0\.\.5, "
    )
    message += r"experts 0\.\.15"
    with pytest.raises(ExpertcacheError, match=message):
        ec.simulate_timing(
            ec.default_trace(), 24, prefetch=ec.PrefetchConfig(Wrong(PredictContext(6, 16, 2)))
        )
    pf = ec.PrefetchConfig(Wrong(PredictContext(6, 16, 2)), deterministic=True)
    with ec.load(expert_memory="30%", prefetch=pf) as model, pytest.raises(ExpertcacheError, match=message):
        model.generate_text("def read_config(path):", 4)


def test_a_sloppy_policy_or_predictor_is_one_line_or_taken_as_meant(plugin):
    """A victim that is not resident (on_evict that forgot the key) or is pinned was a KeyError in the
    cache; a predictor ranking with numpy failed on its truth value."""
    from user_classes import MRU, LastStep

    from expertcache.errors import PolicyError
    from expertcache.predict.base import PredictContext

    class Forgetful(MRU):
        name = "users-forgetful"

        def on_evict(self, key):
            pass  # the key stays in its list: a later victim is no longer resident

    class Pinning(MRU):
        name = "users-pinning"

        def victim(self, incoming, pinned):
            return next(reversed(self.keys)) if len(self.keys) >= self.capacity else None  # in use

    class Numpy(LastStep):
        name = "users-numpy"

        def _predict(self, source, target, gate_input):
            return np.asarray([1, 2])

    for cls, why in ((Forgetful, "which is not resident"), (Pinning, "which is pinned")):
        ec.register_policy(cls, dist=False)
        try:
            with pytest.raises(
                PolicyError, match=rf"{cls.name}: victim\(\) chose \(\d+, \d+\) for .*, {why}"
            ):
                ec.simulate(ec.default_trace(), [cls.name], [4])
        finally:
            POLICIES.pop(cls.name, None)
    got = ec.simulate_timing(
        ec.default_trace(), 24, prefetch=ec.PrefetchConfig(Numpy(PredictContext(6, 16, 2)))
    )
    assert got.cache["prefetch_issued"] > 0
    with pytest.raises(ExpertcacheError, match="'BadName' is not a name commands can take"):
        ec.register_policy(type("Bad", (MRU,), {"name": "BadName"}))


def test_a_wrong_victim_is_an_error_on_a_prefetch_and_in_a_host_level_too(plugin):
    """A victim that is not resident was one clear error on a demand miss, and on a prefetch or in a host
    level the same choice was counted as 'nothing evictable': the prefetch skipped or the miss read
    straight through, exit 0, and the broken policy's counts beat LRU's (a new user's trial)."""
    from user_classes import MRU

    from expertcache.config import HostConfig
    from expertcache.errors import PolicyError

    class WrongForPrefetch(MRU):
        name = "users-wrong-for-prefetch"

        def victim(self, incoming, pinned):
            got = super().victim(incoming, pinned)
            return (99, 99) if got is not None and incoming[0] != self.clock.layer else got  # a later layer's

    class Forgetful(MRU):
        name = "users-forgetful-host"

        def on_evict(self, key):
            pass  # a later victim is no longer resident

    for cls in (WrongForPrefetch, Forgetful):
        ec.register_policy(cls, dist=False)
    try:
        trace = ec.default_trace()
        assert ec.simulate_timing(trace, 24, cache=WrongForPrefetch.name).misses > 0  # demands: right
        with pytest.raises(PolicyError, match=r"victim\(\) chose \(99, 99\) .* which is not resident"):
            ec.simulate_timing(trace, 24, cache=WrongForPrefetch.name, prefetch="oracle")
        with pytest.raises(PolicyError, match=r"users-forgetful-host: victim\(\) chose .* not resident"):
            ec.simulate_timing(trace, 8, host=HostConfig("30%", Forgetful.name))
        wrong = pytest.raises(PolicyError, match=r"users-forgetful-host: victim\(\) chose .* not resident")
        with wrong, ec.load(expert_memory="10%", host_memory="30%", host_policy=Forgetful.name) as model:
            model.generate_text("def read_config(path):", 16)
    finally:
        for cls in (WrongForPrefetch, Forgetful):
            POLICIES.pop(cls.name, None)


def test_a_plugins_own_check_of_a_parameter_is_one_line(plugin, tmp_path):
    """A ValueError from a plugin's __init__ (its own check of a parameter) was a traceback and exit 1."""
    (tmp_path / "checking.py").write_text(
        textwrap.dedent("""
        import expertcache
        from user_classes import MRU

        @expertcache.register_policy
        class Checked(MRU):
            name = "users-checked"

            def __init__(self, ctx, half_life=8):
                super().__init__(ctx)
                if half_life <= 0:
                    raise ValueError(f"half_life must be positive, got {half_life}")
    """)
    )
    done = _cli(tmp_path, "sim", "default", "--policy", "users-checked:half_life=-1", "--capacity", "24",
                plugins="checking")  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "users-checked" in done.stderr and "half_life must be positive, got -1" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_an_unknown_policy_in_python_with_plugins_named_for_the_commands_says_how_to_load_them(monkeypatch):
    """EXPERTCACHE_PLUGINS set, a notebook's simulate() said only 'unknown policy' (a new user's trial)."""
    monkeypatch.setenv("EXPERTCACHE_PLUGINS", "users_never_imported")
    with pytest.raises(
        ExpertcacheError, match=r"unknown policy 'lruu' \(did you mean lru or llru\?\) .*load_plugins"
    ):
        ec.simulate(ec.default_trace(), ["lruu"], [24])
    monkeypatch.setenv("EXPERTCACHE_PLUGINS", "json")  # imported: the commands would have it
    with pytest.raises(ExpertcacheError) as got:
        ec.simulate(ec.default_trace(), ["lruu"], [24])
    assert "load_plugins" not in str(got.value)


OWN = """
import expertcache
from user_classes import MRU, LastStep


class Mine(MRU):
    name = "mine-mru"


class MyPredictor(LastStep):
    name = "mine-last-step"


expertcache.register_policy(Mine)
expertcache.register_predictor(MyPredictor)
"""


def test_a_resumed_sweep_runs_a_plugins_cells_again_once_its_code_changed(tmp_path):
    """``--resume`` knows a cell by its identity; a plugin's policy or predictor whose code changed since
    kept its old rows (a new user's trial): the file defining its class is now part of the identity."""
    (tmp_path / "mine.py").write_text(OWN)
    argv = ["sweep", "--policy", "mine-mru", "lru", "--capacity", "24", "--prefetch", "none",
            "mine-last-step", "--out", "r.json"]  # fmt: skip

    def rows(*more: str) -> tuple[list[dict], str]:
        done = _cli(tmp_path, *argv, *more, plugins="mine")
        assert done.returncode == 0, done.stderr
        return json.loads((tmp_path / "r.json").read_text()), done.stderr

    first, _ = rows()
    assert len(first) == 4  # 2 policies x (no prefetching, the predictor)
    code = {r["policy"]: r["params"] for r in first if r["prefetch"] == "none"}
    assert code["lru"] == "" and code["mine-mru"].startswith("policy_code_sha=")
    predicted = {r["policy"]: r["params"] for r in first if r["prefetch"] == "mine-last-step"}
    assert predicted["lru"].startswith("prefetch_code_sha=")  # the predictor's code, not the policy's
    assert predicted["mine-mru"] == code["mine-mru"] + "," + predicted["lru"]
    again, said = rows("--resume")
    assert again == first and "0 computed, 4 already in" in said
    (tmp_path / "mine.py").write_text(OWN + "# changed\n")
    changed, said = rows("--resume")
    assert "3 computed, 1 already in" in said  # only lru without prefetching ran no code of the plugin's
    assert "3 rows in r.json are not cells of this grid" in said and "a plugin's changed code" in said
    assert len(changed) == 7 and changed[4:] == [r for r in first if r["params"]]
