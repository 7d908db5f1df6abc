// 3-D parallel matrix multiplication on a p x p x p cube (Bian et al., §3.1): the block
// layout of every operand and which collective runs on which axis at each step.
// Local GEMMs are done by the caller (torch); the engine owns the choreography.
//
// Directions: weights always on "x"; `a` is the direction of the input A and `c`
// that of the output C (Algorithm 1: a = "y", c = "z"). After a Linear the next
// layer swaps them (§3.1.3).
#pragma once
#include <string>
#include <utility>
#include <vector>

namespace gridweave {

enum class CubeForm : int { AB = 0, ABt = 1, AtB = 2 };

// One operand's layout: for each of its two dims, the axes splitting it, outermost first.
using MatrixLayout = std::vector<std::vector<std::string>>;

// operand: 0 = lhs (A), 1 = rhs (B), 2 = out (C). Bian et al. §3.1.1:
//   AB : A_ijl [(x,a) | c]   B_lji [c | (a,x)]   C_ilj [(x,c) | a]
//   ABt: A     [(x,a) | c]   B     [a | (c,x)]   C     [(x,c) | a]
//   AtB: A     [(x,a) | c]   B     [(x,c) | a]   C     [c | (a,x)]
MatrixLayout cube_layout(CubeForm form, int operand, const std::string& a, const std::string& c);

// Algorithms 7-8: a vector (a bias, layer-norm gamma and beta) added to columns split over
// `col` is stored once, on the diagonal ranks (whose `col` and row coordinates agree, Fig. 5),
// split over (col, x). Returns that one-dimensional layout.
MatrixLayout cube_vector_layout(const std::string& col);

// Element range [begin, end) of this rank's block along one dimension of length n split
// by axes of the given sizes, where this rank's coordinates on them are `coords`
// (row-major, the first axis outermost). The block index math of every layout.
struct Range {
  long long begin = 0, end = 0;
};
Range block_range(long long n, const std::vector<int>& sizes, const std::vector<int>& coords);

struct CubeStep {
  std::string axis;
  int dim = 0;
};

// Algorithms 1, 3, 5: all-gather lhs, all-gather rhs, local GEMM, reduce-scatter out.
struct CubePlan {
  CubeStep gather_lhs, gather_rhs, reduce_scatter_out;
  bool trans_lhs = false, trans_rhs = false;
};
CubePlan cube_plan(CubeForm form, const std::string& a, const std::string& c);

// Algorithms 2, 4, 6: each gradient is itself a cube product. Operands: 0 = A,
// 1 = B, 2 = dC.
struct CubeGrad {
  CubeForm form;
  std::string a, c;
  int lhs, rhs;
};
std::pair<CubeGrad, CubeGrad> cube_backward(CubeForm form, const std::string& a, const std::string& c);

}  // namespace gridweave
