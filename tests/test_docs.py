"""Every ``expertcache`` command example in the README and the docs runs as written.

Examples are the lines of ``bash``/``sh`` code blocks that start with ``expertcache`` (a ``$ `` prompt
and a trailing ``# comment`` are dropped, ``a && b`` runs both). Usage synopses (``[--flag ...]``) are
not examples and are left out. Placeholders are filled in: ``DIR`` is a tiny checkpoint (a new directory
after ``-o``), ``TRACE.npz`` a small synthetic trace, ``"..."`` a short prompt; relative outputs land in
a temporary directory. Examples for a GPU (``--device cuda``) run only where torch sees one.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import engine_fixtures
import pytest
import torch

from expertcache.cli import main
from expertcache.trace import synthesize

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_one_torch_thread = engine_fixtures._one_torch_thread
make_ckpt = engine_fixtures.make_ckpt
tokenizer_dir = engine_fixtures.tokenizer_dir


def examples() -> list[tuple[str, str]]:
    out = []
    for doc in DOCS:
        for block in re.findall(r"```(?:bash|sh)\n(.*?)```", doc.read_text(), re.S):
            for line in block.splitlines():
                line = line.strip().removeprefix("$ ")
                if not line.startswith("expertcache ") or re.search(r"\[-|\[[A-Z]", line):
                    continue
                for command in line.split(" && "):
                    command = command.split("  #")[0].split(" # ")[0].strip()
                    out.append((doc.name, command))
    return out


EXAMPLES = examples()


def test_the_docs_have_examples():
    assert len(EXAMPLES) > 20 and any(doc == "MISS.md" for doc, _ in EXAMPLES)


@pytest.mark.parametrize("doc, command", EXAMPLES, ids=[f"{d}:{c[:60]}" for d, c in EXAMPLES])
def test_example_runs_as_written(doc, command, make_ckpt, tmp_path, monkeypatch, capsys):
    if "--device cuda" in command and not torch.cuda.is_available():
        pytest.skip("a GPU example, and torch sees no CUDA device here")
    monkeypatch.chdir(tmp_path)
    trace = tmp_path / "TRACE.npz"
    synthesize("sticky", tokens=300, layers=4, experts=8, top_k=2, seed=1, sequences=2, prompt_len=20).save(
        trace
    )
    argv = shlex.split(command)[1:]
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
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, f"{doc}: {command}\n{err}"
    assert out.strip() or err.strip()
