// Overlap benchmark on the sim device (a benchmark, not a test).
//
// A stack of N layers, each with a fixed compute time (a sleep on the compute
// stream) and a fixed weight size; the link bandwidth is set so that total
// transfer time / total compute time is 0.5, 1 and 2. For each ratio and
// prefetch depth it prints step time / max(total compute, total transfer):
// 1.00 is perfect overlap. Goal: <= 1.10 at every ratio with prefetch >= 2.
//
//   build/bench/bench_overlap [--layers 24] [--compute-ms 3] [--layer-mib 1]
//                             [--steps 5] [--json] [--no-versions]
// --no-versions: the scheduler is not told that weights are unchanged, so
// it drops slot content and stops prefetching at every step boundary. [--no-versions]
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench/overlap.h"

using layerstream::bench::OverlapConfig;
using layerstream::bench::OverlapResult;

namespace {

struct Config : OverlapConfig {
  bool json = false;
};

}  // namespace

int main(int argc, char** argv) {
  Config c;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "bench_overlap: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--layers") c.layers = std::atoi(next());
    else if (a == "--compute-ms") c.compute_ms = std::atof(next());
    else if (a == "--layer-mib") c.layer_mib = std::atof(next());
    else if (a == "--steps") c.steps = std::atoi(next());
    else if (a == "--json") c.json = true;
    else if (a == "--no-versions") c.versioned = false;
    else {
      std::fprintf(stderr, "usage: bench_overlap [--layers N] [--compute-ms MS] [--layer-mib MIB] [--steps N] [--json] [--no-versions]\n");
      return 2;
    }
  }
  if (c.layers < 1 || c.compute_ms <= 0 || c.layer_mib <= 0 || c.steps < 1) {
    std::fprintf(stderr, "bench_overlap: layers, compute-ms, layer-mib and steps must be positive\n");
    return 2;
  }
  std::vector<OverlapResult> results;
  for (double ratio : {0.5, 1.0, 2.0})
    for (int k : {0, 1, 2, 3}) {
      results.push_back(layerstream::bench::run_overlap_case(c, ratio, k));
      const OverlapResult& r = results.back();
      if (r.ordering_errors) {
        std::fprintf(stderr, "ordering errors: %zu, first: %s\n", r.ordering_errors,
                     r.first_ordering_error.c_str());
        return 1;
      }
    }

  if (c.json) {
    std::printf("[");
    for (size_t i = 0; i < results.size(); ++i) {
      const OverlapResult& r = results[i];
      std::printf("%s{\"transfer_over_compute\": %.2f, \"prefetch\": %d, \"slots\": %d, "
                  "\"step_ms\": %.3f, \"ideal_ms\": %.3f, \"overlap_ratio\": %.4f, \"hit_rate\": %.3f}",
                  i ? ", " : "", r.ratio, r.prefetch, r.slots, r.step_ms, r.ideal_ms,
                  r.overlap_ratio, r.hit_rate);
    }
    std::printf("]\n");
    return 0;
  }
  std::printf("sim overlap: %d layers x %.2f ms compute, %.2f MiB each, median of %d steps\n",
              c.layers, c.compute_ms, c.layer_mib, c.steps);
  std::printf("%-18s %-9s %-6s %-10s %-10s %-14s %s\n", "transfer/compute", "prefetch", "slots",
              "step ms", "ideal ms", "step/ideal", "hit rate");
  for (const OverlapResult& r : results)
    std::printf("%-18.2f %-9d %-6d %-10.2f %-10.2f %-14.3f %.2f\n", r.ratio, r.prefetch, r.slots,
                r.step_ms, r.ideal_ms, r.overlap_ratio, r.hit_rate);
  return 0;
}
