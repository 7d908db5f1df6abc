// Registers what cuda/ provides with the core's registry (cpp/registry.h) while the
// library loads: the NCCL transport, CUDA device memory, and the lse-merge kernel.
// Linked whole (CMake WHOLE_ARCHIVE), so this initialiser is never dropped.
#include <cuda_runtime.h>

#include "lse_merge.h"
#include "nccl_communicator.h"
#include "registry.h"
#include "stream.h"

namespace gridweave {
namespace {

const bool registered = [] {
  register_transport(Backend::Nccl, [](CommInfo info, std::shared_ptr<Store> store, int device_index) {
    return std::static_pointer_cast<Communicator>(
        std::make_shared<NcclCommunicator>(std::move(info), std::move(store), device_index));
  });
  DeviceAllocator cuda;
  cuda.allocate = [](std::size_t bytes) {
    void* p = nullptr;
    check_cuda(cudaMalloc(&p, bytes), "cudaMalloc");
    check_cuda(cudaMemset(p, 0, bytes), "cudaMemset");
    return p;
  };
  cuda.release = [](void* p) { cudaFree(p); };
  cuda.copy = [](void* dst, const void* src, std::size_t bytes) {
    check_cuda(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault), "cudaMemcpy");
  };
  cuda.copy_async = [](void* dst, const void* src, std::size_t bytes, void* stream) {
    check_cuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, static_cast<cudaStream_t>(stream)),
               "cudaMemcpyAsync");
  };
  register_allocator(Device::CUDA, cuda);
  register_lse_merge([](void* out, void* lse, const void* blk, const void* blk_lse, long long rows, long long dim,
                        DType dtype, void* stream) {
    lse_merge(out, lse, blk, blk_lse, rows, dim, dtype, static_cast<cudaStream_t>(stream));
  });
  return true;
}();

}  // namespace
}  // namespace gridweave
