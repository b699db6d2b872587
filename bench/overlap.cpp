// Sim overlap benchmark core (see overlap.h).
#include "bench/overlap.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "backends/sim/sim_backend.h"
#include "core/error.h"
#include "core/host_store.h"
#include "core/quant.h"
#include "core/scheduler.h"

namespace layerstream::bench {

namespace {
using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median step time (ms) of `c.steps` steps after one that records the trace:
// every layer is acquired, `before_compute` runs (may be empty), the compute
// (a sleep of c.compute_ms x the layer's multiplier on `compute`) is
// enqueued, and the lease released.
double timed_steps(const OverlapConfig& c, Backend& sim, Scheduler& sched, Stream compute,
                   const std::function<void(const Lease&)>& before_compute) {
  std::vector<double> times;
  for (int step = 0; step < c.steps + 1; ++step) {
    const auto t0 = Clock::now();
    for (int l = 0; l < c.layers; ++l) {
      const auto compute_time =
          std::chrono::microseconds(static_cast<long>(c.compute_ms * c.multiplier(l) * 1000));
      Lease lease = sched.acquire(l, compute);
      if (before_compute) before_compute(lease);
      sim.launch_host_func(compute, [compute_time] { std::this_thread::sleep_for(compute_time); });
      sched.release(lease, compute);
    }
    sim.synchronize(compute);
    const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    if (step > 0) times.push_back(ms);  // step 0 records the trace
  }
  return median(times);
}
}  // namespace

OverlapResult run_overlap_case(const OverlapConfig& c, double ratio, int prefetch) {
  LS_CHECK(c.layers >= 1 && c.compute_ms > 0 && c.layer_mib > 0 && c.steps >= 1,
           "overlap benchmark: layers, compute-ms, layer-mib and steps must be positive");
  LS_CHECK(ratio > 0 && prefetch >= 0, "overlap benchmark: ratio must be positive and prefetch >= 0");
  for (double m : c.pattern) LS_CHECK(m > 0, "overlap benchmark: pattern multipliers must be positive");
  const size_t bytes = static_cast<size_t>(c.layer_mib * 1024 * 1024);  // a layer of multiplier 1
  const double transfer_s = ratio * c.compute_ms / 1000.0;
  SimOptions o;
  o.h2d_gbps = static_cast<double>(bytes) / transfer_s / 1e9;
  o.latency_us = 0;
  o.checker = true;  // the protocol is checked here too
  auto sim = make_sim_backend(o);
  HostStore store(*sim);
  std::vector<LayerSpec> specs;
  double sum_multipliers = 0;
  std::vector<unsigned char> data;
  for (int i = 0; i < c.layers; ++i) {
    sum_multipliers += c.multiplier(i);
    const size_t n = static_cast<size_t>(static_cast<double>(bytes) * c.multiplier(i));
    if (data.size() < n) data.assign(n, 1);
    const size_t idx = store.add(n, data.data(), "layer" + std::to_string(i));
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
  OverlapResult r;
  {
    Scheduler sched(*sim, transfer, specs, so);
    r.step_ms = timed_steps(c, *sim, sched, compute, nullptr);
    const SchedulerStats st = sched.stats();
    r.hit_rate = st.acquires ? static_cast<double>(st.hits) / static_cast<double>(st.acquires) : 0;
  }
  const auto errors = sim->ordering_errors();
  r.ordering_errors = errors.size();
  if (!errors.empty()) r.first_ordering_error = errors[0];
  r.ratio = ratio;
  r.prefetch = prefetch;
  r.slots = so.num_slots;
  const double total_compute = sum_multipliers * c.compute_ms;
  const double total_transfer = sum_multipliers * ratio * c.compute_ms;
  r.ideal_ms = std::max(total_compute, total_transfer);
  r.overlap_ratio = r.step_ms / r.ideal_ms;
  sim->destroy_stream(compute);
  sim->destroy_stream(transfer);
  return r;
}

DequantResult run_dequant_case(const OverlapConfig& c, const std::string& format, double ratio,
                               DequantAt at) {
  LS_CHECK(c.layers >= 1 && c.compute_ms > 0 && c.layer_mib > 0 && c.steps >= 1,
           "dequant benchmark: layers, compute-ms, layer-mib and steps must be positive");
  LS_CHECK(ratio > 0, "dequant benchmark: ratio must be positive");
  LS_CHECK(c.pattern.empty(), "dequant benchmark: layers are uniform here (no pattern)");
  const quant::Format fmt = quant::parse_format(format);
  LS_CHECK(fmt != quant::Format::None, "dequant benchmark needs a quantization format");
  const int64_t cols = 1024;
  const int64_t rows = std::max<int64_t>(1, static_cast<int64_t>(c.layer_mib * 1024 * 1024 / 2) / cols);
  const quant::PackedLayout layout = quant::layout_for(fmt, rows, cols);
  const size_t packed_bytes = layout.total_bytes();
  const size_t dense_bytes = static_cast<size_t>(rows * cols) * 2;  // bf16

  // One packed weight (random normal-ish values), shared by every layer.
  std::vector<float> w(static_cast<size_t>(rows * cols));
  uint32_t x = 12345;
  for (float& v : w) {
    x = x * 1664525u + 1013904223u;
    v = (static_cast<float>(x >> 8) / 16777216.0f - 0.5f) * 0.04f;
  }
  std::vector<unsigned char> packed(packed_bytes);
  quant::pack(fmt, w.data(), rows, cols, packed.data());

  // The CPU dequantization time of one layer, measured here.
  DequantResult r;
  {
    std::vector<unsigned char> out(dense_bytes);
    std::vector<double> t;
    for (int i = 0; i < 5; ++i) {
      const auto t0 = Clock::now();
      quant::dequantize_cpu(layout, packed.data(), out.data(), quant::OutDtype::BF16, 1);
      t.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    }
    r.dequant_ms = median(t);
  }

  const double transfer_s = ratio * c.compute_ms / 1000.0;
  SimOptions o;
  o.h2d_gbps = static_cast<double>(packed_bytes) / transfer_s / 1e9;
  o.latency_us = 0;
  o.checker = true;
  auto sim = make_sim_backend(o);
  HostStore store(*sim);
  Stream transfer = sim->create_stream("transfer");
  Stream compute = sim->create_stream("compute");
  Stream dequant = sim->create_stream("dequant");
  Backend* be = sim.get();
  auto dequantize_into_slot = [be, layout](const BufferRef& slot, const std::vector<size_t>& off,
                                           Stream s) {
    be->declare_access(slot, Access::Read, s, "dequantize (reads the packed weight)");
    be->declare_access(slot, Access::Write, s, "dequantize (writes the workspace)");
    const unsigned char* src = static_cast<const unsigned char*>(slot.ptr) + off.at(0);
    unsigned char* dst = static_cast<unsigned char*>(slot.ptr) + off.at(1);
    be->launch_host_func(s, [layout, src, dst] {
      quant::dequantize_cpu(layout, src, dst, quant::OutDtype::BF16, 1);
    });
  };
  std::vector<LayerSpec> specs;
  for (int i = 0; i < c.layers; ++i) {
    const size_t idx = store.add(packed_bytes, packed.data(), "layer" + std::to_string(i));
    LayerSpec spec("layer" + std::to_string(i), {store.buffer(idx)});
    spec.workspace_bytes = dense_bytes;
    if (at == DequantAt::TransferPath) spec.post_copy = dequantize_into_slot;
    specs.push_back(std::move(spec));
  }
  SchedulerOptions so;
  so.prefetch_depth = 2;
  so.num_slots = 3;
  so.post_copy_stream = dequant;
  if (c.versioned) so.content_version = [](int) -> uint64_t { return 0; };
  {
    Scheduler sched(*sim, transfer, specs, so);
    std::function<void(const Lease&)> at_use;
    if (at == DequantAt::Use)
      at_use = [&](const Lease& lease) { dequantize_into_slot(lease.slot_buf, lease.offsets, compute); };
    r.step_ms = timed_steps(c, *sim, sched, compute, at_use);
  }
  const auto errors = sim->ordering_errors();
  r.ordering_errors = errors.size();
  if (!errors.empty()) r.first_ordering_error = errors[0];
  r.format = quant::to_string(fmt);
  r.at = at;
  r.transfer_ms = ratio * c.compute_ms;
  r.ideal_ms = c.layers * std::max({c.compute_ms, r.transfer_ms, r.dequant_ms});
  sim->destroy_stream(dequant);
  sim->destroy_stream(compute);
  sim->destroy_stream(transfer);
  return r;
}

std::vector<OverlapResult> run_overlap(const OverlapConfig& config, const std::vector<double>& ratios,
                                       const std::vector<int>& prefetches) {
  std::vector<OverlapResult> results;
  for (double ratio : ratios)
    for (int k : prefetches) results.push_back(run_overlap_case(config, ratio, k));
  return results;
}

}  // namespace layerstream::bench
