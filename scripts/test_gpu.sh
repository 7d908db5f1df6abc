#!/usr/bin/env bash
# The GPU tier: run where a CUDA GPU is visible (each test skips with its reason elsewhere).
# NCCL at world size 1, 2-4 ranks sharing the GPU through Gloo, stream ordering, the CUDA
# kernels, bf16 training on the GPU, OffloadAdam's measured device memory; then the main
# job's model in gridweave and in plain torch on the GPU (tokens/s, MFU), and the planner
# calibrated on the GPU against measured steps (bench_plan_gpu); where MPI and mpi4py are
# there, the transport benchmark on the machine's 16 cores (2-8 ranks, none sharing a core,
# the 1.1x goal). Stream-ordered waits, a dropped op under allocator churn, a
# collective captured in a CUDA graph, compute-sanitizer's memcheck and racecheck, and the
# profiler's count of host synchronisations and cudaMalloc per step (bench_gpu_syncs).
# Results go to benchmarks/results/gpu/ named after the device.
#
#   scripts/test_gpu.sh                    # every part
#   scripts/test_gpu.sh gpu suite          # some parts (a leased machine limits one command's time):
#                                          # gpu suite zero sanitizer bench transports
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUT"
PARTS=${*:-gpu suite zero sanitizer bench transports}
want() { [[ " $PARTS " == *" $1 "* ]]; }
rc=0  # a failing part is reported at the end; the parts after it still run
DEV=$(python3 -c "import torch; print(torch.cuda.get_device_name(0).replace(' ', '_') if torch.cuda.is_available() else 'none')")
if want gpu; then
  python3 -m pytest -q -m gpu tests/python -rs --junitxml="$OUT/test_gpu_${DEV}.xml" 2>&1 | tee "$OUT/test_gpu_${DEV}.txt" || rc=1
fi
if [ "$DEV" != "none" ] && want suite; then
  # the layer, ring, pipeline and sharding tests again, every rank on the GPU (shared through Gloo)
  GRIDWEAVE_TEST_DEVICE=cuda python3 -m pytest -q tests/python/test_layers.py tests/python/test_tensor1d2d.py \
    tests/python/test_tensor3d.py tests/python/test_sequence.py tests/python/test_subgraph.py \
    tests/python/test_pipeline.py tests/python/test_sharding.py tests/python/test_sequence_model.py \
    tests/python/test_documents.py -rs 2>&1 | tee "$OUT/test_cuda_suite_${DEV}.txt" || rc=1
  # the shared expert beside the experts' exchanges (--moe-overlap), the waits on the device
  GRIDWEAVE_TEST_DEVICE=cuda python3 -m pytest -q tests/python/test_moe.py -rs -k "overlapped" 2>&1 \
    | tee "$OUT/test_cuda_moe_overlap_${DEV}.txt" || rc=1
fi
if [ "$DEV" != "none" ] && want zero; then
  # ZeRO 1-3 and hybrid sharding on the GPU: the reduce-scatters start from autograd's
  # hooks and ZeRO-3's gathers from module and tensor hooks, on autograd's device thread there
  GRIDWEAVE_TEST_DEVICE=cuda python3 -m pytest -q tests/python/test_zero.py -rs \
    -k "equals or hybrid or activation or offload" 2>&1 | tee "$OUT/test_cuda_zero_${DEV}.txt" || rc=1
fi
if [ "$DEV" != "none" ] && want sanitizer && command -v compute-sanitizer >/dev/null 2>&1; then
  # memory and race checks over the NCCL and kernel tests of the GPU tier
  for tool in memcheck racecheck; do
    compute-sanitizer --tool "$tool" --error-exitcode 9 python3 -m pytest -q -m gpu tests/python/test_gpu.py \
      -k "nccl or ordered or lse or captured or dropped" 2>&1 | tee "$OUT/sanitizer_${tool}_${DEV}.txt" || true
  done
fi
if [ "$DEV" != "none" ] && want bench; then
  python3 benchmarks/bench_gpu_syncs.py --out "$OUT" || echo "host synchronisation count failed"
  python3 benchmarks/bench_gpu_throughput.py --out "$OUT" || echo "throughput benchmark failed"
  python3 benchmarks/bench_plan_gpu.py --out "$OUT" || echo "planner benchmark failed"
fi
if want transports && python3 -c "import mpi4py, gridweave.launch as l; assert l.mpi_installed()" 2>/dev/null; then
  python3 benchmarks/bench_transports.py --out "$OUT/transports_${DEV}" || echo "transport benchmark failed"
fi
exit $rc
