// Placement planner: budget property across random layer sets, determinism,
// policy, error text, time model, parse_bytes and model descriptions.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/json.h"
#include "core/gguf.h"
#include "core/host_tier.h"
#include "core/options.h"
#include "core/planner.h"
#include "core/slot_layout.h"

using namespace layerstream;

namespace {

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    EXPECT_EQ(e.message().find('\n'), std::string::npos);
    return e.message();
  }
  ADD_FAILURE() << "did not throw";
  return "";
}

#define EXPECT_HAS(haystack, needle) EXPECT_NE((haystack).find(needle), std::string::npos) << (haystack)

PlannerLayer layer(const std::string& name, uint64_t bytes, double flops = 0.0) {
  PlannerLayer l;
  l.name = name;
  l.bytes = bytes;
  l.resident_bytes = bytes;
  l.flops = flops;
  return l;
}

constexpr uint64_t MiB = 1ull << 20;

}  // namespace

// ------------------------------------------------------------ parse_bytes

TEST(ParseBytes, Units) {
  EXPECT_EQ(parse_bytes("123"), 123u);
  EXPECT_EQ(parse_bytes("12GiB"), 12ull << 30);
  EXPECT_EQ(parse_bytes("500MB"), 500000000u);
  EXPECT_EQ(parse_bytes("1.5e9"), 1500000000u);
  EXPECT_EQ(parse_bytes(" 64 KiB "), 65536u);
  EXPECT_EQ(parse_bytes("2g"), 2000000000u);
  EXPECT_EQ(parse_bytes("1.5GiB"), 3ull << 29);
  EXPECT_EQ(parse_bytes("7B"), 7u);
  EXPECT_EQ(parse_bytes("1TiB"), 1ull << 40);
  EXPECT_EQ(parse_bytes("0"), 0u);
}

TEST(ParseBytes, Errors) {
  EXPECT_HAS(error_of([] { parse_bytes(""); }), "empty size");
  EXPECT_HAS(error_of([] { parse_bytes("abc"); }), "invalid size \"abc\"");
  EXPECT_HAS(error_of([] { parse_bytes("-5GB"); }), "invalid size \"-5GB\"");
  EXPECT_HAS(error_of([] { parse_bytes("12XB"); }), "unknown unit");
  EXPECT_HAS(error_of([] { parse_bytes("12 G iB"); }), "unexpected space");
  EXPECT_HAS(error_of([] { parse_bytes("1e30"); }), "too large");
  EXPECT_HAS(error_of([] { parse_bytes("0.5"); }), "not a whole number of bytes");
  EXPECT_HAS(error_of([] { parse_bytes("1e"); }), "unknown unit");
  EXPECT_HAS(error_of([] { parse_bytes("inf"); }), "invalid size");
  EXPECT_HAS(error_of([] { parse_bytes("0x10"); }), "unknown unit");
}

TEST(FormatBytes, Readable) {
  EXPECT_EQ(format_bytes(10), "10 B");
  EXPECT_EQ(format_bytes(1536), "1.50 KiB");
  EXPECT_EQ(format_bytes(12ull << 30), "12.00 GiB");
}

// ------------------------------------------------------------ planner

TEST(Planner, EverythingResidentWhenItFits) {
  PlannerInput in;
  in.budget_bytes = 100 * MiB;
  in.layers = {layer("a", 10 * MiB), layer("b", 20 * MiB)};
  in.fixed_resident_bytes = MiB;
  Plan p = plan_placement(in);
  EXPECT_EQ(p.num_streamed, 0u);
  EXPECT_EQ(p.num_slots, 0);
  EXPECT_EQ(p.prefetch_depth, 0);
  EXPECT_EQ(p.slot_bytes, 0u);
  EXPECT_EQ(p.device_bytes, 31 * MiB);
  EXPECT_EQ(p.host_pinned_bytes, 0u);
}

TEST(Planner, TrainingBytesOfResidentWeightsCountInTheBudget) {
  // Four 100 MiB trainable layers and 600 MiB: resident as weights alone; with
  // their gradients and AdamW states (train_bytes, 3x the weight here) only
  // two stay resident beside 2 slots, and the plan says what is what.
  PlannerInput in;
  in.budget_bytes = 600 * MiB;
  for (int i = 0; i < 4; ++i) in.layers.push_back(layer("l" + std::to_string(i), 100 * MiB));
  Plan weights_only = plan_placement(in);
  EXPECT_EQ(weights_only.num_resident, 4u);
  EXPECT_EQ(weights_only.train_bytes, 0u);
  for (auto& l : in.layers) l.train_bytes = 300 * MiB;
  in.layers[3].train_bytes = 0;  // frozen
  in.fixed_resident_bytes = 10 * MiB;
  in.fixed_train_bytes = 30 * MiB;
  Plan p = plan_placement(in);
  EXPECT_EQ(p.num_resident, 1u);  // the frozen one: 100 MiB; a trainable one would need 400
  EXPECT_TRUE(p.layers[3].resident);
  EXPECT_EQ(p.layers[3].train_bytes, 0u);
  EXPECT_EQ(p.layers[0].train_bytes, 0u);  // streamed: its gradient and states are on the host
  EXPECT_EQ(p.train_bytes, 30 * MiB);
  EXPECT_EQ(p.device_bytes, 100 * MiB + 40 * MiB + 2 * 100 * MiB);
  in.budget_bytes = 1000 * MiB;
  p = plan_placement(in);
  EXPECT_EQ(p.num_resident, 2u);  // 140 fixed + 100 frozen + 400 trainable + 2 slots x 100 <= 1000
  EXPECT_EQ(p.train_bytes, 330 * MiB);
  EXPECT_EQ(p.resident_bytes, 200 * MiB);
  EXPECT_LE(p.device_bytes, in.budget_bytes);
  EXPECT_HAS(p.explain(), "+ gradients and optimizer states 330.00 MiB +");
  EXPECT_HAS(p.to_json(), "\"train_bytes\": 346030080");
  in.budget_bytes = 35 * MiB;
  EXPECT_HAS(error_of([&] { plan_placement(in); }),
             "e.g. by exclude=: 40.00 MiB, of which 30.00 MiB their gradients and optimizer states (train=))");
}

TEST(Planner, TooSmallBudgetErrorNamesLargestLayer) {
  PlannerInput in;
  in.budget_bytes = 100 * MiB;
  in.layers = {layer("small", 10 * MiB), layer("model.layers.3.mlp.up_proj", 60 * MiB), layer("c", 50 * MiB)};
  in.fixed_resident_bytes = MiB;
  std::string m = error_of([&] { plan_placement(in); });
  EXPECT_HAS(m, "budget 100.00 MiB (104857600 bytes) is too small");
  EXPECT_HAS(m, "the largest layer \"model.layers.3.mlp.up_proj\" is 60.00 MiB (62914560 bytes)");
  EXPECT_HAS(m, "needs 2 slots of it plus 1.00 MiB of small resident tensors");
  EXPECT_HAS(m, "a budget of at least 121.00 MiB (126877696 bytes) is needed");
  EXPECT_HAS(m, "(or quantize the weights, e.g. to nf4)");

  in.fixed_resident_bytes = 200 * MiB;
  EXPECT_HAS(error_of([&] { plan_placement(in); }), "cannot even hold the always-resident small tensors");
}

// The prefetch depth the plan reports and times is the one the engine runs,
// min(prefetch, slots - 1): slots=5 with prefetch=1 said depth 4 (3 slots never
// prefetched into) and prefetch=0 said 1, and timed copies that never overlap.
TEST(Planner, PlansThePrefetchDepthTheEngineRuns) {
  PlannerInput in;
  in.link_bytes_per_s = 1e9;
  in.device_flops_per_s = 1e12;
  for (int i = 0; i < 8; ++i) in.layers.push_back(layer("l" + std::to_string(i), 10 * MiB, 1e9));
  in.budget_bytes = 60 * MiB;
  const Plan five = plan_slots_first(in, 1, 5);
  EXPECT_EQ(five.num_slots, 5);
  EXPECT_EQ(five.prefetch_depth, 1);
  const Plan two = plan_slots_first(in, 1, 2);
  EXPECT_EQ(two.prefetch_depth, 1);
  const Plan deep = plan_slots_first(in, 4, 5);
  EXPECT_EQ(deep.prefetch_depth, 4);
  const Plan none = plan_slots_first(in, 0, 0);
  EXPECT_EQ(none.num_slots, 2);
  EXPECT_EQ(none.prefetch_depth, 0);
  EXPECT_GE(none.step_time_s, two.step_time_s);
  EXPECT_HAS(five.explain(), "prefetch depth 1");
}

// Every slots= the engine takes plans (slots=66 with a budget was refused with
// "max_prefetch must be in [1, 64] (got 65)"), and values out of range get the
// engine's own messages, not the planner's internal bounds.
TEST(Planner, PlansEverySlotCountTheEngineTakesAndRefusesOthersInItsWords) {
  PlannerInput in;
  for (int i = 0; i < 80; ++i) in.layers.push_back(layer("l" + std::to_string(i), 1 * MiB, 1e9));
  in.budget_bytes = 70 * MiB;  // 66 slots and 4 layers resident; or 65 and 5
  EXPECT_EQ(plan_slots_first(in, 2, static_cast<int>(options::kMaxSlots)).num_slots, options::kMaxSlots);
  EXPECT_EQ(plan_slots_first(in, static_cast<int>(options::kMaxPrefetch), 0).num_slots, options::kMaxPrefetch + 1);
  EXPECT_HAS(error_of([&] { plan_slots_first(in, 100, 0); }), "prefetch must be in [0, 64]");
  EXPECT_HAS(error_of([&] { plan_slots_first(in, 2, 67); }), "slots must be in [2, 66]");
  EXPECT_HAS(error_of([&] { plan_slots_first(in, 2, 1); }), "slots must be in [2, 66]");
}

TEST(Planner, LowFlopsPerByteLayerIsKeptResidentFirst) {
  PlannerInput in;
  in.link_bytes_per_s = 1e9;
  in.device_flops_per_s = 1e12;
  // Four equal layers; room for 2 slots + exactly one resident layer.
  in.layers = {layer("hi_a", 10 * MiB, 1e12), layer("low", 10 * MiB, 1e6), layer("hi_b", 10 * MiB, 1e12),
               layer("hi_c", 10 * MiB, 1e12)};
  in.budget_bytes = 30 * MiB;
  in.max_prefetch = 1;
  Plan p = plan_placement(in);
  ASSERT_EQ(p.num_resident, 1u);
  EXPECT_TRUE(p.layers[1].resident);
  EXPECT_EQ(p.layers[1].name, "low");
  EXPECT_EQ(p.num_slots, 2);
  EXPECT_EQ(p.slot_bytes, 10 * MiB);
  EXPECT_EQ(p.host_pinned_bytes, 30 * MiB);

  // Unknown FLOPs: largest first, then execution order.
  PlannerInput u;
  u.layers = {layer("x", 4 * MiB), layer("y", 6 * MiB), layer("z", 6 * MiB), layer("w", 5 * MiB)};
  u.budget_bytes = 18 * MiB;  // total 21; y resident (6) + 2 slots x 6 (z) = 18
  Plan q = plan_placement(u);
  EXPECT_TRUE(q.layers[1].resident);
  EXPECT_FALSE(q.layers[2].resident);
  EXPECT_LE(q.device_bytes, u.budget_bytes);
}

TEST(Planner, TimeModel) {
  PlannerInput in;
  in.link_bytes_per_s = 1e9;
  in.device_flops_per_s = 1e12;
  in.budget_bytes = 2 * 1000000;  // only the slots fit
  for (int i = 0; i < 10; ++i) in.layers.push_back(layer("l" + std::to_string(i), 1000000, 1e10));  // 1 ms each way... compute 10 ms
  Plan p = plan_placement(in);
  ASSERT_TRUE(p.has_time);
  EXPECT_EQ(p.num_streamed, 10u);
  EXPECT_NEAR(p.compute_time_s, 0.1, 1e-9);
  EXPECT_NEAR(p.transfer_time_s, 0.01, 1e-9);
  EXPECT_NEAR(p.step_time_s, 0.1, 1e-6);  // transfers hide behind compute
  EXPECT_EQ(p.bound(), "compute");

  EXPECT_NEAR(p.stall_s(), 0.0, 1e-6);

  for (auto& l : in.layers) l.flops = 1e8;  // compute 0.1 ms, transfer 1 ms
  p = plan_placement(in);
  EXPECT_NEAR(p.step_time_s, 0.01, 1e-4);  // link-bound: one transfer after another
  EXPECT_EQ(p.bound(), "transfer");
  EXPECT_GE(p.first_step_time_s, p.step_time_s - 1e-12);

  in.link_bytes_per_s = 0;
  p = plan_placement(in);
  EXPECT_FALSE(p.has_time);
  EXPECT_EQ(p.bound(), "unknown");
  EXPECT_EQ(p.to_json().find("\"time\": null") != std::string::npos, true);
}

TEST(Planner, TrainingStreamsTwice) {
  PlannerInput in;
  in.link_bytes_per_s = 1e9;
  in.budget_bytes = 2 * 1000000;
  in.training = true;
  for (int i = 0; i < 4; ++i) in.layers.push_back(layer("l" + std::to_string(i), 1000000));
  Plan p = plan_placement(in);
  EXPECT_EQ(p.bus_bytes_per_step, 8000000u);
  EXPECT_NEAR(p.step_time_s, 0.008, 1e-6);
}

TEST(Planner, ExplainAndJson) {
  PlannerInput in;
  in.link_bytes_per_s = 25e9;
  in.device_flops_per_s = 1e14;
  in.budget_bytes = 50 * MiB;
  in.fixed_resident_bytes = 1000;
  for (int i = 0; i < 6; ++i) in.layers.push_back(layer("blk." + std::to_string(i) + ".fc", 10 * MiB, 1e9 * (i + 1)));
  Plan p = plan_placement(in);
  std::string text = p.explain();
  EXPECT_HAS(text, "blk.5.fc");
  EXPECT_HAS(text, "resident");
  EXPECT_HAS(text, "streamed");
  EXPECT_HAS(text, "host RAM needed (pinned)");
  EXPECT_HAS(text, "predicted step time");
  json::Value v = json::parse(p.to_json(), "plan json");
  uint64_t dev = 0, budget = 0;
  ASSERT_TRUE(v.find("device_bytes")->to_uint64(dev));
  ASSERT_TRUE(v.find("budget_bytes")->to_uint64(budget));
  EXPECT_LE(dev, budget);
  EXPECT_EQ(v.find("layers")->array.size(), 6u);
  EXPECT_TRUE(v.find("time")->is_object());
  EXPECT_TRUE(v.find("time")->find("step_s")->is_number());
}

TEST(Planner, InputValidation) {
  PlannerInput in;
  in.budget_bytes = 100;
  in.layers = {layer("a", 10)};
  in.min_slots = 1;
  EXPECT_HAS(error_of([&] { plan_placement(in); }), "min_slots must be at least 2");
  in.min_slots = 2;
  in.layers[0].flops = -1;
  EXPECT_HAS(error_of([&] { plan_placement(in); }), "invalid FLOPs");
  in.layers[0].flops = NAN;
  EXPECT_HAS(error_of([&] { plan_placement(in); }), "invalid FLOPs");
}

// Budget held across hundreds of random layer sets; deterministic; consistent.
// The least device memory of any plan with min_slots slots: the k largest
// layers resident and min_slots slots of the next one, for the best k.
long double least_with_min_slots(const PlannerInput& in) {
  std::vector<const PlannerLayer*> by_slot;
  for (const auto& l : in.layers)
    if (!l.lookup) by_slot.push_back(&l);
  std::stable_sort(by_slot.begin(), by_slot.end(), [](const PlannerLayer* a, const PlannerLayer* b) {
    return a->streamed_slot_bytes() > b->streamed_slot_bytes();
  });
  long double best = INFINITY, res = static_cast<long double>(in.fixed_resident_bytes + in.fixed_train_bytes);
  for (const PlannerLayer* l : by_slot) {
    best = std::min(best, res + static_cast<long double>(in.min_slots) * static_cast<long double>(l->streamed_slot_bytes()));
    res += static_cast<long double>(l->resident_bytes + l->train_bytes);
  }
  return best;
}

TEST(Planner, LookupTablesTakeNoDeviceMemory) {
  // A 100 MiB table looked up in host memory beside four 10 MiB layers and a
  // 25 MiB budget: the table is neither resident nor in a slot; its bytes are
  // pinned host memory and the rows a step reads cross the bus.
  PlannerInput in;
  PlannerLayer table = layer("model.embed_tokens", 100 * MiB);
  table.lookup = true;
  table.lookup_bytes = 2 * MiB;
  in.layers.push_back(table);
  for (int i = 0; i < 4; ++i) in.layers.push_back(layer("l" + std::to_string(i), 10 * MiB));
  in.budget_bytes = 25 * MiB;
  in.link_bytes_per_s = 1e9;
  Plan p = plan_placement(in);
  EXPECT_TRUE(p.layers[0].lookup);
  EXPECT_FALSE(p.layers[0].resident);
  EXPECT_EQ(p.num_lookup, 1u);
  EXPECT_EQ(p.num_streamed + p.num_resident, 4u);
  EXPECT_EQ(p.slot_bytes, 10 * MiB);
  EXPECT_LE(p.device_bytes, 25 * MiB);
  EXPECT_EQ(p.host_pinned_bytes, 100 * MiB + 10 * MiB * p.num_streamed);
  EXPECT_EQ(p.bus_bytes_per_step, 2 * MiB + 10 * MiB * p.num_streamed);
  EXPECT_NEAR(p.layers[0].transfer_s, 2.0 * MiB / 1e9, 1e-12);
  EXPECT_HAS(p.explain(), "1 looked up in host memory");
  EXPECT_HAS(p.explain(), "+ 1 looked-up tables");
  EXPECT_HAS(p.to_json(), "\"placement\": \"lookup\"");
  EXPECT_HAS(p.to_json(), "\"num_lookup\": 1");
  // Everything else fits resident: the table is still looked up.
  in.budget_bytes = 40 * MiB;
  p = plan_placement(in);
  EXPECT_EQ(p.num_resident, 4u);
  EXPECT_TRUE(p.layers[0].lookup);
  EXPECT_EQ(p.device_bytes, 40 * MiB);
}

// A table's rows read across the bus take the link from the weights' copies:
// a transfer-bound step is never predicted shorter than the bytes it moves
// (inference: host->device; training: the gradient rows back too).
TEST(Planner, LookedUpRowsAreChargedToTheLink) {
  for (bool training : {false, true}) {
    PlannerInput in;
    PlannerLayer table = layer("model.embed_tokens", 100 * MiB);
    table.lookup = true;
    table.lookup_bytes = 20 * MiB;
    table.trainable = training;
    in.layers.push_back(table);
    for (int i = 0; i < 4; ++i) in.layers.push_back(layer("l" + std::to_string(i), 10 * MiB, 1e3));
    in.budget_bytes = 25 * MiB;  // every block streams
    in.link_bytes_per_s = 1e9;
    in.device_flops_per_s = 1e12;
    in.training = training;
    const Plan p = plan_placement(in);
    ASSERT_EQ(p.num_resident, 0u) << p.explain();
    if (!training) {
      EXPECT_EQ(p.bus_bytes_per_step, 20 * MiB + 40 * MiB);
    }
    EXPECT_GE(p.step_time_s, static_cast<double>(p.bus_bytes_per_step) / 1e9 * (1 - 1e-9))
        << (training ? "training" : "inference");
  }
}

TEST(Planner, TiedHeadSharesItsTablesHostCopyOrHoldsItResident) {
  // A 100 MiB table and an lm_head tied to it. Streamed, the head reads the
  // table's host copy: pinned host bytes count it once. Kept resident, the
  // table is resident with it: no lookup, no rows on the bus, no extra
  // device bytes.
  auto model = [](int blocks, uint64_t block_bytes) {
    PlannerInput in;
    PlannerLayer table = layer("model.embed_tokens", 100 * MiB);
    table.lookup = true;
    table.lookup_bytes = 2 * MiB;
    in.layers.push_back(table);
    for (int i = 0; i < blocks; ++i) in.layers.push_back(layer("l" + std::to_string(i), block_bytes));
    PlannerLayer head = layer("lm_head", 100 * MiB);
    head.tied_table = 0;
    in.layers.push_back(head);
    in.link_bytes_per_s = 1e9;
    return in;
  };
  // Blocks larger than the head: 3 slots of a block and nothing else fit.
  PlannerInput in = model(4, 120 * MiB);
  in.budget_bytes = 400 * MiB;
  Plan p = plan_placement(in);
  const size_t h = 5;
  ASSERT_FALSE(p.layers[h].resident);
  EXPECT_TRUE(p.layers[0].lookup);
  EXPECT_EQ(p.layers[h].tied_with, 0);
  EXPECT_EQ(p.layers[0].tied_with, static_cast<int>(h));
  uint64_t streamed = 0;
  for (size_t i = 1; i < h; ++i) streamed += p.layers[i].resident ? 0 : 120 * MiB;
  EXPECT_EQ(p.host_pinned_bytes, 100 * MiB + streamed);  // the table once; the head reads it
  EXPECT_EQ(p.bus_bytes_per_step, 2 * MiB + 100 * MiB + streamed);
  EXPECT_HAS(p.explain(), "tied weights:             lm_head streams the host copy of model.embed_tokens");
  EXPECT_HAS(p.to_json(), "\"tied_with\": \"lm_head\"");

  // An outlier head beside 10 MiB blocks: kept resident so that the slots shrink.
  in = model(8, 10 * MiB);
  in.budget_bytes = 150 * MiB;
  p = plan_placement(in);
  const size_t h2 = 9;
  ASSERT_TRUE(p.layers[h2].resident);
  EXPECT_TRUE(p.layers[0].resident);
  EXPECT_FALSE(p.layers[0].lookup);
  EXPECT_EQ(p.layers[0].resident_bytes, 0u);
  EXPECT_EQ(p.num_lookup, 0u);
  EXPECT_EQ(p.layers[0].transfer_s, 0.0);
  ASSERT_GT(p.num_streamed, 0u);
  EXPECT_EQ(p.host_pinned_bytes, 10 * MiB * p.num_streamed);
  EXPECT_EQ(p.bus_bytes_per_step, 10 * MiB * p.num_streamed);
  EXPECT_EQ(p.device_bytes, p.resident_bytes + static_cast<uint64_t>(p.num_slots) * p.slot_bytes);
  EXPECT_LE(p.device_bytes, 150 * MiB);
  EXPECT_HAS(p.explain(), "tied weights:             lm_head is resident, and model.embed_tokens with it");

  in.layers[h2].tied_table = 2;  // not a table
  EXPECT_HAS(error_of([&] { plan_placement(in); }), "is tied to layer #2, which is not a lookup table");
}

TEST(Planner, LayersSharingAWeightArePlacedTogetherAndCountItOnce) {
  // Two Linears sharing one weight (offload() streams both from one host copy):
  // resident together or streamed together; the weight on the device once (in
  // the first one's resident_bytes) and pinned once. Before, the planner placed
  // them apart (offload() then kept both resident, beyond the plan it reported)
  // and counted the weight twice.
  constexpr uint64_t KiB = 1024, W = 256 * KiB, B = KiB;
  auto model = [&] {
    PlannerInput in;
    in.layers.push_back(layer("l1", W + B));
    for (int i = 0; i < 3; ++i) in.layers.push_back(layer("mid" + std::to_string(i), W + B));
    PlannerLayer l2 = layer("l2", W + B);
    l2.tied_layer = 0;
    l2.tied_bytes = W;
    l2.resident_bytes = B;  // its weight is l1's
    in.layers.push_back(l2);
    return in;
  };
  PlannerInput in = model();
  int together = 0, apart_streamed = 0;
  for (uint64_t budget = 2 * (W + B); budget <= 6 * (W + B); budget += 16 * KiB) {
    in.budget_bytes = budget;
    SCOPED_TRACE(budget);
    Plan p;
    try {
      p = plan_slots_first(in, 1, 0);
    } catch (const BudgetTooSmall&) {
      continue;
    }
    EXPECT_EQ(p.layers[0].resident, p.layers[4].resident);
    together += p.layers[0].resident;
    apart_streamed += !p.layers[0].resident;
    EXPECT_EQ(p.layers[4].tied_with, 0);
    EXPECT_TRUE(p.layers[4].shares_weight);
    uint64_t res = 0, pinned = 0;
    for (const auto& l : p.layers) (l.resident ? res : pinned) += l.resident ? l.resident_bytes : l.bytes;
    if (!p.layers[4].resident) pinned -= W;  // one host copy
    EXPECT_EQ(p.resident_bytes, res);
    EXPECT_EQ(p.host_pinned_bytes, pinned);
    EXPECT_LE(p.device_bytes, budget);
  }
  EXPECT_GT(together, 0);
  EXPECT_GT(apart_streamed, 0);
  // Everything fits with the weight counted once: 4 weights + 5 biases.
  in.budget_bytes = 4 * W + 5 * B;
  Plan p = plan_slots_first(in, 1, 0);
  EXPECT_EQ(p.num_streamed, 0u);
  EXPECT_EQ(p.device_bytes, 4 * W + 5 * B);
  EXPECT_HAS(p.explain(), "tied weights:             l2 is resident with l1, whose weight it shares (counted once)");
  EXPECT_HAS(p.to_json(), "\"tied_with\": \"l1\"");
  // Room for l1 and 2 slots, not for l1's partner too: both stream (l1 alone resident was the old plan).
  in.budget_bytes = 3 * (W + B) + B / 2;
  p = plan_slots_first(in, 1, 0);
  EXPECT_FALSE(p.layers[0].resident);
  EXPECT_FALSE(p.layers[4].resident);
  EXPECT_HAS(p.explain(), "tied weights:             l2 streams with l1, whose weight it shares (counted once)");

  in.layers[4].tied_layer = 4;  // not an earlier layer
  EXPECT_HAS(error_of([&] { plan_placement(in); }), "is tied to layer #4, which is not an earlier streamable layer");
}

TEST(Planner, RandomTiedLayersArePlacedTogetherWithinBudget) {
  std::mt19937_64 rng(77);
  int together_resident = 0, together_streamed = 0;
  for (int iter = 0; iter < 300; ++iter) {
    PlannerInput in;
    const size_t n = 2 + rng() % 30;
    uint64_t total = 0;
    for (size_t i = 0; i < n; ++i) {
      const uint64_t bytes = 1024 + rng() % (1 << 20);
      PlannerLayer l = layer("layer" + std::to_string(i), bytes,
                             rng() % 2 ? 0.0 : static_cast<double>(rng() % 1000000000));
      if (i > 0 && rng() % 3 == 0) {  // shares layer t's weight (t not tied itself)
        size_t t = rng() % i;
        while (in.layers[t].tied_layer >= 0) t = static_cast<size_t>(in.layers[t].tied_layer);
        l.tied_layer = static_cast<int>(t);
        l.tied_bytes = std::min(bytes, in.layers[t].resident_bytes);
        l.resident_bytes = bytes - l.tied_bytes;
      }
      total += l.resident_bytes;
      in.layers.push_back(l);
    }
    in.budget_bytes = static_cast<uint64_t>(static_cast<double>(total) * (static_cast<double>(rng() % 1200) / 1000.0));
    in.link_bytes_per_s = rng() % 2 ? 0.0 : 1e10;
    in.device_flops_per_s = 1e12;
    SCOPED_TRACE("iteration " + std::to_string(iter));
    Plan p;
    try {
      p = plan_slots_first(in, static_cast<int>(1 + rng() % 3), 0);
    } catch (const BudgetTooSmall&) {
      continue;
    }
    EXPECT_LE(p.device_bytes, in.budget_bytes);
    uint64_t res = 0, pinned = 0;
    for (size_t i = 0; i < n; ++i) {
      const auto& l = p.layers[i];
      if (l.resident) {
        res += l.resident_bytes;
      } else {
        pinned += l.bytes - in.layers[i].tied_bytes;
      }
      if (in.layers[i].tied_layer < 0) continue;
      EXPECT_EQ(l.resident, p.layers[static_cast<size_t>(in.layers[i].tied_layer)].resident);
      ++(l.resident ? together_resident : together_streamed);
    }
    EXPECT_EQ(p.resident_bytes, res);
    EXPECT_EQ(p.host_pinned_bytes, pinned);
  }
  EXPECT_GT(together_resident, 20);
  EXPECT_GT(together_streamed, 20);
}

TEST(Models, TiedHeadFromConfig) {
  // A checkpoint of a tied model stores only the table: add_tied_head adds
  // the head when the config says tie_word_embeddings, or does not say and
  // names a language-model architecture; never when the head is there or
  // the config says false.
  auto table_only = [] {
    ModelDescription m;
    ModelLayer t;
    t.name = "model.embed_tokens";
    t.weight_shape = {1000, 64};
    t.weight_dtype = "BF16";
    t.embedding = true;
    m.layers.push_back(t);
    ModelLayer l;
    l.name = "model.layers.0.mlp.up_proj";
    l.weight_shape = {256, 64};
    l.weight_dtype = "BF16";
    m.layers.push_back(l);
    return m;
  };
  ModelDescription m = table_only();
  EXPECT_EQ(add_tied_head(m, R"({"tie_word_embeddings": true, "vocab_size": 1000})", "c"), "model.embed_tokens");
  ASSERT_EQ(m.layers.size(), 3u);
  EXPECT_EQ(m.layers[2].name, "lm_head");
  EXPECT_EQ(m.layers[2].tied_to, "model.embed_tokens");
  EXPECT_EQ(m.layers[2].weight_shape, (std::vector<uint64_t>{1000, 64}));
  EXPECT_EQ(add_tied_head(m, R"({"tie_word_embeddings": true})", "c"), "");  // already there
  m = table_only();
  EXPECT_EQ(add_tied_head(m, R"({"architectures": ["Gemma3ForCausalLM"]})", "c"), "model.embed_tokens");
  m = table_only();
  EXPECT_EQ(add_tied_head(m, R"({"text_config": {"tie_word_embeddings": true}})", "c"), "model.embed_tokens");
  m = table_only();
  EXPECT_EQ(add_tied_head(m, R"({"tie_word_embeddings": false, "architectures": ["LlamaForCausalLM"]})", "c"), "");
  EXPECT_EQ(add_tied_head(m, R"({"architectures": ["BertModel"]})", "c"), "");
  EXPECT_EQ(add_tied_head(m, R"({"tie_word_embeddings": true, "vocab_size": 999})", "c"), "");  // no such table
  EXPECT_EQ(m.layers.size(), 2u);
  EXPECT_HAS(error_of([&] { add_tied_head(m, "{", "config.json"); }), "config.json");

  // As offload(): the tied head is never quantized, and its host copy is the table's.
  m = table_only();
  add_tied_head(m, R"({"tie_word_embeddings": true})", "c");
  LayerOptions opt;
  opt.quantize = Quantization::NF4;
  const auto specs = layer_specs(m, opt);
  EXPECT_EQ(specs[2].tied_table, 0);
  EXPECT_EQ(specs[2].bytes, 1000u * 64 * 2);
  EXPECT_TRUE(specs[2].as_stored);
  PlannerInput in;
  in.layers = specs;
  in.budget_bytes = 100000;  // below 2 slots of the 128000-byte head
  EXPECT_HAS(error_of([&] { plan_placement(in); }), "it streams as stored: quantization does not apply to it");
  EXPECT_LT(specs[1].bytes, 256u * 64 * 2);  // the others are quantized
}

TEST(Models, ExpertTensorsFormOneGroupPerModule) {
  // A checkpoint of a mixture-of-experts model: per-expert tensors (as
  // transformers saves them) and fused 3-D ones both join one group per
  // "<prefix>.experts", planned as one slot, never quantized; the config's
  // num_experts_per_tok / num_experts scales its FLOPs.
  Checkpoint ck;
  auto add = [&](const std::string& name, std::vector<uint64_t> shape, const std::string& dtype = "BF16") {
    TensorInfo t;
    t.name = name;
    t.dtype = dtype;
    t.shape = shape;
    t.numel = 1;
    for (auto d : shape) t.numel *= d;
    t.nbytes = t.numel * (dtype == "F32" ? 4 : 2);
    ck.tensors.push_back(t);
  };
  for (int e = 0; e < 4; ++e)
    for (const char* p : {"gate_proj", "up_proj", "down_proj"})
      add("model.layers.0.mlp.experts." + std::to_string(e) + "." + p + ".weight", {16, 32});
  add("model.layers.0.mlp.gate.weight", {4, 32});  // the router: an ordinary layer
  add("model.layers.1.mlp.experts.gate_up_proj", {4, 32, 32});
  add("model.layers.1.mlp.experts.gate_up_proj_bias", {4, 32});
  add("model.layers.1.mlp.experts.down_proj", {4, 32, 16});
  add("model.layers.0.self_attn.q_proj.weight", {32, 32});
  ModelDescription m = describe_checkpoint(ck);
  const ModelLayer* g0 = nullptr;
  const ModelLayer* g1 = nullptr;
  for (const auto& l : m.layers) {
    if (l.name == "model.layers.0.mlp.experts") g0 = &l;
    if (l.name == "model.layers.1.mlp.experts") g1 = &l;
    EXPECT_EQ(l.name.find(".experts."), std::string::npos) << l.name;  // no per-expert layer left
  }
  ASSERT_TRUE(g0 && g1);
  EXPECT_TRUE(g0->group);
  EXPECT_EQ(g0->stored_bytes(), 4u * 3 * 16 * 32 * 2);
  EXPECT_EQ(g1->params(), 4u * 32 * 32 + 4 * 32 + 4 * 32 * 16);
  EXPECT_EQ(m.layers.size(), 4u);  // two groups, the router, q_proj
  EXPECT_EQ(m.small_tensors, 0u);
  EXPECT_EQ(set_expert_activity(m, R"({"num_experts_per_tok": 1, "num_experts": 4})", "c"), 0.25);
  EXPECT_EQ(set_expert_activity(m, R"({"text_config": {"num_experts_per_tok": 2, "num_local_experts": 4}})", "c"), 0.5);
  EXPECT_EQ(set_expert_activity(m, R"({"hidden_size": 32})", "c"), 0.0);
  LayerOptions opt;
  opt.tokens = 10;
  for (auto q : {Quantization::None, Quantization::NF4}) {
    opt.quantize = q;
    int seen = 0;
    for (const auto& sp : layer_specs(m, opt)) {
      if (sp.name == "model.layers.0.mlp.experts") {
        ++seen;
        // Quantized as offload() packs them: each tensor a matrix of its last dimension.
        const uint64_t one = quantized_weight_bytes({16, 32}, "BF16", q);
        EXPECT_EQ(sp.bytes, 12 * one);
        // In a slot (core/slot_layout.h): each packed tensor, then each dequantized one.
        EXPECT_EQ(sp.slot_bytes, q == Quantization::None ? 0u : 12 * slot_layout::align(one) + 12 * 16 * 32 * 2);
        EXPECT_FALSE(sp.as_stored);
        EXPECT_DOUBLE_EQ(sp.flops, 2.0 * 10 * (4 * 3 * 16 * 32) * 0.5);
      }
      if (sp.name == "model.layers.1.mlp.experts") {
        ++seen;  // the 3-D tensors as [experts * rows, cols]; the 2-D bias too
        const uint64_t want = q == Quantization::None
                                  ? (4u * 32 * 32 + 4 * 32 + 4 * 32 * 16) * 2
                                  : quantized_weight_bytes({128, 32}, "BF16", q) +
                                        quantized_weight_bytes({4, 32}, "BF16", q) +
                                        quantized_weight_bytes({128, 16}, "BF16", q);
        EXPECT_EQ(sp.bytes, want);
      }
    }
    EXPECT_EQ(seen, 2);
  }
}

TEST(Models, MultiheadAttentionTensorsFormOneGroup) {
  // nn.MultiheadAttention as torch saves it (OpenCLIP, torchvision ViT): the
  // in-projection and the out_proj become one group named after the module,
  // as offload() streams it; no separate out_proj layer, no small tensor left.
  Checkpoint ck;
  auto add = [&](const std::string& name, std::vector<uint64_t> shape) {
    TensorInfo t;
    t.name = name;
    t.dtype = "F16";
    t.shape = shape;
    t.numel = 1;
    for (auto d : shape) t.numel *= d;
    t.nbytes = t.numel * 2;
    ck.tensors.push_back(t);
  };
  add("transformer.resblocks.0.attn.in_proj_weight", {96, 32});
  add("transformer.resblocks.0.attn.in_proj_bias", {96});
  add("transformer.resblocks.0.attn.out_proj.weight", {32, 32});
  add("transformer.resblocks.0.attn.out_proj.bias", {32});
  add("transformer.resblocks.0.mlp.c_fc.weight", {128, 32});
  ModelDescription m = describe_checkpoint(ck);
  ASSERT_EQ(m.layers.size(), 2u);
  EXPECT_EQ(m.layers[0].name, "transformer.resblocks.0.attn");
  EXPECT_TRUE(m.layers[0].group);
  EXPECT_EQ(m.layers[0].group_bytes, (96u * 32 + 96 + 32 * 32 + 32) * 2);
  EXPECT_EQ(m.layers[0].group_tensors.size(), 4u);
  EXPECT_EQ(m.small_tensors, 0u);
  EXPECT_DOUBLE_EQ(layer_specs(m, LayerOptions{}).at(0).flops, 2.0 * 4096 * (96 * 32 + 96 + 32 * 32 + 32));
}

TEST(Models, RoutedExpertsCopyTheShareOfExpertsAStepReaches) {
  // As offload(experts="routed"): 1 token with 1 of 8 experts active per
  // token reaches 1/8 of them, so a fetch copies 1/8 of the group; 8 tokens
  // reach 1 - (7/8)^8 = 66% (more than half): the whole group; --experts all: whole.
  ModelDescription m;
  ModelLayer g;
  g.name = "model.layers.0.mlp.experts";
  g.group = true;
  g.group_tensors = {{{8, 64, 32}, "BF16"}, {{8, 32, 32}, "BF16"}};
  g.group_bytes = (8 * 64 * 32 + 8 * 32 * 32) * 2;
  g.group_params = g.group_bytes / 2;
  g.active = 1.0 / 8;
  m.layers.push_back(g);
  LayerOptions opt;
  opt.tokens = 1;
  PlannerLayer one = layer_specs(m, opt).at(0);
  EXPECT_EQ(one.bytes, g.group_bytes);
  EXPECT_EQ(one.routed_bytes, g.group_bytes / 8);
  EXPECT_EQ(one.fetch_bytes(), g.group_bytes / 8);
  EXPECT_EQ(one.streamed_slot_bytes(), g.group_bytes);  // the slot still holds every expert's place
  opt.tokens = 8;
  EXPECT_EQ(layer_specs(m, opt).at(0).routed_bytes, 0u);
  opt.tokens = 1;
  opt.routed_experts = false;
  EXPECT_EQ(layer_specs(m, opt).at(0).routed_bytes, 0u);
}

TEST(Planner, DenseLayersStayBeforeRoutedGroupsOfTheSameFlopsPerByte) {
  // Three blocks: attention (8 MiB) and a routed experts group (32 MiB, 2 MiB
  // fetched a step), the same FLOPs per fetched byte. Kept resident, the group
  // saves 2 MiB a step for 32 MiB of device memory, the attention 8 for 8: the
  // budget's 33 MiB past the slots hold the three attentions (6 MiB a step on
  // the link), not a group (larger first: 28 MiB a step).
  PlannerInput in;
  for (int b = 0; b < 3; ++b) {
    in.layers.push_back(layer("attn" + std::to_string(b), 8 * MiB, 8e6));
    PlannerLayer g = layer("experts" + std::to_string(b), 32 * MiB, 2e6);
    g.routed_bytes = 2 * MiB;
    in.layers.push_back(g);
  }
  in.budget_bytes = 2 * 32 * MiB + 33 * MiB;
  in.link_bytes_per_s = 1e9;
  in.device_flops_per_s = 1e12;
  const Plan p = plan_placement(in);
  for (int b = 0; b < 3; ++b) {
    EXPECT_TRUE(p.layers[2 * b].resident) << p.explain();
    EXPECT_FALSE(p.layers[2 * b + 1].resident) << p.explain();
  }
  EXPECT_EQ(p.bus_bytes_per_step, 6 * MiB);
}

TEST(Planner, RoutedGroupsCrossTheirShareOnDemand) {
  // Two blocks of attention (1 MiB, 1 ms) and a routed group (32 MiB, of
  // which a fetch copies 2 MiB, 1 ms); the budget holds only 2 slots of a
  // group, so everything streams. A routed copy moves its share (bus bytes,
  // transfer time) and starts only after the compute before it (the router):
  // per block 1 ms of attention, 2 ms of copy, 1 ms of experts = 8 ms a step.
  PlannerInput in;
  PlannerLayer g = layer("experts", 32 * MiB, 1e9);
  g.routed_bytes = 2 * MiB;
  for (int b = 0; b < 2; ++b) {
    in.layers.push_back(layer("attn" + std::to_string(b), 1 * MiB, 1e9));
    in.layers.push_back(g);
    in.layers.back().name += std::to_string(b);
  }
  in.budget_bytes = 2 * 32 * MiB + MiB / 2;
  in.link_bytes_per_s = static_cast<double>(MiB) * 1000;  // 1 MiB per ms
  in.device_flops_per_s = 1e12;                            // 1e9 FLOPs = 1 ms
  Plan p = plan_placement(in);
  ASSERT_EQ(p.num_resident, 0u);
  EXPECT_EQ(p.bus_bytes_per_step, 2 * (1 + 2) * MiB);
  EXPECT_DOUBLE_EQ(p.layers[1].transfer_s, 0.002);
  EXPECT_EQ(p.layers[1].routed_bytes, 2 * MiB);
  EXPECT_NEAR(p.step_time_s, 0.008, 1e-9);
  for (auto& l : in.layers) l.routed_bytes = 0;  // whole, prefetched: 2 x 32 ms of copy per step
  EXPECT_GT(plan_placement(in).step_time_s, 0.064);
}

TEST(Planner, OutlierLayerIsKeptResidentSoSlotsShrink) {
  // Eight 10 MiB block layers and a 100 MiB LM head: 3 slots of the head
  // (300 MiB) do not fit in 150 MiB, but the head resident and 3 slots of
  // 10 MiB do, with room for two more resident layers.
  PlannerInput in;
  for (int i = 0; i < 8; ++i) in.layers.push_back(layer("l" + std::to_string(i), 10 * MiB));
  in.layers.push_back(layer("lm_head", 100 * MiB));
  in.min_slots = 3;
  in.max_prefetch = 2;
  in.budget_bytes = 150 * MiB;
  Plan p = plan_placement(in);
  EXPECT_TRUE(p.layers[8].resident);
  EXPECT_EQ(p.num_slots, 3);
  EXPECT_EQ(p.slot_bytes, 10 * MiB);
  EXPECT_EQ(p.num_resident, 3u);
  EXPECT_EQ(p.device_bytes, 150 * MiB);
  // Below that, the error gives the least budget of any plan and how.
  in.budget_bytes = 120 * MiB;
  const std::string m = error_of([&] { plan_placement(in); });
  EXPECT_HAS(m, "the largest layer \"lm_head\" is 100.00 MiB");
  EXPECT_HAS(m, "a budget of at least 130.00 MiB (136314880 bytes) is needed (the least with the 1 largest "
                "layer(s) resident and 3 slots of \"l0\", 10.00 MiB)");
}

TEST(Planner, RandomLayerSetsNeverExceedBudget) {
  std::mt19937_64 rng(2024);
  int planned = 0, rejected = 0, outlier_plans = 0, tied_streamed = 0, tied_resident = 0, trained = 0;
  for (int iter = 0; iter < 600; ++iter) {
    PlannerInput in;
    size_t n = 1 + rng() % 80;
    uint64_t total = 0, largest = 0;
    int untied_table = -1;  // the last table no layer is tied to yet
    for (size_t i = 0; i < n; ++i) {
      uint64_t bytes = static_cast<uint64_t>(std::exp2(10 + static_cast<double>(rng() % 2000) / 100.0));
      if (rng() % 10 == 0) bytes = bytes / 7 * 7;  // ties
      if (rng() % 20 == 0) bytes = 0;
      PlannerLayer l = layer("layer" + std::to_string(i), bytes, rng() % 4 == 0 ? 0.0 : static_cast<double>(rng() % 1000000000000ull));
      l.resident_bytes = rng() % 3 == 0 ? bytes * (1 + rng() % 4) : bytes;
      l.trainable = rng() % 2;
      // Like a quantized layer: the slot also holds the dequantized weight.
      if (rng() % 8 == 0) l.slot_bytes = bytes + bytes * (1 + rng() % 4);
      // Like an embedding table: looked up in host memory, never on the device.
      if (rng() % 12 == 0) {
        l.lookup = true;
        l.lookup_bytes = rng() % (bytes + 1);
      } else if (untied_table >= 0 && rng() % 3 == 0) {
        // Tied weights: an lm_head that is that table's weight (never quantized).
        l.tied_table = untied_table;
        l.bytes = l.resident_bytes = in.layers[static_cast<size_t>(untied_table)].bytes;
        l.slot_bytes = 0;
        untied_table = -1;
      }
      if (l.lookup) untied_table = static_cast<int>(i);
      // Training (offload(train=...)): its gradient and states when resident.
      if (!l.lookup && l.trainable && rng() % 2 == 0) l.train_bytes = l.resident_bytes * (1 + rng() % 5);
      in.layers.push_back(l);
      if (l.lookup) continue;
      total += l.resident_cost();
      largest = std::max(largest, l.streamed_slot_bytes());
    }
    in.fixed_resident_bytes = rng() % 3 == 0 ? rng() % (largest + 1) : 0;
    in.fixed_train_bytes = rng() % 4 == 0 ? in.fixed_resident_bytes * (1 + rng() % 4) : 0;
    const uint64_t fixed = in.fixed_resident_bytes + in.fixed_train_bytes;
    in.budget_bytes = static_cast<uint64_t>(static_cast<double>(total + fixed) *
                                            (static_cast<double>(rng() % 1300) / 1000.0));
    in.link_bytes_per_s = rng() % 5 == 0 ? 0.0 : 1e9 * (1 + rng() % 50);
    in.device_flops_per_s = rng() % 5 == 0 ? 0.0 : 1e12 * (1 + rng() % 500);
    in.min_slots = 2 + static_cast<int>(rng() % 2);
    in.max_prefetch = 1 + static_cast<int>(rng() % 6);
    in.training = rng() % 4 == 0;
    SCOPED_TRACE("iteration " + std::to_string(iter));
    Plan p;
    try {
      p = plan_placement(in);
    } catch (const Error& e) {
      ++rejected;
      // Only when it genuinely cannot fit: not everything resident, and for no
      // set of the largest layers kept resident do min_slots slots of the
      // largest other one fit beside them.
      bool all_fit = total + fixed <= in.budget_bytes;
      EXPECT_FALSE(all_fit) << e.message();
      EXPECT_GT(fixed + static_cast<uint64_t>(in.min_slots) * largest, in.budget_bytes) << e.message();
      EXPECT_GT(least_with_min_slots(in), static_cast<long double>(in.budget_bytes)) << e.message();
      continue;
    }
    // Planned although the largest layer's slots alone would not fit: it kept
    // the largest layers resident (an outlier such as an LM head).
    if (fixed + static_cast<uint64_t>(in.min_slots) * largest > in.budget_bytes && total + fixed > in.budget_bytes)
      ++outlier_plans;
    ++planned;
    EXPECT_LE(p.device_bytes, in.budget_bytes);
    uint64_t res = 0, train = 0, streamed = 0, slot = 0, looked = 0, shared = 0;
    size_t ns = 0, nl = 0;
    std::vector<char> held(n, 0);  // tables on the device with their resident tied layer
    for (size_t i = 0; i < n; ++i) {
      const int t = in.layers[i].tied_table;
      if (t < 0) continue;
      EXPECT_EQ(p.layers[i].tied_with, t);
      EXPECT_EQ(p.layers[static_cast<size_t>(t)].tied_with, static_cast<int>(i));
      held[static_cast<size_t>(t)] = p.layers[i].resident;
      ++(p.layers[i].resident ? tied_resident : tied_streamed);
    }
    for (size_t i = 0; i < n; ++i) {
      const auto& l = p.layers[i];
      EXPECT_EQ(l.index, i);
      EXPECT_EQ(l.name, in.layers[i].name);
      EXPECT_EQ(l.lookup, in.layers[i].lookup && !held[i]);
      EXPECT_EQ(l.train_bytes, l.resident && !held[i] ? in.layers[i].train_bytes : 0u);
      if (held[i]) {
        EXPECT_TRUE(l.resident);
        EXPECT_EQ(l.resident_bytes, 0u);
      } else if (l.lookup) {
        EXPECT_FALSE(l.resident);
        looked += l.bytes;
        ++nl;
      } else if (l.resident) {
        res += l.resident_bytes;
        train += l.train_bytes;
      } else {
        streamed += l.bytes;
        if (in.layers[i].tied_table >= 0) shared += l.bytes;  // the table's host copy
        slot = std::max(slot, in.layers[i].streamed_slot_bytes());
        ++ns;
      }
    }
    EXPECT_EQ(p.resident_bytes, res);
    EXPECT_EQ(p.train_bytes, train + in.fixed_train_bytes);
    if (train) ++trained;
    EXPECT_EQ(p.host_pinned_bytes, streamed + looked - shared);
    EXPECT_EQ(p.num_lookup, nl);
    EXPECT_EQ(p.slot_bytes, slot);
    EXPECT_EQ(p.num_streamed, ns);
    EXPECT_EQ(p.device_bytes, res + train + fixed + static_cast<uint64_t>(p.num_slots) * slot);
    if (ns > 0) {
      EXPECT_GE(p.num_slots, in.min_slots);
      EXPECT_LE(p.num_slots, std::max(in.min_slots, in.max_prefetch + 1));
      EXPECT_EQ(p.prefetch_depth, p.num_slots - 1);
    } else {
      EXPECT_EQ(p.num_slots, 0);
    }
    if (p.has_time) {
      EXPECT_TRUE(std::isfinite(p.step_time_s));
      EXPECT_GE(p.step_time_s + 1e-9, p.compute_time_s * 0.999999);
    }
    // Deterministic.
    Plan again = plan_placement(in);
    EXPECT_EQ(again.to_json(), p.to_json());
  }
  EXPECT_GT(planned, 250);  // enough plans exercised (larger quantized-like slots reject more)
  EXPECT_GT(rejected, 5);
  EXPECT_GT(outlier_plans, 5);
  EXPECT_GT(tied_streamed, 5);
  EXPECT_GT(tied_resident, 5);
  EXPECT_GT(trained, 20);  // plans that keep a training layer's gradient and states on the device
}

TEST(Planner, SlotHoldsPackedAndDequantizedWeight) {
  // Two quantized layers: 1 MiB crosses the bus, but each slot holds 5 MiB
  // (packed + dequantized). 2 slots of 5 MiB must fit, not 2 of 1 MiB.
  PlannerInput in;
  for (int i = 0; i < 2; ++i) {
    PlannerLayer l = layer("q" + std::to_string(i), MiB);
    l.resident_bytes = 6 * MiB;
    l.slot_bytes = 5 * MiB;
    in.layers.push_back(l);
  }
  in.budget_bytes = 9 * MiB;  // < 12 (all resident) and < 2 slots of 5
  const std::string m = error_of([&] { plan_placement(in); });
  EXPECT_HAS(m, "needs a slot of 5.00 MiB");
  EXPECT_HAS(m, "1.00 MiB copied + the weight written on the device, dequantized or cast");
  EXPECT_HAS(m, "have the device write a narrower dtype");  // it is quantized already: no "quantize" advice
  EXPECT_TRUE(m.find("e.g. to nf4") == std::string::npos) << m;
  // Written as bf16 already (narrow_write): nothing narrower to suggest.
  for (auto& l : in.layers) l.narrow_write = true;
  const std::string narrow = error_of([&] { plan_placement(in); });
  EXPECT_HAS(narrow, "needs a slot of 5.00 MiB");
  EXPECT_TRUE(narrow.find("narrower") == std::string::npos && narrow.find("nf4") == std::string::npos) << narrow;
  for (auto& l : in.layers) l.narrow_write = false;
  in.budget_bytes = 10 * MiB;
  Plan p = plan_placement(in);
  EXPECT_EQ(p.slot_bytes, 5 * MiB);
  EXPECT_EQ(p.num_slots, 2);
  EXPECT_EQ(p.host_pinned_bytes, 2 * MiB);  // packed bytes cross the bus
  EXPECT_LE(p.device_bytes, in.budget_bytes);
}

// ------------------------------------------------------------ models

TEST(Models, BuiltinsAndUnknownName) {
  auto names = builtin_model_names();
  EXPECT_NE(std::find(names.begin(), names.end(), "llama-7b"), names.end());
  for (const auto& n : names) {
    ModelDescription m = builtin_model(n);
    EXPECT_FALSE(m.layers.empty()) << n;
  }
  ModelDescription l7 = builtin_model("llama-7b");
  uint64_t params = 0;
  for (const auto& l : l7.layers) params += l.params();
  EXPECT_NEAR(static_cast<double>(params), 6.74e9, 0.05e9);
  ModelDescription g = builtin_model("gpt2-small");
  params = 0;
  for (const auto& l : g.layers)
    if (l.tied_to.empty()) params += l.params();  // the tied lm_head is wte's weight
  EXPECT_NEAR(static_cast<double>(params), 124e6, 2e6);
  EXPECT_EQ(g.layers.back().name, "lm_head");
  EXPECT_EQ(g.layers.back().tied_to, "transformer.wte");
  ModelDescription f = builtin_model("flux-dev");
  params = 0;
  for (const auto& l : f.layers) params += l.params();
  EXPECT_NEAR(static_cast<double>(params), 11.9e9, 0.2e9);
  // Qwen3-30B-A3B: 30.5B parameters, 3.3B of them active per token (8 of 128 experts;
  // the embedding table counted, as Qwen counts it);
  // decoding one token copies 1/16 of each expert group (routed), 4096 tokens all of it.
  ModelDescription q = builtin_model("qwen3-30b-a3b");
  params = 0;
  double active = 0;
  for (const auto& l : q.layers) {
    const uint64_t n = l.group ? l.group_params : l.params();
    params += n;
    active += static_cast<double>(n) * (l.group ? l.active : 1.0);
  }
  EXPECT_NEAR(static_cast<double>(params), 30.5e9, 0.1e9);
  EXPECT_NEAR(active, 3.3e9, 0.1e9);
  LayerOptions one;
  one.tokens = 1;
  for (const auto& sp : layer_specs(q, one))
    if (sp.name == "model.layers.0.mlp.experts") {
      EXPECT_EQ(sp.routed_bytes, (sp.bytes + 15) / 16);
    }
  EXPECT_EQ(layer_specs(q, LayerOptions{}).at(5).routed_bytes, 0u);  // 4096 tokens reach every expert
  std::string m = error_of([] { builtin_model("gpt5"); });
  EXPECT_HAS(m, "unknown model \"gpt5\" (built-in models: gpt2-small");
  EXPECT_HAS(m, "llama-13b");
}

TEST(Models, QuantizedBytes) {
  std::vector<uint64_t> s = {4096, 4096};
  EXPECT_EQ(quantized_weight_bytes(s, "BF16", Quantization::None), 4096u * 4096 * 2);
  EXPECT_EQ(quantized_weight_bytes(s, "BF16", Quantization::Int8), 4096u * 4096 + 4096 * 4);
  EXPECT_EQ(quantized_weight_bytes(s, "F32", Quantization::FP8), 4096u * 4096 + 4096 * 4);
  EXPECT_EQ(quantized_weight_bytes(s, "BF16", Quantization::NF4), 4096u * 2048 + 4096 * 64 * 4);
  EXPECT_EQ(quantized_weight_bytes(s, "BF16", Quantization::Int4), 4096u * 2048 + 4096 * 32 * 8);
  EXPECT_EQ(quantized_weight_bytes(s, "I8", Quantization::NF4), 4096u * 4096);  // already narrow
  // Small shapes: the runtime's packed layout aligns each section to 256 B.
  EXPECT_EQ(quantized_weight_bytes({10, 3}, "F16", Quantization::NF4), 512u);
  // int4 cannot lay out cols % 128 != 0: offload() streams such a weight as stored (it planned a
  // packed size, 1348 B here, the CLI's figures 6.7x off what offload() moved).
  EXPECT_EQ(quantized_weight_bytes({10, 100}, "F16", Quantization::Int4), 1000u * 2);
  EXPECT_EQ(parse_quantization("nf4"), Quantization::NF4);
  EXPECT_HAS(error_of([] { parse_quantization("int3"); }), "unknown quantization format 'int3'; valid formats are: int8");
  EXPECT_EQ(parse_quantization("e4m3"), Quantization::FP8);  // offload()'s aliases too
  EXPECT_EQ(parse_quantization("FP8_E4M3"), Quantization::FP8);
}

TEST(Models, LayerSpecsFlopsAndQuantization) {
  ModelDescription m = builtin_model("llama-7b");
  LayerOptions opt;
  opt.tokens = 100;
  auto specs = layer_specs(m, opt);
  ASSERT_EQ(specs.size(), m.layers.size());
  EXPECT_EQ(specs[1].name, "model.layers.0.self_attn.q_proj");
  EXPECT_DOUBLE_EQ(specs[1].flops, 2.0 * 100 * 4096 * 4096);
  EXPECT_EQ(specs[1].bytes, 4096u * 4096 * 2);
  EXPECT_LT(specs[0].flops, specs[1].flops / 1000);  // embedding lookup is cheap
  // The table is looked up in host memory: the rows of 100 tokens cross the bus.
  EXPECT_TRUE(specs[0].lookup);
  EXPECT_EQ(specs[0].lookup_bytes, 100u * 4096 * 2);
  EXPECT_EQ(specs[0].bytes, 32000u * 4096 * 2);
  EXPECT_FALSE(specs[1].lookup);
  opt.training = true;
  opt.quantize = Quantization::NF4;
  opt.resident_dequantized = true;
  specs = layer_specs(m, opt);
  EXPECT_DOUBLE_EQ(specs[1].flops, 3 * 2.0 * 100 * 4096 * 4096);
  EXPECT_EQ(specs[1].bytes, 4096u * 2048 + 4096 * 64 * 4);
  EXPECT_EQ(specs[1].resident_bytes, 4096u * 4096 * 2);
  EXPECT_FALSE(specs[1].trainable);  // quantized base weights are frozen
  EXPECT_EQ(specs[0].bytes, 32000u * 4096 * 2);  // tables are never quantized
}

TEST(Models, LayerBytesAreTheSlotLayoutTheEngineAllocates) {
  // Each tensor of a slot starts on a 256-byte boundary (slot_layout::of, the
  // engine's rule); layer_specs added a weight and a bias unaligned: a
  // 100-element F32 bias (400 B) was planned 112 B short.
  ModelDescription m;
  ModelLayer l;
  l.name = "fc";
  l.weight_shape = {100, 36};  // 14400 B: 14592 aligned
  l.weight_dtype = "F32";
  l.bias_numel = 100;
  l.bias_dtype = "F32";
  m.layers.push_back(l);
  ModelLayer g;  // a tensor group of two unaligned tensors
  g.name = "experts";
  g.group = true;
  g.group_tensors = {{{3, 5, 7}, "F32"}, {{3, 5}, "F32"}};
  g.group_bytes = (105 + 15) * 4;
  g.group_params = 120;
  m.layers.push_back(g);
  for (const char* compute : {"", "BF16"}) {
    LayerOptions opt;
    opt.compute_dtype = compute;
    const auto specs = layer_specs(m, opt);
    SCOPED_TRACE(compute);
    EXPECT_EQ(specs[0].bytes, slot_layout::of({{14400, 0}, {400, 0}}).bus_bytes);
    EXPECT_EQ(specs[0].bytes, 14592u + 512);
    EXPECT_EQ(specs[1].bytes, 512u + 256);
    EXPECT_EQ(specs[0].resident_bytes, 14400u + 400);  // resident: the tensors as they are
  }
}

TEST(Models, LayerSpecsComputeDtypeWorkspace) {
  // Like offload(compute_dtype=...): the slot also holds the weight cast to
  // it (dense) or dequantized to it (quantized); same dtype: no workspace.
  ModelDescription m = builtin_model("llama-7b");  // BF16 weights, no biases
  const uint64_t n = 4096u * 4096;
  LayerOptions opt;
  EXPECT_EQ(layer_specs(m, opt)[1].slot_bytes, 0u);
  opt.compute_dtype = "BF16";
  EXPECT_EQ(layer_specs(m, opt)[1].slot_bytes, 0u);
  opt.compute_dtype = "F32";
  auto s = layer_specs(m, opt)[1];
  EXPECT_EQ(s.bytes, n * 2);
  EXPECT_EQ(s.slot_bytes, n * 2 + n * 4);  // the slot's layout (core/slot_layout.h)
  opt.quantize = Quantization::NF4;
  const uint64_t packed = layer_specs(m, opt)[1].bytes;
  EXPECT_EQ(layer_specs(m, opt)[1].slot_bytes, slot_layout::align(packed) + n * 4);  // dequantized to F32
  opt.compute_dtype.clear();
  EXPECT_EQ(layer_specs(m, opt)[1].slot_bytes, slot_layout::align(packed) + n * 2);  // to the stored BF16
}

TEST(Models, PlansBuiltinModelsUnderBudget) {
  for (const auto& name : builtin_model_names()) {
    ModelDescription m = builtin_model(name);
    PlannerInput in;
    in.layers = layer_specs(m, LayerOptions{});
    in.fixed_resident_bytes = m.small_bytes;
    in.link_bytes_per_s = 25e9;
    in.device_flops_per_s = 1e14;
    uint64_t largest = 0;
    for (const auto& l : in.layers)
      if (!l.lookup) largest = std::max(largest, l.bytes);  // tables are looked up, never in a slot
    in.budget_bytes = m.small_bytes + 3 * largest;
    Plan p = plan_placement(in);
    EXPECT_LE(p.device_bytes, in.budget_bytes) << name;
    EXPECT_GT(p.num_streamed, 0u) << name;
  }
}

// A GGUF tensor record of `type` (a ggml type id) as the reader gives it.
static GgufTensor gguf_tensor(const std::string& name, std::vector<uint64_t> shape, uint32_t type) {
  GgufTensor t;
  t.name = name;
  t.shape = std::move(shape);
  t.type = type;
  t.type_name = ggml_type(type).name;
  t.numel = 1;
  for (uint64_t d : t.shape) t.numel *= d;
  t.nbytes = t.numel / ggml_type(type).block_elems * ggml_type(type).block_bytes;
  return t;
}

TEST(Models, GgufFilePlansItsBlocksOnTheBusAndDenseWeightsInTheSlot) {
  // What load_gguf() + offload() do: a Q4_K / Q8_0 Linear weight crosses as
  // the file's blocks (padded to 256 B) and is dequantized in its slot to the
  // model's dtype; resident it is dense; a Q6_K token table is dequantized on
  // load (dense, looked up in host memory); F32 tensors are cast to the model's
  // dtype, as load_gguf() reads them.
  GgufFile g;
  g.path = "m.gguf";
  g.tensors = {gguf_tensor("token_embd.weight", {1000, 512}, 14), gguf_tensor("blk.0.q.weight", {1024, 512}, 12),
               gguf_tensor("blk.0.q.bias", {1024}, 0), gguf_tensor("blk.0.up.weight", {100, 512}, 8),
               gguf_tensor("blk.0.norm.weight", {512}, 0)};
  const ModelDescription m = describe_gguf(g, "BF16");
  ASSERT_EQ(m.layers.size(), 3u);
  EXPECT_EQ(m.layers[0].name, "token_embd");
  EXPECT_TRUE(m.layers[0].embedding);
  EXPECT_EQ(m.layers[0].weight_dtype, "BF16");
  EXPECT_EQ(m.small_bytes, 512u * 2);
  const ModelLayer* q = nullptr;
  for (const auto& l : m.layers)
    if (l.name == "blk.0.q") q = &l;
  ASSERT_NE(q, nullptr);
  EXPECT_EQ(q->weight_dtype, "Q4_K");
  EXPECT_EQ(q->dense_dtype, "BF16");
  LayerOptions opt;
  opt.tokens = 8;
  const std::vector<PlannerLayer> specs = layer_specs(m, opt);
  for (const auto& s : specs) {
    if (s.name == "blk.0.q") {
      const uint64_t packed = 1024u * 512 / 256 * 144;  // 294912, a multiple of 256
      EXPECT_EQ(s.bytes, packed + 1024 * 2);  // the bias in bf16
      EXPECT_EQ(s.slot_bytes, s.bytes + 1024u * 512 * 2);  // aligned parts (core/slot_layout.h)
      EXPECT_EQ(s.resident_bytes, 1024u * 512 * 2 + 1024 * 2);
      EXPECT_FALSE(s.trainable);
    } else if (s.name == "blk.0.up") {
      EXPECT_EQ(s.bytes, (100u * 512 / 32 * 34 + 255) / 256 * 256);  // 54400 -> 54528
      EXPECT_EQ(s.resident_bytes, 100u * 512 * 2);
    } else {
      EXPECT_TRUE(s.lookup);
      EXPECT_EQ(s.bytes, 1000u * 512 * 2);
    }
  }
  for (const auto& s : layer_specs(m, opt)) {
    if (s.name == "blk.0.q") {
      EXPECT_TRUE(s.narrow_write);  // dequantized to bf16: nothing narrower to suggest
    }
  }
  opt.compute_dtype = "F32";  // offload(compute_dtype=) dequantizes to it
  for (const auto& s : layer_specs(m, opt)) {
    if (s.name == "blk.0.q") {
      EXPECT_EQ(s.resident_bytes, 1024u * 512 * 4 + 1024 * 2);  // the bias stays the model's bf16
      EXPECT_FALSE(s.narrow_write);
    }
  }
  // A type layerstream cannot read is refused; so is a non-float dense dtype.
  g.tensors.push_back(gguf_tensor("blk.0.iq.weight", {4, 512}, 20));
  EXPECT_THROW(describe_gguf(g, "BF16"), Error);
  g.tensors.pop_back();
  EXPECT_THROW(describe_gguf(g, "I8"), Error);
}

TEST(Models, GgufExpertTensorsPlanAsOneGroupOfTheFilesBlocks) {
  // llama.cpp's expert tensors of a block (8 experts, 2 per token, from the
  // file's metadata) are one group, "blk.0.experts", as load_gguf(rename=
  // "llama.cpp") + offload() stream transformers' experts module: Q8_0 / Q6_K
  // blocks on the bus (each padded to 256 B), dequantized into the slot;
  // dense when resident; frozen; routed decoding reads 2 of 8 experts.
  GgufFile g;
  g.path = "moe.gguf";
  g.metadata = {{"general.architecture", "qwen3moe"}, {"qwen3moe.expert_count", "8"},
                {"qwen3moe.expert_used_count", "2"}};
  g.tensors = {gguf_tensor("blk.0.ffn_gate_inp.weight", {8, 256}, 0), gguf_tensor("blk.0.ffn_gate_exps.weight", {8, 64, 256}, 8),
               gguf_tensor("blk.0.ffn_up_exps.weight", {8, 64, 256}, 8), gguf_tensor("blk.0.ffn_down_exps.weight", {8, 256, 64}, 8),
               gguf_tensor("blk.0.attn_q.weight", {256, 256}, 14)};
  const ModelDescription m = describe_gguf(g, "BF16");
  const ModelLayer* experts = nullptr;
  for (const auto& l : m.layers)
    if (l.name == "blk.0.experts") experts = &l;
  ASSERT_NE(experts, nullptr);
  EXPECT_TRUE(experts->group);
  EXPECT_EQ(experts->group_tensors.size(), 3u);
  EXPECT_EQ(experts->dense_dtype, "BF16");
  EXPECT_DOUBLE_EQ(experts->active, 0.25);
  const uint64_t numel = 8u * 64 * 256;  // each of the three
  EXPECT_EQ(experts->group_bytes, 3 * numel * 2);
  LayerOptions opt;
  opt.tokens = 1;
  opt.routed_experts = true;
  bool seen = false;
  for (const auto& s : layer_specs(m, opt)) {
    if (s.name != "blk.0.experts") continue;
    seen = true;
    const uint64_t blocks = (numel / 32 * 34 + 255) / 256 * 256;
    EXPECT_EQ(s.bytes, 3 * blocks);
    EXPECT_EQ(s.slot_bytes, 3 * blocks + 3 * slot_layout::align(numel * 2));  // core/slot_layout.h
    EXPECT_EQ(s.resident_bytes, 3 * numel * 2);
    EXPECT_FALSE(s.trainable);
    EXPECT_TRUE(s.narrow_write);
    EXPECT_EQ(s.routed_bytes, static_cast<uint64_t>(std::ceil(3.0 * blocks * 0.25)));
  }
  EXPECT_TRUE(seen);
}

// ------------------------------------------------------------ host_tier::plan

namespace {

// Six frozen layers of `bytes` that may stay in their file (load_safetensors()), or not.
std::vector<host_tier::Layer> tier_layers(uint64_t bytes, bool from_file) {
  std::vector<host_tier::Layer> out;
  for (int i = 0; i < 6; ++i) {
    host_tier::Layer l;
    l.name = std::to_string(i);
    l.bytes = bytes;
    l.from_file = from_file;
    out.push_back(l);
  }
  return out;
}

}  // namespace

// The disk rule and its reasons are one rule: a layer may stay in its file
// exactly when no reason holds, and each reason names what breaks it (lossless
// holds with a cache directory too; a quantized format only without one).
TEST(HostTierPlan, InRamReasonsAreTheRuleSpelledOut) {
  using V = std::vector<std::string>;
  EXPECT_EQ(host_tier::in_ram_reasons(true, true, true, "", false), V{});
  EXPECT_EQ(host_tier::in_ram_reasons(true, true, true, "none", false), V{});
  EXPECT_EQ(host_tier::in_ram_reasons(true, true, true, "int8", true), V{});
  EXPECT_EQ(host_tier::in_ram_reasons(true, true, true, "int8", false), V{"quantized"});
  EXPECT_EQ(host_tier::in_ram_reasons(true, true, true, "lossless", true), V{"lossless"});
  EXPECT_EQ(host_tier::in_ram_reasons(false, false, false, "lossless", false),
            (V{"not_linear", "trainable", "cast", "lossless"}));
  EXPECT_EQ(host_tier::in_ram_reasons(true, false, true, "nf4", false), (V{"trainable", "quantized"}));
  for (bool linear : {false, true})
    for (bool frozen : {false, true})
      for (bool as_stored : {false, true})
        for (const char* format : {"", "none", "int8", "nf4", "lossless"})
          for (bool cache : {false, true})
            EXPECT_EQ(host_tier::may_stay_in_file(linear, frozen, as_stored, format, cache),
                      host_tier::in_ram_reasons(linear, frozen, as_stored, format, cache).empty());
}

// A pinned budget below the store makes store tensors pageable, and those cross
// through staging entries: the stager needs two of the largest layer
// (core/io/stager.cpp). Whatever RAM the host budget leaves, the plan stages
// either nothing or two entries at least, within host_budget: a host budget that
// cannot hold the entries beside the store sends file layers to the disk tier
// (host_budget of store + 1.5 entries staged 1.5 entries, and the first forward
// failed), and without file layers it is an error saying what to raise.
TEST(HostTierPlan, StagesTwoEntriesOrNoneWhateverTheBudgets) {
  constexpr uint64_t L = 1000;
  for (bool from_file : {true, false}) {
    for (uint64_t budget = 6 * L; budget <= 12 * L; budget += L / 4) {
      for (uint64_t pinned : {uint64_t{0}, 3 * L, 6 * L}) {
        host_tier::Plan p;
        try {
          p = host_tier::plan(tier_layers(L, from_file), static_cast<int64_t>(budget), static_cast<int64_t>(pinned), 1);
        } catch (const Error& e) {
          EXPECT_FALSE(from_file) << budget << " " << pinned << ": " << e.message();
          EXPECT_LT(budget, 8 * L) << e.message();
          EXPECT_HAS(e.message(), "Raise host_budget to at least 7.81 KiB, or pinned_budget to at least 5.86 KiB");
          continue;
        }
        const bool staged = p.pageable_store_bytes > 0 || p.disk_bytes > 0;
        EXPECT_TRUE(staged ? p.staging_bytes >= 2 * L : p.staging_bytes == 0) << budget << " " << pinned;
        EXPECT_LE(p.host_bytes(), budget) << budget << " " << pinned;
      }
    }
  }
  // store + 1.5 entries: the disk tier, entries in whole ones.
  const host_tier::Plan p = host_tier::plan(tier_layers(L, true), 7 * L + L / 2, 0, 1);
  EXPECT_EQ(p.disk_bytes, 6 * L);
  EXPECT_EQ(p.store_bytes, 0u);
  EXPECT_EQ(p.staging_bytes, 7 * L);
}

// What the plan leaves of host_budget (the saved activations' host cap) is
// counted after the staging entries the pinned budget adds: it was counted
// before them, so store + staging + spare exceeded host_budget.
TEST(HostTierPlan, SpareHostBytesCountEveryStagingEntry) {
  constexpr uint64_t L = 1000;
  for (uint64_t budget : {11 * L, 8 * L, 3 * L}) {
    for (int64_t pinned : {int64_t{0}, static_cast<int64_t>(2 * L), host_tier::kUnlimited}) {
      const host_tier::Plan p = host_tier::plan(tier_layers(L, true), static_cast<int64_t>(budget), pinned, 1);
      EXPECT_EQ(p.host_bytes() + static_cast<uint64_t>(p.spare_host_bytes), budget) << budget << " " << pinned;
    }
  }
  const host_tier::Plan p = host_tier::plan(tier_layers(L, true), 11 * L, 0, 1);
  EXPECT_EQ(p.staging_bytes, 3 * L);
  EXPECT_EQ(p.spare_host_bytes, 2 * L);
  // All in RAM with pageable store tensors: the entries are whole ones too (2.5
  // entries of room staged 2.5, and the half entry was left to nothing).
  const host_tier::Plan q = host_tier::plan(tier_layers(L, false), 8 * L + L / 2, 0, 1);
  EXPECT_EQ(q.staging_bytes, 2 * L);
  EXPECT_EQ(q.spare_host_bytes, static_cast<int64_t>(L / 2));
}

// The staging entries are pinned first. All in RAM, they only make pageable
// copies asynchronous, which a pageable entry cannot: a pinned budget below the
// entries wanted (prefetch + 2) holds as many as fit, at least two. A disk
// tier's cache is in whole entries, so one that fits the pinned budget is pinned.
TEST(HostTierPlan, PinsAsManyStagingEntriesAsFit) {
  constexpr uint64_t L = 1000;
  host_tier::Plan p = host_tier::plan(tier_layers(L, true), host_tier::kUnlimited, 2 * L, 1);
  EXPECT_EQ(p.staging_bytes, 2 * L);
  EXPECT_TRUE(p.staging_pinned);
  EXPECT_EQ(p.store_pinned_cap, 0);
  p = host_tier::plan(tier_layers(L, true), host_tier::kUnlimited, 3 * L, 1);
  EXPECT_EQ(p.staging_bytes, 3 * L);
  EXPECT_TRUE(p.staging_pinned);
  p = host_tier::plan(tier_layers(L, true), host_tier::kUnlimited, L, 1);  // not even two: pageable
  EXPECT_EQ(p.staging_bytes, 3 * L);
  EXPECT_FALSE(p.staging_pinned);
  EXPECT_EQ(p.store_pinned_cap, static_cast<int64_t>(L));
  p = host_tier::plan(tier_layers(L, true), 2 * L + L / 3, 2 * L, 1);  // the disk tier
  EXPECT_EQ(p.disk_bytes, 6 * L);
  EXPECT_EQ(p.staging_bytes, 2 * L);
  EXPECT_TRUE(p.staging_pinned);
}

// The error of a host budget too small says what the numbers are: two entries of
// X each, the model's weights in all; the advice to load with load_safetensors()
// is not given as if it applied to every model (GGUF weights are read into RAM).
TEST(HostTierPlan, TooSmallSaysWhatEachFigureIs) {
  constexpr uint64_t L = 1024;
  std::vector<host_tier::Layer> layers = tier_layers(L, true);
  layers[0].from_file = false;
  std::string m = error_of([&] { host_tier::plan(layers, 2 * L, host_tier::kUnlimited, 1); });
  EXPECT_HAS(m, "the disk tier needs two staging entries of 1.00 KiB each (2.00 KiB); the streamed weights are "
                "6.00 KiB in all. Raise host_budget to at least 3.00 KiB");
  m = error_of([&] { host_tier::plan(tier_layers(L, false), 2 * L, host_tier::kUnlimited, 1); });
  EXPECT_HAS(m, "Raise host_budget to at least 6.00 KiB, or let frozen weights stay in their file: only frozen "
                "Linear weights that load_safetensors() left in a .safetensors file can, and none here can");
  EXPECT_EQ(m.find("load_gguf"), std::string::npos) << m;
}
