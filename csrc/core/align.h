// Rounding a size up to a multiple: buffer alignment, pages, slots, file sections.
// Header-only, no state; usable from any thread.
#pragma once

#include <cstdint>

namespace layerstream {

// `v` rounded up to a multiple of `to` (> 0). The caller keeps `v + to - 1`
// from overflowing (sizes checked against SIZE_MAX - to where they come in).
constexpr uint64_t round_up(uint64_t v, uint64_t to) { return (v + to - 1) / to * to; }

}  // namespace layerstream
