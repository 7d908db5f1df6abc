// Element types, devices and the raw buffer view every engine op works on.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace gridweave {

// UInt8: bytes moved whole (float8 values with their scales elsewhere: ZeRO-3's float8 gathers); no reduction
enum class DType : int { Float32 = 0, Float64, Float16, BFloat16, Int32, Int64, UInt8 };
enum class Device : int { CPU = 0, CUDA = 1 };
enum class ReduceOp : int { Sum = 0, Max, Min };

std::size_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);
const char* reduce_op_name(ReduceOp op);

// A borrowed buffer: pointer, element count, dtype, device and stream (nullptr on CPU).
struct BufferView {
  void* ptr = nullptr;
  std::size_t count = 0;
  DType dtype = DType::Float32;
  Device device = Device::CPU;
  int device_index = -1;
  void* stream = nullptr;
  std::size_t nbytes() const { return count * dtype_size(dtype); }
  BufferView slice(std::size_t offset, std::size_t n) const {
    BufferView v = *this;
    v.ptr = static_cast<char*>(ptr) + offset * dtype_size(dtype);
    v.count = n;
    return v;
  }
};

// out[k] = a[k] (op) b[k] for k < count; out may alias a or b. CPU memory only.
void reduce_into(void* out, const void* a, const void* b, std::size_t count, DType dtype, ReduceOp op);

}  // namespace gridweave
