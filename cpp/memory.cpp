#include "memory.h"

#include <cstdlib>
#include <cstring>

#include "error.h"

#ifdef GRIDWEAVE_WITH_NCCL
#include <cuda_runtime.h>

#include "stream.h"
#endif

namespace gridweave {

namespace {
class HostMemory : public DeviceMemory {
 public:
  explicit HostMemory(std::size_t bytes) {
    ptr_ = std::calloc(bytes ? bytes : 1, 1);
    bytes_ = bytes;
    GW_CHECK(ptr_ != nullptr, "out of host memory allocating " << bytes << " bytes");
  }
  ~HostMemory() override { std::free(ptr_); }
};

#ifdef GRIDWEAVE_WITH_NCCL
class CudaMemory : public DeviceMemory {
 public:
  explicit CudaMemory(std::size_t bytes) {
    check_cuda(cudaMalloc(&ptr_, bytes ? bytes : 1), "cudaMalloc");
    check_cuda(cudaMemset(ptr_, 0, bytes ? bytes : 1), "cudaMemset");
    bytes_ = bytes;
  }
  ~CudaMemory() override { cudaFree(ptr_); }
};
#endif
}  // namespace

std::unique_ptr<DeviceMemory> allocate(Device device, std::size_t bytes) {
  if (device == Device::CPU) return std::make_unique<HostMemory>(bytes);
#ifdef GRIDWEAVE_WITH_NCCL
  return std::make_unique<CudaMemory>(bytes);
#else
  GW_CHECK(false, "device memory requested but gridweave was built without CUDA");
#endif
}

void copy_bytes(void* dst, const void* src, std::size_t bytes, Device device) {
  if (device == Device::CPU) {
    std::memcpy(dst, src, bytes);
    return;
  }
#ifdef GRIDWEAVE_WITH_NCCL
  check_cuda(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault), "cudaMemcpy");
#else
  GW_CHECK(false, "device copy requested but gridweave was built without CUDA");
#endif
}

}  // namespace gridweave
