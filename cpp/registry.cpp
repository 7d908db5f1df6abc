#include "registry.h"

#include <map>
#include <mutex>

#include "error.h"

namespace gridweave {

namespace {
struct Registry {
  std::mutex mu;
  std::map<Backend, TransportFactory> transports;
  std::map<Device, DeviceAllocator> allocators;
  LseMergeKernel lse_merge;
  WorldRuntime mpi;
  bool has_mpi = false;
};

Registry& registry() {
  static Registry r;  // constructed on first use, so registration order across libraries is safe
  return r;
}
}  // namespace

const char* backend_name(Backend backend) {
  switch (backend) {
    case Backend::Gloo: return "gloo";
    case Backend::Nccl: return "nccl";
    case Backend::Mpi: return "mpi";
  }
  return "?";
}

void register_mpi_runtime(WorldRuntime runtime) {
  std::lock_guard<std::mutex> lock(registry().mu);
  registry().mpi = std::move(runtime);
  registry().has_mpi = true;
}

const WorldRuntime* mpi_runtime() {
  std::lock_guard<std::mutex> lock(registry().mu);
  return registry().has_mpi ? &registry().mpi : nullptr;
}

void register_transport(Backend backend, TransportFactory factory) {
  std::lock_guard<std::mutex> lock(registry().mu);
  registry().transports[backend] = std::move(factory);
}

void register_allocator(Device device, DeviceAllocator allocator) {
  std::lock_guard<std::mutex> lock(registry().mu);
  registry().allocators[device] = std::move(allocator);
}

void register_lse_merge(LseMergeKernel kernel) {
  std::lock_guard<std::mutex> lock(registry().mu);
  registry().lse_merge = std::move(kernel);
}

bool transport_available(Backend backend) {
  std::lock_guard<std::mutex> lock(registry().mu);
  return registry().transports.count(backend) > 0;
}

std::shared_ptr<Communicator> make_communicator(Backend backend, CommInfo info, std::shared_ptr<Store> store,
                                                int device_index) {
  TransportFactory f;
  {
    std::lock_guard<std::mutex> lock(registry().mu);
    auto it = registry().transports.find(backend);
    GW_CHECK(it != registry().transports.end(),
             "backend '" << backend_name(backend) << "' requested but gridweave was built without that transport"
                         << (backend == Backend::Nccl ? " (rebuild with nvcc and NCCL present, GRIDWEAVE_CUDA=ON)"
                             : backend == Backend::Mpi ? " (install an MPI, e.g. apt-get install libopenmpi-dev, "
                                                         "and rebuild)"
                                                       : ""));
    f = it->second;
  }
  return f(std::move(info), std::move(store), device_index);
}

const DeviceAllocator* allocator_for(Device device) {
  std::lock_guard<std::mutex> lock(registry().mu);
  auto it = registry().allocators.find(device);
  return it == registry().allocators.end() ? nullptr : &it->second;
}

const LseMergeKernel* lse_merge_kernel() {
  std::lock_guard<std::mutex> lock(registry().mu);
  return registry().lse_merge ? &registry().lse_merge : nullptr;
}

}  // namespace gridweave
