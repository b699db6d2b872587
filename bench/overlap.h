// Sim overlap benchmark core, shared by bench/bench_overlap.cpp and
// `layerstream bench`.
//
// A stack of N layers, each with a fixed compute time (a sleep on the compute
// stream) and a fixed weight size (both scaled per layer by
// OverlapConfig::pattern); the simulated link bandwidth is set so that
// total transfer time / total compute time equals `ratio`. A case reports the
// median step time over `steps` steps (after one step that records the
// trace) and overlap_ratio = step time / max(total compute, total transfer):
// 1.00 is perfect overlap.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace layerstream::bench {

struct OverlapConfig {
  int layers = 24;
  double compute_ms = 3.0;
  double layer_mib = 1.0;
  int steps = 5;
  // Tell the scheduler the weights never change, so prefetching runs across
  // step boundaries (as the torch glue does with version counters).
  bool versioned = true;
  // Per-layer multipliers of compute_ms and layer_mib, cycled over the layers
  // (empty: all 1). {1, 1, 1, 1, 4, 4} is a transformer block at a fixed
  // token count: q, k, v, o, then a 4x MLP's up and down, each layer's
  // compute proportional to its bytes. Used by run_overlap_case.
  std::vector<double> pattern;
  double multiplier(int layer) const {
    return pattern.empty() ? 1.0 : pattern[static_cast<size_t>(layer) % pattern.size()];
  }
};

// Where a quantized layer is dequantized (run_dequant_case).
enum class DequantAt { TransferPath, Use };

struct DequantResult {
  std::string format;
  DequantAt at = DequantAt::TransferPath;
  double step_ms = 0;        // median step time
  double dequant_ms = 0;     // measured CPU dequantization time of one layer
  double transfer_ms = 0;    // modelled transfer time of one packed layer
  double ideal_ms = 0;       // max(total compute, total transfer, total dequant)
  size_t ordering_errors = 0;
  std::string first_ordering_error;
};

struct OverlapResult {
  double ratio = 0;     // transfer / compute
  int prefetch = 0;
  int slots = 0;
  double step_ms = 0;   // median step time
  double ideal_ms = 0;  // max(total compute, total transfer)
  double overlap_ratio = 0;
  double hit_rate = 0;
  // Races found by the sim device's ordering checker (must be 0).
  size_t ordering_errors = 0;
  std::string first_ordering_error;
};

// One case. Throws layerstream::Error on invalid configs.
OverlapResult run_overlap_case(const OverlapConfig& config, double ratio, int prefetch);

// A stack of `layers` bf16 weights of `layer_mib` MiB each, packed in
// `format`, streamed with prefetch 2 over a link on which one packed layer
// takes `ratio` x compute_ms, and dequantized (the real CPU reference kernel,
// into the slot's workspace) either on the transfer path (scheduler
// post-copy work on a dequant stream of its own) or at use (on the compute
// stream, before the layer's compute). Ordering checker on.
DequantResult run_dequant_case(const OverlapConfig& config, const std::string& format, double ratio,
                               DequantAt at);

// Every (ratio, prefetch) pair, ratios outer.
std::vector<OverlapResult> run_overlap(const OverlapConfig& config,
                                       const std::vector<double>& ratios = {0.5, 1.0, 2.0},
                                       const std::vector<int>& prefetches = {0, 1, 2, 3});

}  // namespace layerstream::bench
