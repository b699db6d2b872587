// Sim overlap benchmark core, shared by bench/bench_overlap.cpp and
// `layerstream bench`.
//
// A stack of N layers, each with a fixed compute time (a sleep on the compute
// stream) and a fixed weight size; the simulated link bandwidth is set so that
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

// Every (ratio, prefetch) pair, ratios outer.
std::vector<OverlapResult> run_overlap(const OverlapConfig& config,
                                       const std::vector<double>& ratios = {0.5, 1.0, 2.0},
                                       const std::vector<int>& prefetches = {0, 1, 2, 3});

}  // namespace layerstream::bench
