#include "lse_merge.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

#include "error.h"
#include "stream.h"

namespace gridweave {

namespace {

template <typename T, typename S>
__device__ S load(const T& x) {
  return static_cast<S>(x);
}
template <>
__device__ double load<__half, double>(const __half& x) {
  return static_cast<double>(__half2float(x));
}
template <>
__device__ double load<__nv_bfloat16, double>(const __nv_bfloat16& x) {
  return static_cast<double>(__bfloat162float(x));
}
template <typename T, typename S>
__device__ T store(S x) {
  return static_cast<T>(x);
}
template <>
__device__ __half store<__half, double>(double x) {
  return __float2half(static_cast<float>(x));
}
template <>
__device__ __nv_bfloat16 store<__nv_bfloat16, double>(double x) {
  return __float2bfloat16(static_cast<float>(x));
}

// One block per row; rows whose both sides are empty (-inf) stay empty.
template <typename T, typename S>
__global__ void lse_merge_kernel(T* out, S* lse, const T* blk, const S* blk_lse, long long dim) {
  const long long row = blockIdx.x;
  const S a = lse[row], b = blk_lse[row];
  const S m = a > b ? a : b;
  const S neg_inf = -INFINITY;
  const S merged = m == neg_inf ? neg_inf : m + log(exp(a - m) + exp(b - m));
  const S wa = a == neg_inf ? S(0) : exp(a - merged);
  const S wb = b == neg_inf ? S(0) : exp(b - merged);
  for (long long k = threadIdx.x; k < dim; k += blockDim.x) {
    const long long i = row * dim + k;
    out[i] = store<T, S>(load<T, S>(out[i]) * wa + load<T, S>(blk[i]) * wb);
  }
  __syncthreads();  // every thread read lse[row] before it changes
  if (threadIdx.x == 0) lse[row] = merged;
}

template <typename T, typename S>
void launch(void* out, void* lse, const void* blk, const void* blk_lse, long long rows, long long dim,
            cudaStream_t stream) {
  if (rows == 0) return;
  const int threads = dim >= 128 ? 128 : 32;
  lse_merge_kernel<T, S><<<static_cast<unsigned>(rows), threads, 0, stream>>>(
      static_cast<T*>(out), static_cast<S*>(lse), static_cast<const T*>(blk), static_cast<const S*>(blk_lse), dim);
  check_cuda(cudaGetLastError(), "lse_merge kernel launch");
}

}  // namespace

void lse_merge(void* out, void* lse, const void* blk_out, const void* blk_lse, long long rows, long long dim,
               DType dtype, cudaStream_t stream) {
  GW_CHECK(rows >= 0 && dim > 0, "lse_merge: bad shape rows=" << rows << " dim=" << dim);
  switch (dtype) {
    case DType::Float32: return launch<float, double>(out, lse, blk_out, blk_lse, rows, dim, stream);
    case DType::Float64: return launch<double, double>(out, lse, blk_out, blk_lse, rows, dim, stream);
    case DType::Float16: return launch<__half, double>(out, lse, blk_out, blk_lse, rows, dim, stream);
    case DType::BFloat16: return launch<__nv_bfloat16, double>(out, lse, blk_out, blk_lse, rows, dim, stream);
    default: GW_CHECK(false, "lse_merge: dtype " << dtype_name(dtype) << " is not a floating type");
  }
}

}  // namespace gridweave
