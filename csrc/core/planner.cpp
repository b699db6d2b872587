// layerstream core — the placement planner: placement (which layers stay resident, how many slots)
// (planner.h; the files: docs/design/README.md).
#include "planner.h"
#include "planner_impl.h"
#include "options.h"
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <numeric>
#include <optional>
#include <set>

#include "error.h"
#include "slot_layout.h"
#include "gguf.h"
#include "json.h"
#include "quant.h"

namespace layerstream {

struct Candidate {
  std::vector<char> resident;
  int slots = 0;
  uint64_t slot_bytes = 0;
  uint64_t resident_bytes = 0;
  uint64_t device_bytes = 0;
  uint64_t streamed_bytes = 0;
  uint64_t streamed_host_bytes = 0;  // what the streamed layers hold on the host
  size_t num_streamed = 0;
  uint64_t fetched_bytes = 0;     // what the streamed layers copy per pass (routed groups: some experts)
  uint64_t lookup_bytes = 0;      // tables looked up in host memory (pinned)
  uint64_t lookup_bus_bytes = 0;  // the rows they read per step
  size_t num_lookup = 0;
  uint64_t shared_host_bytes = 0;  // streamed tied layers' bytes: the table's host copy
  std::vector<char> held;          // tables_held()
  Timing timing;
};

std::string Plan::bound() const {
  if (!has_time || (num_streamed > 0 && device_flops_per_s <= 0)) return "unknown";
  // What takes longer per step: the compute or the copies. A step can stall on
  // a few copies (the first layers, a large one) and still be compute-bound:
  // explain() shows those stalls on their own.
  // Nothing streamed: the copies left are tables' lookups (and saved activations),
  // which can still take longer than the compute.
  if (transfer_time_s <= compute_time_s) return "compute";
  return "transfer";
}

// plan_placement() without its throw: no plan when the budget is too small,
// and *too_small says why. The slots-first retry below asks this way, so that
// no exception is thrown and caught on the way to a plan (Note [No exceptions
// for the retry]).
static std::optional<Plan> place(const PlannerInput& in, std::string* too_small);

Plan plan_placement(const PlannerInput& in) {
  std::string why;
  std::optional<Plan> plan = place(in, &why);
  if (!plan) throw BudgetTooSmall(why, __FILE__, __LINE__);
  return std::move(*plan);
}

// Note [No exceptions for the retry]: a budget too small for prefetch + 1
// slots is common for a large model, so trying fewer slots is ordinary
// control flow, not a BudgetTooSmall thrown and caught around a return in a
// loop. That shape was where a benchmark peer died with SIGSEGV on the H200
// run of 2026-12-04 (GCC 13.3; GCC 12 builds run it cleanly under ASan/UBSan
// and valgrind): docs/benchmarks.md, run 5.
Plan plan_slots_first(PlannerInput in, int prefetch, int slots) {
  // The engine's rules, checked here too: offload() plans before it makes the
  // engine, and a value out of range reached place() as an internal bound.
  options::check_prefetch(prefetch);
  options::check_slots(slots);
  std::vector<int> wanted;
  if (slots > 0) {
    wanted.push_back(slots);
  } else {
    for (int k = std::max(2, prefetch + 1); k >= 2; --k) wanted.push_back(k);
  }
  std::string why;
  in.prefetch_depth = std::max(prefetch, 0);  // as the engine runs it (engine.cpp build_scheduler_locked)
  for (int k : wanted) {  // fewer slots may fit (prefetch becomes slots - 1)
    in.min_slots = k;
    in.max_prefetch = std::max({1, prefetch, k - 1});  // up to kMaxSlots - 1 (slots=kMaxSlots)
    std::optional<Plan> plan = place(in, &why);
    if (plan) return std::move(*plan);
  }
  if (slots > 0)
    throw BudgetTooSmall("slots=" + std::to_string(slots) + " do not fit in the budget: " + why +
                             "; or ask for fewer slots (at least 2)",
                         __FILE__, __LINE__);
  throw BudgetTooSmall(why, __FILE__, __LINE__);
}

static std::optional<Plan> place(const PlannerInput& in, std::string* too_small) {
  LS_CHECK(in.min_slots >= 2, "planner: min_slots must be at least 2 (got ", in.min_slots, ")");
  LS_CHECK(in.max_prefetch >= 1 && in.max_prefetch < options::kMaxSlots, "planner: max_prefetch must be in [1, ",
           options::kMaxSlots - 1, "] (got ", in.max_prefetch, ")");
  LS_CHECK(std::isfinite(in.link_bytes_per_s) && in.link_bytes_per_s >= 0,
           "planner: link bandwidth must be a non-negative number of bytes/s");
  LS_CHECK(std::isfinite(in.device_flops_per_s) && in.device_flops_per_s >= 0,
           "planner: device throughput must be a non-negative number of FLOP/s");
  const size_t n = in.layers.size();
  LS_CHECK(in.fixed_train_bytes <= UINT64_MAX - in.fixed_resident_bytes, "planner: fixed bytes overflow");
  // The always-resident small tensors, with their gradients and states when they train.
  const uint64_t fixed = in.fixed_resident_bytes + in.fixed_train_bytes;
  uint64_t total_resident = fixed;  // every layer that can be resident
  bool total_overflow = false;
  for (const auto& l : in.layers) {
    LS_CHECK(std::isfinite(l.flops) && l.flops >= 0, "planner: layer ", json::quote(l.name),
             " has invalid FLOPs (must be >= 0)");
    LS_CHECK(l.tied_table < 0 || (static_cast<size_t>(l.tied_table) < n && !l.lookup &&
                                  in.layers[static_cast<size_t>(l.tied_table)].lookup),
             "planner: layer ", json::quote(l.name), " is tied to layer #", l.tied_table,
             ", which is not a lookup table");
    LS_CHECK(l.tied_layer < 0 || (static_cast<size_t>(l.tied_layer) < static_cast<size_t>(&l - in.layers.data()) &&
                                  !l.lookup && l.tied_table < 0 && l.tied_bytes <= l.bytes &&
                                  !in.layers[static_cast<size_t>(l.tied_layer)].lookup &&
                                  in.layers[static_cast<size_t>(l.tied_layer)].tied_layer < 0),
             "planner: layer ", json::quote(l.name), " is tied to layer #", l.tied_layer,
             ", which is not an earlier streamable layer of its own weight (or its tied_bytes exceed its bytes)");
    if (l.lookup) continue;
    if (l.train_bytes > UINT64_MAX - l.resident_bytes || total_resident > UINT64_MAX - l.resident_cost())
      total_overflow = true;
    else
      total_resident += l.resident_cost();
  }
  LS_CHECK(fixed <= in.budget_bytes, "budget ", format_bytes(in.budget_bytes), " (", in.budget_bytes,
           " bytes) cannot even hold the always-resident small tensors (the tensors outside the streamed "
           "layers, any layer left unstreamed included, e.g. by exclude=: ", format_bytes(fixed),
           in.fixed_train_bytes ? ", of which " + format_bytes(in.fixed_train_bytes) +
                                      " their gradients and optimizer states (train=)"
                                : std::string(),
           "); raise the budget to at least ", format_bytes(fixed), ", or stream more of them");

  // Layers with tied weights (PlannerLayer::tied_layer) are placed together:
  // unit[i], the layers resident with layer i (i among them); unit_cost(i),
  // what they take on the device resident (saturated: UINT64_MAX fits no budget).
  std::vector<std::vector<size_t>> unit(n);
  for (size_t i = 0; i < n; ++i)
    if (in.layers[i].tied_layer < 0) unit[i].push_back(i);
  for (size_t i = 0; i < n; ++i)
    if (in.layers[i].tied_layer >= 0) unit[static_cast<size_t>(in.layers[i].tied_layer)].push_back(i);
  for (size_t i = 0; i < n; ++i)
    if (in.layers[i].tied_layer >= 0) unit[i] = unit[static_cast<size_t>(in.layers[i].tied_layer)];
  auto unit_cost = [&](size_t i) {
    uint64_t c = 0;
    for (size_t j : unit[i]) {
      const PlannerLayer& l = in.layers[j];
      if (l.train_bytes > UINT64_MAX - l.resident_bytes || c > UINT64_MAX - l.resident_cost()) return UINT64_MAX;
      c += l.resident_cost();
    }
    return c;
  };

  Plan plan;
  plan.budget_bytes = in.budget_bytes;
  plan.fixed_resident_bytes = in.fixed_resident_bytes;
  plan.link_bytes_per_s = in.link_bytes_per_s;
  plan.device_flops_per_s = in.device_flops_per_s;
  plan.training = in.training;
  plan.has_time = in.link_bytes_per_s > 0;

  auto build = [&](const std::vector<char>& resident, int k) {
    Candidate c;
    c.resident = resident;
    c.held = tables_held(in, resident);
    c.resident_bytes = fixed;
    for (size_t i = 0; i < n; ++i) {
      const int tied = in.layers[i].tied_layer;  // placed with it
      LS_INTERNAL_CHECK(tied < 0 || resident[i] == resident[static_cast<size_t>(tied)]);
      if (c.held[i]) continue;  // on the device in its tied layer's resident bytes
      if (in.layers[i].lookup) {
        c.lookup_bytes += in.layers[i].bytes;
        c.lookup_bus_bytes += in.layers[i].lookup_bytes;
        ++c.num_lookup;
      } else if (resident[i]) {
        c.resident_bytes += in.layers[i].resident_cost();
      } else {
        c.slot_bytes = std::max(c.slot_bytes, in.layers[i].streamed_slot_bytes());
        c.streamed_bytes += in.layers[i].bytes;
        c.streamed_host_bytes += in.layers[i].host_bytes ? in.layers[i].host_bytes : in.layers[i].bytes;
        c.fetched_bytes += in.layers[i].fetch_bytes();
        if (in.layers[i].tied_table >= 0) c.shared_host_bytes += in.layers[i].bytes;
        c.shared_host_bytes += in.layers[i].tied_bytes;  // 0 unless tied_layer
        ++c.num_streamed;
      }
    }
    c.slots = effective_slots(k, in.min_slots, c.num_streamed);
    c.device_bytes = c.resident_bytes + static_cast<uint64_t>(c.slots) * c.slot_bytes;
    c.timing = simulate(in, resident, c.slots);
    return c;
  };

  // Tables looked up in host memory are never resident nor streamed through a slot.
  std::vector<char> all_resident(n, 1);
  for (size_t i = 0; i < n; ++i)
    if (in.layers[i].lookup) all_resident[i] = 0;
  Candidate best;
  if (!total_overflow && total_resident <= in.budget_bytes) {
    best = build(all_resident, in.min_slots);
  } else {
    // Streaming needs k slots of the largest streamed layer. Usually that is
    // the model's largest layer, but one outlier (an LM head 10x the size of
    // a block's layers) may be kept resident instead, so that the slots are
    // sized by the next one: the fewest largest layers that must be resident
    // for k slots to fit are forced resident before the greedy fill below.
    std::vector<size_t> by_slot;  // the layers that may stream
    for (size_t i = 0; i < n; ++i)
      if (!in.layers[i].lookup) by_slot.push_back(i);
    LS_INTERNAL_CHECK(!by_slot.empty());  // else everything is resident or looked up: handled above
    std::stable_sort(by_slot.begin(), by_slot.end(), [&](size_t a, size_t b) {
      return in.layers[a].streamed_slot_bytes() > in.layers[b].streamed_slot_bytes();
    });
    // The number of largest layers forced resident for k slots, or n + 1
    // when no such plan fits (keeping every layer resident does not fit
    // either: that case was handled above); each forced with the layers tied
    // to it (unit). Also the least device memory any plan with k slots needs,
    // its forced prefix, and how many largest layers and layers tied to them
    // that plan keeps resident.
    auto forced_prefix = [&](uint64_t k, long double* least = nullptr, size_t* least_p = nullptr,
                             size_t* least_largest = nullptr, size_t* least_tied = nullptr) -> size_t {
      long double res = static_cast<long double>(fixed);
      std::vector<char> forced(n, 0);
      size_t found = n + 1, largest = 0, tied = 0;
      for (size_t p = 0; p < by_slot.size(); ++p) {
        if (forced[by_slot[p]]) continue;  // resident with a larger layer it is tied to
        const long double need = res + static_cast<long double>(k) *
                                           static_cast<long double>(in.layers[by_slot[p]].streamed_slot_bytes());
        if (least && (p == 0 || need < *least)) {
          *least = need;
          *least_p = p;
          *least_largest = largest;
          *least_tied = tied;
        }
        if (need <= static_cast<long double>(in.budget_bytes)) {
          found = p;
          if (!least) break;
        }
        ++largest;
        for (size_t j : unit[by_slot[p]]) {
          forced[j] = 1;
          res += static_cast<long double>(in.layers[j].resident_cost());
          tied += j != by_slot[p];
        }
      }
      return found;
    };
    const uint64_t min_slots = static_cast<uint64_t>(in.min_slots);
    long double least = 0;
    size_t least_p = 0, least_largest = 0, least_tied = 0;
    if (forced_prefix(min_slots, &least, &least_p, &least_largest, &least_tied) > n) {
      const PlannerLayer& L = in.layers[by_slot[0]];
      const uint64_t L_slot = L.streamed_slot_bytes();
      std::string resident_note;
      if (!total_overflow && static_cast<long double>(total_resident) <= least) {
        least = static_cast<long double>(total_resident);  // cheaper than any streaming plan
        resident_note = " (every layer resident)";
      } else if (least_p > 0) {
        const PlannerLayer& S = in.layers[by_slot[least_p]];
        resident_note = " (the least with the " + std::to_string(least_largest) + " largest layer(s)" +
                        (least_tied ? " and the " + std::to_string(least_tied) + " layer(s) tied to them" : "") +
                        " resident and " + std::to_string(in.min_slots) + " slots of " + json::quote(S.name) + ", " +
                        format_bytes(S.streamed_slot_bytes()) + ")";
      }
      const uint64_t needed_b = least >= 18446744073709551615.0L ? UINT64_MAX : static_cast<uint64_t>(least);
      *too_small = detail::compose("budget ", format_bytes(in.budget_bytes), " (", in.budget_bytes,
              " bytes) is too small: the largest layer ", json::quote(L.name),
              L_slot > L.bytes ? " needs a slot of " : " is ", format_bytes(L_slot), " (", L_slot, " bytes",
              L_slot > L.bytes ? ": " + format_bytes(L.bytes) + " copied + the weight written on the device, "
                                 "dequantized or cast" : std::string(),
              ") and streaming needs ", in.min_slots, " slots of it",
              fixed ? " plus " + format_bytes(fixed) + " of small resident tensors" +
                          (in.fixed_train_bytes ? " (with their gradients and optimizer states)" : "")
                    : std::string(),
              "; a budget of at least ", format_bytes(needed_b), " (", needed_b,
              " bytes) is needed", resident_note,
              L_slot > L.bytes && !L.narrow_write
                  ? std::string(" (or have the device write a narrower dtype, e.g. ") +
                        (in.cli ? "--compute-dtype bf16 / --dense-dtype bf16" : "dequant_dtype / compute_dtype bfloat16") +
                        ": the slot holds that weight too)"
              : L.as_stored ? " (it streams as stored: quantization does not apply to it)"
              : L_slot > L.bytes ? ""
                                 : " (or quantize the weights, e.g. to nf4)",
              L.stored_slot_bytes && L.stored_slot_bytes < L_slot
                  ? std::string(" (streamed as stored, without ") +
                        (in.cli ? "--quantize / --compute-dtype" : "quantize= / compute_dtype") +
                        ", it would need a slot of " +
                        format_bytes(L.stored_slot_bytes) + ": what crosses the bus shrinks, but the slot also holds "
                        "the weight written from it)"
                  : std::string());
      return std::nullopt;
    }

    // Residency priority: lowest FLOPs per streamed byte first (its transfer
    // hides least behind its compute); unknown FLOPs count as 0; ties: the most
    // link bytes saved per device byte first (a routed experts group fetches a
    // share of its bytes a step but holds them all resident: a dense layer of
    // the same FLOPs per byte saves more; larger first put the groups first and
    // a decode step moved ~1.7x the bytes), then larger, then execution order.
    std::vector<size_t> order(n);
    std::iota(order.begin(), order.end(), size_t{0});
    std::vector<double> ratio(n), saves(n);
    for (size_t i = 0; i < n; ++i) {  // tied layers: their unit's, so that they are considered together
      double flops = 0, fetched = 0, held = 0;
      for (size_t j : unit[i]) {
        flops += in.layers[j].flops;
        fetched += static_cast<double>(in.layers[j].fetch_bytes());
        held += static_cast<double>(in.layers[j].resident_cost());
      }
      ratio[i] = fetched > 0 ? flops / fetched : 0.0;
      saves[i] = held > 0 ? fetched / held : 0.0;
    }
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      if (ratio[a] != ratio[b]) return ratio[a] < ratio[b];
      if (saves[a] != saves[b]) return saves[a] > saves[b];
      if (in.layers[a].bytes != in.layers[b].bytes) return in.layers[a].bytes > in.layers[b].bytes;
      return a < b;
    });

    bool have_best = false;
    const int max_slots = in.max_prefetch + 1;
    for (int k = in.min_slots; k <= std::max(in.min_slots, max_slots); ++k) {
      const size_t forced = forced_prefix(static_cast<uint64_t>(k));
      if (forced > n) break;  // no plan holds k slots (nor more)
      std::vector<char> resident(n, 0);
      std::multiset<uint64_t> streamed;  // slot sizes of the streamed layers
      uint64_t res = fixed;
      for (size_t p = 0; p < forced; ++p)
        for (size_t j : unit[by_slot[p]])
          if (!resident[j]) {
            resident[j] = 1;
            res += in.layers[j].resident_cost();
          }
      for (size_t i = 0; i < n; ++i)
        if (!resident[i] && !in.layers[i].lookup) streamed.insert(in.layers[i].streamed_slot_bytes());
      for (size_t i : order) {  // with the layers tied to it (unit), all or none
        if (resident[i] || in.layers[i].lookup) continue;
        const uint64_t cost = unit_cost(i);
        if (cost > in.budget_bytes - res) continue;
        for (size_t j : unit[i]) {
          auto it = streamed.find(in.layers[j].streamed_slot_bytes());
          LS_INTERNAL_CHECK(it != streamed.end());
          streamed.erase(it);
        }
        uint64_t slot = streamed.empty() ? 0 : *streamed.rbegin();
        uint64_t slots = static_cast<uint64_t>(effective_slots(k, in.min_slots, streamed.size()));
        uint64_t new_res = res + cost;
        bool fits = slot == 0 || slots <= (in.budget_bytes - new_res) / slot;
        if (fits) {
          for (size_t j : unit[i]) resident[j] = 1;
          res = new_res;
        } else {
          for (size_t j : unit[i]) streamed.insert(in.layers[j].streamed_slot_bytes());
        }
      }
      Candidate c = build(resident, k);
      LS_INTERNAL_CHECK(c.device_bytes <= in.budget_bytes);
      auto better = [&](const Candidate& a, const Candidate& b) {
        const double tol = 1e-9 * std::max(a.timing.step, b.timing.step);
        if (std::fabs(a.timing.step - b.timing.step) > tol) return a.timing.step < b.timing.step;
        if (a.streamed_bytes != b.streamed_bytes) return a.streamed_bytes < b.streamed_bytes;
        if (a.device_bytes != b.device_bytes) return a.device_bytes < b.device_bytes;
        return a.slots < b.slots;
      };
      if (!have_best || better(c, best)) {
        best = std::move(c);
        have_best = true;
      }
    }
    LS_INTERNAL_CHECK(have_best);
  }

  // Fill the plan from the chosen candidate.
  plan.slot_bytes = best.slot_bytes;
  plan.num_slots = best.slots;
  plan.prefetch_depth = best.slots > 0 ? best.slots - 1 : 0;
  if (in.prefetch_depth >= 0) plan.prefetch_depth = std::min(plan.prefetch_depth, in.prefetch_depth);
  plan.device_bytes = best.device_bytes;
  plan.train_bytes = in.fixed_train_bytes;
  for (size_t i = 0; i < n; ++i)
    if (best.resident[i] && !best.held[i] && !in.layers[i].lookup) plan.train_bytes += in.layers[i].train_bytes;
  plan.resident_bytes = best.resident_bytes - fixed - (plan.train_bytes - in.fixed_train_bytes);
  plan.host_pinned_bytes = best.streamed_host_bytes + best.lookup_bytes - best.shared_host_bytes;
  plan.bus_bytes_per_step = best.fetched_bytes * (in.training ? 2 : 1) + best.lookup_bus_bytes;
  plan.num_streamed = best.num_streamed;
  plan.num_lookup = best.num_lookup;
  plan.num_resident = n - best.num_streamed - best.num_lookup;
  std::vector<int> tied_with(n, -1);
  for (size_t i = 0; i < n; ++i) {
    if (in.layers[i].tied_table < 0) continue;
    tied_with[i] = in.layers[i].tied_table;
    tied_with[static_cast<size_t>(in.layers[i].tied_table)] = static_cast<int>(i);
  }
  for (size_t i = 0; i < n; ++i)
    if (in.layers[i].tied_layer >= 0) tied_with[i] = in.layers[i].tied_layer;
  for (size_t i = 0; i < n; ++i) {
    const PlannerLayer& l = in.layers[i];
    const bool held = best.held[i] != 0;
    LayerPlacement p;
    p.index = i;
    p.name = l.name;
    p.resident = best.resident[i] != 0 || held;
    p.lookup = l.lookup && !held;
    p.tied_with = tied_with[i];
    p.shares_weight = l.tied_layer >= 0;
    p.bytes = l.bytes;
    p.routed_bytes = l.routed_bytes;
    p.resident_bytes = held ? 0 : l.resident_bytes;
    p.train_bytes = p.resident && !held ? l.train_bytes : 0;
    p.flops = l.flops;
    p.compute_s = compute_seconds(in, l);
    p.transfer_s = p.lookup     ? transfer_seconds(in, l.lookup_bytes)
                   : p.resident ? 0.0
                                : transfer_seconds(in, l.fetch_bytes()) * (in.training ? 2 : 1);
    if (in.training) {  // saved activations back over the same link (and out over the other direction)
      p.transfer_s += transfer_seconds(in, l.activation_bytes);
      plan.activation_bytes_per_step += l.activation_bytes;
    }
    plan.compute_time_s += p.compute_s;
    plan.transfer_time_s += p.transfer_s;
    plan.layers.push_back(std::move(p));
  }
  if (plan.has_time) {
    plan.step_time_s = best.timing.step;
    plan.first_step_time_s = best.timing.first_step;
  }
  LS_INTERNAL_CHECK(plan.device_bytes <= plan.budget_bytes);
  return plan;
}

namespace {
// The projections that read one input, by the last part of their names.
const std::vector<std::vector<std::string>>& input_families() {
  static const std::vector<std::vector<std::string>> families = {
      {"q_proj", "k_proj", "v_proj"}, {"gate_proj", "up_proj"}, {"to_q", "to_k", "to_v"},
      {"query", "key", "value"},      {"w1", "w3"},             {"wq", "wk", "wv"},
      {"q", "k", "v"},                {"gate", "up"}};
  return families;
}

// (prefix, the index of the family) of a layer named "<prefix>.<member>"; family -1: none.
std::pair<std::string, int> family_of(const std::string& name) {
  const size_t dot = name.rfind('.');
  const std::string last = dot == std::string::npos ? name : name.substr(dot + 1);
  const auto& families = input_families();
  for (size_t f = 0; f < families.size(); ++f)
    if (std::find(families[f].begin(), families[f].end(), last) != families[f].end())
      return {dot == std::string::npos ? std::string() : name.substr(0, dot), static_cast<int>(f)};
  return {std::string(), -1};
}

uint64_t in_features(const ModelLayer& l) {
  return l.weight_shape.size() >= 2 && l.weight_shape[0] ? l.weight_numel() / l.weight_shape[0] : 0;
}
}  // namespace

bool reads_an_earlier_layers_input(const std::vector<ModelLayer>& layers, size_t i) {
  const ModelLayer& l = layers[i];
  if (l.embedding || l.group) return false;
  const auto [prefix, family] = family_of(l.name);
  if (family < 0) return false;
  for (size_t j = 0; j < i; ++j) {
    const ModelLayer& e = layers[j];
    if (e.embedding || e.group || in_features(e) != in_features(l)) continue;
    if (family_of(e.name) == std::make_pair(prefix, family)) return true;
  }
  return false;
}

}  // namespace layerstream
