#!/usr/bin/env bash
# Builds and installs gridweave on a GPU machine that cannot reach a package registry but
# has torch, nvcc, CMake, pybind11, scikit-build-core and nvidia-nccl (a CUDA image), with
# Gloo's Debian packages carried in beside the tree. Fetch them where apt works:
#   mkdir -p .gpu/debs && (cd .gpu/debs && apt-get download libgloo0 libgloo-dev \
#     libhiredis0.14 libibverbs1 libnl-3-200 libnl-route-3-200)
# and the pure-Python dependencies the image lacks (seen on the H100 image: tomli-w, which the
# trainer writes its resolved config with):
#   python3 -m pip download --no-deps --only-binary=:all: -d .gpu/wheels tomli_w
# then run this there, and scripts/test_gpu.sh after it. Idempotent: skips a working install.
set -euo pipefail
cd "$(dirname "$0")/.."
DEBS=${DEBS:-.gpu/debs}
WHEELS=${WHEELS:-.gpu/wheels}
if compgen -G "$WHEELS/*.whl" >/dev/null; then python3 -m pip install -q --no-index --no-deps "$WHEELS"/*.whl; fi
python3 -c "import gridweave._C" 2>/dev/null && exit 0
T0=$(date +%s)
X=$(mktemp -d)
for f in "$DEBS"/*.deb; do dpkg -x "$f" "$X"; done
# libgloo's CMake package names /usr/lib/libgloo.so.0.5.0 absolutely: install it there
cp -a "$X"/usr/lib/libgloo* /usr/lib/
cp -a "$X"/usr/include/gloo /usr/include/
mkdir -p /usr/share/cmake && cp -a "$X"/usr/share/cmake/Gloo /usr/share/cmake/
# its runtime dependencies, only where the image lacks them (never shadow the image's own)
mkdir -p /opt/gridweave-deps
for so in libibverbs.so.1 libhiredis.so.0.14 libnl-3.so.200 libnl-route-3.so.200; do
  ldconfig -p | grep -q "$so " || cp -a $(find "$X" -name "$so*") /opt/gridweave-deps/
done
echo /opt/gridweave-deps > /etc/ld.so.conf.d/gridweave-deps.conf && ldconfig
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
# The system compiler: a CUDA image may put a gcc of its own first (seen: /opt/gcc) that
# links libstdc++ statically; torch's process must keep one C++ runtime.
export CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++
# the one architecture of the GPU present: a build for four takes minutes longer
ARCH=$(python3 -c "import torch; p = torch.cuda.get_device_capability(0); print(f'{p[0]}{p[1]}')")
GRIDWEAVE_CUDA=ON CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=$ARCH" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
  python3 -m pip install --no-build-isolation --no-deps -q .
python3 -c "import gridweave as gw; print('gridweave', gw.__file__, 'nccl', gw._C.nccl_available)"
rm -rf "$X"
echo "setup took $(( $(date +%s) - T0 )) s"
