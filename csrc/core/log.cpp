#include "log.h"

#include <cstdio>
#include <mutex>
#include <set>

namespace layerstream {
namespace {
std::mutex g_mu;
WarningHandler g_handler;
std::set<std::string> g_seen;
}  // namespace

WarningHandler set_warning_handler(WarningHandler handler) {
  std::lock_guard<std::mutex> lock(g_mu);
  WarningHandler prev = std::move(g_handler);
  g_handler = std::move(handler);
  return prev;
}

void warn(const std::string& message) {
  WarningHandler h;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    h = g_handler;
  }
  if (h) {
    h(message);
  } else {
    std::fprintf(stderr, "layerstream: warning: %s\n", message.c_str());
  }
}

void warn_once(const std::string& key, const std::string& message) {
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (!g_seen.insert(key).second) return;
  }
  warn(message);
}

}  // namespace layerstream
