// Rounding a size up to a multiple: buffer alignment, pages, slots, file sections.
// Header-only, no state; usable from any thread.
#pragma once

#include <cstdint>

namespace layerstream {

// `v` rounded up to a multiple of `to` (> 0); `v + to - 1` must not overflow
// (a size from outside is checked first, as the CUDA backend's allocations do).
constexpr uint64_t round_up(uint64_t v, uint64_t to) { return (v + to - 1) / to * to; }

}  // namespace layerstream
