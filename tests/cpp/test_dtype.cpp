#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "dtype.h"
#include "error.h"

using namespace gridweave;

TEST(DType, Sizes) {
  EXPECT_EQ(dtype_size(DType::Float32), 4u);
  EXPECT_EQ(dtype_size(DType::Float64), 8u);
  EXPECT_EQ(dtype_size(DType::Float16), 2u);
  EXPECT_EQ(dtype_size(DType::BFloat16), 2u);
  EXPECT_EQ(dtype_size(DType::Int32), 4u);
  EXPECT_EQ(dtype_size(DType::Int64), 8u);
  EXPECT_THROW(dtype_size(static_cast<DType>(42)), Error);
}

TEST(DType, ReduceNative) {
  double a[3] = {1, -2, 3}, b[3] = {4, 5, -6}, o[3];
  reduce_into(o, a, b, 3, DType::Float64, ReduceOp::Sum);
  EXPECT_EQ(o[2], -3);
  reduce_into(o, a, b, 3, DType::Float64, ReduceOp::Max);
  EXPECT_EQ(o[1], 5);
  int64_t x[2] = {1LL << 40, 7}, y[2] = {3, -9}, z[2];
  reduce_into(z, x, y, 2, DType::Int64, ReduceOp::Min);
  EXPECT_EQ(z[0], 3);
  EXPECT_EQ(z[1], -9);
}

TEST(DType, ReduceBFloat16RoundsToNearestEven) {
  auto bf = [](float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return static_cast<uint16_t>(u >> 16);  // exact for these values
  };
  uint16_t a[2] = {bf(1.0f), bf(256.0f)}, b[2] = {bf(2.0f), bf(1.0f)}, o[2];
  reduce_into(o, a, b, 2, DType::BFloat16, ReduceOp::Sum);
  EXPECT_EQ(o[0], bf(3.0f));
  EXPECT_EQ(o[1], bf(256.0f));  // 257 is halfway between 256 and 258: ties to even (256)
}

TEST(DType, ReduceFloat16) {
  _Float16 a[2] = {static_cast<_Float16>(1.5f), static_cast<_Float16>(-3.0f)};
  _Float16 b[2] = {static_cast<_Float16>(0.25f), static_cast<_Float16>(2.0f)};
  _Float16 o[2];
  reduce_into(o, a, b, 2, DType::Float16, ReduceOp::Sum);
  EXPECT_EQ(static_cast<float>(o[0]), 1.75f);
  EXPECT_EQ(static_cast<float>(o[1]), -1.0f);
}
