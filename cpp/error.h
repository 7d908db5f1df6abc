// One error type for the engine. Its kind maps to gridweave.GridError (a bad
// configuration or argument), gridweave.CommError and gridweave.CommTimeout.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace gridweave {

enum class ErrorKind : int { Config = 0, Comm = 1, Timeout = 2 };

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& what) : std::runtime_error(what), kind_(kind) {}
  ErrorKind kind() const { return kind_; }

 private:
  ErrorKind kind_;
};

std::string join_ranks(const std::vector<int>& ranks);

}  // namespace gridweave

// GW_CHECK(cond, "message " << value): a configuration error with a clear string.
#define GW_CHECK(cond, msg)                                                     \
  do {                                                                          \
    if (!(cond)) {                                                              \
      std::ostringstream gw_check_os_;                                          \
      gw_check_os_ << "gridweave: " << msg;                                     \
      throw ::gridweave::Error(::gridweave::ErrorKind::Config, gw_check_os_.str()); \
    }                                                                           \
  } while (0)
