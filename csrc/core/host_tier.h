// layerstream core — the host budget plan: where each streamed weight lives
// on the host, written once for offload() (Python and C++), the engine and
// `layerstream plan` (docs/design/host-tier.md).
//
// Given each streamed layer's host bytes and whether it may stay in its file
// (frozen, loaded by load_safetensors()/load_gguf()), a host budget and a
// pinned budget:
//  * When every layer fits in the host budget, all are in RAM (the store).
//  * The gradients' staging buffers (training) are always in RAM and count
//    first.
//  * Otherwise every layer that may stay in its file does (the disk tier),
//    and the RAM left after the layers that must be in RAM (trainable, or not
//    from a file) and the gradients' buffers is the staging cache: entries the disk reads go into, kept
//    by farthest next use in the traced schedule, so what RAM there is holds
//    the layers needed soonest. It must hold two of the largest disk layer.
//  * Pinned memory: the staging entries are pinned first (they are what the
//    device copies from), then the store up to what is left of the pinned
//    budget; store tensors beyond it are pageable and cross through the
//    staging entries (copied to a pinned entry on a host thread, then to the
//    device), so their copies stay asynchronous. Those entries are as many as
//    the pinned budget holds (two at least; all pageable below two), and two
//    at least: a host budget without room for them beside the store sends the
//    layers that may stay in their file to the disk tier, or is an error.
//
// Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace layerstream::host_tier {

constexpr int64_t kUnlimited = -1;

struct Layer {
  std::string name;
  uint64_t bytes = 0;     // host bytes (weight and bias as stored)
  bool from_file = false; // may stay in its file (frozen, read-only source)
  // Training: the host bytes of its gradient's staging buffer (the engine's
  // copy target for the gradient, one per use in a backward;
  // slot_layout::gradient_bytes), 0 when it gets no gradient. Always in RAM.
  uint64_t grad_bytes = 0;
};

struct Plan {
  std::vector<bool> on_disk;    // per layer
  uint64_t store_bytes = 0;     // layers in RAM
  uint64_t disk_bytes = 0;      // layers read from their files on every use
  uint64_t staging_bytes = 0;   // the staging entries (0: none needed)
  uint64_t grad_staging_bytes = 0;  // the gradients' staging buffers (Layer::grad_bytes, one use each)
  bool staging_pinned = true;   // the entries fit the pinned budget
  int64_t store_pinned_cap = kUnlimited;  // pinned bytes the store may take
  uint64_t pageable_store_bytes = 0;      // store bytes beyond that cap: a floor (the store pins whole
                                          // tensors; EngineStats::pageable_bytes, what it made)
  // What the budgets leave for the engine's other host buffers (the saved
  // activations' copies, EngineOptions::activation_host_cap / _pinned_cap):
  // kUnlimited when that budget is.
  int64_t spare_host_bytes = kUnlimited;
  int64_t spare_pinned_bytes = kUnlimited;
  // Pinned bytes the gradients' staging buffers may take (they are pinned
  // after the staging entries, before the store); beyond: pageable.
  int64_t grad_pinned_cap = kUnlimited;
  uint64_t host_bytes() const { return store_bytes + staging_bytes + grad_staging_bytes; }
};

// `prefetch` is the engine's prefetch depth: the staging entries hold at
// least prefetch + 2 of the largest staged layer when they can. Throws
// layerstream::Error saying what to raise when the host budget cannot hold
// the layers that must be in RAM plus two entries.
Plan plan(const std::vector<Layer>& layers, int64_t host_budget, int64_t pinned_budget, int prefetch);

// Whether a streamed layer may stay in its file (Layer::from_file): the rule
// offload() and `layerstream plan --host-budget` share. A frozen Linear weight
// (and bias) that the file holds in the model's dtype (`as_stored`: not cast
// as read, docs/design/host-tier.md "Cast as read"), streamed as it is or,
// with a cache directory, packed in the quantization cache
// (core/io/quant_cache.h); never lossless, which is coded in RAM. `format`:
// "" or "none" for none, else the quantization format's name.
bool may_stay_in_file(bool linear, bool frozen, bool as_stored, const std::string& format, bool cache_dir);
// The same rule, saying why not: every reason that holds, in this order:
// "not_linear", "trainable", "cast" (not as_stored), "lossless", "quantized"
// (quantized without a cache directory); empty when the layer may stay.
// offload()'s host budget error names the layers by these reasons
// (python/layerstream/_host_plan.py), so that its advice follows the rule.
std::vector<std::string> in_ram_reasons(bool linear, bool frozen, bool as_stored, const std::string& format,
                                        bool cache_dir);

// The default host budget: what this machine can give now (MemAvailable of
// /proc/meminfo) minus a margin of 10% of MemTotal (at least 2 GiB) for the
// process and the system; kUnlimited when /proc/meminfo cannot be read.
int64_t default_host_budget();
// The default pinned budget: unlimited on Linux; under WSL (/proc/version
// names Microsoft), where the driver cannot pin more than about half of the
// RAM, 40% of MemTotal.
int64_t default_pinned_budget();

}  // namespace layerstream::host_tier
