// The 3-D choreography against Bian et al. §3.1: block index math of A_ijl, B_lji, C_ilj,
// the collectives of Algorithms 1, 3, 5, and the gradient products of Algorithms 2, 4, 6.
#include <gtest/gtest.h>

#include <map>

#include "cube.h"
#include "error.h"

using namespace gridweave;

namespace {
// Range of one matrix dim under a cube layout for processor (i, j, l) = (x, y, z).
Range dim_range(const std::vector<std::string>& axes, long long n, int p, int i, int j, int l) {
  std::map<std::string, int> coord = {{"x", i}, {"y", j}, {"z", l}};
  std::vector<int> sizes, coords;
  for (const auto& a : axes) {
    sizes.push_back(p);
    coords.push_back(coord.at(a));
  }
  return block_range(n, sizes, coords);
}
}  // namespace

TEST(Cube, BlocksAreThePapersBlocks) {
  for (int p : {2, 3}) {
    const long long M = 6 * p * p, N = 4 * p * p, K = 5 * p * p;
    const long long m = M / (p * p), n = N / (p * p), k = K / (p * p);
    auto A = cube_layout(CubeForm::AB, 0, "y", "z");
    auto B = cube_layout(CubeForm::AB, 1, "y", "z");
    auto C = cube_layout(CubeForm::AB, 2, "y", "z");
    for (int i = 0; i < p; ++i)
      for (int j = 0; j < p; ++j)
        for (int l = 0; l < p; ++l) {
          // A_ijl = A[imp + jm : +m, lnp : +np]
          EXPECT_EQ(dim_range(A[0], M, p, i, j, l).begin, i * m * p + j * m);
          EXPECT_EQ(dim_range(A[0], M, p, i, j, l).end, i * m * p + j * m + m);
          EXPECT_EQ(dim_range(A[1], N, p, i, j, l).begin, l * n * p);
          EXPECT_EQ(dim_range(A[1], N, p, i, j, l).end, l * n * p + n * p);
          // B_lji = B[lnp : +np, jkp + ik : +k]
          EXPECT_EQ(dim_range(B[0], N, p, i, j, l).begin, l * n * p);
          EXPECT_EQ(dim_range(B[1], K, p, i, j, l).begin, j * k * p + i * k);
          EXPECT_EQ(dim_range(B[1], K, p, i, j, l).end, j * k * p + i * k + k);
          // C_ilj = C[imp + lm : +m, jkp : +kp]
          EXPECT_EQ(dim_range(C[0], M, p, i, j, l).begin, i * m * p + l * m);
          EXPECT_EQ(dim_range(C[0], M, p, i, j, l).end, i * m * p + l * m + m);
          EXPECT_EQ(dim_range(C[1], K, p, i, j, l).begin, j * k * p);
          EXPECT_EQ(dim_range(C[1], K, p, i, j, l).end, j * k * p + k * p);
        }
  }
  EXPECT_THROW(block_range(10, {4}, {0}), Error);  // 10 does not split over 4
}

TEST(Cube, VectorsLiveOnTheDiagonalSplitByColumnThenX) {
  // Fig. 5: a bias over columns split by c is stored on the diagonal, split over (c, x)
  EXPECT_EQ(cube_vector_layout("z"), (MatrixLayout{{"z", "x"}}));
  EXPECT_EQ(cube_vector_layout("y"), (MatrixLayout{{"y", "x"}}));
  EXPECT_THROW(cube_vector_layout("x"), Error);
}

TEST(Cube, Algorithm1CollectivesAndDirectionSwap) {
  CubePlan p = cube_plan(CubeForm::AB, "y", "z");
  EXPECT_EQ(p.gather_lhs.axis, "y");  // 1: all-gather A_il in y
  EXPECT_EQ(p.gather_rhs.axis, "x");  // 2: all-gather B_lj in x
  EXPECT_EQ(p.reduce_scatter_out.axis, "z");  // 4: reduce-scatter C_ilj in z
  // The output's layout is the next layer's input layout with y and z exchanged.
  EXPECT_EQ(cube_layout(CubeForm::AB, 2, "y", "z"), cube_layout(CubeForm::AB, 0, "z", "y"));
  CubePlan q = cube_plan(CubeForm::AB, "z", "y");
  EXPECT_EQ(q.gather_lhs.axis, "z");
  EXPECT_EQ(q.reduce_scatter_out.axis, "y");
  EXPECT_EQ(cube_plan(CubeForm::AtB, "y", "z").reduce_scatter_out.axis, "x");
  EXPECT_THROW(cube_plan(CubeForm::AB, "x", "y"), Error);
}

TEST(Cube, GradientsAreCubeProductsWithConsistentLayouts) {
  // Each gradient product must consume the operands in the layouts they have and
  // produce the gradient in its operand's layout (Algorithms 2, 4, 6).
  for (auto [a, c] : std::vector<std::pair<std::string, std::string>>{{"y", "z"}, {"z", "y"}}) {
    for (CubeForm f : {CubeForm::AB, CubeForm::ABt, CubeForm::AtB}) {
      MatrixLayout lay[3] = {cube_layout(f, 0, a, c), cube_layout(f, 1, a, c), cube_layout(f, 2, a, c)};
      auto [ga, gb] = cube_backward(f, a, c);
      int target = 0;
      for (const CubeGrad& g : {ga, gb}) {
        EXPECT_EQ(cube_layout(g.form, 0, g.a, g.c), lay[g.lhs]);
        EXPECT_EQ(cube_layout(g.form, 1, g.a, g.c), lay[g.rhs]);
        EXPECT_EQ(cube_layout(g.form, 2, g.a, g.c), lay[target]);
        ++target;
      }
    }
  }
}
