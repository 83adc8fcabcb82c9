#!/usr/bin/env bash
# Served A/B at 8 clients: A = the build before row-independent numerics, B = main; both servers up, one warm-up
# run each, then A B B A A B B A.
set -u
export SPECDECODE_COST_CACHE=0
out=/work/bench-out/serve-ab2; mkdir -p $out
start() {  # dir port
  PYTHONPATH=$1 python -m specdecode.cli serve --model qwen2.5-coder-1.5b-instruct --method eagle \
    --port $2 --max-num-seqs 8 --max-waiting 32 --log-level warning > $out/server-$2.log 2>&1 &
}
start /work/pre57 8101; start /work/main 8102
for p in 8101 8102; do
  for i in $(seq 1 300); do curl -sf http://127.0.0.1:$p/health >/dev/null && break; sleep 2; done
done
n=0
for p in 8101 8102 8101 8102 8102 8101 8101 8102 8102 8101; do
  n=$((n+1))
  PYTHONPATH=/work/main python /work/main/benchmarks/serve_load.py --url http://127.0.0.1:$p --concurrency 8 \
    --dataset gsm8k --num-prompts 16 --max-tokens 64 --rounds 2 --out $out/run$n-$p > $out/load-$n-$p.log 2>&1
  echo "run $n port $p rc $?"
done
pkill -f "specdecode.cli serve --model qwen2.5-coder-1.5b-instruct --method eagle --port 81" || true
