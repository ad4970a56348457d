"""Every ``expertcache`` command example in the README and the docs runs as written.

Examples are the lines of ``bash``/``sh`` code blocks that start with ``expertcache``, and the lines of
any other code block that start with ``$ expertcache`` (a ``$ `` prompt and a trailing ``# comment`` are
dropped, ``a && b`` runs both). Usage synopses (``[--flag ...]``) are not examples and are left out.
Placeholders are filled in: ``DIR`` is a tiny checkpoint (a new directory after ``-o``), ``TRACE.npz`` a
small synthetic trace, ``"..."`` a short prompt; relative outputs land in a temporary directory (with a
copy of ``examples/``, whose files examples name). Examples for a GPU (``--device cuda``) run only where
torch sees one. A command shown in several docs runs once; ``serve`` and ``selftest`` examples are
parsed here and run by their own tests (``RUN_ELSEWHERE``).

Sample outputs: the lines after a ``$ expertcache ...`` line, up to the next ``$ `` line or the block's
end, are what that command prints, and an example without placeholders must print exactly that (line for
line, trailing spaces aside; ``...`` in a sample line stands for any text, e.g. a machine's path).

Inline code is checked without running it: an ``expertcache ...`` span must parse as a command line
(placeholders and synopsis brackets allowed), a span of bare words must name a real (sub)command, and
every concrete ``--policy``/``--miss``/``--prefetch`` value or ``name:k=v`` spec of a policy or miss path
must be accepted by its registry.
"""

from __future__ import annotations

import argparse
import io
import itertools
import re
import shlex
import shutil
import sys
from pathlib import Path

import engine_fixtures
import pytest
import torch

from expertcache.cli import _build_parser, main
from expertcache.config import MissConfig, PrefetchConfig
from expertcache.errors import ExpertcacheError
from expertcache.miss.registry import MISS_PATHS
from expertcache.policy.base import PolicyContext
from expertcache.policy.registry import POLICIES, make_policy, parse_policy, policy_class
from expertcache.trace import synthesize

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_one_torch_thread = engine_fixtures._one_torch_thread
make_ckpt = engine_fixtures.make_ckpt
tokenizer_dir = engine_fixtures.tokenizer_dir


FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
SYNOPSIS = re.compile(r"\[-|\[[A-Z]")


def examples() -> list[tuple[str, str, str | None]]:
    """(doc, command, the sample output shown after it or None) for every example."""
    out = []
    for doc in DOCS:
        for lang, block in FENCE.findall(doc.read_text()):
            lines = block.splitlines()
            for i, line in enumerate(lines):
                line = line.strip()
                prompted, line = line.startswith("$ "), line.removeprefix("$ ")
                if not (prompted or lang in ("bash", "sh")) or not line.startswith("expertcache "):
                    continue
                if SYNOPSIS.search(line):
                    continue
                shown = (
                    itertools.takewhile(lambda s: not s.startswith("$ "), lines[i + 1 :]) if prompted else ()
                )
                sample = "\n".join(shown).strip("\n") or None
                commands = [c.split("  #")[0].split(" # ")[0].strip() for c in line.split(" && ")]
                out += [(doc.name, c, sample if c is commands[-1] else None) for c in commands]
    return out


def inline_code() -> list[tuple[str, str]]:
    """(doc, span) for every inline code span outside code blocks, whitespace collapsed."""
    out = []
    for doc in DOCS:
        text = FENCE.sub("", doc.read_text())
        out += [(doc.name, " ".join(span.split())) for span in re.findall(r"`([^`]+)`", text)]
    return out


def distinct(examples: list[tuple[str, str, str | None]]) -> list[tuple[str, str, str | None]]:
    """Each command once, named by every doc that shows it ("README.md+MISS.md"), with the sample output
    one of them shows; a command shown with two different samples runs once for each."""
    docs: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for doc, command, sample in examples:
        docs.setdefault(command, [])
        if doc not in docs[command]:
            docs[command].append(doc)
        if sample is not None and sample not in samples.setdefault(command, []):
            samples[command].append(sample)
    return [
        ("+".join(names), command, sample)
        for command, names in docs.items()
        for sample in samples.get(command) or [None]
    ]


EXAMPLES = distinct(examples())
INLINE = inline_code()


# commands whose examples another test runs as written: serve runs until stopped (tests/test_serve.py);
# selftest --device cpu --quick is tests/test_selftest.py's first test, which checks every line it prints
RUN_ELSEWHERE = ("serve", "selftest")


def matches_sample(out: str, sample: str) -> bool:
    """Line for line, trailing spaces aside; ``...`` in a sample line matches any text."""
    got, want = out.strip("\n").splitlines(), sample.splitlines()
    pattern = [".*".join(map(re.escape, w.rstrip().split("..."))) for w in want]
    return len(got) == len(want) and all(
        re.fullmatch(p, g.rstrip()) for p, g in zip(pattern, got, strict=True)
    )


def test_the_docs_have_examples():
    assert len(EXAMPLES) > 20 and any(doc == "MISS.md" for doc, _, _ in EXAMPLES)
    assert any(sample for _, _, sample in EXAMPLES)  # TIMING.md's sample output


def test_samples_match_like_this():
    sample = "trace      .../data/t.npz: T=5\nTPOT       1.5 ms"
    assert matches_sample("trace      /x/y/data/t.npz: T=5  \nTPOT       1.5 ms\n", sample)
    assert not matches_sample("trace      /x/y/data/t.npz: T=5\nTPOT       1.6 ms\n", sample)
    assert not matches_sample("trace      /x/y/data/t.npz: T=5\n", sample)


@pytest.mark.parametrize("doc, command, sample", EXAMPLES, ids=[f"{d}:{c[:60]}" for d, c, _ in EXAMPLES])
def test_example_runs_as_written(doc, command, sample, make_ckpt, tmp_path, monkeypatch, capsys):
    if "--device cuda" in command and not torch.cuda.is_available():
        pytest.skip("a GPU example, and torch sees no CUDA device here")
    monkeypatch.chdir(tmp_path)
    trace = tmp_path / "TRACE.npz"
    # the embedded trace's shape (6 layers x 16 experts, top-2): an example that runs on TRACE.npz runs on
    # the trace a new user has at hand (lru-dist:budgets=4/4/8/8 did not)
    synthesize("sticky", tokens=300, layers=6, experts=16, top_k=2, seed=1, sequences=2, prompt_len=20).save(
        trace
    )
    argv = shlex.split(command)[1:]
    redirected = ">" in argv  # `... > out.txt`: the output goes to stdout, which is what is checked
    if redirected:
        argv = argv[: argv.index(">")]
    # files the examples name (a sweep's grid, prompts, routing logs), as in a clone
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    monkeypatch.setattr(sys, "stdin", io.StringIO("def f(x):\n"))  # what `chat` and `--prompt -` read
    for i, arg in enumerate(argv):
        if arg == "DIR":
            argv[i] = (
                str(tmp_path / "new-model") if argv[i - 1] in ("-o", "--out") else str(make_ckpt("mixtral"))
            )
        elif arg == "TRACE.npz":
            argv[i] = str(trace)
        elif arg == "...":
            argv[i] = "def f(x):"
    if "run.npz" in argv and "--record-trace" not in argv:  # a trace an earlier example wrote
        assert main(["generate", "--prompt", "x", "--max-new-tokens", "2", "--record-trace", "run.npz"]) == 0
    if "users16.npz" in argv and argv[:2] != ["trace", "batch"]:  # a batched trace an earlier one wrote
        assert main(["trace", "batch", "--concurrency", "16", "-o", "users16.npz"]) == 0
    if "users16c.npz" in argv and argv[:2] != ["trace", "batch"]:  # the same, its prompts chunked
        assert (
            main(["trace", "batch", "--concurrency", "16", "--batch-tokens", "32", "-o", "users16c.npz"]) == 0
        )
    if "profile.json" in argv and argv[0] != "profile":  # a profile an earlier example wrote
        assert main(["profile", "--device", "cpu", "--steps", "2", "-o", "profile.json"]) == 0
    if "int8-model" in argv and argv[0] != "quantize" and not Path("int8-model").exists():
        assert main(["quantize", "--bits", "8", "--checkpoint", "int8-model"]) == 0  # an earlier example's
    if "--miss" in argv and argv[argv.index("--miss") + 1].startswith("hobbit") and argv[0] != "quantize":
        # HOBBIT's copies, which an earlier example builds (`quantize --bits 8 4`) in the user's cache: a
        # worker that did not run it builds them first (the cache is per worker: conftest)
        assert main(["quantize", "--bits", "8", "4"]) == 0
    if "plan.json" in argv and argv[0] != "plan":  # a plan an earlier example wrote
        assert main(["plan", "--expert-memory", "25%", "--method", "uniform", "-o", "plan.json"]) == 0
    if argv[0] in RUN_ELSEWHERE:  # parsed here, run by the test that checks what it does
        assert _build_parser().parse_args(argv).func is not None
        return
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, f"{doc}: {command}\n{err}"
    assert out.strip() if redirected else out.strip() or err.strip()
    if sample is not None and argv == shlex.split(command)[1:]:  # no placeholder: the output is the doc's
        assert matches_sample(out, sample), f"{doc}: {command} prints, unlike its sample output:\n{out}"


def _placeholder(word: str) -> bool:
    return word == "..." or bool(re.fullmatch(r"[A-Z][A-Z_.]*", word))


def test_inline_commands_parse():
    """`expertcache sim FILE --order layer` parses; `expertcache sim timing` names no command."""
    bad = []
    for doc, span in INLINE:
        if not span.startswith("expertcache "):
            continue
        words = shlex.split(span.replace("[", " ").replace("]", " "))[1:]
        if all(re.fullmatch(r"[a-z][a-z-]*", w) for w in words):  # a command's name
            parser = _build_parser()
            for word in words:
                subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
                if not subs or word not in subs[0].choices:
                    bad.append(f"{doc}: `{span}`: {word!r} is not a command here")
                    break
                parser = subs[0].choices[word]
            continue
        try:
            _build_parser().parse_args(["x" if _placeholder(w) else w for w in words])
        except SystemExit:
            bad.append(f"{doc}: `{span}` does not parse")
    assert not bad, "\n".join(bad)


def inline_specs() -> list[tuple[str, str, str]]:
    """(doc, kind, value) for every concrete --policy/--miss/--prefetch value and name:k=v spec."""
    out = []
    for doc, span in INLINE:
        found = re.findall(r"--(policy|miss|prefetch) (\S+)", span)
        name = span.split(":")[0]
        if re.fullmatch(r"[a-z-]+:[a-z_]+=\S+", span) and (name in POLICIES or name in MISS_PATHS):
            found.append(("policy" if name in POLICIES else "miss", span))
        for kind, value in found:
            out += [(doc, kind, v) for v in value.split("|") if not re.search(r"[A-Z\[]|\.\.\.", v)]
    return out


def test_inline_specs_are_accepted():
    """`--policy llru:window=8` in prose is as wrong as on a command line."""
    specs = inline_specs()
    assert {"policy", "prefetch"} <= {kind for _, kind, _ in specs}
    ctx = PolicyContext(capacity=64, num_layers=4, num_experts=16, top_k=2, future={}, profile={})
    bad = []
    for doc, kind, value in specs:
        try:
            if kind == "policy":
                name, params = parse_policy(value)
                for key in policy_class(name).text_params:  # a file an example writes: checked when it runs
                    params.pop(key, None)
                make_policy(name, ctx, **params)
            elif kind == "miss":
                MissConfig(value)
            else:
                PrefetchConfig(value)
        except ExpertcacheError as e:
            bad.append(f"{doc}: --{kind} {value}: {e}")
    assert not bad, "\n".join(bad)


PYTHON = [
    (doc.name, i, block)
    for doc in DOCS
    for i, block in enumerate(b for lang, b in FENCE.findall(doc.read_text()) if lang == "python")
]


@pytest.mark.parametrize("doc, index, block", PYTHON, ids=[f"{d}:{i}" for d, i, _ in PYTHON])
def test_python_examples_name_nothing_they_do_not_define(doc, index, block):
    """Every Python block of the docs defines what it uses (ruff's undefined-name check): the README's
    first used ``input_ids`` and never said what it was."""
    import subprocess

    ruff = [sys.executable, "-m", "ruff", "check", "--isolated", "--select=F821", "--stdin-filename=x.py"]
    done = subprocess.run([*ruff, "-"], input=block, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"{doc}, Python block {index}:\n{done.stdout}"


def test_the_readmes_python_example_runs(make_ckpt, tmp_path, monkeypatch):
    """The README's engine example, run as written on a tiny checkpoint (``DIR``)."""
    block = next(b for d, _, b in PYTHON if d == "README.md" and "expertcache.load" in b)
    monkeypatch.chdir(tmp_path)
    exec(compile(block.replace('"DIR"', repr(str(make_ckpt("mixtral")))), "README.md", "exec"), {})
    assert (tmp_path / "run.npz").is_file()


def test_the_readmes_trace_import_example_runs(tmp_path, monkeypatch):
    block = next(b for d, _, b in PYTHON if d == "README.md" and "routes.pt" in b)
    monkeypatch.chdir(tmp_path)
    exec(compile(block, "README.md", "exec"), {})
    assert main(["trace", "import", "routes.pt", "-o", "r.npz"]) == 0


def _slug(heading: str) -> str:
    """A Markdown heading's anchor as GitHub makes it: code marks and links' targets dropped, lower case,
    every character but letters, digits, '_', '-' and spaces removed, spaces made hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.replace("`", ""))
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def test_links_between_the_docs_reach_their_files_and_headings():
    """`[text](OTHER.md#heading)` and `[text](#heading)`: the file is there, and so is the heading."""
    anchors = {}
    for doc in DOCS:
        seen: dict[str, int] = {}
        for heading in re.findall(r"^#{1,6} (.+)$", FENCE.sub("", doc.read_text()), re.M):
            slug = _slug(heading)
            anchors.setdefault(doc.resolve(), set()).add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    bad = []
    for doc in DOCS:
        for target, fragment in re.findall(
            r"\]\(([^)\s#]*)(?:#([^)\s]+))?\)", FENCE.sub("", doc.read_text())
        ):
            if target.startswith(("http:", "https:", "mailto:")):
                continue
            path = (doc.parent / target).resolve() if target else doc.resolve()
            if not path.exists():
                bad.append(f"{doc.name}: ({target}) is not a file of the repository")
            elif fragment and path in anchors and fragment not in anchors[path]:
                bad.append(f"{doc.name}: ({target}#{fragment}) names no heading of {path.name}")
    assert not bad, "\n".join(bad)


def test_the_readmes_python_names_of_the_commands_exist():
    """The README's table of each command's Python name: every name in it resolves (a renamed function
    would leave the table pointing at nothing)."""
    import importlib

    import expertcache

    text = (ROOT / "README.md").read_text()
    table = text[text.index("| command | Python |") :].split("\n\n")[0]
    names = re.findall(r"`(expertcache\.[\w.]+)", table)
    bare = {n for cell in re.findall(r"\| ([^|]+) \|\n", table) for n in re.findall(r"`(\w+)", cell)}
    assert len(names) >= 10
    modules = []
    for dotted in names:
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):  # the longest importable module, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            modules.append(obj)
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
            break
    for name in bare - {"expertcache"}:  # a top-level name, or one of a module named beside it
        assert name in expertcache.__all__ or any(hasattr(m, name) for m in modules), name
