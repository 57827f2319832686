#!/usr/bin/env bash
# Reproduces every figure in BENCHMARKS.md (SmolLM2-135M, fp32, CPU, 2 threads). Results go to
# bench/results/*.json and the rendered tables to bench/results/*.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p bench/results
STATIC='0;1;2;0.0;0.1;1.0;0.0.0;0.0.1;0.0.0.0;0.0.0.0.0'
run() { name=$1; shift; specpilot bench --threads 2 "$@" --json "bench/results/$name.json" \
          2> "bench/results/$name.txt" || echo "$name exited $?" >> bench/results/$name.txt; }
case "${1:-all}" in
  hf|all)
    run hf_parity_humaneval20_64 --workload humaneval --limit 20 --max-new-tokens 64 --peers hf \
        --drafter suffix --tree dynamic
    run hf_peers_humaneval20_128 --workload humaneval --limit 20 --max-new-tokens 128 --peers hf \
        --drafter lookup --drafter suffix --tree chain --tree dynamic ;;&
  lossless|all)
    run lossless_humaneval164_128 --workload humaneval --max-new-tokens 128 --drafter suffix \
        --tree chain --tree static --tree dynamic --paths "$STATIC"
    run lossless_chat_128 --workload chat --max-new-tokens 128 --drafter lookup --drafter suffix \
        --tree chain --tree static --tree dynamic --paths "$STATIC" ;;
  batch|all)
    # batched AR vs batched speculative at batch 1..16, token-forced against batched AR
    python bench/batch_sweep.py --sizes 1 2 4 8 16 --limit 16 --max-new-tokens 96 \
        --out bench/results/batch_sweep_humaneval16_96 -- --drafter suffix --threads 2 \
        --workload humaneval > bench/results/batch_sweep_humaneval16_96.txt 2>&1 ;;&
  serve|all)
    # 32 concurrent streaming requests from the openai client against a loopback server
    python bench/load_test.py --concurrency 32 --requests 32 --max-tokens 64 --limit 32 \
        --max-batch 8 --json bench/results/load_test_32x64.json -- --threads 2 \
        > bench/results/load_test_32x64.txt 2>&1 ;;
esac
