#!/usr/bin/env bash
# The GPU session's one prepared run: our throughput against transformers' (gpu_engine --only-throughput), the
# engine's checks on CUDA (gpu_engine --skip-throughput), its own time per step with and without overlapped
# scheduling and CUDA graphs (gpu_overlap), CUDA graph capture beside a dead engine (gpu_capture), then the Triton
# kernels' checks and decode timings (gpu_kernels).
# Runs where the machine's python3 already holds torch, triton and transformers (nothing is installed: the
# package is laid out from the working tree as pyproject maps it).
# Needs the smollm2 tokenizer (the tiny presets use it) under $PAGED_BACKEND_CACHE/v1/smollm2-tokenizer.
# Usage: benchmarks/gpu/gpu_session.sh OUTPUT_DIR      (each part has its own time limit; GPU_PARTS="engine" runs one;
#        THROUGHPUT_ARGS, ENGINE_ARGS, OVERLAP_ARGS are passed to the part's script)
# Wheels in .whl/ (carried to the machine) are installed beside the package first: the machine has no xgrammar,
# which the engine part's structured-output request needs (it is skipped, and says so, without). Fetched here by:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
#     typing-inspection==0.4.5
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
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl \
        || echo "installing the carried wheels failed; going on without them"
fi
export PYTHONPATH="$site" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export PAGED_BACKEND_CACHE=${PAGED_BACKEND_CACHE:-$PWD/.gpu/cache}
cd "$site"   # not the checkout: `python -m` puts the current folder first on the path
nvidia-smi -L
python3 -c 'import sys, torch, triton, transformers; print(sys.version.split()[0], "torch", torch.__version__,
"triton", triton.__version__, "transformers", transformers.__version__)'
status=0
parts=" ${GPU_PARTS:-throughput engine overlap kernels} "
[[ $parts == *" throughput "* ]] && { timeout "${THROUGHPUT_TIMEOUT:-300}" python3 -m paged_backend.benchmarks.gpu.gpu_engine --only-throughput \
    --output "$out/throughput" ${THROUGHPUT_ARGS:-} 2>&1 | grep -v Warning | tee "$out/gpu_throughput.log" || status=1; }
[[ $parts == *" engine "* ]] && { timeout "${ENGINE_TIMEOUT:-270}" python3 -m paged_backend.benchmarks.gpu.gpu_engine --skip-throughput \
    --output "$out" ${ENGINE_ARGS:-} 2>&1 | grep -v Warning | tee "$out/gpu_engine.log" || status=1; }
[[ $parts == *" overlap "* ]] && { timeout "${OVERLAP_TIMEOUT:-240}" python3 -m paged_backend.benchmarks.gpu.gpu_overlap --output "$out" ${OVERLAP_ARGS:-} 2>&1 \
    | grep -v Warning | tee "$out/gpu_overlap.log" || status=1; }
[[ $parts == *" capture "* ]] && { timeout "${CAPTURE_TIMEOUT:-120}" python3 -m paged_backend.benchmarks.gpu.gpu_capture --output "$out" \
    ${CAPTURE_ARGS:-} 2>&1 | grep -v Warning | tee "$out/gpu_capture.log" || status=1; }
[[ $parts == *" kernels "* ]] && { timeout "${KERNELS_TIMEOUT:-240}" python3 -m paged_backend.benchmarks.gpu.gpu_kernels \
    --output "$out/kernels_gpu.md" --kv-cache-dtype float8_e4m3fn 2>&1 | tee "$out/gpu_kernels.log" || status=1; }
exit $status
