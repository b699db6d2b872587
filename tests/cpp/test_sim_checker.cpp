// Tests of the sim backend's ordering checker: planted races in the streaming
// protocols are reported with the buffer, both streams and both operations;
// the correct protocols produce no errors, also over many randomized runs
// with random link timing and random compute durations.
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "backends/sim/sim_backend.h"

namespace layerstream {
namespace {

SimOptions instant() {
  SimOptions o;
  o.h2d_gbps = 0;
  o.d2h_gbps = 0;
  o.latency_us = 0;
  return o;
}

SimOptions slow_link() {
  SimOptions o;
  o.h2d_gbps = 0.5;
  o.d2h_gbps = 0.5;
  o.latency_us = 300;
  o.jitter = 0.3;
  o.seed = 7;
  return o;
}

struct Timing {
  std::string name;
  SimOptions opts;
};

void PrintTo(const Timing& t, std::ostream* os) { *os << t.name; }

std::vector<Timing> timings() { return {{"Instant", instant()}, {"SlowLink", slow_link()}}; }

std::string all_errors(const SimBackend& sim) {
  std::string s;
  for (const std::string& e : sim.ordering_errors()) s += "  " + e + "\n";
  return s.empty() ? "  (no errors)\n" : s;
}

// Asserts that some recorded error mentions every one of `parts`.
void expect_error_naming(const SimBackend& sim, const std::vector<std::string>& parts) {
  const auto errs = sim.ordering_errors();
  ASSERT_FALSE(errs.empty()) << "the planted race was not reported";
  bool found = false;
  for (const std::string& e : errs) {
    bool all = true;
    for (const std::string& p : parts) all = all && e.find(p) != std::string::npos;
    found = found || all;
  }
  std::string want;
  for (const std::string& p : parts) want += " [" + p + "]";
  EXPECT_TRUE(found) << "no error names all of" << want << "; errors:\n" << all_errors(sim);
}

void expect_no_errors(const SimBackend& sim) {
  EXPECT_TRUE(sim.ordering_errors().empty()) << all_errors(sim);
}

void compute_for(std::chrono::microseconds us) { std::this_thread::sleep_for(us); }

// Orders two host functions on different streams behind the checker's back
// (the checker only sees events and host waits), so a planted race can be
// made to execute in a safe order: it must be reported anyway, and the test
// stays free of real data races (ThreadSanitizer-clean).
class HiddenOrder {
 public:
  void open() {
    {
      std::lock_guard<std::mutex> l(m_);
      open_ = true;
    }
    cv_.notify_all();
  }
  void pass() {
    std::unique_lock<std::mutex> l(m_);
    cv_.wait(l, [&] { return open_; });
  }

 private:
  std::mutex m_;
  std::condition_variable cv_;
  bool open_ = false;
};

// ---------------------------------------------------------------- the protocols

// (a) Slot reuse: transfer copies layer 6 into slot[2], compute reads it and
// records "freed"; transfer then copies layer 7 into the same slot. Correct
// only if transfer waits on "freed" first.
struct SlotReuse {
  static constexpr const char* kRead = "layer6 matmul reads slot[2]";
  uint64_t slot_id = 0;
  void run(SimBackend& sim, bool buggy) {
    Stream transfer = sim.create_stream("transfer"), compute = sim.create_stream("compute");
    HostBuffer w6 = HostBuffer::allocate(sim, 8192, true, "layer6.weight");
    HostBuffer w7 = HostBuffer::allocate(sim, 8192, true, "layer7.weight");
    DeviceBuffer slot(sim, 8192, "slot[2]");
    slot_id = slot.ref().id;
    Event loaded = sim.create_event(), freed = sim.create_event();
    sim.copy_async(slot.ref(), 0, w6.ref(), 0, 8192, transfer);
    sim.record(loaded, transfer);
    sim.wait(compute, loaded);
    sim.declare_access(slot.ref(), Access::Read, compute, kRead);
    sim.launch_host_func(compute, [] { compute_for(std::chrono::microseconds(500)); });
    sim.record(freed, compute);
    if (!buggy) sim.wait(transfer, freed);
    sim.copy_async(slot.ref(), 0, w7.ref(), 0, 8192, transfer);
    sim.synchronize(transfer);
    sim.synchronize(compute);
  }
};

// (b) Compute reads a slot whose H2D copy it did not wait for.
struct UnwaitedLoad {
  static constexpr const char* kRead = "attention reads slot[1]";
  void run(SimBackend& sim, bool buggy) {
    Stream transfer = sim.create_stream("transfer"), compute = sim.create_stream("compute");
    HostBuffer w = HostBuffer::allocate(sim, 8192, true, "layer3.weight");
    DeviceBuffer slot(sim, 8192, "slot[1]");
    Event loaded = sim.create_event();
    sim.copy_async(slot.ref(), 0, w.ref(), 0, 8192, transfer);
    sim.record(loaded, transfer);
    if (!buggy) sim.wait(compute, loaded);
    sim.declare_access(slot.ref(), Access::Read, compute, kRead);
    sim.synchronize(transfer);
    sim.synchronize(compute);
  }
};

// (c) The gradient race: compute writes a device gradient, the grad stream
// copies it to the host, and the host reads the host copy.
enum class HostWaitsBy { Nothing, EventSynchronize, QueryLoop, StreamSynchronize, InlineWait };

struct GradientHandoff {
  static constexpr const char* kRead = "optimizer step reads layer5.grad.host";
  void run(SimBackend& sim, HostWaitsBy how) {
    Stream compute = sim.create_stream("compute"), grad = sim.create_stream("grad");
    DeviceBuffer g(sim, 8192, "layer5.grad");
    HostBuffer host = HostBuffer::allocate(sim, 8192, true, "layer5.grad.host");
    Event computed = sim.create_event(), copied = sim.create_event();
    sim.declare_access(g.ref(), Access::Write, compute, "backward writes layer5.grad");
    sim.launch_host_func(compute, [&] { std::memset(g.data(), 0x5A, 8192); });
    sim.record(computed, compute);
    sim.wait(grad, computed);
    sim.copy_async(host.ref(), 0, g.ref(), 0, 8192, grad);
    sim.record(copied, grad);
    switch (how) {
      case HostWaitsBy::Nothing: break;
      case HostWaitsBy::EventSynchronize: sim.synchronize(copied); break;
      case HostWaitsBy::QueryLoop:
        while (!sim.query(copied)) std::this_thread::yield();
        break;
      case HostWaitsBy::StreamSynchronize: sim.synchronize(grad); break;
      case HostWaitsBy::InlineWait: {
        Stream host_stream = sim.create_inline_stream("host-inline");
        sim.wait(host_stream, copied);
        break;
      }
    }
    sim.declare_host_access(host.ref(), Access::Read, kRead);
    if (how != HostWaitsBy::Nothing) {
      const auto* p = static_cast<const uint8_t*>(host.data());
      for (size_t i = 0; i < 8192; ++i) ASSERT_EQ(p[i], 0x5A) << "byte " << i;
    }
    sim.synchronize(grad);
  }
};

// ---------------------------------------------------------------- planted races

class SimPlantedRace : public ::testing::TestWithParam<Timing> {};

TEST_P(SimPlantedRace, SlotReusedWithoutWaitingForComputesFreeEvent) {
  auto sim = make_sim_backend(GetParam().opts);
  SlotReuse p;
  p.run(*sim, /*buggy=*/true);
  expect_error_naming(*sim, {"'slot[2]'", "id " + std::to_string(p.slot_id), "stream 'transfer'",
                             "stream 'compute'", "copy H2D 'slot[2]' <- 'layer7.weight'",
                             SlotReuse::kRead});
  EXPECT_EQ(sim->ordering_errors().size(), 1u) << all_errors(*sim);
}

TEST_P(SimPlantedRace, ComputeReadsSlotWithoutWaitingForItsCopy) {
  auto sim = make_sim_backend(GetParam().opts);
  UnwaitedLoad().run(*sim, /*buggy=*/true);
  expect_error_naming(*sim, {"'slot[1]'", "stream 'transfer'", "stream 'compute'",
                             "copy H2D 'slot[1]' <- 'layer3.weight'", UnwaitedLoad::kRead});
  EXPECT_EQ(sim->ordering_errors().size(), 1u) << all_errors(*sim);
}

TEST_P(SimPlantedRace, HostReadsGradientBeforeItsCopyCompleted) {
  auto sim = make_sim_backend(GetParam().opts);
  GradientHandoff().run(*sim, HostWaitsBy::Nothing);
  expect_error_naming(*sim, {"'layer5.grad.host'", "host reads", "stream 'grad'",
                             "copy D2H 'layer5.grad.host' <- 'layer5.grad'", GradientHandoff::kRead});
  EXPECT_EQ(sim->ordering_errors().size(), 1u) << all_errors(*sim);
}

TEST_P(SimPlantedRace, HostRefillsStagingBufferWhileItsCopyIsPending) {
  auto sim = make_sim_backend(GetParam().opts);
  Stream transfer = sim->create_stream("transfer");
  HostBuffer staging = HostBuffer::allocate(*sim, 4096, true, "staging");
  DeviceBuffer slot(*sim, 4096, "slot[0]");
  sim->declare_host_access(staging.ref(), Access::Write, "host fills staging");  // ordered: program order
  sim->copy_async(slot.ref(), 0, staging.ref(), 0, 4096, transfer);
  sim->declare_host_access(staging.ref(), Access::Write, "host refills staging");
  expect_error_naming(*sim, {"'staging'", "host writes", "stream 'transfer' reading",
                             "copy H2D 'slot[0]' <- 'staging'", "host refills staging"});
  EXPECT_EQ(sim->ordering_errors().size(), 1u) << all_errors(*sim);
  sim->synchronize(transfer);
}

TEST_P(SimPlantedRace, TwoStreamsWriteOneSlot) {
  auto sim = make_sim_backend(GetParam().opts);
  Stream a = sim->create_stream("a"), b = sim->create_stream("b");
  HostBuffer w = HostBuffer::allocate(*sim, 4096, true, "w");
  DeviceBuffer slot(*sim, 4096, "slot[0]");
  HiddenOrder a_done;
  sim->copy_async(slot.ref(), 0, w.ref(), 0, 4096, a);
  sim->launch_host_func(a, [&] { a_done.open(); });
  sim->launch_host_func(b, [&] { a_done.pass(); });  // safe in fact, unordered for the checker
  sim->copy_async(slot.ref(), 0, w.ref(), 0, 4096, b);
  expect_error_naming(*sim, {"'slot[0]'", "stream 'b' writes", "stream 'a' writing"});
  sim->synchronize(a);
  sim->synchronize(b);
}

TEST_P(SimPlantedRace, QueryThatReturnedFalseDoesNotOrderTheHost) {
  auto sim = make_sim_backend(GetParam().opts);
  Stream grad = sim->create_stream("grad");
  DeviceBuffer g(*sim, 64, "g");
  HostBuffer h = HostBuffer::allocate(*sim, 64, true, "g.host");
  Event copied = sim->create_event();
  std::mutex gate;
  gate.lock();
  sim->launch_host_func(grad, [&] { std::lock_guard<std::mutex> l(gate); });
  sim->copy_async(h.ref(), 0, g.ref(), 0, 64, grad);
  sim->record(copied, grad);
  EXPECT_FALSE(sim->query(copied));
  sim->declare_host_access(h.ref(), Access::Read, "host peeks");
  expect_error_naming(*sim, {"'g.host'", "host reads", "stream 'grad'"});
  gate.unlock();
  sim->synchronize(grad);
}

INSTANTIATE_TEST_SUITE_P(Timings, SimPlantedRace, ::testing::ValuesIn(timings()),
                         [](const ::testing::TestParamInfo<Timing>& i) { return i.param.name; });

// ---------------------------------------------------------------- correct protocols

class SimCorrectProtocol : public ::testing::TestWithParam<Timing> {};

TEST_P(SimCorrectProtocol, SlotReuseAfterWaitingForFree) {
  auto sim = make_sim_backend(GetParam().opts);
  SlotReuse().run(*sim, /*buggy=*/false);
  expect_no_errors(*sim);
}

TEST_P(SimCorrectProtocol, ComputeWaitsForItsLoad) {
  auto sim = make_sim_backend(GetParam().opts);
  UnwaitedLoad().run(*sim, /*buggy=*/false);
  expect_no_errors(*sim);
}

TEST_P(SimCorrectProtocol, ConcurrentReadsDoNotConflict) {
  auto sim = make_sim_backend(GetParam().opts);
  Stream a = sim->create_stream("a"), b = sim->create_stream("b");
  HostBuffer w = HostBuffer::allocate(*sim, 4096, true, "w");
  DeviceBuffer d1(*sim, 4096, "d1"), d2(*sim, 4096, "d2");
  sim->copy_async(d1.ref(), 0, w.ref(), 0, 4096, a);
  sim->copy_async(d2.ref(), 0, w.ref(), 0, 4096, b);
  sim->declare_host_access(w.ref(), Access::Read, "host reads w too");
  sim->synchronize(a);
  sim->synchronize(b);
  sim->declare_host_access(w.ref(), Access::Write, "host rewrites w after both syncs");
  expect_no_errors(*sim);
}

TEST_P(SimCorrectProtocol, DisjointSubregionsAreIndependent) {
  auto sim = make_sim_backend(GetParam().opts);
  Stream a = sim->create_stream("a"), b = sim->create_stream("b");
  HostBuffer w = HostBuffer::allocate(*sim, 4096, true, "w");
  DeviceBuffer arena(*sim, 8192, "arena");
  BufferRef lo = sim->subregion(arena.ref(), 0, 4096, "arena.lo");
  BufferRef hi = sim->subregion(arena.ref(), 4096, 4096, "arena.hi");
  EXPECT_NE(lo.id, hi.id);
  HiddenOrder a_done;
  sim->copy_async(lo, 0, w.ref(), 0, 4096, a);
  sim->launch_host_func(a, [&] { a_done.open(); });
  sim->copy_async(hi, 0, w.ref(), 0, 4096, b);
  expect_no_errors(*sim);
  sim->launch_host_func(b, [&] { a_done.pass(); });  // hidden from the checker
  sim->copy_async(lo, 0, w.ref(), 0, 4096, b);  // same sub-region, unordered
  expect_error_naming(*sim, {"'arena.lo'", "stream 'b' writes", "stream 'a' writing"});
  sim->synchronize(a);
  sim->synchronize(b);
}

INSTANTIATE_TEST_SUITE_P(Timings, SimCorrectProtocol, ::testing::ValuesIn(timings()),
                         [](const ::testing::TestParamInfo<Timing>& i) { return i.param.name; });

struct HandoffCase {
  std::string name;
  HostWaitsBy how;
};

void PrintTo(const HandoffCase& c, std::ostream* os) { *os << c.name; }

class SimGradientHandoff : public ::testing::TestWithParam<std::tuple<HandoffCase, Timing>> {};

TEST_P(SimGradientHandoff, HostWaitOrdersTheRead) {
  auto sim = make_sim_backend(std::get<1>(GetParam()).opts);
  GradientHandoff().run(*sim, std::get<0>(GetParam()).how);
  expect_no_errors(*sim);
}

INSTANTIATE_TEST_SUITE_P(
    Waits, SimGradientHandoff,
    ::testing::Combine(::testing::Values(HandoffCase{"EventSynchronize", HostWaitsBy::EventSynchronize},
                                         HandoffCase{"QueryLoop", HostWaitsBy::QueryLoop},
                                         HandoffCase{"StreamSynchronize", HostWaitsBy::StreamSynchronize},
                                         HandoffCase{"InlineWait", HostWaitsBy::InlineWait}),
                       ::testing::ValuesIn(timings())),
    [](const ::testing::TestParamInfo<std::tuple<HandoffCase, Timing>>& i) {
      return std::get<0>(i.param).name + "_" + std::get<1>(i.param).name;
    });

// ---------------------------------------------------------------- host agent / inline streams

TEST(SimChecker, InlineStreamAccessesAreHostAccesses) {
  auto sim = make_sim_backend(instant());
  Stream in = sim->create_inline_stream("loader");
  Stream compute = sim->create_stream("compute");
  HostBuffer w = HostBuffer::allocate(*sim, 256, true, "w");
  DeviceBuffer slot(*sim, 256, "slot");
  sim->copy_async(slot.ref(), 0, w.ref(), 0, 256, in);  // a host access, done on return
  sim->declare_host_access(slot.ref(), Access::Read, "host checks slot");  // same agent: fine
  sim->declare_access(slot.ref(), Access::Read, compute, "compute reads slot");  // enqueued after: fine
  expect_no_errors(*sim);
  // The inline stream writing the slot while compute may still read it is a race.
  sim->copy_async(slot.ref(), 0, w.ref(), 0, 256, in);
  expect_error_naming(*sim, {"'slot'", "host (inline stream 'loader') writes", "stream 'compute' reading",
                             "compute reads slot"});
  sim->synchronize(compute);
}

TEST(SimChecker, FreeDropsTracking) {
  auto sim = make_sim_backend(instant());
  Stream a = sim->create_stream("a");
  BufferRef buf = sim->alloc_device(128, "scratch");
  BufferRef sub = sim->subregion(buf, 64, 64, "scratch.hi");
  sim->declare_access(buf, Access::Write, a, "a writes scratch");
  sim->declare_access(sub, Access::Write, a, "a writes scratch.hi");
  sim->synchronize(a);
  sim->free(buf);  // forgets buf and its sub-region
  sim->declare_host_access(sub, Access::Write, "host reuses the address range");
  expect_no_errors(*sim);
}

// unwrap() forgets a wrapped buffer (the framework's memory again): what the checker
// knew of it goes (it had kept a region per wrapped buffer for the backend's life,
// one per saved activation and copy back), so its next user starts fresh.
TEST(SimChecker, UnwrapDropsTracking) {
  auto sim = make_sim_backend(instant());
  Stream a = sim->create_stream("a");
  std::vector<char> memory(128);
  BufferRef wrapped = sim->wrap(memory.data(), memory.size(), MemoryKind::Device, "framework tensor");
  sim->declare_access(wrapped, Access::Write, a, "a writes the tensor");
  BufferRef kept = sim->wrap(memory.data(), memory.size(), MemoryKind::Device, "still wrapped");
  sim->declare_access(kept, Access::Write, a, "a writes it too");
  sim->unwrap(wrapped);
  sim->declare_host_access(wrapped, Access::Write, "the framework reuses the memory");
  expect_no_errors(*sim);
  sim->declare_host_access(kept, Access::Write, "the host writes a buffer a stream may still write");
  EXPECT_EQ(sim->ordering_errors().size(), 1u);
  sim->synchronize(a);
}

// A free is a host write of the buffer and of the regions inside it: a stream that
// may still read one of them (a copy in flight) makes it an error, named.
TEST(SimChecker, FreeWhileAStreamMayStillReadItIsAnError) {
  auto sim = make_sim_backend(instant());
  Stream a = sim->create_stream("a");
  BufferRef buf = sim->alloc_device(128, "scratch");
  BufferRef sub = sim->subregion(buf, 64, 64, "scratch.hi");
  sim->declare_access(buf, Access::Write, a, "a writes scratch");
  sim->synchronize(a);
  sim->declare_access(sub, Access::Read, a, "a reads scratch.hi");
  sim->free(buf);
  expect_error_naming(*sim, {"free of 'scratch.hi'", "stream 'a' may still read it", "a reads scratch.hi"});
  sim->synchronize(a);
}

TEST(SimChecker, ClearAndDisable) {
  auto sim = make_sim_backend(instant());
  UnwaitedLoad().run(*sim, true);
  EXPECT_FALSE(sim->ordering_errors().empty());
  sim->clear_ordering_errors();
  EXPECT_TRUE(sim->ordering_errors().empty());

  SimOptions off = instant();
  off.checker = false;
  auto unchecked = make_sim_backend(off);
  UnwaitedLoad().run(*unchecked, true);
  EXPECT_FALSE(unchecked->caps().ordering_checker);
  EXPECT_TRUE(unchecked->ordering_errors().empty());
}

TEST(SimChecker, AbortModeThrowsAtTheRacyCallAndEnqueuesNothing) {
  SimOptions o = instant();
  o.abort_on_ordering_error = true;
  auto sim = make_sim_backend(o);
  Stream transfer = sim->create_stream("transfer"), compute = sim->create_stream("compute");
  HostBuffer w1 = HostBuffer::allocate(*sim, 64, true, "w1"), w2 = HostBuffer::allocate(*sim, 64, true, "w2");
  std::memset(w1.data(), 1, 64);
  std::memset(w2.data(), 2, 64);
  DeviceBuffer slot(*sim, 64, "slot[0]");
  Event loaded = sim->create_event();
  sim->copy_async(slot.ref(), 0, w1.ref(), 0, 64, transfer);
  sim->record(loaded, transfer);
  sim->wait(compute, loaded);
  sim->declare_access(slot.ref(), Access::Read, compute, "compute reads slot[0]");
  try {
    sim->copy_async(slot.ref(), 0, w2.ref(), 0, 64, transfer);  // no wait for compute
    FAIL() << "expected an ordering error";
  } catch (const Error& e) {
    EXPECT_NE(e.message().find("'slot[0]'"), std::string::npos) << e.message();
    EXPECT_NE(e.message().find("stream 'transfer'"), std::string::npos) << e.message();
    EXPECT_NE(e.message().find("stream 'compute'"), std::string::npos) << e.message();
  }
  sim->synchronize(transfer);
  EXPECT_EQ(static_cast<const uint8_t*>(slot.data())[0], 1) << "the racy copy must not have run";
  EXPECT_TRUE(sim->ordering_errors().empty());
  // The correct protocol goes through.
  Event freed = sim->create_event();
  sim->record(freed, compute);
  sim->wait(transfer, freed);
  EXPECT_NO_THROW(sim->copy_async(slot.ref(), 0, w2.ref(), 0, 64, transfer));
  sim->synchronize(transfer);
  EXPECT_EQ(static_cast<const uint8_t*>(slot.data())[0], 2);
}

// ---------------------------------------------------------------- randomized pipeline

// Which wait the buggy variant drops.
enum class Drop { None, TransferWaitsFree, ComputeWaitsLoad, ComputeWaitsGradFree, GradWaitsCompute, HostSync };

struct PipelineResult {
  std::string expected_buffer;  // the buffer a planted race must name
  int data_mismatches = 0;
};

// A forward+backward streaming loop over `layers` layers with `slots` device
// slots (ring), a transfer, a compute and a grad stream, real data flow
// (compute copies its slot into a device grad buffer, the grad stream copies
// that to a per-layer host buffer) and random compute durations.
PipelineResult run_pipeline(SimBackend& sim, std::mt19937& rng, int layers, int slots, Drop drop,
                            int drop_layer) {
  constexpr size_t kBytes = 2048;
  Stream transfer = sim.create_stream("transfer"), compute = sim.create_stream("compute"),
         grad = sim.create_stream("grad");
  std::vector<HostBuffer> weights, host_grads;
  std::vector<DeviceBuffer> slot, dgrad;
  std::vector<Event> loaded, freed, grad_free, copied;
  for (int i = 0; i < layers; ++i) {
    weights.push_back(HostBuffer::allocate(sim, kBytes, true, "layer" + std::to_string(i) + ".weight"));
    std::memset(weights.back().data(), i + 1, kBytes);
    host_grads.push_back(HostBuffer::allocate(sim, kBytes, true, "host_grad[" + std::to_string(i) + "]"));
    copied.push_back(sim.create_event());
  }
  for (int k = 0; k < slots; ++k) {
    slot.emplace_back(sim, kBytes, "slot[" + std::to_string(k) + "]");
    dgrad.emplace_back(sim, kBytes, "grad[" + std::to_string(k) + "]");
    loaded.push_back(sim.create_event());
    freed.push_back(sim.create_event());
    grad_free.push_back(sim.create_event());
  }
  std::uniform_int_distribution<int> sleep_us(0, 150), coin(0, 3);
  PipelineResult res;
  int consumed = 0;
  auto consume = [&](int j, bool skip_sync) {
    if (!skip_sync) {
      if (coin(rng) == 0) {
        while (!sim.query(copied[j])) std::this_thread::yield();
      } else {
        sim.synchronize(copied[j]);
      }
    }
    sim.declare_host_access(host_grads[j].ref(), Access::Read, "optimizer reads host_grad");
    if (drop == Drop::None && static_cast<const uint8_t*>(host_grads[j].data())[kBytes - 1] != j + 1)
      ++res.data_mismatches;
  };
  for (int i = 0; i < layers; ++i) {
    const int k = i % slots;
    const bool d = i == drop_layer;
    if (!(d && drop == Drop::TransferWaitsFree)) sim.wait(transfer, freed[k]);
    sim.copy_async(slot[k].ref(), 0, weights[i].ref(), 0, kBytes, transfer);
    sim.record(loaded[k], transfer);

    if (!(d && drop == Drop::ComputeWaitsLoad)) sim.wait(compute, loaded[k]);
    if (!(d && drop == Drop::ComputeWaitsGradFree)) sim.wait(compute, grad_free[k]);
    sim.declare_access(slot[k].ref(), Access::Read, compute, "layer compute reads slot");
    sim.declare_access(dgrad[k].ref(), Access::Write, compute, "layer compute writes grad");
    const int us = sleep_us(rng);
    void* gd = dgrad[k].data();
    const void* sd = slot[k].data();
    // Buggy runs do not touch the bytes, so they contain no real data race
    // (the checker reports the missing wait from the protocol alone).
    const bool touch = drop == Drop::None;
    sim.launch_host_func(compute, [gd, sd, us, touch] {
      std::this_thread::sleep_for(std::chrono::microseconds(us));
      if (touch) std::memcpy(gd, sd, kBytes);
    });
    sim.record(freed[k], compute);

    if (!(d && drop == Drop::GradWaitsCompute)) sim.wait(grad, freed[k]);
    sim.copy_async(host_grads[i].ref(), 0, dgrad[k].ref(), 0, kBytes, grad);
    sim.record(grad_free[k], grad);
    sim.record(copied[i], grad);

    // The host consumes finished gradients now and then (not in buggy runs:
    // a host wait could legitimately order the dropped pair).
    if (drop == Drop::None && coin(rng) == 0 && consumed < i) consume(consumed++, false);
  }
  while (consumed < layers) {
    const int j = consumed++;
    consume(j, drop == Drop::HostSync && j == drop_layer);
  }
  sim.synchronize(transfer);
  sim.synchronize(compute);
  sim.synchronize(grad);
  const int k = drop_layer >= 0 ? drop_layer % slots : 0;
  switch (drop) {
    case Drop::None: break;
    case Drop::TransferWaitsFree:
    case Drop::ComputeWaitsLoad: res.expected_buffer = "'slot[" + std::to_string(k) + "]'"; break;
    case Drop::ComputeWaitsGradFree:
    case Drop::GradWaitsCompute: res.expected_buffer = "'grad[" + std::to_string(k) + "]'"; break;
    case Drop::HostSync: res.expected_buffer = "'host_grad[" + std::to_string(drop_layer) + "]'"; break;
  }
  return res;
}

SimOptions random_options(std::mt19937& rng, uint64_t seed) {
  SimOptions o;
  std::uniform_int_distribution<int> pick(0, 2);
  o.h2d_gbps = pick(rng) == 0 ? 0.0 : 2.0;
  o.d2h_gbps = pick(rng) == 0 ? 0.0 : 2.0;
  o.latency_us = pick(rng) * 40.0;
  o.jitter = 0.5;
  o.seed = seed;
  return o;
}

TEST(SimRandomized, CorrectPipelineHasNoErrorsAndCorrectData) {
  for (uint64_t seed = 1; seed <= 40; ++seed) {
    std::mt19937 rng(static_cast<uint32_t>(seed));
    auto sim = make_sim_backend(random_options(rng, seed));
    const int slots = 1 + static_cast<int>(seed % 3);
    PipelineResult r = run_pipeline(*sim, rng, 10, slots, Drop::None, -1);
    ASSERT_TRUE(sim->ordering_errors().empty()) << "seed " << seed << ":\n" << all_errors(*sim);
    ASSERT_EQ(r.data_mismatches, 0) << "seed " << seed;
  }
}

TEST(SimRandomized, EveryDroppedWaitIsReported) {
  const Drop drops[] = {Drop::TransferWaitsFree, Drop::ComputeWaitsLoad, Drop::ComputeWaitsGradFree,
                        Drop::GradWaitsCompute, Drop::HostSync};
  for (uint64_t seed = 1; seed <= 30; ++seed) {
    std::mt19937 rng(static_cast<uint32_t>(seed * 7919));
    auto sim = make_sim_backend(random_options(rng, seed));
    const int slots = 1 + static_cast<int>(seed % 3);
    const Drop drop = drops[seed % 5];
    // Drops that need an earlier use of the slot happen once the ring wrapped.
    const int drop_layer = std::uniform_int_distribution<int>(slots, 9)(rng);
    PipelineResult r = run_pipeline(*sim, rng, 10, slots, drop, drop_layer);
    const auto errs = sim->ordering_errors();
    ASSERT_FALSE(errs.empty()) << "seed " << seed << " drop " << static_cast<int>(drop) << " at layer "
                               << drop_layer << " was not reported";
    bool named = false;
    for (const std::string& e : errs) named = named || e.find(r.expected_buffer) != std::string::npos;
    EXPECT_TRUE(named) << "seed " << seed << ": expected " << r.expected_buffer << " in:\n"
                       << all_errors(*sim);
  }
}

}  // namespace
}  // namespace layerstream
