// Log-sum-exp merge of blockwise attention partial results (ring attention), the one
// fused op torch lacks: out <- out * e^(lse - m) + blk * e^(blk_lse - m), lse <- m,
// with m = log(e^lse + e^blk_lse). Rows: batch * heads * queries; dim: head size.
#pragma once
#include <cuda_runtime.h>

#include "dtype.h"

namespace gridweave {

// `lse` / `blk_lse` are float64 for every output dtype (backward recomputes P from lse).
void lse_merge(void* out, void* lse, const void* blk_out, const void* blk_lse, long long rows, long long dim,
               DType dtype, cudaStream_t stream);

}  // namespace gridweave
