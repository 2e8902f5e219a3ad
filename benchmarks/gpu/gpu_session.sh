#!/usr/bin/env bash
# The GPU session's one prepared run: the engine end to end on CUDA (gpu_engine), its own time per step with and
# without overlapped scheduling (gpu_overlap), then the Triton kernels' checks and decode timings (gpu_kernels).
# Runs where the machine's python3 already holds torch, triton and transformers (nothing is installed: the
# package is laid out from the working tree as pyproject maps it).
# Needs the smollm2 tokenizer (the tiny presets use it) under $PAGED_BACKEND_CACHE/v1/smollm2-tokenizer.
# Usage: benchmarks/gpu/gpu_session.sh OUTPUT_DIR      (each part has its own time limit; GPU_PARTS="engine" runs one)
set -u -o pipefail
out=${1:?usage: benchmarks/gpu/gpu_session.sh OUTPUT_DIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
# the records name the commit of the checkout the package is copied from (the copy is not a git checkout)
export PAGED_BENCH_COMMIT=${PAGED_BENCH_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}
site=$(mktemp -d)
mkdir -p "$site/paged_backend"
cp -r paged_backend/. "$site/paged_backend/"
for sub in adapters kernels benchmarks; do cp -r "$sub" "$site/paged_backend/$sub"; done
export PYTHONPATH="$site" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export PAGED_BACKEND_CACHE=${PAGED_BACKEND_CACHE:-$PWD/.gpu/cache}
cd "$site"   # not the checkout: `python -m` puts the current folder first on the path
nvidia-smi -L
python3 -c 'import sys, torch, triton, transformers; print(sys.version.split()[0], "torch", torch.__version__,
"triton", triton.__version__, "transformers", transformers.__version__)'
status=0
parts=" ${GPU_PARTS:-engine overlap kernels} "
[[ $parts == *" engine "* ]] && { timeout "${ENGINE_TIMEOUT:-270}" python3 -m paged_backend.benchmarks.gpu.gpu_engine --output "$out" ${ENGINE_ARGS:-} 2>&1 \
    | grep -v Warning | tee "$out/gpu_engine.log" || status=1; }
[[ $parts == *" overlap "* ]] && { timeout "${OVERLAP_TIMEOUT:-240}" python3 -m paged_backend.benchmarks.gpu.gpu_overlap --output "$out" ${OVERLAP_ARGS:-} 2>&1 \
    | grep -v Warning | tee "$out/gpu_overlap.log" || status=1; }
[[ $parts == *" kernels "* ]] && { timeout "${KERNELS_TIMEOUT:-240}" python3 -m paged_backend.benchmarks.gpu.gpu_kernels \
    --output "$out/kernels_gpu.md" --kv-cache-dtype float8_e4m3fn 2>&1 | tee "$out/gpu_kernels.log" || status=1; }
exit $status
