// What is built outside the core registers itself here: transports (cuda/ registers
// NCCL), device memory (cuda/ registers CUDA), kernels (cuda/ registers the lse merge).
// The core asks the registry, so no file in cpp/ includes a header from cuda/.
#pragma once
#include <cstddef>
#include <functional>
#include <memory>

#include "communicator.h"
#include "dtype.h"
#include "store.h"

namespace gridweave {

enum class Backend : int { Gloo = 0, Nccl = 1, Mpi = 2 };

using TransportFactory =
    std::function<std::shared_ptr<Communicator>(CommInfo info, std::shared_ptr<Store> store, int device_index)>;

// Raw memory of one device kind, and copies to, from and within it: synchronous, and in the
// order of a stream (a host source may be reused as soon as copy_async returns).
struct DeviceAllocator {
  std::function<void*(std::size_t bytes)> allocate;
  std::function<void(void* ptr)> release;
  std::function<void(void* dst, const void* src, std::size_t bytes)> copy;
  std::function<void(void* dst, const void* src, std::size_t bytes, void* stream)> copy_async;
};

// out <- out * e^(lse - m) + blk * e^(blk_lse - m), lse <- m (see cuda/lse_merge.h).
using LseMergeKernel = std::function<void(void* out, void* lse, const void* blk_out, const void* blk_lse,
                                          long long rows, long long dim, DType dtype, void* stream)>;

// A launcher-provided world (MPI): who this process is, and the clean-up at exit.
struct WorldRuntime {
  std::function<std::pair<int, int>()> rank_and_size;  // initialises the runtime if nobody has
  std::function<void()> finalize;                      // only what it initialised
};

// Registration happens while a library loads (static initialisers); lookups after.
void register_transport(Backend backend, TransportFactory factory);
void register_allocator(Device device, DeviceAllocator allocator);
void register_lse_merge(LseMergeKernel kernel);
void register_mpi_runtime(WorldRuntime runtime);
const WorldRuntime* mpi_runtime();  // nullptr when built without MPI

bool transport_available(Backend backend);
std::shared_ptr<Communicator> make_communicator(Backend backend, CommInfo info, std::shared_ptr<Store> store,
                                                int device_index);
const DeviceAllocator* allocator_for(Device device);  // nullptr when none is registered
const LseMergeKernel* lse_merge_kernel();              // nullptr when none is registered
const char* backend_name(Backend backend);

}  // namespace gridweave
