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
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "backends/sim/sim_backend.h"
#include "core/host_store.h"
#include "core/scheduler.h"

using namespace layerstream;
using Clock = std::chrono::steady_clock;

namespace {

struct Config {
  int layers = 24;
  double compute_ms = 3.0;
  double layer_mib = 1.0;
  int steps = 5;
  bool json = false;
  bool versioned = true;
};

struct Result {
  double ratio;
  int prefetch;
  int slots;
  double step_ms;
  double ideal_ms;
  double overlap_ratio;
  double hit_rate;
};

Result run_case(const Config& c, double ratio, int prefetch) {
  const size_t bytes = static_cast<size_t>(c.layer_mib * 1024 * 1024);
  const double transfer_s = ratio * c.compute_ms / 1000.0;
  SimOptions o;
  o.h2d_gbps = static_cast<double>(bytes) / transfer_s / 1e9;
  o.latency_us = 0;
  o.checker = true;  // the protocol is checked here too
  auto sim = make_sim_backend(o);
  HostStore store(*sim);
  std::vector<LayerSpec> specs;
  std::vector<unsigned char> data(bytes, 1);
  for (int i = 0; i < c.layers; ++i) {
    const size_t idx = store.add(bytes, data.data(), "layer" + std::to_string(i));
    specs.push_back(LayerSpec{"layer" + std::to_string(i), {store.buffer(idx)}});
  }
  Stream transfer = sim->create_stream("transfer");
  Stream compute = sim->create_stream("compute");
  SchedulerOptions so;
  so.prefetch_depth = prefetch;
  so.num_slots = prefetch + 1;
  // The host weights never change here (inference): say so, as the torch
  // glue does with tensor version counters, so prefetching runs across steps.
  if (c.versioned) so.content_version = [](int) -> uint64_t { return 0; };
  Result r{};
  {
    Scheduler sched(*sim, transfer, specs, so);
    const auto compute_time = std::chrono::microseconds(static_cast<long>(c.compute_ms * 1000));
    std::vector<double> times;
    for (int step = 0; step < c.steps + 1; ++step) {
      const auto t0 = Clock::now();
      for (int l = 0; l < c.layers; ++l) {
        Lease lease = sched.acquire(l, compute);
        sim->launch_host_func(compute, [compute_time] { std::this_thread::sleep_for(compute_time); });
        sched.release(lease, compute);
      }
      sim->synchronize(compute);
      const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
      if (step > 0) times.push_back(ms);  // step 0 records the trace
    }
    std::sort(times.begin(), times.end());
    r.step_ms = times[times.size() / 2];
    const SchedulerStats st = sched.stats();
    r.hit_rate = st.acquires ? static_cast<double>(st.hits) / static_cast<double>(st.acquires) : 0;
  }
  const auto errors = sim->ordering_errors();
  if (!errors.empty()) {
    std::fprintf(stderr, "ordering errors: %zu, first: %s\n", errors.size(), errors[0].c_str());
    std::exit(1);
  }
  r.ratio = ratio;
  r.prefetch = prefetch;
  r.slots = so.num_slots;
  const double total_compute = c.layers * c.compute_ms;
  const double total_transfer = c.layers * ratio * c.compute_ms;
  r.ideal_ms = std::max(total_compute, total_transfer);
  r.overlap_ratio = r.step_ms / r.ideal_ms;
  sim->destroy_stream(compute);
  sim->destroy_stream(transfer);
  return r;
}

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
  std::vector<Result> results;
  for (double ratio : {0.5, 1.0, 2.0})
    for (int k : {0, 1, 2, 3}) results.push_back(run_case(c, ratio, k));

  if (c.json) {
    std::printf("[");
    for (size_t i = 0; i < results.size(); ++i) {
      const Result& r = results[i];
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
  for (const Result& r : results)
    std::printf("%-18.2f %-9d %-6d %-10.2f %-10.2f %-14.3f %.2f\n", r.ratio, r.prefetch, r.slots,
                r.step_ms, r.ideal_ms, r.overlap_ratio, r.hit_rate);
  return 0;
}
