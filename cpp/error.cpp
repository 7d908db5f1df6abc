#include "error.h"

namespace gridweave {

std::string join_ranks(const std::vector<int>& ranks) {
  std::ostringstream os;
  os << "[";
  for (std::size_t i = 0; i < ranks.size(); ++i) os << (i ? ", " : "") << ranks[i];
  os << "]";
  return os.str();
}

}  // namespace gridweave
