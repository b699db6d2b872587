#include "host_memory.h"

#include <fstream>
#include <sstream>

namespace layerstream {

HostMemory parse_meminfo(const std::string& text) {
  HostMemory m;
  std::istringstream in(text);
  std::string key, unit;
  unsigned long long value = 0;
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    unit.clear();
    if (!(fields >> key >> value)) continue;
    fields >> unit;
    const uint64_t bytes = static_cast<uint64_t>(value) * (unit == "kB" ? 1024u : 1u);
    if (key == "MemTotal:") m.total_bytes = bytes;
    else if (key == "MemAvailable:") m.available_bytes = bytes;
  }
  return m;
}

HostMemory host_memory() {
  std::ifstream f("/proc/meminfo");
  if (!f) return {};
  std::ostringstream text;
  text << f.rdbuf();
  return parse_meminfo(text.str());
}

}  // namespace layerstream
