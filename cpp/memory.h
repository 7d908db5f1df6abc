// Raw memory on a device, for engine-owned message buffers (the pipeline's): host memory
// on CPU, device memory through cuda/ when the NCCL transport is built.
#pragma once
#include <cstddef>
#include <memory>

#include "dtype.h"

namespace gridweave {

class DeviceMemory {
 public:
  virtual ~DeviceMemory() = default;
  void* data() const { return ptr_; }
  std::size_t size() const { return bytes_; }

 protected:
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
};

std::unique_ptr<DeviceMemory> allocate(Device device, std::size_t bytes);
// Synchronous copy of `bytes` between two addresses on `device` (or host <-> device when
// one side is host memory; CUDA's unified addressing tells which).
void copy_bytes(void* dst, const void* src, std::size_t bytes, Device device);
// The same in the order of `stream` (CUDA; on the host, at once). A host source may be
// reused when it returns.
void copy_bytes_async(void* dst, const void* src, std::size_t bytes, Device device, void* stream);

}  // namespace gridweave
