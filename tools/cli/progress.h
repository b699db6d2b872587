// Small helpers shared by the CLI subcommands: a text progress bar and
// option-value parsing. Header-only, torch-free.
#pragma once

#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "core/error.h"
#include "core/options.h"
#include "core/planner.h"

namespace layerstream::cli {

// Bad usage: the command prints `message` on one line and exits with 2.
struct UsageError {
  std::string message;
};

// "[#####.....]" for done/total.
inline std::string progress_bar(int done, int total, int width = 20) {
  const int filled = total > 0 ? static_cast<int>(static_cast<int64_t>(done) * width / total) : width;
  return "[" + std::string(static_cast<size_t>(filled), '#') +
         std::string(static_cast<size_t>(width - filled), '.') + "]";
}

// Progress on stdout. On a terminal, a "running" line is redrawn in place with
// \r while a step runs and replaced by the step's result line; otherwise only
// the result lines are printed, one per step.
class Progress {
 public:
  explicit Progress(int total) : total_(total), tty_(isatty(fileno(stdout)) != 0) {}
  bool tty() const { return tty_; }
  // Call before step `step` (1-based) starts.
  void running(int step, const std::string& what = "") {
    if (!tty_) return;
    std::printf("\r\033[K%s step %d/%d %s", progress_bar(step - 1, total_).c_str(), step, total_,
                what.c_str());
    std::fflush(stdout);
  }
  // Call when step `step` is done; `columns` follows the bar and step count.
  void done(int step, const std::string& columns) {
    std::printf("%s%s step %*d/%d  %s\n", tty_ ? "\r\033[K" : "", progress_bar(step, total_).c_str(),
                width(total_), step, total_, columns.c_str());
    std::fflush(stdout);
  }

 private:
  static int width(int n) { return static_cast<int>(std::to_string(n).size()); }
  int total_;
  bool tty_;
};

inline int parse_int(const std::string& flag, const std::string& v, int lo, int hi) {
  char* end = nullptr;
  const long n = std::strtol(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || n < lo || n > hi)
    throw UsageError{flag + " expects an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) +
                     "], got '" + v + "'"};
  return static_cast<int>(n);
}

// A size for `flag`, by the project's one size rule (parse_bytes in
// core/planner.h: "1048576", "1.5MiB", "2MB", "512KiB", "1e6", "3G";
// K/M/G/T = powers of 1000, Ki/Mi/Gi/Ti = powers of 1024; B optional;
// whole bytes), above 0.
inline int64_t parse_size(const std::string& flag, const std::string& v) {
  uint64_t n = 0;
  try {
    n = layerstream::parse_bytes(v);
  } catch (const layerstream::Error& e) {
    throw UsageError{flag + ": " + e.message()};
  }
  if (n == 0 || n >= (uint64_t{1} << 63))
    throw UsageError{flag + " expects a size above 0 and below 2^63 bytes, such as 2MiB, got '" + v + "'"};
  return static_cast<int64_t>(n);
}

// A device budget on the command line is a byte count: "auto" and "40%"
// (offload()'s shares of free device memory, options::names_share) are
// refused naming the forms taken; `why` says why `command` has no free
// device memory to take a share of.
inline void refuse_budget_share(const std::string& flag, const std::string& v, const char* command,
                                const char* why) {
  if (layerstream::options::names_share(v))
    throw UsageError{flag + " '" + v + "': " + command + " needs a byte count (" + why +
                     "): a size such as 2MiB, 1.5GiB, 500MB, 1e6 or 1048576 (bytes; K/M/G/T = powers of 1000, "
                     "Ki/Mi/Gi/Ti = powers of 1024)"};
}

// Value of option argv[i] (either "--flag value" or "--flag=value"); advances i.
inline bool take_option(int argc, char** argv, int& i, const std::string& flag, std::string& value) {
  const std::string a = argv[i];
  if (a == flag) {
    if (i + 1 >= argc) throw UsageError{flag + " needs a value"};
    value = argv[++i];
    return true;
  }
  if (a.rfind(flag + "=", 0) == 0) {
    value = a.substr(flag.size() + 1);
    return true;
  }
  return false;
}

}  // namespace layerstream::cli
