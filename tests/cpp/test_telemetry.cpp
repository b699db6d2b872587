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
