#!/usr/bin/env bash
# The GPU checks the issues ask for, in parts, each under its own time limit, for a machine lent for a few
# minutes (an H100 or H200 with a 64 GB disk): `bench/gpu_checks.sh OUT PART...`, parts in the order given:
#
#   tests   the tests of the paths with GPU code (EXPERTCACHE_TEST_DEVICE=cuda), 5 minutes at most
#   tiers   issue 32: Mixtral-8x7B's experts (8 layers, 22.5 GiB) over a 16 GiB host level and 8 GiB of
#           slots, exclusive and two tiers, against transformers; 7 minutes at most, the checkpoint too
#   serve   issue 31: `serve` on Qwen1.5-MoE's shapes (random weights, the embedded model's tokenizer and
#           vocabulary; SERVE_LAYERS of its 24 layers, default 8) at 100 % and 25 % (LRU/fetch,
#           TLFU/batch), 16 and 64 clients, a run of its own each; 4-6 minutes with the checkpoint
#           (SERVE_DURATION, SERVE_SINGLE, SERVE_WARM: seconds of load, of one client, of warm-up)
#   kernels issue 30: one expert's kernel, transfer and miss per packed format on Mixtral's shapes, 2 minutes
#   hobbit  issue 30: hobbit against fetch at 25 % on 4 of Mixtral-8x7B's layers with top-2 gate weights
#           drawn as HOBBIT reports Mixtral's (a random router's even split sends nothing to low
#           precision); 5 minutes at most, the checkpoint and the int4 copies too
#   attention issue 31: the server on the serve part's checkpoint at 100 % and at 25 % (TLFU/batch), with
#           --attention sdpa_no_cudnn (16 and 64 clients) and sdpa (16 clients: cuDNN's planning makes it
#           too slow for 64 in the time), a cold JIT cache each (as on a machine just started); 6.5 minutes
#           with the checkpoint on an H200, 10 at most. Decode attention's cost per new key length alone
#           is bench/attention_gpu.py's (all six backend sets measured on an H200 on 2026-11-27)
#   grouped issues 31 and 30: why the grouped kernel is not bit-exact on a GPU, one difference at a time,
#           and one layer's experts at 1-256 tokens grouped against one at a time (bench/grouped_gpu.py),
#           then the same at the tests' tiny shapes in float32 and bfloat16; then the attention part's
#           servers with --kernel grouped (sdpa_no_cudnn); 3.5 minutes on an H200, 9.5 at most
#
#   selftest  `expertcache selftest --device cuda`: 568 checks, every family in bfloat16 too, the default
#           attention on a GPU (sdpa_no_cudnn) and transformers' own sdpa; 5 minutes at most
#   exact-grouped  the engine's exactness tests with the grouped kernel against transformers' grouped_mm
#           on the GPU (EXPERTCACHE_TEST_KERNEL=grouped), stopping at the first failure, with the failure's
#           figures, then bench/grouped_exact_gpu.py (each engine kernel against each of transformers'
#           implementations, whole tiny models at three budgets); 5 minutes at most
#
# Results (JSON and logs) go to OUT. Needs python3 with torch, transformers and expertcache importable (an
# install of this repository, or PYTHONPATH=src:bench; `serve` also needs fastapi, uvicorn, sse-starlette
# and their dependencies, which the lent machines' image lacked on 2026-11-26: carry them as wheels). The
# checkpoints are written to $TMPDIR (or /tmp) and the Mixtral one is removed before the Qwen one is
# written (both do not fit a 64 GB disk at once). Files under OUT are named without '%' (the device tool
# returns only names of letters, digits, '.', '_' and '-').
set -uo pipefail
HERE=$(cd "$(dirname "$0")/.." && pwd)
PARTS="tests tiers serve kernels hobbit attention grouped selftest exact-grouped"
if [ "$#" -lt 2 ]; then
  echo "usage: bench/gpu_checks.sh OUT PART... (parts: $PARTS)" >&2
  exit 2
fi
for part in "${@:2}"; do  # every part known before any runs, or OUT made
  case " $PARTS " in *" $part "*) ;; *) echo "bench/gpu_checks.sh: unknown part $part ($PARTS)" >&2; exit 2;; esac
done
OUT=$(mkdir -p "$1" 2>/dev/null && cd "$1" && pwd) || { echo "bench/gpu_checks.sh: cannot write to $1" >&2; exit 2; }
shift
cd "$HERE" || exit 2
CACHE=${TMPDIR:-/tmp}/expertcache-gpu
mkdir -p "$CACHE" || exit 2
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/src:$PWD/bench
stamp() { echo "[$(date +%H:%M:%S)] $*"; }
qwen_checkpoint() {  # sets $model: Qwen1.5-MoE's shapes, SERVE_LAYERS layers, the tokenizer's vocabulary
  rm -rf "$CACHE"/mixtral-8x7b-*
  layers=${SERVE_LAYERS:-8}
  timeout 120 python3 bench/engine_gpu.py --build-only --layers "$layers" --cache-dir "$CACHE" \
    --tokenizer src/expertcache/data/default >"$OUT/serve_build.log" 2>&1 \
    || { stamp "the Qwen checkpoint failed"; tail -5 "$OUT/serve_build.log"; return 1; }
  model=$(ls -d "$CACHE"/qwen15-moe-a2.7b-l"$layers"-v*-bfloat16)
}

for part in "$@"; do
  case "$part" in
    tests)
      stamp "tests"
      EXPERTCACHE_TEST_DEVICE=cuda timeout 300 python3 -m pytest -rs -n 8 -p no:cacheprovider \
        tests/test_tiers.py tests/test_dense.py tests/test_packed.py tests/test_published.py tests/test_engine.py \
        >"$OUT/tests.log" 2>&1
      stamp "tests rc $?"
      grep -E "^(FAILED|ERROR)|[0-9]+ (passed|failed)" "$OUT/tests.log" | tail -20
      ;;
    tiers)
      stamp "tiers"
      timeout 420 python3 bench/engine_gpu.py --shape mixtral-8x7b --layers 8 --cache-dir "$CACHE" \
        --new-tokens 32 --budgets 8GiB --policies lru --host-memory 16GiB none --host-levels exclusive \
        --references eager --out "$OUT/engine_gpu_mixtral8_tiers.json" 2>&1 | grep -v "Loading weights" \
        | tee "$OUT/tiers.log" | tail -12
      stamp "tiers rc $?"
      ;;
    serve)
      stamp "serve"
      qwen_checkpoint || continue
      for cell in 100% 25%:lru:fetch 25%:tlfu:batch; do  # a run each: what ran is kept if time runs out
        name=$(printf %s "$cell" | tr -c 'a-z0-9' '_')
        timeout 150 python3 bench/serve_load.py --device cuda --model "$model" --compare "$cell" \
          --clients 16,64 --duration "${SERVE_DURATION:-15}" --single "${SERVE_SINGLE:-10}" --rounds 1 \
          --warm "${SERVE_WARM:-5}" --tokens 16-48 \
          --out "$OUT/serve_gpu_$name.json" >"$OUT/serve_$name.log" 2>&1
        stamp "serve $cell rc $?"
      done
      ;;
    kernels)
      stamp "kernels"
      timeout 120 python3 bench/packed_gpu.py --shape mixtral-8x7b --formats int8 int4 mxfp4 fp8 --no-sweep \
        --reps 20 --out "$OUT/packed_gpu_mixtral.json" 2>&1 | tail -8
      stamp "kernels rc $?"
      ;;
    hobbit)
      stamp "hobbit"
      timeout 300 python3 bench/engine_gpu.py --shape mixtral-8x7b --layers 4 --cache-dir "$CACHE" \
        --new-tokens 32 --budgets 25 --policies lru --miss fetch hobbit hobbit:low_share=0.1 \
        --gate-weights hobbit --no-reference --out "$OUT/engine_gpu_mixtral4_hobbit_weights.json" 2>&1 \
        | grep -v "Loading weights" | tee "$OUT/hobbit.log" | tail -8
      stamp "hobbit rc $?"
      ;;
    attention)
      stamp "attention"
      qwen_checkpoint || continue
      for cell in 100% 25%:tlfu:batch; do
        for att in sdpa_no_cudnn sdpa; do  # one log for all four: the device tool returns 8 files a run
          name=$(printf %s "${cell}_$att" | tr -c 'a-z0-9_' '_')
          clients=16,64; [ "$att" = sdpa ] && clients=16
          CUDA_CACHE_DISABLE=1 timeout 120 python3 bench/serve_load.py --device cuda --model "$model" \
            --compare "$cell" --attention "$att" --clients "$clients" --duration 10 --single 6 --rounds 1 \
            --warm 3 --tokens 16-48 --out "$OUT/serve_gpu_attention_$name.json" >"$CACHE/run.log" 2>&1
          stamp "serve $cell attention $att rc $?"
          grep -E "^  (1 client|16 clients|64 clients):" "$CACHE/run.log" | cut -c1-220
          cat "$CACHE/run.log" >>"$OUT/serve_attention.log"
        done
      done
      ;;
    grouped)
      stamp "grouped"
      timeout 90 python3 bench/grouped_gpu.py --out "$OUT/grouped_gpu.json" 2>&1 | tee "$OUT/grouped.log"
      for dtype in float32 bfloat16; do  # the tests' tiny models' shapes, where the H100's tests differed
        timeout 60 python3 bench/grouped_gpu.py --experts 8 --top-k 2 --hidden 32 --intermediate 32 \
          --tokens 1,7,16 --dtype "$dtype" --out "$OUT/grouped_gpu_tiny_$dtype.json" 2>&1 | tee -a "$OUT/grouped.log"
      done
      qwen_checkpoint || continue
      for cell in 100% 25%:tlfu:batch; do
        name=$(printf %s "$cell" | tr -c 'a-z0-9_' '_')
        CUDA_CACHE_DISABLE=1 timeout 120 python3 bench/serve_load.py --device cuda --model "$model" \
          --compare "$cell" --attention sdpa_no_cudnn --kernel grouped --clients 16,64 --duration 10 \
          --single 6 --rounds 1 --warm 3 --tokens 16-48 --out "$OUT/serve_gpu_grouped_$name.json" \
          >"$CACHE/run.log" 2>&1
        stamp "serve $cell grouped rc $?"
        grep -E "^  (1 client|16 clients|64 clients):" "$CACHE/run.log" | cut -c1-220
        cat "$CACHE/run.log" >>"$OUT/serve_grouped.log"
      done
      ;;
    selftest)
      stamp "selftest"
      timeout 300 python3 -m expertcache.cli selftest --device cuda >"$OUT/selftest.log" 2>&1
      stamp "selftest rc $?"
      grep -v -E "^PASS " "$OUT/selftest.log" | tail -25
      ;;
    exact-grouped)
      stamp "exact-grouped"
      EXPERTCACHE_TEST_DEVICE=cuda EXPERTCACHE_TEST_KERNEL=grouped timeout 180 python3 -m pytest -x -n 0 \
        -p no:cacheprovider tests/test_engine.py -k "exact or equal" >"$OUT/exact_grouped.log" 2>&1
      stamp "exact-grouped rc $?"
      grep -E "^(FAILED|ERROR|E )|[0-9]+ (passed|failed)" "$OUT/exact_grouped.log" | head -30
      # which of transformers' implementations each engine kernel equals, model against model
      timeout 120 python3 bench/grouped_exact_gpu.py --out "$OUT/grouped_exact_gpu.json" 2>&1 \
        | grep -v -E "^(Loading|Writing)" | tee "$OUT/grouped_exact.log"
      ;;
  esac
done
