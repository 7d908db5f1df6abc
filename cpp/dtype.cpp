#include "dtype.h"

#include <algorithm>
#include <cstring>

#include "error.h"

namespace gridweave {

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::Float32: return 4;
    case DType::Float64: return 8;
    case DType::Float16: return 2;
    case DType::BFloat16: return 2;
    case DType::Int32: return 4;
    case DType::Int64: return 8;
    case DType::UInt8: return 1;
  }
  throw Error(ErrorKind::Config, "unknown dtype " + std::to_string(static_cast<int>(dtype)));
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::Float32: return "float32";
    case DType::Float64: return "float64";
    case DType::Float16: return "float16";
    case DType::BFloat16: return "bfloat16";
    case DType::Int32: return "int32";
    case DType::Int64: return "int64";
    case DType::UInt8: return "uint8";
  }
  return "unknown";
}

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return "sum";
    case ReduceOp::Max: return "max";
    case ReduceOp::Min: return "min";
  }
  return "unknown";
}

namespace {

// Half-precision types are reduced in float and rounded back, as torch does on CPU.
struct BF16 {
  static float load(uint16_t v) {
    uint32_t u = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  static uint16_t store(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    return static_cast<uint16_t>(u >> 16);
  }
};

struct F16 {
  static float load(uint16_t v) {
    _Float16 h;
    std::memcpy(&h, &v, 2);
    return static_cast<float>(h);
  }
  static uint16_t store(float f) {
    _Float16 h = static_cast<_Float16>(f);
    uint16_t v;
    std::memcpy(&v, &h, 2);
    return v;
  }
};

struct Sum {
  template <typename T>
  T operator()(T a, T b) const { return a + b; }
};
struct Max {
  template <typename T>
  T operator()(T a, T b) const { return std::max(a, b); }
};
struct Min {
  template <typename T>
  T operator()(T a, T b) const { return std::min(a, b); }
};

// The op is a type, so each loop is branch-free and vectorizes.
template <typename T, typename Op>
void reduce_loop(T* o, const T* x, const T* y, std::size_t n) {
  Op f;
  for (std::size_t k = 0; k < n; ++k) o[k] = f(x[k], y[k]);
}

template <typename T>
void reduce_native(void* out, const void* a, const void* b, std::size_t n, ReduceOp op) {
  T* o = static_cast<T*>(out);
  const T* x = static_cast<const T*>(a);
  const T* y = static_cast<const T*>(b);
  switch (op) {
    case ReduceOp::Sum: return reduce_loop<T, Sum>(o, x, y, n);
    case ReduceOp::Max: return reduce_loop<T, Max>(o, x, y, n);
    case ReduceOp::Min: return reduce_loop<T, Min>(o, x, y, n);
  }
}

template <typename H, typename Op>
void reduce_half_loop(uint16_t* o, const uint16_t* x, const uint16_t* y, std::size_t n) {
  Op f;
  for (std::size_t k = 0; k < n; ++k) o[k] = H::store(f(H::load(x[k]), H::load(y[k])));
}

template <typename H>
void reduce_half(void* out, const void* a, const void* b, std::size_t n, ReduceOp op) {
  uint16_t* o = static_cast<uint16_t*>(out);
  const uint16_t* x = static_cast<const uint16_t*>(a);
  const uint16_t* y = static_cast<const uint16_t*>(b);
  switch (op) {
    case ReduceOp::Sum: return reduce_half_loop<H, Sum>(o, x, y, n);
    case ReduceOp::Max: return reduce_half_loop<H, Max>(o, x, y, n);
    case ReduceOp::Min: return reduce_half_loop<H, Min>(o, x, y, n);
  }
}

}  // namespace

void reduce_into(void* out, const void* a, const void* b, std::size_t count, DType dtype, ReduceOp op) {
  switch (dtype) {
    case DType::Float32: return reduce_native<float>(out, a, b, count, op);
    case DType::Float64: return reduce_native<double>(out, a, b, count, op);
    case DType::Int32: return reduce_native<int32_t>(out, a, b, count, op);
    case DType::Int64: return reduce_native<int64_t>(out, a, b, count, op);
    case DType::Float16: return reduce_half<F16>(out, a, b, count, op);
    case DType::BFloat16: return reduce_half<BF16>(out, a, b, count, op);
    case DType::UInt8: break;
  }
  throw Error(ErrorKind::Config, std::string("no reduction of ") + dtype_name(dtype) + " (its bytes are moved, not summed)");
}

}  // namespace gridweave
