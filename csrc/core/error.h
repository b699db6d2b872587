// layerstream — error reporting.
//
// One family of check macros for the whole project. Every failure throws
// layerstream::Error whose message carries file:line and a composed sentence.
// User-facing messages must say what to change. No bare C asserts: they vanish in release builds.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace layerstream {

// Thrown for every error raised by layerstream. what() is "<message> (file:line)".
class Error : public std::runtime_error {
 public:
  Error(std::string message, const char* file, int line)
      : std::runtime_error(message + " (" + file + ":" + std::to_string(line) + ")"),
        message_(std::move(message)) {}
  // The message without the source location, for one-line CLI output.
  const std::string& message() const noexcept { return message_; }

 private:
  std::string message_;
};

namespace detail {
inline void append(std::ostringstream&) {}
template <typename T, typename... Rest>
void append(std::ostringstream& os, const T& v, const Rest&... rest) {
  os << v;
  append(os, rest...);
}
template <typename... Args>
std::string compose(const Args&... args) {
  std::ostringstream os;
  append(os, args...);
  return os.str();
}
[[noreturn]] inline void fail(const char* file, int line, std::string msg) {
  throw Error(std::move(msg), file, line);
}
}  // namespace detail
}  // namespace layerstream

// LS_CHECK(cond, parts...): throw layerstream::Error composed of parts if !cond.
#define LS_CHECK(cond, ...)                                                            \
  do {                                                                                 \
    if (!(cond)) {                                                                     \
      ::layerstream::detail::fail(__FILE__, __LINE__,                                  \
                                  ::layerstream::detail::compose(__VA_ARGS__));        \
    }                                                                                  \
  } while (0)

// LS_FAIL(parts...): throw unconditionally.
#define LS_FAIL(...) \
  ::layerstream::detail::fail(__FILE__, __LINE__, ::layerstream::detail::compose(__VA_ARGS__))

// LS_INTERNAL_CHECK(cond): an invariant of layerstream itself was broken (a bug, not a user error).
#define LS_INTERNAL_CHECK(cond, ...) \
  LS_CHECK(cond, "internal error in layerstream (please report): ", #cond, " ", ##__VA_ARGS__)
