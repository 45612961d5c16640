#!/usr/bin/env bash
# What to run on a lent machine with many cores and a GPU (the device tool), in two calls of
# under 10 minutes each:
#   bash benchmarks/run_16cores.sh cpu    # install, the speedup table over 1-16 workers and
#                                         # processes (JSON, plot), the main example
#   bash benchmarks/run_16cores.sh cuda   # install, the CUDA tests under their timeouts, the
#                                         # CUDA benchmark, the whole suite
# Everything goes under $OUT (or ./out).
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-cpu}
out=${OUT:-out}
mkdir -p "$out"
out=$(cd "$out" && pwd)  # absolute: the benchmarks run from benchmarks/
python -m pip install --quiet -e ".[test,examples]" > "$out/install-$mode.txt" 2>&1
python -c "import torch; print(torch.__version__, torch.cuda.is_available())" > "$out/env.txt"
nproc >> "$out/env.txt"
if [ "$mode" = cpu ]; then
    (cd benchmarks && timeout 420 python bench_speedup.py --jobs 1,2,4,8,16 \
        --procs 1,2,4,8,16 --rounds 15 --json "$out/speedup-16cores.json" \
        --png "$out/speedup-16cores.png") > "$out/speedup-16cores.txt" 2>&1
    timeout 120 python examples/train_ensemble.py > "$out/train-ensemble.txt" 2>&1
else
    timeout 200 python -m pytest -q -p no:cacheprovider tests/test_devices.py \
        tests/test_concurrency.py tests/test_sum_models.py -k "cuda or devices" \
        > "$out/cuda-tests.txt" 2>&1
    if python -c "import torch; raise SystemExit(not torch.cuda.is_available())"; then
        (cd benchmarks && timeout 200 python bench_speedup.py --device cuda --jobs 1,4 \
            --rounds 15 --json "$out/speedup-cuda.json" --png "$out/speedup-cuda.png") \
            > "$out/speedup-cuda.txt" 2>&1
    fi
    timeout 150 python -m pytest -n 8 -q -p no:cacheprovider tests > "$out/tests.txt" 2>&1
fi
tail -n 3 "$out"/*.txt
