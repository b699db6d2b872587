// layerstream — this machine's host memory (torch-free, CUDA-free).
//
// What plans and budgets compare host bytes with: the `layerstream plan`
// warning when the host RAM a plan needs exceeds the machine's, and, through
// _C.host_memory(), the Python side. Linux reads /proc/meminfo; elsewhere both
// figures are 0 (unknown). Thread-safe (no state).
#pragma once

#include <cstdint>
#include <string>

namespace layerstream {

struct HostMemory {
  uint64_t total_bytes = 0;      // MemTotal (0: unknown)
  uint64_t available_bytes = 0;  // MemAvailable: what can be allocated without swapping (0: unknown)
};

// This machine's memory now (reads /proc/meminfo on each call).
HostMemory host_memory();

// Parses the text of /proc/meminfo ("MemTotal:  32768 kB" lines); fields it
// lacks stay 0. host_memory() is this applied to the file.
HostMemory parse_meminfo(const std::string& text);

}  // namespace layerstream
