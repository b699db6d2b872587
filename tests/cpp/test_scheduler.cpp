// Scheduler + slot pool + host store on the sim device, ordering checker on.
// Randomized schedules (prefetch depth 0-4, slots 2-8, random orders and
// deviations, hundreds of steps): zero ordering errors, every fetched slot
// byte-identical to its host source, the budget never exceeded. Also with
// post-copy work (a device-side transform into the layer's workspace, like
// dequantization) on the transfer stream or on a stream of its own.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <optional>
#include <random>
#include <thread>

#include "backends/sim/sim_backend.h"
#include "core/host_store.h"
#include "core/log.h"
#include "core/scheduler.h"

using namespace layerstream;

namespace {

struct Model {
  std::vector<size_t> tensor_index;  // per layer: first host-store index
  std::vector<std::vector<size_t>> parts;
  std::vector<LayerSpec> specs;
};

// Builds `n` layers of 1-2 parts with random sizes and random content.
Model make_model(HostStore& store, int n, std::mt19937& rng, size_t max_bytes) {
  Model m;
  std::uniform_int_distribution<size_t> size(1, max_bytes);
  std::uniform_int_distribution<int> nparts(1, 2);
  for (int l = 0; l < n; ++l) {
    LayerSpec spec;
    spec.name = "layer" + std::to_string(l);
    std::vector<size_t> idx;
    const int np = nparts(rng);
    for (int p = 0; p < np; ++p) {
      std::vector<unsigned char> bytes(size(rng));
      for (auto& b : bytes) b = static_cast<unsigned char>(rng());
      idx.push_back(store.add(bytes.size(), bytes.data(), spec.name + ".p" + std::to_string(p)));
      spec.parts.push_back(store.buffer(idx.back()));
    }
    m.parts.push_back(idx);
    m.specs.push_back(spec);
  }
  return m;
}

constexpr unsigned char kXor = 0xA5;

// Post-copy work for the tests: workspace[i] = part0[i] ^ kXor, run as a host
// function on the post-copy stream (like a dequantization kernel), with its
// accesses declared for the checker. A short random sleep widens any race.
void add_post_copy(Backend& be, LayerSpec& spec, unsigned seed) {
  spec.workspace_bytes = spec.parts[0].bytes;
  const size_t n = spec.parts[0].bytes;
  const size_t np = spec.parts.size();
  spec.post_copy = [&be, n, np, seed](const BufferRef& slot, const std::vector<size_t>& off, Stream s) {
    be.declare_access(slot, Access::Read, s, "post-copy reads the packed part");
    be.declare_access(slot, Access::Write, s, "post-copy writes the workspace");
    auto* base = static_cast<unsigned char*>(slot.ptr);
    const unsigned char* src = base + off.at(0);
    unsigned char* dst = base + off.at(np);
    const auto us = static_cast<int>(seed % 7u) * 20;
    be.launch_host_func(s, [src, dst, n, us] {
      if (us) std::this_thread::sleep_for(std::chrono::microseconds(us));
      for (size_t i = 0; i < n; ++i) dst[i] = static_cast<unsigned char>(src[i] ^ kXor);
    });
  };
}

bool slot_matches(const Lease& lease, const LayerSpec& spec) {
  for (size_t i = 0; i < spec.parts.size(); ++i) {
    if (std::memcmp(lease.part_ptr(i), spec.parts[i].ptr, spec.parts[i].bytes) != 0) return false;
  }
  if (spec.post_copy) {
    const auto* src = static_cast<const unsigned char*>(spec.parts[0].ptr);
    const auto* ws = static_cast<const unsigned char*>(lease.part_ptr(spec.parts.size()));
    for (size_t i = 0; i < spec.workspace_bytes; ++i)
      if (ws[i] != static_cast<unsigned char>(src[i] ^ kXor)) return false;
  }
  return true;
}

// A partial copy's ranges hold the layer's bytes; with post-copy work, the
// workspace bytes computed from those ranges of part 0 too.
bool ranges_match(const Lease& lease, const LayerSpec& spec, const PartialCopy& copy) {
  for (size_t i = 0; i < spec.parts.size(); ++i)
    for (const auto& [a, n] : copy.ranges[i])
      if (std::memcmp(static_cast<const char*>(lease.part_ptr(i)) + a,
                      static_cast<const char*>(spec.parts[i].ptr) + a, n) != 0)
        return false;
  if (spec.post_copy) {
    const auto* src = static_cast<const unsigned char*>(spec.parts[0].ptr);
    const auto* ws = static_cast<const unsigned char*>(lease.part_ptr(spec.parts.size()));
    for (const auto& [a, n] : copy.ranges[0])
      for (size_t i = a; i < a + n; ++i)
        if (ws[i] != static_cast<unsigned char>(src[i] ^ kXor)) return false;
  }
  return true;
}

// A step's fetch sequence: forward 0..n-1 then backward n-1..0, with random
// deviations (skips, swaps, repeats, a jump) when `deviate`.
std::vector<std::pair<int, Phase>> make_step(int n, std::mt19937& rng, bool deviate) {
  std::vector<std::pair<int, Phase>> seq;
  for (int i = 0; i < n; ++i) seq.push_back({i, Phase::Forward});
  for (int i = n - 1; i >= 0; --i) seq.push_back({i, Phase::Backward});
  if (!deviate) return seq;
  std::uniform_int_distribution<size_t> pos(1, seq.size() - 1);
  std::uniform_int_distribution<int> kind(0, 3);
  const int changes = 1 + static_cast<int>(rng() % 3);
  for (int c = 0; c < changes; ++c) {
    const size_t p = pos(rng);
    switch (kind(rng)) {
      case 0: seq.erase(seq.begin() + static_cast<long>(p)); break;               // skip
      case 1: if (p + 1 < seq.size()) std::swap(seq[p].first, seq[p + 1].first); break;  // swap
      case 2: seq.insert(seq.begin() + static_cast<long>(p), seq[p]); break;      // repeat
      default: seq[p].first = static_cast<int>(rng() % static_cast<unsigned>(n)); break;  // jump
    }
    if (seq.size() < 2) break;
  }
  return seq;
}

enum class Post { None, OnTransfer, OwnStream };

struct Params {
  int prefetch;
  int slots;
  bool async_compute;  // compute on a sim worker stream (else inline = host)
  Post post = Post::None;
};

std::string param_name(const testing::TestParamInfo<Params>& info) {
  const char* post = info.param.post == Post::None         ? ""
                     : info.param.post == Post::OnTransfer ? "_postOnTransfer"
                                                           : "_postOwnStream";
  return "prefetch" + std::to_string(info.param.prefetch) + "_slots" +
         std::to_string(info.param.slots) + (info.param.async_compute ? "_async" : "_inline") + post;
}

class RandomSchedule : public testing::TestWithParam<Params> {};

TEST_P(RandomSchedule, NoRacesBytesExactBudgetHeld) {
  const Params p = GetParam();
  SimOptions o;
  o.h2d_gbps = 0;  // infinite: keep the test fast, ordering is what matters
  o.latency_us = 0;
  o.jitter = 0;
  auto sim = make_sim_backend(o);
  std::mt19937 rng(1234u + static_cast<unsigned>(p.prefetch * 31 + p.slots));
  HostStore store(*sim);
  const int n = 6 + static_cast<int>(rng() % 5);
  Model m = make_model(store, n, rng, 4096);
  if (p.post != Post::None)
    for (size_t l = 0; l < m.specs.size(); ++l)
      if (l % 3 != 2) add_post_copy(*sim, m.specs[l], static_cast<unsigned>(rng()));  // most layers

  size_t largest = 0;
  for (auto& s : m.specs) {
    size_t b = 0;
    for (auto& part : s.parts) b = (b + part.bytes + 255) / 256 * 256;
    b = (b + s.workspace_bytes + 255) / 256 * 256;
    largest = std::max(largest, b);
  }
  SchedulerOptions so;
  so.num_slots = p.slots;
  so.prefetch_depth = p.prefetch;
  so.budget_bytes = largest * static_cast<size_t>(p.slots);  // exactly enough
  Stream transfer = sim->create_stream("transfer");
  Stream compute = p.async_compute ? sim->create_stream("compute") : sim->create_inline_stream("compute");
  Stream post;
  if (p.post == Post::OwnStream) so.post_copy_stream = post = sim->create_stream("post-copy");
  std::atomic<int> mismatches{0};
  int partial_copies = 0;
  {
    Scheduler sched(*sim, transfer, m.specs, so);
    const int steps = 40;
    for (int step = 0; step < steps; ++step) {
      auto seq = make_step(n, rng, step > 1 && rng() % 2 == 0);
      for (auto [layer, phase] : seq) {
        const LayerSpec& spec = m.specs[static_cast<size_t>(layer)];
        // Now and then a layer stops (or starts again) being prefetched, and
        // an acquire copies only some random byte ranges (as a mixture-of-
        // experts group's routed fetch does), with the layer's post-copy work.
        if (rng() % 16 == 0) sched.set_prefetch(layer, false);
        if (rng() % 4 == 0) sched.set_prefetch(layer, true);
        std::optional<PartialCopy> partial;
        if (rng() % 8 == 0) {
          partial.emplace();
          partial->post_copy = spec.post_copy;
          for (const BufferRef& part : spec.parts) {
            partial->ranges.emplace_back();
            for (unsigned r = rng() % 3; r > 0; --r) {
              const size_t a = rng() % part.bytes;
              partial->ranges.back().push_back({a, rng() % (part.bytes - a + 1)});
            }
          }
        }
        Lease lease = partial ? sched.acquire_partial(layer, compute, phase, *partial)
                              : sched.acquire(layer, compute, phase);
        const bool whole = !partial || lease.hit;  // a loaded layer is used whole
        partial_copies += whole ? 0 : 1;
        auto check = [&mismatches, &spec, whole, partial](const Lease& l) {
          if (!(whole ? slot_matches(l, spec) : ranges_match(l, spec, *partial))) mismatches++;
        };
        if (p.async_compute) {
          Lease copy = lease;
          sim->launch_host_func(compute, [check, copy] { check(copy); });
        } else {
          check(lease);
        }
        sched.release(lease, compute);
      }
      if (step % 10 == 9) sched.quiesce();
    }
    sim->synchronize(compute);
    SchedulerStats st = sched.stats();
    EXPECT_LE(st.max_slots_held, p.slots);
    EXPECT_LE(st.device_bytes, so.budget_bytes);
    EXPECT_GE(st.steps, 30u) << "auto step detection should see most step boundaries";
    EXPECT_FALSE(st.recording);
    if (p.prefetch > 0) {
      EXPECT_GT(st.hits, st.misses) << "prefetching should serve most fetches";
    }
  }
  EXPECT_EQ(mismatches.load(), 0) << "a slot did not hold its layer's bytes when compute read it";
  EXPECT_GT(partial_copies, 10) << "too few partial copies to test them";
  EXPECT_LE(sim->stats().peak_device_bytes, so.budget_bytes);
  auto errors = sim->ordering_errors();
  EXPECT_TRUE(errors.empty()) << errors.size() << " ordering errors, first: " << errors.front();
  sim->destroy_stream(compute);
  if (post) sim->destroy_stream(post);
  sim->destroy_stream(transfer);
}

std::vector<Params> all_params() {
  std::vector<Params> v;
  for (int k = 0; k <= 4; ++k)
    for (int s : {2, 3, 5, 8})
      for (bool async : {false, true}) v.push_back({k, s, async});
  for (Post post : {Post::OnTransfer, Post::OwnStream})
    for (int k : {0, 1, 2, 4})
      for (int s : {2, 3, 5})
        for (bool async : {false, true}) v.push_back({k, s, async, post});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Grid, RandomSchedule, testing::ValuesIn(all_params()), param_name);

class SchedulerTest : public testing::Test {
 protected:
  void SetUp() override {
    SimOptions o;
    o.h2d_gbps = 0;
    o.latency_us = 0;
    sim = make_sim_backend(o);
    store = std::make_unique<HostStore>(*sim);
    std::mt19937 rng(7);
    model = make_model(*store, 5, rng, 1000);
    transfer = sim->create_stream("transfer");
    compute = sim->create_inline_stream("compute");
  }
  std::shared_ptr<SimBackend> sim;
  std::unique_ptr<HostStore> store;
  Model model;
  Stream transfer, compute;
};

// One step of `order`: the first `forward` entries in the forward phase.
void run_step(Scheduler& sched, Stream compute, const std::vector<int>& order, size_t forward) {
  for (size_t i = 0; i < order.size(); ++i) {
    Lease l = sched.acquire(order[i], compute, i < forward ? Phase::Forward : Phase::Backward);
    sched.release(l, compute);
  }
}

// Step orders over the fixture's 5 layers: a forward-only pass and a training step.
const std::vector<int> kInfer = {0, 1, 2, 3, 4};
const std::vector<int> kTrain = {0, 1, 2, 3, 4, 4, 3, 2, 1, 0};
// Training with checkpointed segments: backward recomputes before it runs.
const std::vector<int> kCkpt = {0, 1, 2, 3, 4, 3, 4, 4, 3, 1, 2, 2, 1, 0};

SchedulerOptions options(int slots, int depth) {
  SchedulerOptions so;
  so.num_slots = slots;
  so.prefetch_depth = depth;
  return so;
}

TEST_F(SchedulerTest, MoreLayersHeldThanSlotsNamesThemAndTheThreadsThatMayHoldThem) {
  // What two threads running one compiled model at once meet (their calls do not take
  // turns): every slot held. The message names the layers and says what to change.
  Scheduler sched(*sim, transfer, model.specs, options(2, 1));
  Lease a = sched.acquire(0, compute), b = sched.acquire(1, compute);
  try {
    sched.acquire(2, compute);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("all 2 device slots are held at once (layer0, layer1)"), std::string::npos) << msg;
    EXPECT_NE(msg.find("several threads run the model at once"), std::string::npos) << msg;
  }
  sched.release(b, compute);
  sched.release(a, compute);
  Lease c = sched.acquire(2, compute);  // free again: the scheduler goes on
  sched.release(c, compute);
}

TEST_F(SchedulerTest, StepBeginsLooksAtEachCachedLayerBeforeTheStepsFirstReuse) {
  // SchedulerOptions::step_begins (the torch glue samples host bytes there: Note
  // [Writes through .data between steps]): called once per step for each layer a slot
  // holds, before any fetch of the step looks for cached content, so a version it
  // moves makes that step copy the layer again, and only that layer.
  std::vector<uint64_t> version(5, 0);
  std::vector<int> looked;
  int written = -1;
  SchedulerOptions so = options(6, 1);  // every layer keeps a slot
  so.content_version = [&](int l) { return version[size_t(l)]; };
  so.step_begins = [&](int l) {
    looked.push_back(l);
    if (l == written) version[size_t(l)]++;
  };
  Scheduler sched(*sim, transfer, model.specs, so);
  for (int step = 0; step < 3; ++step) run_step(sched, compute, kInfer, 5);
  looked.clear();
  uint64_t before = sched.stats().h2d_bytes;
  run_step(sched, compute, kInfer, 5);
  std::sort(looked.begin(), looked.end());
  EXPECT_EQ(looked, (std::vector<int>{0, 1, 2, 3, 4})) << "one look per cached layer";
  EXPECT_EQ(sched.stats().h2d_bytes, before) << "nothing moved: every layer a hit";
  written = 2;
  before = sched.stats().h2d_bytes;
  run_step(sched, compute, kInfer, 5);
  size_t bytes = 0;
  for (const auto& part : model.specs[2].parts) bytes += part.bytes;
  EXPECT_EQ(sched.stats().h2d_bytes - before, bytes) << "layer 2 copied again, in the step that found it written";
  sched.quiesce();
  EXPECT_TRUE(sim->ordering_errors().empty());
}

TEST_F(SchedulerTest, TraceIsRecordedThenReplayedWithHits) {
  Scheduler sched(*sim, transfer, model.specs, options(3, 2));
  const std::vector<int>& order = kTrain;
  for (int step = 0; step < 3; ++step) run_step(sched, compute, order, 5);
  EXPECT_EQ(sched.trace(), order);
  SchedulerStats st = sched.stats();
  EXPECT_EQ(st.steps, 3u);  // the third counts before a fourth begins
  EXPECT_EQ(st.deviations, 0u);
  // After the first step, only the first fetch of each step misses.
  EXPECT_GE(st.hits, 2u * order.size() - 2);
  EXPECT_TRUE(sim->ordering_errors().empty());
}

TEST_F(SchedulerTest, AGivenTraceIsReplayedFromTheFirstStep) {
  // The engine's scheduler rebuilt after suspend() gets the order the old one
  // learnt: its first step prefetches by it, where recording would guess the
  // next layer by index (wrong for this order) and miss.
  const std::vector<int> order = {3, 1, 4, 0, 2};
  Scheduler recorded(*sim, transfer, model.specs, options(3, 2));
  run_step(recorded, compute, order, order.size());
  EXPECT_LT(recorded.stats().hits, order.size() - 1);  // guesses by index: some miss

  SchedulerOptions so = options(3, 2);
  so.trace = order;
  Scheduler replayed(*sim, transfer, model.specs, so);
  run_step(replayed, compute, order, order.size());
  const SchedulerStats st = replayed.stats();
  EXPECT_FALSE(st.recording);
  EXPECT_EQ(replayed.trace(), order);
  EXPECT_EQ(st.deviations, 0u);
  EXPECT_EQ(st.hits, order.size() - 1);  // all but the first fetch were prefetched
  EXPECT_TRUE(sim->ordering_errors().empty());

  so.trace = {0, 5};
  EXPECT_THROW(Scheduler(*sim, transfer, model.specs, so), Error);  // no layer #5
  so.trace = order;
  so.trace_forward = {true, false};
  EXPECT_THROW(Scheduler(*sim, transfer, model.specs, so), Error);  // phases of another trace
  so.trace_forward = recorded.trace_forward();
  EXPECT_EQ(Scheduler(*sim, transfer, model.specs, so).trace_forward(), so.trace_forward);
}

TEST_F(SchedulerTest, DeviationFetchesOnDemandAndResyncs) {
  SchedulerOptions so;
  so.num_slots = 2;
  so.prefetch_depth = 1;
  Scheduler sched(*sim, transfer, model.specs, so);
  for (int l : {0, 1, 2, 3, 4}) {
    Lease x = sched.acquire(l, compute);
    sched.release(x, compute);
  }
  for (int l : {0, 3, 1, 2, 4}) {  // out of order
    Lease x = sched.acquire(l, compute);
    EXPECT_TRUE(slot_matches(x, model.specs[static_cast<size_t>(l)]));
    sched.release(x, compute);
  }
  EXPECT_GT(sched.stats().deviations, 0u);
  EXPECT_TRUE(sim->ordering_errors().empty());
}

TEST_F(SchedulerTest, RetracesAfterTwoDeviatingStepsThenReplaysTheNewOrder) {
  // The first step is plain training; checkpointed training follows. Its
  // backward deviates from the trace for two steps, then the last step's
  // order is the trace and backward is prefetched again.
  Scheduler sched(*sim, transfer, model.specs, options(3, 2));
  run_step(sched, compute, kTrain, 5);
  EXPECT_EQ(sched.trace(), kTrain);
  run_step(sched, compute, kCkpt, 5);
  run_step(sched, compute, kCkpt, 5);
  const SchedulerStats before = sched.stats();
  EXPECT_GT(before.deviations, 0u);
  EXPECT_EQ(before.retraces, 0u);
  run_step(sched, compute, kCkpt, 5);  // its start closes the 2nd deviating step: retrace
  EXPECT_EQ(sched.stats().retraces, 1u);
  EXPECT_EQ(sched.trace(), kCkpt);
  for (int i = 0; i < 3; ++i) run_step(sched, compute, kCkpt, 5);
  run_step(sched, compute, kInfer, 5);  // closes the last checkpointed step
  const SchedulerStats after = sched.stats();
  EXPECT_EQ(after.retraces, 1u);
  EXPECT_EQ(after.deviations, before.deviations) << "steps after the retrace follow the trace";
  const std::vector<StepStats> steps = sched.step_stats();
  ASSERT_GE(steps.size(), 7u);
  for (size_t i = 3; i < 7; ++i) {
    EXPECT_EQ(steps[i].misses, 1u) << "step " << i << ": only the first fetch misses";
    EXPECT_EQ(steps[i].hits, kCkpt.size() - 1) << "step " << i;
  }
  EXPECT_TRUE(sim->ordering_errors().empty());
}

TEST_F(SchedulerTest, AStepThatExtendsTheTraceReplacesItAtOnce) {
  // An inference pass first, training after it: the first training step runs
  // the whole (forward-only) trace and goes on, so its order is the trace
  // from the next step on; steps that follow the old trace are prefixes of
  // the new one.
  Scheduler sched(*sim, transfer, model.specs, options(3, 2));
  run_step(sched, compute, kInfer, 5);
  run_step(sched, compute, kTrain, 5);
  run_step(sched, compute, kTrain, 5);  // its start closes the extending step
  EXPECT_EQ(sched.stats().retraces, 1u);
  EXPECT_EQ(sched.trace(), kTrain);
  const uint64_t deviations = sched.stats().deviations;
  for (int i = 0; i < 3; ++i) run_step(sched, compute, kTrain, 5);
  run_step(sched, compute, kInfer, 5);
  EXPECT_EQ(sched.stats().deviations, deviations);
  const std::vector<StepStats> steps = sched.step_stats();
  ASSERT_GE(steps.size(), 6u);
  for (size_t i = 2; i < 6; ++i) EXPECT_EQ(steps[i].misses, 1u) << "step " << i;
  EXPECT_TRUE(sim->ordering_errors().empty());
}

TEST_F(SchedulerTest, InferenceAndTrainingAlternatingAfterAnInferenceTraceLearnTraining) {
  // As DPO with a reference model that shares the base weights: a no-grad
  // forward, then a training step, alternating, the first step being the
  // inference pass. The prefix steps used to reset the deviation count, so
  // the trace never learned backward and every backward fetch was on demand.
  Scheduler sched(*sim, transfer, model.specs, options(3, 2));
  run_step(sched, compute, kInfer, 5);
  for (int i = 0; i < 4; ++i) {
    run_step(sched, compute, kTrain, 5);
    run_step(sched, compute, kInfer, 5);
  }
  run_step(sched, compute, kTrain, 5);  // closes the last inference step
  EXPECT_EQ(sched.stats().retraces, 1u);
  EXPECT_EQ(sched.trace(), kTrain);
  const std::vector<StepStats> steps = sched.step_stats();
  ASSERT_EQ(steps.size(), 9u);
  for (size_t i = 3; i < 9; i += 2)  // training steps after the first one
    EXPECT_EQ(steps[i].misses, 1u) << "step " << i << ": backward is prefetched";
  EXPECT_TRUE(sim->ordering_errors().empty());
}

TEST_F(SchedulerTest, AlternatingStepKindsDoNotThrashTheTrace) {
  // Training trace; inference steps (a prefix of it) in between never
  // deviate, and one odd step is not enough to replace the trace.
  Scheduler sched(*sim, transfer, model.specs, options(3, 2));
  const std::vector<int> odd = {0, 2, 1, 3, 4};
  run_step(sched, compute, kTrain, 5);
  for (int i = 0; i < 4; ++i) {
    run_step(sched, compute, kInfer, 5);
    run_step(sched, compute, i % 2 ? odd : kTrain, 5);
  }
  run_step(sched, compute, kTrain, 5);
  EXPECT_EQ(sched.stats().retraces, 0u);
  EXPECT_EQ(sched.trace(), kTrain);
  EXPECT_TRUE(sim->ordering_errors().empty());
}

// Note [When a step begins] (scheduler.cpp): weights cached in slots by one call
// of the model must not be served to the next once the host bytes changed, also
// when the next call skips the layer that began the steps before. With 6 slots
// every layer of the fixture stays cached, so a missed boundary serves the old
// bytes. `changed` rewrites a layer's host bytes (an optimizer step, a merged
// LoRA), after the copies that read them.
class StepBoundaryTest : public SchedulerTest {
 protected:
  void change(Scheduler& sched, int layer) {
    sim->synchronize(transfer);
    sched.wait_copies_read(layer);
    const BufferRef& part = model.specs[static_cast<size_t>(layer)].parts[0];
    auto* bytes = static_cast<unsigned char*>(part.ptr);
    for (size_t i = 0; i < part.bytes; ++i) bytes[i] = static_cast<unsigned char>(bytes[i] + 1);
  }
  // Fetches `layer` in `phase`; true when the slot holds its current host bytes.
  bool fetch_current(Scheduler& sched, int layer, Phase phase = Phase::Forward) {
    Lease x = sched.acquire(layer, compute, phase);
    const bool ok = slot_matches(x, model.specs[static_cast<size_t>(layer)]);
    sched.release(x, compute);
    return ok;
  }
};

TEST_F(StepBoundaryTest, AfterABackwardTheNextForwardBeginsAStepWhicheverLayerItFetches) {
  // A conditional first block: the first step ran layer 0, the next ones skip it.
  Scheduler sched(*sim, transfer, model.specs, options(6, 2));
  run_step(sched, compute, kTrain, 5);
  sched.backward_ended();
  change(sched, 1);  // the optimizer step
  EXPECT_TRUE(fetch_current(sched, 1)) << "the first step's copy of layer 1 was served";
  EXPECT_EQ(sched.stats().steps, 2u);
  for (int l : {2, 3, 4}) fetch_current(sched, l);
  for (int l : {4, 3, 2, 1}) fetch_current(sched, l, Phase::Backward);
  sched.backward_ended();
  change(sched, 3);
  for (int l : {1, 2}) fetch_current(sched, l);
  EXPECT_TRUE(fetch_current(sched, 3));
  EXPECT_EQ(sched.stats().steps, 3u);
  EXPECT_TRUE(sim->ordering_errors().empty());
}

TEST_F(StepBoundaryTest, AForwardAfterABackwardFetchBeginsAStepWithoutBackwardEnded) {
  // A torch.compile graph's backward calls no backward_ended(): its fetches say it.
  Scheduler sched(*sim, transfer, model.specs, options(6, 2));
  run_step(sched, compute, kTrain, 5);
  change(sched, 1);
  EXPECT_TRUE(fetch_current(sched, 1)) << "the first step's copy of layer 1 was served";
  EXPECT_EQ(sched.stats().steps, 2u);
  EXPECT_EQ(sched.trace(), kTrain);
}

TEST_F(StepBoundaryTest, ACallTheOwnerAnnouncesBeginsAStepEvenWhileTheFirstIsRecorded) {
  Scheduler sched(*sim, transfer, model.specs, options(6, 2));
  run_step(sched, compute, kInfer, 5);  // recording: the next fetch of layer 0 would end it
  sched.begin_call();
  change(sched, 2);  // e.g. peft's merge_and_unload() through `.data`
  for (int l : {1, 2}) EXPECT_TRUE(fetch_current(sched, l)) << "layer " << l;
  EXPECT_EQ(sched.trace(), kInfer) << "the first call alone is the first step";
  EXPECT_EQ(sched.stats().steps, 2u);

  // Announced before its first fetch (and a backward's end too), a call is one step.
  Scheduler announced(*sim, transfer, model.specs, options(6, 2));
  for (int i = 0; i < 3; ++i) {
    announced.begin_call();
    run_step(announced, compute, kTrain, 5);
    announced.backward_ended();
  }
  EXPECT_EQ(announced.stats().steps, 3u);
  for (const StepStats& st : announced.step_stats()) EXPECT_EQ(st.acquires, kTrain.size());
}

TEST_F(StepBoundaryTest, AFetchTheTraceDoesNotExpectAgainBeginsAStepALoopedLayerDoesNot) {
  Scheduler sched(*sim, transfer, model.specs, options(6, 2));
  run_step(sched, compute, kInfer, 5);
  run_step(sched, compute, kInfer, 5);
  run_step(sched, compute, {1, 2, 3, 4}, 4);  // an inner module's call: no layer 0, no announcement
  change(sched, 2);
  EXPECT_TRUE(fetch_current(sched, 1));
  EXPECT_TRUE(fetch_current(sched, 2)) << "the call before's copy of layer 2 was served";
  EXPECT_EQ(sched.stats().steps, 4u);

  // Under a training trace every layer comes again in the backward; only a
  // forward fetch the trace expects keeps the step: an inner module called
  // on its own, twice, gets the weights written between the calls.
  Scheduler trained(*sim, transfer, model.specs, options(6, 2));
  run_step(trained, compute, kTrain, 5);
  run_step(trained, compute, kTrain, 5);
  EXPECT_EQ(trained.trace_forward(), (std::vector<bool>{true, true, true, true, true, false, false, false, false,
                                                        false}));
  for (int call = 0; call < 3; ++call) {
    EXPECT_TRUE(fetch_current(trained, 2)) << "call " << call;
    change(trained, 2);
  }
  EXPECT_EQ(trained.stats().steps, 5u);

  // A block called several times per step where the trace expects it keeps
  // the step (and its cached content: hits).
  Scheduler looped(*sim, transfer, model.specs, options(6, 2));
  const std::vector<int> loop = {0, 1, 1, 1, 2};
  for (int i = 0; i < 3; ++i) run_step(looped, compute, loop, loop.size());
  EXPECT_EQ(looped.stats().steps, 3u);
  EXPECT_EQ(looped.trace(), loop);
  const std::vector<StepStats> steps = looped.step_stats();
  ASSERT_EQ(steps.size(), 2u);
  EXPECT_EQ(steps[1].hits, loop.size() - 1);
  EXPECT_TRUE(sim->ordering_errors().empty());
}

TEST_F(StepBoundaryTest, WriteVersionRefusesCachedContentAfterAnInPlaceWriteWithinAStep) {
  // Two calls the signs cannot separate (an inner module, while the first
  // step is still recorded); an in-place write between them is version-counted.
  std::vector<uint64_t> version(model.specs.size(), 0);
  const auto served_current = [&](bool versioned) {
    SchedulerOptions so = options(6, 2);
    if (versioned) so.write_version = [&](int l) { return version[static_cast<size_t>(l)]; };
    Scheduler sched(*sim, transfer, model.specs, so);
    run_step(sched, compute, {1, 2, 3}, 3);
    change(sched, 2);
    version[2]++;
    return fetch_current(sched, 2);  // the next call begins at layer 2 (not the trace's first)
  };
  EXPECT_FALSE(served_current(false)) << "without the version the old copy is served: the test shows nothing";
  EXPECT_TRUE(served_current(true));
  EXPECT_TRUE(sim->ordering_errors().empty());
}

TEST_F(SchedulerTest, RetraceCanBeSwitchedOff) {
  SchedulerOptions so = options(3, 2);
  so.retrace_after = 0;
  Scheduler sched(*sim, transfer, model.specs, so);
  run_step(sched, compute, kInfer, 5);
  for (int i = 0; i < 5; ++i) run_step(sched, compute, kTrain, 5);
  EXPECT_EQ(sched.stats().retraces, 0u);
  EXPECT_EQ(sched.trace(), kInfer);
}

// A partial acquire copies only its ranges (the rest of the slot keeps what
// it held), counts exactly those bytes, and its content is never taken for
// the whole layer by a later acquire; a layer already loaded is used whole.
TEST_F(SchedulerTest, PartialAcquireCopiesOnlyItsRangesAndIsNeverReused) {
  Scheduler sched(*sim, transfer, model.specs, options(2, 0));
  const LayerSpec& spec = model.specs[2];
  const size_t n = spec.parts[0].bytes;
  ASSERT_GE(n, 8u);
  PartialCopy copy;
  copy.ranges.resize(spec.parts.size());
  copy.ranges[0] = {{1, 3}, {n - 2, 2}};  // bytes [1, 4) and the last two
  // Fill both slots with other layers' bytes first, so "untouched" is visible.
  for (int l : {0, 1}) {
    Lease x = sched.acquire(l, compute);
    sched.release(x, compute);
  }
  const uint64_t before = sched.stats().h2d_bytes;
  Lease x = sched.acquire_partial(2, compute, Phase::Forward, copy);
  EXPECT_FALSE(x.hit);
  EXPECT_EQ(sched.stats().h2d_bytes - before, 5u);
  const auto* got = static_cast<const unsigned char*>(x.part_ptr(0));
  const auto* want = static_cast<const unsigned char*>(spec.parts[0].ptr);
  EXPECT_EQ(0, std::memcmp(got + 1, want + 1, 3));
  EXPECT_EQ(0, std::memcmp(got + n - 2, want + n - 2, 2));
  EXPECT_FALSE(slot_matches(x, spec)) << "bytes outside the ranges were copied too";
  sched.release(x, compute);
  // A whole acquire right after copies the whole layer again.
  Lease y = sched.acquire(2, compute);
  EXPECT_FALSE(y.hit);
  EXPECT_TRUE(slot_matches(y, spec));
  sched.release(y, compute);
  // Loaded (cached in a free slot): a partial acquire uses it whole, copying nothing.
  const uint64_t mid = sched.stats().h2d_bytes;
  Lease z = sched.acquire_partial(2, compute, Phase::Forward, copy);
  EXPECT_TRUE(z.hit);
  EXPECT_TRUE(slot_matches(z, spec));
  EXPECT_EQ(sched.stats().h2d_bytes, mid);
  sched.release(z, compute);
  // Ranges outside a part are refused before anything is copied.
  PartialCopy bad;
  bad.ranges.resize(spec.parts.size());
  bad.ranges[0] = {{n - 1, 2}};
  EXPECT_THROW(sched.acquire_partial(3, compute, Phase::Forward, bad), Error);
  EXPECT_TRUE(sim->ordering_errors().empty());
}

// parts_stale / refresh_parts (the engine's trainable coded weights): a
// stale layer's host bytes are remade before its copy, after its earlier
// copies have read them (the checker sees the host write ordered after
// them), and only the bytes refresh_parts names cross the bus.
TEST_F(SchedulerTest, StaleHostBytesAreRemadeAfterEarlierCopiesAndTheirNewSizeIsCopied) {
  SimOptions o;
  o.h2d_gbps = 0.05;  // slow copies: a refresh that did not wait would overlap one
  o.latency_us = 0;
  auto slow = make_sim_backend(o);
  HostStore st(*slow);
  Stream xfer = slow->create_stream("transfer"), comp = slow->create_inline_stream("compute");
  constexpr size_t kBytes = 64 << 10;
  std::vector<LayerSpec> specs(5);
  std::vector<size_t> idx;
  for (int l = 0; l < 5; ++l) {
    std::vector<unsigned char> bytes(kBytes, static_cast<unsigned char>(l));
    idx.push_back(st.add(bytes.size(), bytes.data(), "coded" + std::to_string(l)));
    specs[size_t(l)].name = "layer" + std::to_string(l);
    specs[size_t(l)].parts.push_back(st.buffer(idx.back()));
  }
  std::vector<uint64_t> version(5, 0), coded(5, 0);
  std::vector<int> refreshed(5, 0);
  std::vector<size_t> size(5, kBytes);
  SchedulerOptions so = options(2, 1);
  // Content survives step boundaries and prefetching wraps into the next
  // step: layer 0 is copied again while the last layer computes.
  so.content_version = [&](int l) { return version[size_t(l)]; };
  so.parts_stale = [&](int l) { return coded[size_t(l)] != version[size_t(l)]; };
  so.refresh_parts = [&](int l, std::vector<size_t>& bytes) {
    const BufferRef& b = st.buffer(idx[size_t(l)]);
    slow->declare_host_access(b, Access::Write, "re-code layer" + std::to_string(l));
    std::memset(b.ptr, 100 + refreshed[size_t(l)]++, size[size_t(l)]);
    bytes.at(0) = size[size_t(l)];
    coded[size_t(l)] = version[size_t(l)];
  };
  Scheduler sched(*slow, xfer, specs, so);
  const std::vector<int> order = {0, 1, 2, 3, 4};
  for (int step = 0; step < 2; ++step) run_step(sched, comp, order, 5);
  EXPECT_EQ(refreshed, (std::vector<int>{0, 0, 0, 0, 0}));
  // "An optimizer step" while the next step's first layer may still be
  // copying: every layer changes and now takes fewer bytes.
  size = {1000, 2000, 3000, 4000, 5000};
  version = {1, 1, 1, 1, 1};
  const uint64_t before = sched.stats().h2d_bytes;
  for (size_t i = 0; i < order.size(); ++i) {
    const int l = order[i];
    Lease x = sched.acquire(l, comp);
    const auto* got = static_cast<const unsigned char*>(x.part_ptr(0));
    EXPECT_EQ(got[0], 100) << "layer " << l << " holds bytes copied before they were remade";
    EXPECT_EQ(got[size[size_t(l)] - 1], 100);
    sched.release(x, comp);
  }
  EXPECT_EQ(refreshed, (std::vector<int>{1, 1, 1, 1, 1})) << "each layer is remade once";
  // Each layer's new bytes once, and the next step's layer 0, prefetched by now.
  EXPECT_EQ(sched.stats().h2d_bytes - before, 1000u + 2000 + 3000 + 4000 + 5000 + 1000);
  slow->synchronize(xfer);
  const auto errors = slow->ordering_errors();
  EXPECT_TRUE(errors.empty()) << errors.size() << " ordering errors, first: " << errors.front();
  // One of the pair without the other is refused.
  SchedulerOptions half = options(2, 1);
  half.parts_stale = so.parts_stale;
  EXPECT_THROW(Scheduler(*slow, xfer, specs, half), Error);
}

// Three layers of 64 KiB on a slow sim link (0.05 GB/s: a copy is still reading
// its host bytes when the host writes them next), ordering checker on.
struct SlowLink {
  std::shared_ptr<SimBackend> sim = make_sim_backend([] {
    SimOptions o;
    o.h2d_gbps = 0.05;
    o.latency_us = 0;
    return o;
  }());
  HostStore store{*sim};
  Stream xfer = sim->create_stream("transfer"), comp = sim->create_inline_stream("compute");
  std::vector<LayerSpec> specs;
  std::vector<size_t> idx;
  SlowLink() {
    for (int l = 0; l < 3; ++l) {
      std::vector<unsigned char> bytes(64 << 10, static_cast<unsigned char>(l));
      idx.push_back(store.add(bytes.size(), bytes.data(), "weight" + std::to_string(l)));
      specs.emplace_back();
      specs.back().name = "layer" + std::to_string(l);
      specs.back().parts.push_back(store.buffer(idx.back()));
    }
  }
  // The host writes layer `l`'s bytes (declared as `what`); the checker's errors after
  // every copy ended.
  size_t errors_after_host_write(int l, const std::string& what) {
    const BufferRef& b = store.buffer(idx[static_cast<size_t>(l)]);
    sim->declare_host_access(b, Access::Write, what);
    std::memset(b.ptr, 7, b.bytes);
    sim->synchronize(xfer);
    return sim->ordering_errors().size();
  }
};

// wait_copies_read(layer): an owner that remakes a layer's host bytes itself
// (the engine's re-code after an optimizer step during the backward) may
// write them once it returns, although a prefetch of the layer is in flight;
// writing without it is the race the checker reports.
TEST_F(SchedulerTest, WaitCopiesReadOrdersAnOwnersWriteAfterACopyInFlight) {
  const auto errors_after_write = [](bool wait) {
    SlowLink m;
    Scheduler sched(*m.sim, m.xfer, m.specs, options(2, 1));
    run_step(sched, m.comp, {0, 1, 2}, 3);  // records the trace
    Lease x = sched.acquire(0, m.comp);     // replay: prefetches layer 1
    sched.release(x, m.comp);
    if (wait) sched.wait_copies_read(1);
    return m.errors_after_host_write(1, "owner's re-code of layer1");
  };
#if !defined(__SANITIZE_THREAD__)  // the race is real: ThreadSanitizer reports it (tools/sanitize.sh)
  EXPECT_GT(errors_after_write(false), 0u) << "the prefetch was not in flight: the test shows nothing";
#endif
  EXPECT_EQ(errors_after_write(true), 0u);
}

// A routed copy (acquire_partial) counts too: wait_copies_read orders the
// owner's write (the engine's re-code of a trainable coded group before a
// routed fetch, recode_for_fetch) after it, as after a full copy.
TEST_F(SchedulerTest, WaitCopiesReadOrdersAnOwnersWriteAfterAPartialCopyInFlight) {
  const auto errors_after_write = [](bool wait) {
    SlowLink m;
    Stream comp = m.sim->create_stream("compute");  // not inline: the host does not wait for the copy
    Scheduler sched(*m.sim, m.xfer, m.specs, options(2, 0));
    PartialCopy copy;
    copy.ranges.resize(m.specs[1].parts.size());
    copy.ranges[0] = {{0, m.specs[1].parts[0].bytes / 2}};
    Lease x = sched.acquire_partial(1, comp, Phase::Forward, copy);
    EXPECT_FALSE(x.hit);
    sched.release(x, comp);
    if (wait) sched.wait_copies_read(1);
    const size_t errors = m.errors_after_host_write(1, "owner's re-code of layer1");
    m.sim->synchronize(comp);
    return errors;
  };
#if !defined(__SANITIZE_THREAD__)  // the race is real: ThreadSanitizer reports it (tools/sanitize.sh)
  EXPECT_GT(errors_after_write(false), 0u) << "the partial copy was not in flight: the test shows nothing";
#endif
  EXPECT_EQ(errors_after_write(true), 0u);
}

// Note [No copy in flight at a step's end]: while recording, the backward guesses
// the next layer by index; the first layer's backward reads no weight, so its
// guessed copy is never taken. wait_unused_prefetches() (the engine calls it when
// a backward ends) orders the optimizer's write of that layer after the copy.
TEST_F(SchedulerTest, NoGuessedPrefetchReadsHostWeightsAfterTheBackwardEnds) {
  const auto errors_after_step = [](bool wait, bool versioned) {
    SlowLink m;
    SchedulerOptions so = options(2, 1);
    if (versioned) so.content_version = [](int) { return uint64_t{0}; };
    Scheduler sched(*m.sim, m.xfer, m.specs, so);
    run_step(sched, m.comp, {0, 1, 2, 2, 1}, 3);  // layer 0's backward reads no weight
    EXPECT_EQ(sched.trace(), (std::vector<int>{0, 1, 2, 2, 1}));
    if (wait) sched.wait_unused_prefetches();
    return m.errors_after_host_write(0, "optimizer step of layer0");
  };
#if !defined(__SANITIZE_THREAD__)  // the race is real: ThreadSanitizer reports it (tools/sanitize.sh)
  EXPECT_GT(errors_after_step(false, false), 0u) << "layer 0 was not guessed: the test shows nothing";
  // With content_version such a copy is checked by version, by design: no wait.
  EXPECT_GT(errors_after_step(true, true), 0u);
#endif
  EXPECT_EQ(errors_after_step(true, false), 0u);
}

// A layer held twice (two leases of one slot) on two streams, released on each: the
// slot is reused only after both streams' reads of it, not only the last releaser's.
TEST_F(SchedulerTest, ASlotHeldOnTwoStreamsIsReusedAfterBothReleasersReads) {
  const auto errors = [&](bool swap_releases) {
    sim->clear_ordering_errors();
    Stream a = sim->create_stream("compute-a"), b = sim->create_stream("compute-b");
    Scheduler sched(*sim, transfer, model.specs, options(2, 0));
    Lease first = sched.acquire(0, a);
    Lease second = sched.acquire(0, b);  // the same slot; b waits for its copy too
    EXPECT_EQ(first.slot, second.slot);
    sim->declare_access(first.slot_buf, Access::Read, a, "stream a reads layer 0");
    sim->declare_access(second.slot_buf, Access::Read, b, "stream b reads layer 0");
    sched.release(swap_releases ? second : first, swap_releases ? b : a);
    sched.release(swap_releases ? first : second, swap_releases ? a : b);
    for (int l = 1; l < 5; ++l) {  // two slots: layer 0's is refilled
      Lease x = sched.acquire(l, b);
      sched.release(x, b);
    }
    sim->synchronize(transfer);
    return sim->ordering_errors().size();
  };
  EXPECT_EQ(errors(false), 0u);
  EXPECT_EQ(errors(true), 0u);
}

// set_prefetch(layer, false): replay passes over the layer (it is fetched on
// demand) and prefetches the layers after it instead.
TEST_F(SchedulerTest, ALayerWithoutPrefetchIsFetchedOnDemandAndSkipped) {
  Scheduler sched(*sim, transfer, model.specs, options(3, 1));
  for (int step = 0; step < 2; ++step) run_step(sched, compute, kInfer, 5);
  sched.set_prefetch(2, false);
  for (int l : kInfer) {
    Lease x = sched.acquire(l, compute);
    EXPECT_TRUE(slot_matches(x, model.specs[static_cast<size_t>(l)]));
    // Layer 1's release prefetches layer 3, not layer 2; layer 3 was in flight by its acquire.
    if (l == 2) {
      EXPECT_FALSE(x.hit) << "layer 2 was prefetched";
    }
    if (l == 3) {
      EXPECT_TRUE(x.hit) << "layer 3 was not prefetched past layer 2";
    }
    sched.release(x, compute);
  }
  sched.set_prefetch(2, true);
  sched.begin_step();
  for (int l : kInfer) {
    Lease x = sched.acquire(l, compute);
    if (l > 0) {
      EXPECT_TRUE(x.hit) << "layer " << l;
    }
    sched.release(x, compute);
  }
  EXPECT_TRUE(sim->ordering_errors().empty());
}

TEST_F(SchedulerTest, AllSlotsHeldIsAClearError) {
  SchedulerOptions so;
  so.num_slots = 2;
  so.prefetch_depth = 0;
  Scheduler sched(*sim, transfer, model.specs, so);
  Lease a = sched.acquire(0, compute);
  Lease b = sched.acquire(1, compute);
  try {
    sched.acquire(2, compute);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("all 2 device slots are held"), std::string::npos) << e.what();
  }
  sched.release(a, compute);
  sched.release(b, compute);
}

TEST_F(SchedulerTest, BudgetTooSmallNamesTheLargestLayer) {
  SchedulerOptions so;
  so.num_slots = 2;
  so.budget_bytes = 1000;
  try {
    Scheduler sched(*sim, transfer, model.specs, so);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("too small"), std::string::npos) << msg;
    EXPECT_NE(msg.find("largest streamed layer is 'layer"), std::string::npos) << msg;
  }
}

TEST_F(SchedulerTest, ScratchSlotsComeFromThePool) {
  SchedulerOptions so;
  so.num_slots = 2;
  so.prefetch_depth = 1;
  Scheduler sched(*sim, transfer, model.specs, so);
  Lease w = sched.acquire(0, compute);
  Lease g = sched.acquire_scratch(compute);
  EXPECT_NE(w.slot, g.slot);
  sched.release(g, compute);
  sched.release(w, compute);
  EXPECT_LE(sched.stats().max_slots_held, 2);
}

TEST(SchedulerShutdown, DestroyWithCopiesInFlight) {
  SimOptions o;
  o.h2d_gbps = 0.05;  // 1 MB takes 20 ms
  auto sim = make_sim_backend(o);
  HostStore store(*sim);
  std::vector<LayerSpec> specs;
  std::vector<unsigned char> data(1 << 20, 7);
  for (int i = 0; i < 4; ++i) {
    size_t idx = store.add(data.size(), data.data(), "l" + std::to_string(i));
    specs.push_back(LayerSpec{"l" + std::to_string(i), {store.buffer(idx)}});
  }
  Stream transfer = sim->create_stream("transfer");
  Stream compute = sim->create_stream("compute");
  SchedulerOptions so;
  so.num_slots = 4;
  so.prefetch_depth = 3;
  {
    Scheduler sched(*sim, transfer, specs, so);
    Lease l = sched.acquire(0, compute);  // prefetches 1..3, all in flight
    sched.release(l, compute);
  }  // destroyed with copies in flight: must not hang or leak
  EXPECT_TRUE(sim->ordering_errors().empty());
}

TEST(HostStoreTest, PinnedFallbackWarnsOnceAndAccountsBytes) {
  SimOptions o;
  o.fail_pinned_allocations = true;
  auto sim = make_sim_backend(o);
  std::vector<std::string> warnings;
  auto prev = set_warning_handler([&](const std::string& w) { warnings.push_back(w); });
  HostStore store(*sim);
  store.add(100, nullptr, "a");
  store.add(200, nullptr, "b");
  set_warning_handler(prev);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("pageable"), std::string::npos);
  EXPECT_EQ(store.stats().pageable_bytes, 300u);
  EXPECT_EQ(store.stats().pinned_bytes, 0u);
  EXPECT_EQ(store.buffer(0).kind, MemoryKind::HostPageable);

  auto sim2 = make_sim_backend(SimOptions{});
  HostStore pinned(*sim2);
  pinned.add(64, nullptr, "c");
  EXPECT_EQ(pinned.stats().pinned_bytes, 64u);
  EXPECT_EQ(pinned.buffer(0).kind, MemoryKind::HostPinned);
}

}  // namespace
