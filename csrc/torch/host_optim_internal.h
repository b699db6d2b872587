// layerstream — internal: what host_optim.cpp (the steps over tensors) and
// host_overlap.cpp (the steps overlapped with a backward) share. Not installed.
#pragma once

#include <torch/torch.h>

#include <vector>

#include "layerstream/host_optim.h"

namespace layerstream {
namespace optim {

// The kernels write parameters through raw pointers: bump their version
// counters as an in-place torch op would, so that what watches them (the
// engine's cache_across_steps, a saved tensor's check) sees the update.
void bump_versions(const std::vector<torch::Tensor>& params);

// `g` in the layout of `like` (a copy when it differs).
torch::Tensor in_layout_of(const torch::Tensor& g, const torch::Tensor& like);

// The kernels' view of host parameter `p` (the i-th of a step) and its
// states, after checking they match; the gradient is the caller's to set.
AdamWTensor host_tensor(const torch::Tensor& p, const AdamWStates& s, StateFormat format, size_t i, int64_t step,
                        uint64_t key);

}  // namespace optim
}  // namespace layerstream
