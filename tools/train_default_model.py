#!/usr/bin/env python
"""Train expertcache's embedded default model: a tiny Mixtral-family MoE language model.

The corpus is the Python standard library's own ``.py`` sources (PSF licence) of the interpreter
running this script, so it needs no network access.  Everything (corpus order, validation split,
tokenizer, initialisation, batches) is derived from ``--seed`` and sorted file paths; the only
machine-dependent quantity is how many optimiser steps fit in ``--minutes`` (use ``--steps`` to pin it).

    python tools/train_default_model.py --minutes 30 --out src/expertcache/data/default

Writes into ``--out``: model.safetensors, config.json, generation_config.json, tokenizer files and
training.json (corpus, hyper-parameters, machine, metrics, samples).
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import hashlib
import json
import math
import os
import platform
import sys
import sysconfig
import time
from pathlib import Path

SPECIAL = "<|endoftext|>"
SAMPLE_PROMPTS = ["def ", "import os\n", "class Queue:"]
EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="src/expertcache/data/default", help="output directory")
    p.add_argument("--minutes", type=float, default=30.0, help="wall-clock training budget (minutes)")
    p.add_argument("--steps", type=int, default=0, help="fixed number of optimiser steps (0: use --minutes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch / tokenizers threads")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="final lr as a fraction of the peak")
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--aux-coef", type=float, default=0.1, help="load-balancing loss coefficient")
    p.add_argument(
        "--balance",
        choices=["per-layer", "pooled"],
        default="per-layer",
        help="per-layer: the Switch/Mixtral balancing loss computed for each layer and averaged; pooled: the "
        "loss MixtralForCausalLM adds itself, which pools all layers' tokens, so expert i of one layer and "
        "expert i of another count as one expert and per-layer imbalance goes unpunished",
    )
    p.add_argument("--val-percent", type=float, default=3.0, help="share of files held out for validation")
    p.add_argument("--eval-windows", type=int, default=200)
    p.add_argument("--log-every", type=int, default=50)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------------- corpus
def stdlib_files() -> tuple[Path, list[Path]]:
    root = Path(sysconfig.get_paths()["stdlib"]).resolve()
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        parts = set(rel.parts[:-1])
        if parts & EXCLUDED_DIRS:
            continue
        if rel.as_posix().startswith("lib2to3/tests/"):
            continue
        if path.is_file():
            files.append(path)
    files.sort(key=lambda p: p.relative_to(root).as_posix())
    return root, files


def is_validation(rel: str, percent: float) -> bool:
    h = int.from_bytes(hashlib.sha256(rel.encode("utf-8")).digest()[:8], "big")
    return (h % 10_000) < percent * 100


def build_corpus(val_percent: float):
    root, files = stdlib_files()
    train, val, skipped = [], [], []
    for path in files:
        rel = path.relative_to(root).as_posix()
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            skipped.append(rel)
            continue
        if not text.strip():
            continue  # empty __init__.py files and the like
        (val if is_validation(rel, val_percent) else train).append((rel, text))
    return root, train, val, skipped


# -------------------------------------------------------------------------------------------- tokenizer
def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[SPECIAL],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    eot = tok.token_to_id(SPECIAL)
    # a prompt starts like a document in the training stream: right after <|endoftext|>
    tok.post_processor = processors.TemplateProcessing(
        single=f"{SPECIAL} $A", pair=f"{SPECIAL} $A {SPECIAL} $B:1", special_tokens=[(SPECIAL, eot)]
    )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=SPECIAL,
        eos_token=SPECIAL,
        pad_token=SPECIAL,
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )
    return tok, hf, eot


def token_stream(tok, texts: list[str], eot: int):
    """Documents joined (and preceded) by <|endoftext|>: [eot] doc0 [eot] doc1 ... [eot]."""
    import torch

    ids = [eot]
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.long)


# ---------------------------------------------------------------------------------------------- model
def make_config(vocab_size: int, eot: int, aux_coef: float):
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=vocab_size,
        hidden_size=160,
        intermediate_size=96,
        num_hidden_layers=6,
        num_attention_heads=5,
        num_key_value_heads=1,
        head_dim=32,
        num_local_experts=16,
        num_experts_per_tok=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        router_aux_loss_coef=aux_coef,
        output_router_logits=True,
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
        dtype="float32",
    )


def eval_windows(stream, n: int, seq_len: int):
    """n evenly spaced windows of seq_len tokens (deterministic); overlapping only if the stream is short."""
    import torch

    last = len(stream) - seq_len
    starts = torch.linspace(0, last, n).round().long()
    return torch.stack([stream[s : s + seq_len] for s in starts.tolist()])


def evaluate(model, windows, batch_size: int = 20) -> dict:
    """LM-only cross-entropy (nats/token) and routing statistics on fixed windows."""
    import torch

    num_layers = model.config.num_hidden_layers
    num_experts = model.config.num_local_experts
    top_k = model.config.num_experts_per_tok
    counts = torch.zeros(num_layers, num_experts, dtype=torch.float64)
    tok_entropy = torch.zeros(num_layers, dtype=torch.float64)
    nll_sum, n_tok, n_rows = 0.0, 0, 0
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for i in range(0, len(windows), batch_size):
            x = windows[i : i + batch_size]
            out = model(input_ids=x, output_router_logits=True, use_cache=False)
            logits = out.logits[:, :-1].float()
            nll = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1), reduction="sum"
            )
            nll_sum += nll.item()
            n_tok += x[:, 1:].numel()
            for layer, rl in enumerate(out.router_logits):
                rl = rl.reshape(-1, num_experts).float()
                probs = rl.softmax(-1)
                top = rl.topk(top_k, dim=-1).indices.reshape(-1)
                counts[layer] += torch.bincount(top, minlength=num_experts).double()
                tok_entropy[layer] += (-(probs * probs.clamp_min(1e-12).log2()).sum(-1)).double().sum()
            n_rows += x.numel()
    model.train(was_training)
    usage = counts / counts.sum(-1, keepdim=True)
    usage_entropy = -(usage * usage.clamp_min(1e-12).log2()).sum(-1)
    loss = nll_sum / n_tok
    return {
        "loss": loss,
        "perplexity": math.exp(loss),
        "tokens": n_tok,
        "windows": len(windows),
        "expert_usage_entropy_bits": [round(v, 4) for v in usage_entropy.tolist()],
        "router_token_entropy_bits": [round(v, 4) for v in (tok_entropy / n_rows).tolist()],
        "expert_usage_share": [[round(v, 4) for v in row] for row in usage.tolist()],
    }


def per_layer_balancing_loss(router_logits, num_experts: int, top_k: int):
    """Mean over layers of the Switch/Mixtral balancing loss E * sum_k,i f_ki * P_i of each layer
    (f: share of tokens whose k-th choice is expert i; P: mean router probability). Minimum: top_k."""
    import torch

    losses = []
    for rl in router_logits:
        probs = rl.reshape(-1, num_experts).float().softmax(-1)
        top = probs.topk(top_k, dim=-1).indices
        f = torch.nn.functional.one_hot(top, num_experts).float().mean(0)  # (top_k, E)
        losses.append(num_experts * (f * probs.mean(0)).sum())
    return torch.stack(losses).mean()


def batch_usage_entropy(router_logits, num_experts: int, top_k: int) -> list[float]:
    """Entropy (bits) of each layer's top-k expert-selection histogram over one batch."""
    import torch

    result = []
    with torch.no_grad():
        for rl in router_logits:
            top = rl.reshape(-1, num_experts).topk(top_k, dim=-1).indices.reshape(-1)
            share = torch.bincount(top, minlength=num_experts).double()
            share /= share.sum()
            result.append(float(-(share * share.clamp_min(1e-12).log2()).sum()))
    return result


def lr_at(step: int, progress: float, args) -> float:
    """Linear warmup over --warmup-steps, then cosine decay to min_lr_ratio*lr as progress goes 0 -> 1."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    cos = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return args.lr * (args.min_lr_ratio + (1.0 - args.min_lr_ratio) * cos)


def generate_samples(model, hf_tok, max_new_tokens: int = 60) -> list[dict]:
    import torch

    model.eval()
    samples = []
    with torch.no_grad():
        for prompt in SAMPLE_PROMPTS:
            enc = hf_tok(prompt, return_tensors="pt")
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
            completion = hf_tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=False)
            samples.append({"prompt": prompt, "completion": completion})
    return samples


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# ----------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("RAYON_NUM_THREADS", str(args.threads))  # tokenizers' thread pool
    # Must precede `import torch`: with the default (spinning) OpenMP wait policy a step can take 10-20x
    # longer whenever another process competes for the cores; PASSIVE degrades gracefully instead.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")

    import tokenizers
    import torch
    import transformers
    from transformers import GenerationConfig, MixtralForCausalLM

    torch.set_num_threads(args.threads)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.time()

    # corpus + tokenizer
    root, train_docs, val_docs, skipped = build_corpus(args.val_percent)
    print(
        f"corpus: {root}: {len(train_docs)} train files, {len(val_docs)} validation files, "
        f"{len(skipped)} skipped (not UTF-8)",
        flush=True,
    )
    t0 = time.time()
    tok, hf_tok, eot = train_tokenizer([t for _, t in train_docs], vocab_size=4096)
    train_ids = token_stream(tok, [t for _, t in train_docs], eot)
    val_ids = token_stream(tok, [t for _, t in val_docs], eot)
    print(
        f"tokenizer: vocab {tok.get_vocab_size()} trained in {time.time() - t0:.1f}s; "
        f"{len(train_ids):,} train tokens, {len(val_ids):,} validation tokens",
        flush=True,
    )
    hf_tok.save_pretrained(out_dir)

    # model
    torch.manual_seed(args.seed)
    config = make_config(tok.get_vocab_size(), eot, args.aux_coef)
    model = MixtralForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    expert_params = 3 * config.hidden_size * config.intermediate_size
    print(
        f"model: {n_params:,} parameters; {expert_params:,} per expert "
        f"({expert_params * 4:,} bytes fp32); experts impl {model.config._experts_implementation}",
        flush=True,
    )

    val_windows = eval_windows(val_ids, args.eval_windows, args.seq_len)
    t0 = time.time()
    init_eval = evaluate(model, val_windows)
    print(
        f"untrained init: val loss {init_eval['loss']:.4f} ppl {init_eval['perplexity']:.1f} "
        f"({time.time() - t0:.1f}s)",
        flush=True,
    )

    # training
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "norm" in name else decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    gen = torch.Generator().manual_seed(args.seed)
    budget_s = args.minutes * 60.0
    max_start = len(train_ids) - args.seq_len - 1
    model.train()
    step, tokens_seen = 0, 0
    ema_loss = ema_lm = ema_aux = None
    recent_lm = collections.deque(maxlen=50)  # raw LM losses of the last 50 steps
    log = []
    t_train = time.time()
    while True:
        elapsed = time.time() - t_train
        if args.steps:
            if step >= args.steps:
                break
            progress = step / args.steps
        else:
            if elapsed >= budget_s:
                break
            progress = elapsed / budget_s
        lr = lr_at(step, progress, args)
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, max_start, (args.batch_size,), generator=gen)
        x = torch.stack([train_ids[s : s + args.seq_len] for s in starts.tolist()])
        if args.balance == "pooled":
            out = model(input_ids=x, labels=x, output_router_logits=True, use_cache=False)
            loss = out.loss  # LM loss + router_aux_loss_coef * (pooled) load-balancing loss
            aux_t = out.aux_loss
        else:
            out = model(input_ids=x, output_router_logits=True, use_cache=False)
            lm_t = torch.nn.functional.cross_entropy(
                out.logits[:, :-1].reshape(-1, config.vocab_size).float(), x[:, 1:].reshape(-1)
            )
            aux_t = per_layer_balancing_loss(
                out.router_logits, config.num_local_experts, config.num_experts_per_tok
            )
            loss = lm_t + config.router_aux_loss_coef * aux_t
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        step += 1
        tokens_seen += x.numel()
        aux = aux_t.item()
        lm = loss.item() - config.router_aux_loss_coef * aux
        recent_lm.append(lm)
        a = 0.98 if ema_loss is not None else 0.0
        ema_loss = a * (ema_loss or 0.0) + (1 - a) * loss.item()
        ema_lm = a * (ema_lm or 0.0) + (1 - a) * lm
        ema_aux = a * (ema_aux or 0.0) + (1 - a) * aux
        if step % args.log_every == 0 or step == 1:
            el = time.time() - t_train
            batch_h = batch_usage_entropy(
                out.router_logits, config.num_local_experts, config.num_experts_per_tok
            )
            row = {
                "step": step,
                "elapsed_s": round(el, 1),
                "lr": lr,
                "lm_loss": round(ema_lm, 4),
                "aux_loss": round(ema_aux, 4),
                "grad_norm": round(float(grad_norm), 3),
                "batch_usage_entropy_bits": [round(h, 3) for h in batch_h],
            }
            log.append(row)
            print(
                f"step {step:5d} | {el / 60:5.1f} min | lr {lr:.2e} | lm {ema_lm:.4f} | aux {ema_aux:.4f} "
                f"| gnorm {float(grad_norm):.2f} | usage H min {min(batch_h):.2f} "
                f"mean {sum(batch_h) / len(batch_h):.2f} bits | {tokens_seen / el:,.0f} tok/s",
                flush=True,
            )
    train_s = time.time() - t_train
    print(f"trained {step} steps, {tokens_seen:,} tokens in {train_s / 60:.1f} min", flush=True)

    # evaluation
    t0 = time.time()
    final_eval = evaluate(model, val_windows)
    print(
        f"trained: val loss {final_eval['loss']:.4f} ppl {final_eval['perplexity']:.2f} "
        f"(init {init_eval['loss']:.4f} / {init_eval['perplexity']:.1f}) ({time.time() - t0:.1f}s)",
        flush=True,
    )
    print(
        "expert-usage entropy per layer (bits, max 4):", final_eval["expert_usage_entropy_bits"], flush=True
    )
    print("per-token router entropy per layer (bits):  ", final_eval["router_token_entropy_bits"], flush=True)

    # save
    model.config.output_router_logits = False
    model.generation_config = GenerationConfig(
        do_sample=False, num_beams=1, max_new_tokens=60, bos_token_id=eot, eos_token_id=eot, pad_token_id=eot
    )
    model.save_pretrained(out_dir, safe_serialization=True)
    mask = os.umask(0)  # safetensors writes its file for the owner alone: give it what open() would
    os.umask(mask)
    os.chmod(os.path.join(out_dir, "model.safetensors"), 0o666 & ~mask)

    samples = generate_samples(model, hf_tok)
    for s in samples:
        print(f"--- sample {s['prompt']!r}\n{s['prompt']}{s['completion']}", flush=True)

    def tok_count(ids):
        return int(len(ids))

    report = {
        "model": {
            "family": "mixtral",
            "class": "MixtralForCausalLM",
            "parameters": n_params,
            "parameters_per_expert": expert_params,
            "bytes_per_expert_fp32": expert_params * 4,
            "dtype": "float32",
            "config": {
                k: getattr(config, k)
                for k in (
                    "vocab_size",
                    "hidden_size",
                    "intermediate_size",
                    "num_hidden_layers",
                    "num_attention_heads",
                    "num_key_value_heads",
                    "head_dim",
                    "num_local_experts",
                    "num_experts_per_tok",
                    "max_position_embeddings",
                    "tie_word_embeddings",
                    "router_aux_loss_coef",
                )
            },
        },
        "corpus": {
            "description": "Python standard library .py sources (PSF licence) of the interpreter that ran "
            "the script; excludes site-packages, test/tests/idle_test dirs and lib2to3/tests",
            "licence": "PSF-2.0 (Python Software Foundation License)",
            "python_version": platform.python_version(),
            "stdlib_path": str(root),
            "validation_rule": f"sha256(relative path) first 8 bytes mod 10000 < {args.val_percent * 100:g}",
            "files_skipped_not_utf8": skipped,
            "train": {
                "files": len(train_docs),
                "bytes": sum(len(t.encode()) for _, t in train_docs),
                "tokens": tok_count(train_ids),
            },
            "validation": {
                "files": len(val_docs),
                "bytes": sum(len(t.encode()) for _, t in val_docs),
                "tokens": tok_count(val_ids),
                "file_list": [r for r, _ in val_docs],
            },
        },
        "tokenizer": {
            "type": "byte-level BPE (tokenizers)",
            "vocab_size": tok.get_vocab_size(),
            "special_token": SPECIAL,
            "special_token_id": eot,
            "note": "the tokenizer prepends <|endoftext|> (bos) when add_special_tokens=True",
        },
        "hyperparameters": {k: v for k, v in vars(args).items() if k != "out"}
        | {
            "optimizer": "AdamW",
            "betas": [0.9, 0.95],
            "eps": 1e-8,
            "schedule": "linear warmup, then cosine to min_lr_ratio*lr over the wall-clock budget"
            if not args.steps
            else "linear warmup, then cosine to min_lr_ratio*lr over --steps",
            "weight_decay_on": "matrices only (not norms)",
            "output_router_logits_during_training": True,
            "balancing_loss": "mean over layers of each layer's Switch/Mixtral loss"
            if args.balance == "per-layer"
            else "MixtralForCausalLM's built-in loss (pools all layers)",
        },
        "training": {
            "steps": step,
            "tokens_seen": tokens_seen,
            "train_wall_clock_s": round(train_s, 1),
            "final_train_lm_loss_last50_mean": round(sum(recent_lm) / len(recent_lm), 4),
            "final_train_lm_loss_ema": round(ema_lm, 4),
            "final_train_aux_loss_ema": round(ema_aux, 4),
            "final_train_total_loss_ema": round(ema_loss, 4),
            "log": log,
        },
        "evaluation": {
            "windows": args.eval_windows,
            "seq_len": args.seq_len,
            "loss_note": "mean next-token cross-entropy in nats/token, LM loss only (no aux)",
            "trained": final_eval,
            "untrained_init": init_eval,
        },
        "samples": {
            "decoding": "greedy, max_new_tokens=60, prompt preceded by <|endoftext|>",
            "items": samples,
        },
        "machine": {
            "cpu": cpu_model(),
            "logical_cpus": os.cpu_count(),
            "torch_threads": args.threads,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "platform": platform.platform(),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "total_wall_clock_s": None,
        "out_dir_bytes": None,
    }
    path = out_dir / "training.json"
    # training.json counts itself: rewrite until its own size no longer changes the total
    for _ in range(5):
        report["total_wall_clock_s"] = round(time.time() - t_start, 1)
        path.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
        size = dir_size(out_dir)
        if report["out_dir_bytes"] == size:
            break
        report["out_dir_bytes"] = size
    print(
        f"wrote {out_dir} ({report['out_dir_bytes']:,} bytes) in {report['total_wall_clock_s'] / 60:.1f} min",
        flush=True,
    )
    if report["out_dir_bytes"] > 25_000_000:
        print("WARNING: out dir exceeds 25,000,000 bytes", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
