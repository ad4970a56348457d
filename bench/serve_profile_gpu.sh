#!/usr/bin/env bash
# Where the server's time goes on a GPU: `bench/serve_profile_gpu.sh OUT [MEMORY...]` (default 100 25).
# For each expert memory (a share, without '%'), a server on Qwen1.5-MoE's shapes (SERVE_LAYERS of its 24
# layers, default 8; random weights, the embedded tokenizer's vocabulary; pinned host memory) takes
# closed-loop clients that send non-streaming 40-token completions, one client then 16, 13 s each, while
# py-spy samples the server's threads for 9 s at 250 Hz (raw collapsed stacks, one file per run). Then
# the server's /metrics. Needs py-spy (pip install py-spy; on a lent machine carry its wheel) as
# $PY_SPY or on PATH, and what bench/gpu_checks.sh's serve part needs. The device tool returns 8 files:
# write to a scratch folder and pack it into OUT (`tar czf OUT/all.tgz -C SCRATCH .`).
set -u
if [ "$#" -lt 1 ]; then echo "usage: bench/serve_profile_gpu.sh OUT [MEMORY...]" >&2; exit 2; fi
OUT=$(mkdir -p "$1" && cd "$1" && pwd) || { echo "bench/serve_profile_gpu.sh: cannot write to $1" >&2; exit 2; }
shift
MEMORIES=${*:-100 25}
HERE=$(cd "$(dirname "$0")/.." && pwd)
cd "$HERE" || exit 2
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/src:$PWD/bench
SPY=${PY_SPY:-$(command -v py-spy)} || { echo "bench/serve_profile_gpu.sh: no py-spy" >&2; exit 2; }
CACHE=${TMPDIR:-/tmp}/expertcache-gpu
layers=${SERVE_LAYERS:-8}
python3 bench/engine_gpu.py --build-only --layers "$layers" --cache-dir "$CACHE" \
  --tokenizer src/expertcache/data/default >"$OUT/build.log" 2>&1 || { tail -5 "$OUT/build.log"; exit 1; }
model=$(ls -d "$CACHE"/qwen15-moe-a2.7b-l"$layers"-v*-bfloat16)
PORT=${PORT:-8011}
for mem in $MEMORIES; do
  python3 -m expertcache.cli serve --port "$PORT" --device cuda --expert-memory "$mem%" --slow-tier host \
    --served-model-name embedded --model "$model" >"$OUT/server_$mem.log" 2>&1 &
  server=$!
  for _ in $(seq 120); do curl -sf "localhost:$PORT/health" >/dev/null && break; sleep 0.5; done
  for clients in 1 16; do
    python3 - "$clients" "$PORT" >"$OUT/client_${mem}_$clients.txt" 2>&1 <<'PY' &
import json, sys, threading, time, urllib.request

clients, port = int(sys.argv[1]), sys.argv[2]
done, end = [], time.time() + 13
body = {"model": "embedded", "prompt": "The history of the city begins", "max_tokens": 40, "temperature": 0}


def client():
    while time.time() < end:
        t = time.time()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        answer = json.load(urllib.request.urlopen(req))
        done.append((time.time() - t, answer["usage"]["completion_tokens"]))


threads = [threading.Thread(target=client) for _ in range(clients)]
[t.start() for t in threads]
[t.join() for t in threads]
tokens = sum(n for _, n in done)
print(json.dumps({"clients": clients, "requests": len(done), "tokens": tokens, "tokens_per_s": tokens / 13,
                  "mean_latency_s": sum(s for s, _ in done) / len(done)}))
PY
    load=$!
    sleep 2
    timeout 20 "$SPY" record -p "$server" -d 9 -r 250 -f raw --threads -o "$OUT/prof_${mem}_$clients.txt" \
      >"$OUT/spy_${mem}_$clients.log" 2>&1
    wait "$load"
    echo "$mem% $clients: $(tail -1 "$OUT/client_${mem}_$clients.txt")"
  done
  curl -s "localhost:$PORT/metrics" | grep -E "^expertcache_(steps|step_tokens|cache)" >"$OUT/metrics_$mem.txt"
  kill "$server"; wait "$server" 2>/dev/null
done
