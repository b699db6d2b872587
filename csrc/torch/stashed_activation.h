// layerstream — LibTorch glue: one saved activation's entry in the engine
// (EngineImpl::Stashed; engine_activations.cpp, docs/design/activations.md).
// Plain data, owned by the engine's map of tokens and guarded by its lock.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "core/runtime.h"

namespace layerstream {

struct StashedActivation {
  // Held while kept. Offloaded: until its copy to the host has finished (sim;
  // memory not torch's caching allocator's), else given to the allocator at once.
  torch::Tensor device;
  std::vector<int64_t> sizes, strides;
  torch::TensorOptions options;
  size_t bytes = 0;
  bool offloaded = false;  // false: kept on the device (so far)
  bool in_window = false;  // among the newest saved tensors the device budget keeps
  HostBuffer host;
  Event to_host;           // after the copy to the host
  BufferRef device_ref;    // the device tensor's memory, as the checker knows it
  torch::Tensor restored;  // copied back (prefetched), not yet handed out
  BufferRef restored_ref;
  Event to_device;         // after the newest copy back
  bool copying_back = false;
  bool handed_out = false;  // a copy back was handed to autograd (handed_out_ counts its bytes)
  int handed_task = -1;     // the graph task of the last hand-out (-1: outside a backward)
  int prefetch_task = -1;   // the graph task whose prefetch started the copy back
  std::optional<c10::VariableVersion> version;  // the saved tensor's counter (check_saved_version)
  uint32_t saved_version = 0;
  // Note [A tensor saved by several ops] (engine_activations.cpp). An alias
  // (primary >= 0) holds nothing but its version: its primary's entry holds
  // the data for both. A primary: `sharers`, its own token and its aliases'
  // not dropped yet; `storage` and `data`, where the saved tensor's data was
  // (a later save of the same data, unchanged, becomes an alias); `shared`,
  // its copy back while other sharers may still unpack it (until their last
  // unpack, or the end of graph task shared_task).
  int64_t primary = -1;
  int sharers = 1;
  std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>> storage;
  const void* data = nullptr;
  torch::Tensor shared;
  int shared_task = -1;
};

}  // namespace layerstream
