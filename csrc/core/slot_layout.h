// layerstream core — the byte layout of a device slot: one rule, used by the
// engine (csrc/torch), the planner, the CLI and Python (through _C).
//
// A slot holds one streamed layer: its copied parts (the tensors as the host
// store holds them — dense, or packed), each starting on a kAlign boundary,
// then the workspace that the post-copy step writes after the copy (a packed
// weight dequantized, a weight or bias cast to compute_dtype), whose parts
// also start on kAlign boundaries. A layer's weight gradient goes through a
// slot too (scratch): the weight's gradient, then the bias's at an aligned
// offset. The slot size of an engine is the largest of these over its
// layers. docs/design/streaming-core.md "Slots".
//
// Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <vector>

#include "align.h"

namespace layerstream::slot_layout {

// Every part of a slot starts on this boundary (also the packed formats'
// section alignment, quant::kSectionAlign, which is defined from it).
constexpr uint64_t kAlign = 256;

constexpr uint64_t align(uint64_t bytes) { return round_up(bytes, kAlign); }

// One tensor of a layer: the bytes that cross the bus (as stored on the
// host) and the bytes the post-copy step writes into the workspace for it
// (0: used as copied).
struct Part {
  uint64_t bus = 0;
  uint64_t written = 0;
};

struct Layout {
  uint64_t bus_bytes = 0;        // the copied parts, each aligned
  uint64_t workspace_bytes = 0;  // the written parts, each aligned
  // Per part: its offset in the workspace (meaningful when it writes one).
  std::vector<uint64_t> workspace_offsets;
  uint64_t slot_bytes() const { return bus_bytes + workspace_bytes; }
};

// The layout of a layer's parts, in order.
Layout of(const std::vector<Part>& parts);

// The scratch bytes of a weight gradient (weight, then bias) and where the
// bias's gradient starts.
constexpr uint64_t gradient_bias_offset(uint64_t weight_bytes) { return align(weight_bytes); }
constexpr uint64_t gradient_bytes(uint64_t weight_bytes, uint64_t bias_bytes) {
  return gradient_bias_offset(weight_bytes) + bias_bytes;
}

}  // namespace layerstream::slot_layout
