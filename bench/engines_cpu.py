"""CPU engines side by side: llama.cpp (GGUF bf16, Q8_0), transformers (each experts implementation) and
expertcache (100 %, 25 % from disk), greedy decode at a fixed thread count, in alternating rounds.

    .venv/bin/python bench/engines_cpu.py --model /work/bench-models/granite-3.1-1b-a400m-random \\
        --llama-python /work/llama-venv/bin/python --threads 2 --rounds 5 --out /tmp/engines.json

Every engine gets the same prompt: the first ``--prompt-tokens`` (64) token ids of a fixed code text
(repeated for a longer prompt) under the checkpoint's tokenizer, then ``--new-tokens`` (64) greedy tokens.
Engines are loaded once, each warmed by one short generation (whose TTFT is reported as the cold
``first_ttft``), then each round runs one generation on every engine, the order rotating from round to
round, so that a shared machine's drift falls on all of them alike. Figures are medians over rounds, with
their range and a bootstrap 95 %
interval (``plenty_cpu.ci95``) of the per-round ratio to transformers eager.

Engines (``--only SUBSTR ...`` keeps those whose name contains one of the strings):

- ``llama.cpp <label>``: one per GGUF file (``--gguf``; default ``<model>-*.gguf``, the label is the
  part after the model's name, e.g. ``bf16``, ``q8_0``), run through ``llama_cpp.Llama(n_threads=
  n_threads_batch=--threads)`` in a worker process under ``--llama-python`` (llama-cpp-python lives in
  its own virtualenv; a separate process also keeps ggml's and torch's OpenMP pools apart). The main
  loop drives the worker over a pipe, so the rounds still alternate. Without ``--llama-python`` (or if
  that Python cannot import llama_cpp) llama.cpp is skipped with a note. The worker runs
  ``Llama.generate`` (greedy sampler, ``temp=0``) and timestamps each token as it is yielded: the
  same TTFT/TPOT definition as the torch engines. llama.cpp's own perf counters
  (``llama_perf_context``: prompt eval ms, eval ms per token) are recorded beside them in the JSON.
  End-of-sequence is not suppressed there (``generate`` does not stop at it; a random model rarely
  emits it), so every run still decodes ``--new-tokens`` tokens.
- ``transformers <impl>``: ``experts_implementation`` ``eager``, ``batched_mm``, ``grouped_mm`` and
  ``default`` (what ``from_pretrained`` picks with no argument; its resolved name is recorded). By
  default one model is loaded (``engine.loader.load_reference``: every tensor in fresh memory)
  and its implementation is switched with ``set_experts_implementation`` before each generation (the
  kernel is looked up at every forward), so the four share one load time and one copy of the
  weights; ``--tf-separate`` loads each with its own ``from_pretrained`` instead (4x the memory).
- ``expertcache <memory> <tier> ...``: ``expertcache.load(path, expert_memory=..., slow_tier=...,
  device="cpu")`` for each ``--expertcache MEMORY[:TIER[:key=value,...]]`` (default ``100%:disk
  25%:disk``; e.g. ``100%:disk:kernel=eager``), with ``--expertcache-args key=value ...`` added to
  every ``load()`` (values are Python literals, else strings); ``model=DIR`` runs another checkpoint
  of the same model (a packed one: ``expertcache quantize --checkpoint``). The name says the experts
  kernel the engine resolved (``grouped`` by default where torch has ``grouped_mm``, else ``eager``).
  Tokens are compared with transformers eager's and with those of the implementation the kernel equals
  bit for bit (README, ``--kernel``: ``grouped`` = ``grouped_mm``, ``eager`` = ``eager``): ``kernel_twin``.

Per engine: TTFT (start to first new token) and TPOT (mean gap between later tokens), medians and
ranges over rounds; CPU seconds per decoded token (``time.process_time`` of the whole process, all its
threads, from the first to the last new token, over tokens - 1) and for the prefill; time to ready
(the load call: ``Llama()``, ``load_reference``/``from_pretrained``, ``expertcache.load`` which
includes its own 2-token warm-up); whether the greedy tokens equal transformers eager's in every round,
and which transformers implementations give the same tokens in every round (``same_tokens_as``; with
random weights logits are close together, so kernels that round differently can pick other tokens).
Each run keeps the machine's 1-minute load average beside it (a shared machine's other work shows
there; torch's OpenMP threads slow down far more than llama.cpp's when the cores are oversubscribed).
Results: JSON at ``--out`` (with ``provenance.provenance()``); a markdown table on stdout, progress on
stderr.

Models larger than memory: ``--limit 2.05GiB`` moves this process (and so its llama.cpp worker) into a
fresh memory cgroup of that size without swap before anything is loaded (``memory_cpu.Cgroup``; root),
drops the files the run reads from the page cache first (a cached page stays charged to the group that
read it first, so a file cached by another process would be held outside the limit), and records the
group's peak; ``--no-reference`` leaves transformers out (its model would not fit) and
with it the token checks and ratios. One engine per run (``--only``), each in a group of its own:

    .venv/bin/python bench/engines_cpu.py --model MODEL --llama-python PY --threads 1 --rounds 2 \
        --no-reference --limit 2.05GiB --only q8_0 --out /tmp/q8_0.json

Checkpoints (random weights, built with ``engine.random_checkpoint.make_checkpoint``; ``--build``
reads a config.json for the shapes; the tokenizer comes from the config's folder or ``--tokenizer``):

    .venv/bin/python bench/engines_cpu.py --build ../shared/models/granite-3.1-1b-a400m \\
        --model /work/bench-models/granite-3.1-1b-a400m-random
    .venv/bin/python bench/engines_cpu.py --build ../shared/models/olmoe-1b-7b --layers 4 \\
        --tokenizer ../shared/models/granite-3.1-1b-a400m --model /work/bench-models/olmoe-1b-7b-4l-random

and to GGUF with llama.cpp's converter (``convert_hf_to_gguf.py`` of the llama-cpp-python sdist):

    /work/llama-venv/bin/python CONVERT --outtype bf16 --outfile <model>-bf16.gguf <model>
    /work/llama-venv/bin/python CONVERT --outtype q8_0 --outfile <model>-q8_0.gguf <model>

llama-cpp-python, built from source (cmake; about 15 minutes on 2 cores) in its own virtualenv, with
what the converter needs (torch before transformers; the converter pins transformers 4.57.6):

    python3 -m venv /work/llama-venv
    CMAKE_BUILD_PARALLEL_LEVEL=2 /work/llama-venv/bin/pip install llama-cpp-python==0.3.36
    /work/llama-venv/bin/pip install torch==2.13.0
    /work/llama-venv/bin/pip install gguf numpy safetensors sentencepiece transformers==4.57.6 "protobuf<5"
    /work/llama-venv/bin/pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36 -d /work/llama-src
    tar xzf /work/llama-src/llama_cpp_python-0.3.36.tar.gz -C /work/llama-src
    CONVERT=/work/llama-src/llama_cpp_python-0.3.36/vendor/llama.cpp/convert_hf_to_gguf.py
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT = '''import json
import os
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Config:
    """Settings read from a JSON file, with defaults for every field."""

    name: str = "default"
    threads: int = 2
    paths: list[str] = field(default_factory=list)


def read_config(path: str | Path) -> Config:
    """Read a JSON configuration file and return it as a Config."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return Config(**data)


def main() -> int:
    config = read_config(os.environ.get("CONFIG", "config.json"))
    for p in config.paths:
        print(Path(p).resolve())
    return 0
'''
IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm", "default")
EAGER = "transformers eager"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------ llama.cpp worker
def worker() -> int:
    """Runs under --llama-python: JSON lines in (load / generate / quit), JSON lines out."""
    import llama_cpp

    out = sys.stdout
    sys.stdout = sys.stderr  # nothing but replies on the pipe
    models: dict[str, object] = {}

    def reply(obj: dict) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    reply(
        {
            "ready": True,
            "llama_cpp": llama_cpp.__version__,
            "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
        }
    )
    for line in sys.stdin:
        msg = json.loads(line)
        try:
            if msg["cmd"] == "quit":
                return 0
            if msg["cmd"] == "load":
                t0 = time.perf_counter()
                llm = llama_cpp.Llama(
                    model_path=msg["path"],
                    n_threads=msg["threads"],
                    n_threads_batch=msg["threads"],
                    n_ctx=msg["n_ctx"],
                    n_batch=msg["n_ctx"],
                    seed=0,
                    verbose=False,
                )
                models[msg["name"]] = llm
                meta = {k: v for k, v in llm.metadata.items() if "tokenizer" not in k}
                reply({"ready_s": time.perf_counter() - t0, "n_vocab": llm.n_vocab(), "metadata": meta})
            elif msg["cmd"] == "generate":
                llm, n = models[msg["name"]], msg["n"]
                llm.reset()
                ctx = llm._ctx.ctx
                llama_cpp.llama_perf_context_reset(ctx)
                tokens, times, cpus = [], [], []
                t0, c0 = time.perf_counter(), time.process_time()
                for tok in llm.generate(
                    msg["ids"], top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True
                ):
                    times.append(time.perf_counter())
                    cpus.append(time.process_time())
                    tokens.append(int(tok))
                    if len(tokens) == n:
                        break
                perf = llama_cpp.llama_perf_context(ctx)
                reply(
                    {
                        "tokens": tokens,
                        "t0": t0,
                        "c0": c0,
                        "times": times,
                        "cpus": cpus,
                        "perf": {
                            "prompt_eval_ms": perf.t_p_eval_ms,
                            "prompt_tokens": perf.n_p_eval,
                            "eval_ms": perf.t_eval_ms,
                            "eval_tokens": perf.n_eval,
                        },
                    }
                )
            else:
                reply({"error": f"unknown command {msg['cmd']!r}"})
        except Exception as exc:  # noqa: BLE001 - reported to the main process
            reply({"error": f"{type(exc).__name__}: {exc}"})
    return 0


class LlamaWorker:
    """The main process's end of the worker: one process for every GGUF model."""

    def __init__(self, python: str) -> None:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        self.proc = subprocess.Popen(
            [python, str(Path(__file__).resolve()), "--worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
            env=env,
        )
        self.hello = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the llama.cpp worker exited (status {self.proc.wait()})")
        r = json.loads(line)
        if "error" in r:
            raise RuntimeError(f"llama.cpp worker: {r['error']}")
        return r

    def ask(self, **msg) -> dict:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"cmd": "quit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()


# ------------------------------------------------------------------------------ timing
def summarize(t0: float, c0: float, times: list[float], cpus: list[float], tokens: list[int]) -> dict:
    """TTFT, TPOT and CPU seconds from per-token wall and process-CPU timestamps."""
    n = len(times)
    return {
        "tokens": tokens,
        "ttft_s": times[0] - t0,
        "tpot_s": (times[-1] - times[0]) / (n - 1) if n > 1 else 0.0,
        "total_s": times[-1] - t0,
        "cpu_prefill_s": cpus[0] - c0,
        "cpu_per_token_s": (cpus[-1] - cpus[0]) / (n - 1) if n > 1 else 0.0,
    }


class Stamps:
    """A generate() streamer that stamps wall and process-CPU time at each new token."""

    def __init__(self) -> None:
        self.times, self.cpus, self._prompt_seen = [], [], False

    def put(self, value) -> None:
        if self._prompt_seen:
            self.times.append(time.perf_counter())
            self.cpus.append(time.process_time())
        self._prompt_seen = True

    def end(self) -> None:
        pass


def torch_generate(generate, ids, pad: int, n: int) -> dict:
    """Greedy ``generate`` (transformers or ``OffloadedModel``) timed by ``generation.timed_generate``
    (the project's TTFT/TPOT), with process CPU time stamped per token beside it."""
    import torch

    from expertcache.engine.generation import timed_generate

    stamps = Stamps()
    with torch.inference_mode():
        t0, c0 = time.perf_counter(), time.process_time()
        r = timed_generate(
            generate,
            ids,
            stamps,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=pad,
        )
    out = summarize(t0, c0, stamps.times, stamps.cpus, r["tokens"])
    out.update(ttft_s=r["ttft_s"], tpot_s=r["tpot_s"], total_s=r["total_s"])
    return out


# ------------------------------------------------------------------------------ engines
class Engine:
    name: str
    ready_s: float = 0.0
    info: dict

    def generate(self, ids: list[int], n: int) -> dict:
        raise NotImplementedError

    def close(self) -> None:
        pass


class LlamaEngine(Engine):
    def __init__(self, worker: LlamaWorker, label: str, gguf: Path, threads: int, n_ctx: int) -> None:
        self.name, self.worker = f"llama.cpp {label}", worker
        r = worker.ask(cmd="load", name=self.name, path=str(gguf), threads=threads, n_ctx=n_ctx)
        self.ready_s = r["ready_s"]
        meta = r["metadata"]
        self.info = {
            "gguf": str(gguf),
            "gguf_bytes": gguf.stat().st_size,
            "n_vocab": r["n_vocab"],
            "file_type": meta.get("general.file_type"),
            "architecture": meta.get("general.architecture"),
        }

    def generate(self, ids: list[int], n: int) -> dict:
        r = self.worker.ask(cmd="generate", name=self.name, ids=ids, n=n)
        out = summarize(r["t0"], r["c0"], r["times"], r["cpus"], r["tokens"])
        p = r["perf"]
        out["llama_perf"] = {
            **p,
            "prefill_ms": p["prompt_eval_ms"],
            "decode_ms_per_token": p["eval_ms"] / p["eval_tokens"] if p["eval_tokens"] else None,
        }
        return out


class SharedTransformers:
    """One transformers model, loaded once (``load_reference``), for every experts implementation."""

    def __init__(self, path: Path, dtype: str | None = None) -> None:
        from expertcache.engine.loader import load_reference

        t0 = time.perf_counter()
        self.model = load_reference(path, dtype=dtype)
        self.ready_s = time.perf_counter() - t0
        self.default = self.model.get_correct_experts_implementation(None)


class TransformersEngine(Engine):
    def __init__(
        self, impl: str, path: Path, pad: int, shared: SharedTransformers | None, dtype: str | None = None
    ) -> None:
        self.name, self.pad, self.shared = f"transformers {impl}", pad, shared
        if shared is not None:
            self.model, self.ready_s = shared.model, shared.ready_s
            self.impl = shared.default if impl == "default" else impl
            self.info = {"load": "shared (load_reference, switched per generation)"}
        else:
            from transformers import AutoModelForCausalLM

            kw = {} if impl == "default" else {"experts_implementation": impl}
            if dtype:
                kw["dtype"] = dtype
            t0 = time.perf_counter()
            self.model = AutoModelForCausalLM.from_pretrained(str(path), **kw).eval()
            self.ready_s = time.perf_counter() - t0
            self.impl = self.model.config._experts_implementation
            self.info = {"load": f"from_pretrained({', '.join(f'{k}={v!r}' for k, v in kw.items())})"}
        self.info["experts_implementation"] = self.impl

    def generate(self, ids: list[int], n: int) -> dict:
        import torch

        if self.model.config._experts_implementation != self.impl:
            self.model.set_experts_implementation(self.impl)
        return torch_generate(self.model.generate, torch.tensor([ids]), self.pad, n)

    def close(self) -> None:
        self.model = None


def expertcache_spec(spec: str, extra: dict) -> tuple[str, str, dict, str]:
    """``MEMORY[:TIER[:key=value,...]]`` -> (memory, tier, load() arguments, engine name)."""
    memory, _, rest = spec.partition(":")
    tier, _, own = rest.partition(":")
    tier = tier or "disk"
    own_args = parse_extra([kv for kv in own.split(",") if kv], f"--expertcache {spec}")
    shown = {k: Path(str(v)).name if k == "model" else v for k, v in own_args.items()}
    name = f"expertcache {memory} {tier}" + "".join(f" {k}={v}" for k, v in shown.items())
    return memory, tier, {**extra, **own_args}, name


def check_spec(spec: str, extra: dict) -> None:
    """A ``--expertcache`` spec's memory (a share or a size), tier and ``model=`` as ``load`` would refuse
    them, but before any engine loads (an ExpertcacheError, one line)."""
    from expertcache.errors import ExpertcacheError
    from expertcache.units import parse_size

    memory, tier, kwargs, _ = expertcache_spec(spec, extra)
    text = memory.strip()
    if text.endswith("%"):
        try:
            share = float(text[:-1])
        except ValueError:
            share = -1.0
        if not 0 < share <= 100:
            raise ExpertcacheError(
                f"--expertcache {spec}: expert memory {memory!r} is not a share in (0%, 100%]"
            )
    else:
        parse_size(text, f"--expertcache {spec}: expert memory")
    tiers = ("host", "disk", "mapped")
    if tier not in tiers:
        raise ExpertcacheError(f"--expertcache {spec}: slow tier {tier!r} is not one of {', '.join(tiers)}")
    model = kwargs.get("model")
    if model is not None and not (Path(str(model)) / "config.json").is_file():
        raise ExpertcacheError(f"--expertcache {spec}: model={model}: no checkpoint there (no config.json)")


def evict_inputs(args: argparse.Namespace, extra: dict) -> list[Path]:
    """Drop the files this run reads (the checkpoint, its GGUFs, each spec's ``model=``) from the page
    cache: a page already cached stays charged to the cgroup that first read it, so a run in a fresh
    group would otherwise find a file it cannot hold in memory there for free (``memory_cpu.evict``)."""
    from memory_cpu import evict

    dirs = {Path(args.model)} | {
        Path(str(expertcache_spec(s, extra)[2]["model"]))
        for s in args.expertcache
        if "model" in expertcache_spec(s, extra)[2]
    }
    files = [f for d in dirs if d.is_dir() for f in sorted(d.iterdir()) if f.is_file()]
    files += [Path(g) for g in gguf_files(args.model, args.gguf).values()]
    evict(files)
    return files


class ExpertcacheEngine(Engine):
    def __init__(self, spec: str, path: Path, pad: int, extra: dict) -> None:
        import expertcache

        memory, tier, kwargs, self.name = expertcache_spec(spec, extra)
        path = Path(kwargs.pop("model", path))  # another checkpoint of the same model (a packed one)
        self.pad = pad
        t0 = time.perf_counter()
        self.m = expertcache.load(
            path, expert_memory=memory, slow_tier=tier, device="cpu", progress=False, **kwargs
        )
        self.ready_s = time.perf_counter() - t0
        stats = self.m.stats
        self.kernel = stats.get("kernel")
        if self.kernel and "kernel" not in kwargs:
            self.name += f" ({self.kernel} kernel)"
        self.info = {
            "expert_memory": memory,
            "slow_tier": tier,
            "load_args": kwargs,
            "kernel": self.kernel,
            "expert_memory_bytes": stats["expert_memory_bytes"],
            "warmup_s": stats.get("warmup_s"),
        }
        # the transformers implementation the engine's kernel equals bit for bit (README, --kernel)
        twin = {"grouped": "grouped_mm", "eager": "eager"}.get(self.kernel)
        self.twin = f"transformers {twin}" if twin else None

    def generate(self, ids: list[int], n: int) -> dict:
        import torch

        before = self.m.stats
        out = torch_generate(self.m.generate, torch.tensor([ids]), self.pad, n)
        after = self.m.stats
        out["cache"] = {k: after[k] - before[k] for k in ("hits", "misses", "bytes_transferred", "stall_s")}
        return out

    def close(self) -> None:
        self.m.close()


# ------------------------------------------------------------------------------ checkpoints
def build_checkpoint(config_dir: Path, out: Path, layers: int | None, tokenizer: Path | None) -> Path:
    """A random-weight bf16 checkpoint with ``config_dir``'s shapes (``make_checkpoint``), built once."""
    from expertcache.engine.random_checkpoint import make_checkpoint

    if (out / ".complete").is_file():
        log(f"{out}: already built")
        return out
    cfg = json.loads((config_dir / "config.json").read_text())
    tok = tokenizer or config_dir
    if not (tok / "tokenizer.json").is_file():
        raise SystemExit(
            f"engines_cpu: error: {config_dir}: no tokenizer.json; give --tokenizer DIR (any "
            "model's: random weights need only one)"
        )
    spec = dict(
        hidden=cfg["hidden_size"],
        layers=layers or cfg["num_hidden_layers"],
        experts=cfg.get("num_local_experts") or cfg.get("num_experts") or cfg["n_routed_experts"],
        top_k=cfg["num_experts_per_tok"],
        intermediate=cfg.get("moe_intermediate_size") or cfg["intermediate_size"],
        heads=cfg["num_attention_heads"],
        kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
    )
    log(f"building {out} ({cfg['model_type']}, {spec}, tokenizer {tok})")
    tmp = out.with_name(f".{out.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.perf_counter()
    make_checkpoint(tmp, cfg["model_type"], dtype="bfloat16", tokenizer=tok, max_shard_size="1GB", **spec)
    (tmp / ".complete").write_text(
        json.dumps({"from": str(config_dir), "tokenizer": str(tok), **spec}) + "\n"
    )
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    log(f"built {out} in {time.perf_counter() - t0:.0f} s")
    return out


class OneLineParser(argparse.ArgumentParser):
    """Its refusals in one line (no usage block), as the command line's are."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_extra(pairs: list[str], where: str = "--expertcache-args") -> dict:
    extra = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"engines_cpu: error: {where}: {pair!r} is not key=value")
        try:
            extra[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            extra[key] = value
    return extra


def prompt_ids(path: Path, n: int) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    ids = tok(PROMPT).input_ids
    if len(ids) < n:  # a long context: the text repeated, as a file that holds it several times
        ids = tok(PROMPT * -(-n // len(ids))).input_ids
    return ids[:n]


def gguf_files(model: Path, given: list[Path] | None) -> dict[str, Path]:
    files = given if given is not None else sorted(model.parent.glob(f"{model.name}-*.gguf"))
    prefix = f"{model.name}-"
    return {(f.stem[len(prefix) :] if f.stem.startswith(prefix) else f.stem): f for f in files}


# ------------------------------------------------------------------------------ report
def ms(x: float) -> str:
    return f"{x * 1e3:.1f}"


def table(results: dict) -> str:
    rows = [
        "| engine | TPOT ms median [range] | TTFT ms median [range] | TPOT / eager [95% CI] "
        "| decode CPU s/token | prefill CPU s | ready s | cold TTFT s | tokens = eager | same tokens as |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results["engines"].items():
        vs = r.get("tpot_vs_eager")
        ratio = "" if vs is None else f"{vs['median']:.2f} [{vs['ci95'][0]:.2f}-{vs['ci95'][1]:.2f}]"
        rows.append(
            f"| {name} | {r['tpot_ms']:.1f} [{r['tpot_ms_range'][0]:.1f}-{r['tpot_ms_range'][1]:.1f}] "
            f"| {r['ttft_ms']:.0f} [{r['ttft_ms_range'][0]:.0f}-{r['ttft_ms_range'][1]:.0f}] "
            f"| {ratio} "
            f"| {r['cpu_s_per_token']:.3f} | {r['cpu_prefill_s']:.2f} | {r['ready_s']:.1f} "
            f"| {r['cold_ttft_s']:.2f} | {r['tokens_equal_eager']} "
            f"| {', '.join(n.removeprefix('transformers ') for n in r['same_tokens_as']) or '-'} |"
        )
    return "\n".join(rows)


def main() -> int:
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="the HF checkpoint (random weights: see --build)")
    p.add_argument(
        "--build", type=Path, metavar="CONFIG_DIR", help="build --model from this config.json, then exit"
    )
    p.add_argument("--layers", type=int, help="--build: keep the first N layers")
    p.add_argument("--tokenizer", type=Path, help="--build: tokenizer folder (default: CONFIG_DIR)")
    p.add_argument("--gguf", type=Path, nargs="*", help="GGUF files for llama.cpp (default: <model>-*.gguf)")
    p.add_argument("--llama-python", help="a Python with llama_cpp (default: skip llama.cpp)")
    p.add_argument("--threads", type=int, default=2, help="torch and llama.cpp threads (default 2)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--warmup-tokens", type=int, default=4)
    p.add_argument("--expertcache", nargs="*", default=["100%:disk", "25%:disk"], metavar="MEMORY[:TIER]")
    p.add_argument(
        "--expertcache-args", nargs="*", default=[], metavar="KEY=VALUE", help="extra load() arguments"
    )
    p.add_argument(
        "--tf-separate", action="store_true", help="one from_pretrained per experts implementation"
    )
    p.add_argument("--only", nargs="*", metavar="SUBSTR", help="engines whose name contains one of these")
    p.add_argument(
        "--dtype",
        help="compute dtype of transformers and expertcache, e.g. float32 (default: the checkpoint's; "
        "llama.cpp runs its GGUF files as they are)",
    )
    p.add_argument(
        "--no-reference",
        action="store_true",
        help="no transformers at all (no eager reference: token checks and ratios are left out)",
    )
    p.add_argument(
        "--limit",
        metavar="SIZE",
        help="run inside a fresh memory cgroup of this size (e.g. 2.05GiB; no swap; root), the llama.cpp "
        "worker too: models larger than memory",
    )
    p.add_argument("--out", type=Path, help="JSON results (default: /tmp/engines_cpu.json)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker()
    if args.model is None:
        p.error("--model is required")
    if args.build:
        build_checkpoint(args.build, args.model, args.layers, args.tokenizer)
        return 0
    if args.rounds < 1 or args.new_tokens < 2 or args.prompt_tokens < 1 or args.threads < 1:
        p.error("--rounds, --prompt-tokens and --threads must be at least 1, --new-tokens at least 2")
    if not (args.model / "config.json").is_file():  # before anything loads (transformers' error is 70 lines)
        p.error(f"--model {args.model}: no checkpoint there (no config.json); --build CONFIG_DIR makes one")
    missing = [str(g) for g in args.gguf or () if not Path(g).is_file()]
    if missing:
        p.error(f"--gguf: no such file {missing[0]}")
    out = args.out or Path("/tmp/engines_cpu.json")
    cgroup = None
    if args.limit:  # before anything is loaded: this process and its llama.cpp worker in the group
        from memory_cpu import Cgroup

        from expertcache.units import parse_size

        limit = int(parse_size(args.limit, "--limit"))
        cgroup = Cgroup(limit)
        (cgroup.path / "cgroup.procs").write_text(str(os.getpid()))
        log(f"in memory cgroup {cgroup.path} ({limit} bytes, no swap)")
    extra = parse_extra(args.expertcache_args)
    for spec in args.expertcache:  # each spec's memory and tier checked before anything loads
        check_spec(spec, extra)
    if cgroup is not None:  # the files' pages charged to this group as it reads them, not to whoever did
        evicted = evict_inputs(args, extra)
        log(f"evicted {len(evicted)} files of the runs from the page cache")
    if args.dtype:
        extra.setdefault("dtype", args.dtype)

    import torch
    from plenty_cpu import ci95
    from provenance import provenance, write_json

    torch.set_num_threads(args.threads)
    started = provenance()  # the code that runs is the code at the start (others may commit meanwhile)
    want = (lambda name: any(s in name for s in args.only)) if args.only else (lambda name: True)
    ids = prompt_ids(args.model, args.prompt_tokens)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(args.model))
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    notes: list[str] = []
    engines: list[Engine] = []
    worker_proc, llama_info = None, None

    ggufs = {k: v for k, v in gguf_files(args.model, args.gguf).items() if want(f"llama.cpp {k}")}
    if not args.llama_python:
        notes.append("llama.cpp skipped: no --llama-python given")
    elif not ggufs:
        notes.append(f"llama.cpp skipped: no GGUF files ({args.model}-*.gguf or --gguf)")
    else:
        try:
            worker_proc = LlamaWorker(args.llama_python)
            llama_info = {
                "python": args.llama_python,
                "llama_cpp": worker_proc.hello["llama_cpp"],
                "system_info": worker_proc.hello["system_info"],
            }
        except (OSError, RuntimeError, json.JSONDecodeError) as exc:
            notes.append(f"llama.cpp skipped: the worker under {args.llama_python} did not start ({exc})")
            worker_proc = None
    try:
        if worker_proc is not None:
            for label, path in ggufs.items():
                log(f"loading llama.cpp {label} ({path})")
                engines.append(
                    LlamaEngine(worker_proc, label, path, args.threads, 2 * (len(ids) + args.new_tokens))
                )
        impls = [i for i in IMPLEMENTATIONS if want(f"transformers {i}") or i == "eager"]
        impls = [] if args.no_reference else impls
        shared = None
        if not args.tf_separate and impls:
            log("loading transformers (load_reference)")
            shared = SharedTransformers(args.model, args.dtype)
        for impl in impls:
            log(
                f"loading transformers {impl}"
                if args.tf_separate
                else f"transformers {impl}: the shared model"
            )
            engines.append(TransformersEngine(impl, args.model, pad, shared, args.dtype))
        for spec in args.expertcache:
            name = expertcache_spec(spec, extra)[3]
            if want(name):
                log(f"loading {name}")
                engines.append(ExpertcacheEngine(spec, args.model, pad, extra))
        if not engines:  # nothing selected, or nothing that started: what was skipped says why
            why = (
                "; ".join(
                    ([f"--only {' '.join(args.only)} matches no engine asked for"] if args.only else [])
                    + notes
                )
                or "no engine was asked for"
            )
            raise SystemExit(f"engines_cpu: error: no engine to run ({why})")
        cold = {}
        for e in engines:
            log(f"warm-up {e.name} (ready in {e.ready_s:.1f} s)")
            cold[e.name] = e.generate(ids, args.warmup_tokens)["ttft_s"]
        runs: dict[str, list[dict]] = {e.name: [] for e in engines}
        for r in range(args.rounds):
            k = r % len(engines)
            for e in engines[k:] + engines[:k]:
                run = e.generate(ids, args.new_tokens)
                run["load_avg_1m"] = os.getloadavg()[0]  # the machine may be shared: how busy it was
                runs[e.name].append(run)
            log(
                f"round {r + 1}/{args.rounds} (load average {os.getloadavg()[0]:.1f}): "
                + ", ".join(f"{e.name} {runs[e.name][-1]['tpot_s'] * 1e3:.1f}" for e in engines)
            )
    finally:
        for e in engines:
            e.close()
        if worker_proc is not None:
            worker_proc.close()

    ref = runs.get(EAGER)  # None: --no-reference
    results = {
        "provenance": started,
        "git_at_end": provenance()["git"],
        "settings": {
            **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "out": str(out),
        },
        "method": (
            "one process (llama.cpp in a worker process driven by it); every engine loaded, warmed by one "
            f"{args.warmup_tokens}-token generation, then {args.rounds} rounds of one greedy generation "
            "each, the order rotating; TTFT = start to first new token, TPOT = mean gap between later tokens "
            "(llama.cpp: tokens stamped as Llama.generate yields them; its perf counters under llama_perf), "
            "CPU = process_time of the engine's process from first to last new token / (tokens - 1)"
        ),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "llama": llama_info,
        "prompt_ids": ids,
        "eager_tokens": ref[0]["tokens"] if ref else None,
        "eager_distinct_tokens": len(set(ref[0]["tokens"])) if ref else None,
        "memory_limit_bytes": None if cgroup is None else limit,
        "notes": notes + ["the machine is shared: other work runs at the same time, so timings are noisy"],
        "engines": {},
    }
    for e in engines:
        rs = runs[e.name]
        tpot, ttft = [x["tpot_s"] for x in rs], [x["ttft_s"] for x in rs]
        row = {
            "ready_s": round(e.ready_s, 3),
            "cold_ttft_s": round(cold[e.name], 3),
            "tpot_ms": round(statistics.median(tpot) * 1e3, 2),
            "tpot_ms_range": [round(min(tpot) * 1e3, 2), round(max(tpot) * 1e3, 2)],
            "ttft_ms": round(statistics.median(ttft) * 1e3, 2),
            "ttft_ms_range": [round(min(ttft) * 1e3, 2), round(max(ttft) * 1e3, 2)],
            "cpu_s_per_token": round(statistics.median(x["cpu_per_token_s"] for x in rs), 4),
            "cpu_prefill_s": round(statistics.median(x["cpu_prefill_s"] for x in rs), 3),
            "tokens_per_s": round(args.new_tokens / statistics.median(x["total_s"] for x in rs), 2),
            "tokens_equal_eager": all(x["tokens"] == ref[0]["tokens"] for x in rs) if ref else None,
            "tokens_same_every_round": all(x["tokens"] == rs[0]["tokens"] for x in rs),
            "same_tokens_as": [
                t.name
                for t in engines
                if t.name.startswith("transformers ")
                and t.name != e.name
                and all(a["tokens"] == b["tokens"] for a, b in zip(rs, runs[t.name], strict=True))
            ],
            "tokens": rs[0]["tokens"],
            "tpot_runs_ms": [round(t * 1e3, 2) for t in tpot],
            "ttft_runs_ms": [round(t * 1e3, 2) for t in ttft],
            "load_avg_1m_runs": [round(x["load_avg_1m"], 2) for x in rs],
            "info": e.info,
        }
        twin = getattr(e, "twin", None)
        if twin is not None:
            row["kernel_twin"] = twin
            row["tokens_equal_kernel_twin"] = twin in row["same_tokens_as"] if twin in runs else None
        if cgroup is not None:
            row["cgroup_peak_bytes"] = cgroup.peak()  # the whole process's, every engine of this run
        if e.name != EAGER and ref:
            for what in ("tpot", "ttft"):
                ratios = [a[f"{what}_s"] / b[f"{what}_s"] for a, b in zip(rs, ref, strict=True)]
                lo, hi = ci95(ratios)
                row[f"{what}_vs_eager"] = {
                    "median": round(statistics.median(ratios), 3),
                    "ci95": [round(lo, 3), round(hi, 3)],
                }
        q8 = runs.get("llama.cpp q8_0")
        if q8 is not None and e.name != "llama.cpp q8_0":  # the yardstick, round by round
            ratios = [a["tpot_s"] / b["tpot_s"] for a, b in zip(rs, q8, strict=True)]
            row["tpot_vs_q8_0"] = {
                "median": round(statistics.median(ratios), 3),
                "range": [round(min(ratios), 3), round(max(ratios), 3)],
                "runs": [round(x, 3) for x in ratios],
            }
        if "llama_perf" in rs[0]:
            row["llama_perf"] = {
                "prefill_ms": round(statistics.median(x["llama_perf"]["prefill_ms"] for x in rs), 2),
                "decode_ms_per_token": round(
                    statistics.median(x["llama_perf"]["decode_ms_per_token"] for x in rs), 3
                ),
                "runs": [x["llama_perf"] for x in rs],
            }
        if "cache" in rs[0]:
            row["cache_per_generation"] = rs[-1]["cache"]
        results["engines"][e.name] = row
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, results)
    if cgroup is not None:  # back to the root group (the worker has exited), then the group goes
        (cgroup.path.parent / "cgroup.procs").write_text(str(os.getpid()))
        cgroup.remove()
    print(table(results))
    for key, title, show in (
        ("llama_perf", "llama.cpp's own perf counters (medians)",
         lambda n, v: f"{n}: prefill {v['prefill_ms']:.0f} ms, decode {v['decode_ms_per_token']:.1f} "
                      "ms/token"),
        ("tpot_vs_q8_0", "TPOT / llama.cpp q8_0's in the same round, median [range]",
         lambda n, v: f"{n} {v['median']:.2f}x [{v['range'][0]:.2f}-{v['range'][1]:.2f}]"),
    ):  # fmt: skip
        rows = [show(n, v) for n, r in results["engines"].items() if (v := r.get(key))]
        if rows:
            print(f"\n{title}: " + "; ".join(rows))
    if ref:
        print(
            f"\nTransformers eager's greedy tokens: {results['eager_distinct_tokens']} distinct of "
            f"{len(results['eager_tokens'])} (random weights: a low count makes 'tokens = eager' a weak "
            "check)"
        )
    for note in results["notes"]:
        print(f"\nNote: {note}")
    log(f"wrote {out}")
    return 0


def run() -> int:
    """``main`` with the library's errors (a bad spec, a checkpoint that is not there, a size without its
    unit) as one line and exit 2, as the command line gives them."""
    try:
        from expertcache.errors import ExpertcacheError
    except ImportError:  # the llama.cpp worker, in llama-cpp-python's own environment
        return main()
    try:
        return main()
    except ExpertcacheError as e:
        print(f"engines_cpu: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # the script's own refusals (a message, not a status)
        if not isinstance(e.code, str):
            raise
        print(e.code, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(run())
