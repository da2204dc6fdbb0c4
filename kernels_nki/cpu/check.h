// Argument checks of the cpu kernels: DSN_CHECK(cond, parts...) throws std::invalid_argument with the
// parts streamed into one message, which torch's stable ABI raises in Python as ValueError.
#pragma once

#include <sstream>
#include <stdexcept>

namespace dsn {
namespace {

template <class... A>
[[noreturn]] void value_error(const A&... parts) {
  std::ostringstream o;
  (o << ... << parts);
  throw std::invalid_argument(o.str());
}

}  // namespace
}  // namespace dsn

#define DSN_CHECK(cond, ...) \
  if (!(cond)) value_error(__VA_ARGS__)
