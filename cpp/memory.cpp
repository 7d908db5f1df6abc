#include "memory.h"

#include <cstdlib>
#include <cstring>

#include "error.h"
#include "registry.h"

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

// Memory of a device whose allocator an extension registered (cuda/ registers CUDA).
class RegisteredMemory : public DeviceMemory {
 public:
  RegisteredMemory(const DeviceAllocator& a, std::size_t bytes) : allocator_(a) {
    ptr_ = a.allocate(bytes ? bytes : 1);
    bytes_ = bytes;
  }
  ~RegisteredMemory() override { allocator_.release(ptr_); }

 private:
  DeviceAllocator allocator_;  // a copy: a later registration (torch's caching allocator) must
                               // not free memory the earlier one made
};

const DeviceAllocator& need(Device device, const char* what) {
  const DeviceAllocator* a = allocator_for(device);
  GW_CHECK(a != nullptr, what << " on a CUDA device requested but gridweave was built without CUDA");
  return *a;
}
}  // namespace

std::unique_ptr<DeviceMemory> allocate(Device device, std::size_t bytes) {
  if (device == Device::CPU) return std::make_unique<HostMemory>(bytes);
  return std::make_unique<RegisteredMemory>(need(device, "memory"), bytes);
}

void copy_bytes(void* dst, const void* src, std::size_t bytes, Device device) {
  if (device == Device::CPU) {
    std::memcpy(dst, src, bytes);
    return;
  }
  need(device, "a copy").copy(dst, src, bytes);
}

void copy_bytes_async(void* dst, const void* src, std::size_t bytes, Device device, void* stream) {
  if (device == Device::CPU) {
    std::memcpy(dst, src, bytes);
    return;
  }
  need(device, "a copy").copy_async(dst, src, bytes, stream);
}

}  // namespace gridweave
