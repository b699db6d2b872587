// TraceRecorder: slices, Chrome trace JSON, overlap fraction; and the
// scheduler's per-step counters and copy slices on the sim device.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "backends/sim/sim_backend.h"
#include "core/host_store.h"
#include "core/json.h"
#include "core/scheduler.h"
#include "core/telemetry.h"

using namespace layerstream;

TEST(TraceRecorder, OverlapFractionOfCopiesHiddenBehindCompute) {
  TraceRecorder t;
  t.add({"compute", "fwd a", 0, 100, 0});
  t.add({"compute", "fwd b", 150, 200, 0});
  t.add({"transfer", "H2D x", 50, 150, 10});   // 50 of 100 hidden
  t.add({"transfer", "H2D y", 160, 180, 10});  // fully hidden
  EXPECT_NEAR(t.overlap_fraction("transfer", "compute"), 70.0 / 120.0, 1e-9);
  EXPECT_NEAR(t.overlap_fraction("transfer", "compute", 155, 200), 1.0, 1e-9);
  EXPECT_TRUE(std::isnan(t.overlap_fraction("grad", "compute")));
}

// The batched form (one pass for every step's window) against the definition,
// evaluated on a grid of 1/4-us cells: overlapping and touching compute slices,
// copies longer than a window, windows between slices, a window covering all.
TEST(TraceRecorder, OverlapFractionsOfManyWindowsEqualTheDefinition) {
  TraceRecorder t;
  unsigned seed = 7;
  auto next = [&seed](int n) { seed = seed * 1103515245u + 12345u; return static_cast<int>((seed >> 8) % n); };
  for (int i = 0; i < 300; ++i) {
    const double a = next(4000) / 4.0, d = (1 + next(120)) / 4.0;
    t.add({next(3) ? "compute" : "transfer", "s", a, a + d, 0});
  }
  t.add({"transfer", "long", 10, 900, 0});
  std::vector<std::pair<double, double>> windows = {{0, 0}, {2000, 2000}};
  for (int i = 0; i < 60; ++i) {
    const double a = next(4200) / 4.0;
    windows.emplace_back(a, a + (1 + next(400)) / 4.0);
  }
  const auto slices = t.slices();
  auto busy = [&](const char* lane, double x) {
    for (const auto& s : slices)
      if (s.lane == lane && s.start_us <= x && x < s.end_us) return true;
    return false;
  };
  auto copy_cells = [&](double x) {  // copies covering the cell starting at x
    int n = 0;
    for (const auto& s : slices) n += s.lane == "transfer" && s.start_us <= x && x < s.end_us;
    return n;
  };
  const std::vector<double> got = t.overlap_fractions("transfer", "compute", windows);
  ASSERT_EQ(got.size(), windows.size());
  for (size_t w = 0; w < windows.size(); ++w) {
    const auto [from, to] = windows[w];
    const bool all = to <= from;
    double copied = 0, hidden = 0;
    for (double x = all ? 0 : from; x < (all ? 1100 : to); x += 0.25) {
      const int n = copy_cells(x);
      copied += n;
      hidden += busy("compute", x) ? n : 0;
    }
    if (copied == 0) {
      EXPECT_TRUE(std::isnan(got[w])) << "window " << w;
    } else {
      EXPECT_NEAR(got[w], hidden / copied, 1e-9) << "window " << w << " [" << from << ", " << to << ")";
    }
    EXPECT_TRUE(std::isnan(got[w]) ? std::isnan(t.overlap_fraction("transfer", "compute", from, to))
                                   : got[w] == t.overlap_fraction("transfer", "compute", from, to));
  }
}

TEST(TraceRecorder, ChromeJsonHasLanesSlicesAndSteps) {
  TraceRecorder t;
  t.add({"compute", "fwd \"quoted\"\\name", 1, 2, 0});
  t.add({"transfer", "H2D w", 0, 3, 42});
  t.mark_step(1);
  const json::Value v = json::parse(t.to_chrome_json(), "trace");
  const json::Value* events = v.find("traceEvents");
  ASSERT_NE(events, nullptr);
  int lanes = 0, slices = 0, steps = 0;
  for (const auto& e : events->array) {
    const std::string ph = e.find("ph")->text;
    if (ph == "M" && e.find("name")->text == "thread_name") lanes++;
    if (ph == "X") slices++;
    if (ph == "i") steps++;
  }
  EXPECT_GE(lanes, 2);
  EXPECT_EQ(slices, 2);
  EXPECT_EQ(steps, 1);
}

TEST(TraceRecorder, CapacityBoundsMemory) {
  TraceRecorder t;
  t.set_capacity(3);
  for (int i = 0; i < 10; ++i) t.add({"compute", "x", 0, 1, 0});
  EXPECT_EQ(t.size(), 3u);
  EXPECT_EQ(t.dropped(), 7u);
}

TEST(SchedulerTelemetry, PerStepCountersAndCopySlices) {
  SimOptions o;
  o.h2d_gbps = 1.0;
  o.latency_us = 0;
  auto sim = make_sim_backend(o);
  HostStore store(*sim);
  std::vector<LayerSpec> specs;
  std::vector<unsigned char> data(100000, 3);
  for (int i = 0; i < 4; ++i) {
    size_t idx = store.add(data.size(), data.data(), "l" + std::to_string(i));
    specs.push_back(LayerSpec{"l" + std::to_string(i), {store.buffer(idx)}});
  }
  Stream transfer = sim->create_stream("transfer");
  Stream compute = sim->create_inline_stream("compute");
  SchedulerOptions so;
  so.num_slots = 3;
  so.prefetch_depth = 2;
  auto trace = std::make_shared<TraceRecorder>();
  {
    Scheduler sched(*sim, transfer, specs, so);
    sched.set_trace(trace);
    for (int step = 0; step < 3; ++step)
      for (int l = 0; l < 4; ++l) {
        Lease lease = sched.acquire(l, compute);
        sched.release(lease, compute);
      }
    sched.quiesce();
    const auto steps = sched.step_stats();
    ASSERT_EQ(steps.size(), 2u);  // the third step has not ended yet
    for (const auto& s : steps) {
      EXPECT_EQ(s.acquires, 4u);
      EXPECT_EQ(s.h2d_bytes, 4u * 100000u);  // every layer crosses once per step
      EXPECT_GE(s.max_slots_held, 1);
      EXPECT_LE(s.max_slots_held, 3);
      EXPECT_GT(s.end_us, s.start_us);
    }
  }
  int copies = 0;
  for (const auto& s : trace->slices()) {
    if (s.lane != "transfer") continue;
    copies++;
    EXPECT_EQ(s.bytes, 100000u);
    EXPECT_GE(s.end_us - s.start_us, 90.0);  // 100 kB at 1 GB/s = 100 us
  }
  EXPECT_EQ(copies, 12);
  EXPECT_TRUE(sim->ordering_errors().empty());
}
