#include "cube.h"

#include "error.h"

namespace gridweave {

namespace {
void check_dirs(const std::string& a, const std::string& c) {
  GW_CHECK((a == "y" && c == "z") || (a == "z" && c == "y"),
           "3-D directions must be (a, c) = (y, z) or (z, y) with weights on x; got (" << a << ", " << c << ")");
}
}  // namespace

Range block_range(long long n, const std::vector<int>& sizes, const std::vector<int>& coords) {
  GW_CHECK(sizes.size() == coords.size(), "block_range: " << sizes.size() << " sizes but " << coords.size()
                                                            << " coordinates");
  long long parts = 1, index = 0;
  for (std::size_t k = 0; k < sizes.size(); ++k) {
    GW_CHECK(sizes[k] >= 1 && coords[k] >= 0 && coords[k] < sizes[k],
             "block_range: coordinate " << coords[k] << " outside an axis of size " << sizes[k]);
    parts *= sizes[k];
    index = index * sizes[k] + coords[k];
  }
  GW_CHECK(n % parts == 0, "a dimension of size " << n << " does not split over " << parts << " ranks");
  const long long len = n / parts;
  return {index * len, (index + 1) * len};
}

MatrixLayout cube_layout(CubeForm form, int operand, const std::string& a, const std::string& c) {
  check_dirs(a, c);
  GW_CHECK(operand >= 0 && operand <= 2, "cube operand must be 0 (A), 1 (B) or 2 (C)");
  const MatrixLayout input = {{"x", a}, {c}};
  const MatrixLayout output = {{"x", c}, {a}};
  switch (form) {
    case CubeForm::AB:
      return operand == 0 ? input : operand == 1 ? MatrixLayout{{c}, {a, "x"}} : output;
    case CubeForm::ABt:
      return operand == 0 ? input : operand == 1 ? MatrixLayout{{a}, {c, "x"}} : output;
    case CubeForm::AtB:
      return operand == 0 ? input : operand == 1 ? output : MatrixLayout{{c}, {a, "x"}};
  }
  GW_CHECK(false, "unknown cube form " << static_cast<int>(form));
  return {};
}

MatrixLayout cube_vector_layout(const std::string& col) {
  GW_CHECK(col == "y" || col == "z", "a 3-D vector's columns are split over y or z, got '" << col << "'");
  return {{col, "x"}};
}

CubePlan cube_plan(CubeForm form, const std::string& a, const std::string& c) {
  check_dirs(a, c);
  CubePlan p;
  switch (form) {
    case CubeForm::AB:  // Algorithm 1: all-gather A_il in a, B_lj in x; C_ilj by reduce-scatter in c
      p.gather_lhs = {a, 0};
      p.gather_rhs = {"x", 1};
      p.reduce_scatter_out = {c, 0};
      break;
    case CubeForm::ABt:  // Algorithm 3
      p.gather_lhs = {a, 0};
      p.gather_rhs = {"x", 1};
      p.trans_rhs = true;
      p.reduce_scatter_out = {c, 0};
      break;
    case CubeForm::AtB:  // Algorithm 5
      p.gather_lhs = {a, 0};
      p.gather_rhs = {c, 0};
      p.trans_lhs = true;
      p.reduce_scatter_out = {"x", 1};
      break;
  }
  return p;
}

std::pair<CubeGrad, CubeGrad> cube_backward(CubeForm form, const std::string& a, const std::string& c) {
  check_dirs(a, c);
  switch (form) {
    case CubeForm::AB:  // Algorithm 2: dA = dC B^T (a, c swapped), dB = A^T dC
      return {{CubeForm::ABt, c, a, 2, 1}, {CubeForm::AtB, a, c, 0, 2}};
    case CubeForm::ABt:  // Algorithm 4: dA = dC B, dB = dC^T A
      return {{CubeForm::AB, c, a, 2, 1}, {CubeForm::AtB, c, a, 2, 0}};
    case CubeForm::AtB:  // Algorithm 6: dA = B dC^T, dB = A dC
      return {{CubeForm::ABt, c, a, 1, 2}, {CubeForm::AB, a, c, 0, 2}};
  }
  GW_CHECK(false, "unknown cube form " << static_cast<int>(form));
  return {};
}

}  // namespace gridweave
