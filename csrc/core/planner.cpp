#include "planner.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <numeric>
#include <set>

#include "error.h"
#include "gguf.h"
#include "json.h"
#include "quant.h"

namespace layerstream {

// ------------------------------------------------------------ bytes helpers

uint64_t parse_bytes(const std::string& input) {
  const std::string shown = json::quote(input);
  size_t b = 0, e = input.size();
  while (b < e && std::isspace(static_cast<unsigned char>(input[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(input[e - 1]))) --e;
  std::string s = input.substr(b, e - b);
  LS_CHECK(!s.empty(), "empty size; expected a byte count such as 12GiB, 500MB, 1.5e9 or 123");
  // Number: digits [. digits] [e[+-]digits]
  size_t i = 0;
  auto digits = [&]() {
    size_t n = 0;
    while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i]))) ++i, ++n;
    return n;
  };
  size_t int_digits = digits();
  size_t frac_digits = 0;
  if (i < s.size() && s[i] == '.') {
    ++i;
    frac_digits = digits();
  }
  LS_CHECK(int_digits + frac_digits > 0, "invalid size ", shown,
           ": expected a non-negative number with an optional unit, e.g. 12GiB, 500MB, 1.5e9 or 123");
  if (i < s.size() && (s[i] == 'e' || s[i] == 'E')) {
    size_t save = i;
    ++i;
    if (i < s.size() && (s[i] == '+' || s[i] == '-')) ++i;
    if (digits() == 0) i = save;  // not an exponent: let the unit parser reject it
  }
  std::string number = s.substr(0, i);
  std::string unit;
  for (size_t j = i; j < s.size(); ++j)
    if (!std::isspace(static_cast<unsigned char>(s[j])))
      unit.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(s[j]))));
    else
      LS_CHECK(unit.empty(), "invalid size ", shown, ": unexpected space inside the unit");
  if (!unit.empty() && unit.back() == 'b') unit.pop_back();
  static const std::map<std::string, double> kUnits = {
      {"", 1.0},         {"k", 1e3},           {"m", 1e6},           {"g", 1e9},
      {"t", 1e12},       {"ki", 1024.0},       {"mi", 1048576.0},    {"gi", 1073741824.0},
      {"ti", 1099511627776.0}};
  auto it = kUnits.find(unit);
  LS_CHECK(it != kUnits.end(), "invalid size ", shown,
           ": unknown unit (use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB)");
  double v = std::strtod(number.c_str(), nullptr) * it->second;
  LS_CHECK(std::isfinite(v) && v < 18446744073709551615.0, "invalid size ", shown, ": too large");
  double r = std::floor(v + 0.5);
  LS_CHECK(std::fabs(v - r) <= 1e-6 * std::max(1.0, v), "invalid size ", shown,
           ": not a whole number of bytes");
  return static_cast<uint64_t>(r);
}

std::string format_bytes(uint64_t bytes) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  if (bytes < 1024) return std::to_string(bytes) + " B";
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024.0 && u < 6) {
    v /= 1024.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f %s", v, kUnits[u]);
  return buf;
}

namespace {

std::string format_seconds(double s) {
  char buf[32];
  if (s == 0.0)
    return "0 s";
  else if (s < 1e-3)
    std::snprintf(buf, sizeof buf, "%.1f us", s * 1e6);
  else if (s < 1.0)
    std::snprintf(buf, sizeof buf, "%.2f ms", s * 1e3);
  else
    std::snprintf(buf, sizeof buf, "%.3f s", s);
  return buf;
}

std::string json_number(double v) {
  if (!std::isfinite(v)) return "null";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}

// ----------------------------------------------------------- time model

struct Timing {
  double first_step = 0.0;
  double step = 0.0;
};

double compute_seconds(const PlannerInput& in, const PlannerLayer& l) {
  return in.device_flops_per_s > 0 ? l.flops / in.device_flops_per_s : 0.0;
}
double transfer_seconds(const PlannerInput& in, uint64_t bytes) {
  return in.link_bytes_per_s > 0 ? static_cast<double>(bytes) / in.link_bytes_per_s : 0.0;
}

// Event simulation of the streaming pipeline (see docs/design/planner.md):
// one compute stream, one host->device copy engine, one device->host copy
// engine (gradients), `slots` device slots used round-robin by the streamed
// layers. A streamed layer's copy starts when the link is free and its slot
// has been released by the compute of the layer that used it before; its
// compute starts when the previous compute and its copy are done.
// Tables held on the device by their resident tied layer (PlannerLayer::tied_table):
// resident with it, so they are not looked up.
std::vector<char> tables_held(const PlannerInput& in, const std::vector<char>& resident) {
  std::vector<char> held(in.layers.size(), 0);
  for (size_t i = 0; i < in.layers.size(); ++i)
    if (resident[i] && in.layers[i].tied_table >= 0) held[static_cast<size_t>(in.layers[i].tied_table)] = 1;
  return held;
}

Timing simulate(const PlannerInput& in, const std::vector<char>& resident, int slots) {
  const size_t n = in.layers.size();
  const std::vector<char> held = tables_held(in, resident);
  struct Op {
    size_t layer;
    double compute;
    bool streamed;
    double grad_out;  // seconds of device->host gradient copy after compute
  };
  std::vector<Op> ops;
  for (size_t i = 0; i < n; ++i) {
    const PlannerLayer& l = in.layers[i];
    double c = compute_seconds(in, l);
    double fwd = in.training ? c / 3.0 : c;
    if (l.lookup && !held[i]) fwd += transfer_seconds(in, l.lookup_bytes);  // rows read across the bus, on the compute stream
    ops.push_back({i, fwd, !resident[i] && !l.lookup, 0.0});
  }
  if (in.training) {
    for (size_t r = n; r-- > 0;) {
      const PlannerLayer& l = in.layers[r];
      double c = compute_seconds(in, l);
      bool streamed = !resident[r] && !l.lookup;
      double g = (streamed && l.trainable) ? transfer_seconds(in, l.resident_bytes) : 0.0;
      // A trainable table's gradient rows go back synchronously, on the compute stream.
      const double rows_back = (l.lookup && !held[r] && l.trainable) ? transfer_seconds(in, l.lookup_bytes) : 0.0;
      ops.push_back({r, c * 2.0 / 3.0 + rows_back, streamed, g});
    }
  }
  const int kSteps = 4;
  std::vector<double> slot_free(static_cast<size_t>(std::max(slots, 1)), 0.0);
  double link_free = 0.0, d2h_free = 0.0, compute_free = 0.0;
  uint64_t streamed_count = 0;
  std::vector<double> step_end;
  for (int s = 0; s < kSteps; ++s) {
    for (const Op& op : ops) {
      double ready = 0.0;
      size_t slot = 0;
      if (op.streamed) {
        const PlannerLayer& l = in.layers[op.layer];
        slot = static_cast<size_t>(streamed_count++ % slot_free.size());
        double start = std::max(link_free, slot_free[slot]);
        if (l.routed_bytes) start = std::max(start, compute_free);  // on demand, after the router
        link_free = start + transfer_seconds(in, l.fetch_bytes());
        ready = link_free;
      }
      double start = std::max(compute_free, ready);
      compute_free = start + op.compute;
      if (op.streamed) slot_free[slot] = compute_free;
      if (op.grad_out > 0) d2h_free = std::max(d2h_free, compute_free) + op.grad_out;
    }
    step_end.push_back(std::max(compute_free, d2h_free));
  }
  Timing t;
  t.first_step = step_end[0];
  t.step = (step_end[kSteps - 1] - step_end[kSteps - 3]) / 2.0;
  return t;
}

struct Candidate {
  std::vector<char> resident;
  int slots = 0;
  uint64_t slot_bytes = 0;
  uint64_t resident_bytes = 0;
  uint64_t device_bytes = 0;
  uint64_t streamed_bytes = 0;
  size_t num_streamed = 0;
  uint64_t fetched_bytes = 0;     // what the streamed layers copy per pass (routed groups: some experts)
  uint64_t lookup_bytes = 0;      // tables looked up in host memory (pinned)
  uint64_t lookup_bus_bytes = 0;  // the rows they read per step
  size_t num_lookup = 0;
  uint64_t shared_host_bytes = 0;  // streamed tied layers' bytes: the table's host copy
  std::vector<char> held;          // tables_held()
  Timing timing;
};

int effective_slots(int k, int min_slots, size_t num_streamed) {
  if (num_streamed == 0) return 0;
  return std::min<int>(k, std::max<int>(min_slots, static_cast<int>(std::min<size_t>(num_streamed, 1u << 20))));
}

}  // namespace

std::string Plan::bound() const {
  if (!has_time) return "unknown";
  if (num_streamed == 0 || step_time_s <= compute_time_s * (1.0 + 1e-9) + 1e-12) return "compute";
  return "transfer";
}

Plan plan_placement(const PlannerInput& in) {
  LS_CHECK(in.min_slots >= 2, "planner: min_slots must be at least 2 (got ", in.min_slots, ")");
  LS_CHECK(in.max_prefetch >= 1 && in.max_prefetch <= 64, "planner: max_prefetch must be in [1, 64] (got ",
           in.max_prefetch, ")");
  LS_CHECK(std::isfinite(in.link_bytes_per_s) && in.link_bytes_per_s >= 0,
           "planner: link bandwidth must be a non-negative number of bytes/s");
  LS_CHECK(std::isfinite(in.device_flops_per_s) && in.device_flops_per_s >= 0,
           "planner: device throughput must be a non-negative number of FLOP/s");
  const size_t n = in.layers.size();
  uint64_t total_resident = in.fixed_resident_bytes;  // every layer that can be resident
  bool total_overflow = false;
  for (const auto& l : in.layers) {
    LS_CHECK(std::isfinite(l.flops) && l.flops >= 0, "planner: layer ", json::quote(l.name),
             " has invalid FLOPs (must be >= 0)");
    LS_CHECK(l.tied_table < 0 || (static_cast<size_t>(l.tied_table) < n && !l.lookup &&
                                  in.layers[static_cast<size_t>(l.tied_table)].lookup),
             "planner: layer ", json::quote(l.name), " is tied to layer #", l.tied_table,
             ", which is not a lookup table");
    if (l.lookup) continue;
    if (total_resident > UINT64_MAX - l.resident_bytes) total_overflow = true;
    else total_resident += l.resident_bytes;
  }
  LS_CHECK(in.fixed_resident_bytes <= in.budget_bytes, "budget ", format_bytes(in.budget_bytes), " (",
           in.budget_bytes, " bytes) cannot even hold the always-resident small tensors (",
           format_bytes(in.fixed_resident_bytes), "); raise the budget to at least ",
           format_bytes(in.fixed_resident_bytes));

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
    c.resident_bytes = in.fixed_resident_bytes;
    for (size_t i = 0; i < n; ++i) {
      if (c.held[i]) continue;  // on the device in its tied layer's resident bytes
      if (in.layers[i].lookup) {
        c.lookup_bytes += in.layers[i].bytes;
        c.lookup_bus_bytes += in.layers[i].lookup_bytes;
        ++c.num_lookup;
      } else if (resident[i]) {
        c.resident_bytes += in.layers[i].resident_bytes;
      } else {
        c.slot_bytes = std::max(c.slot_bytes, in.layers[i].streamed_slot_bytes());
        c.streamed_bytes += in.layers[i].bytes;
        c.fetched_bytes += in.layers[i].fetch_bytes();
        if (in.layers[i].tied_table >= 0) c.shared_host_bytes += in.layers[i].bytes;
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
    // either: that case was handled above). Also the least device memory any
    // plan with k slots needs, and its forced prefix.
    auto forced_prefix = [&](uint64_t k, long double* least = nullptr, size_t* least_p = nullptr) -> size_t {
      long double res = static_cast<long double>(in.fixed_resident_bytes);
      size_t found = n + 1;
      for (size_t p = 0; p < by_slot.size(); ++p) {
        const long double need = res + static_cast<long double>(k) *
                                           static_cast<long double>(in.layers[by_slot[p]].streamed_slot_bytes());
        if (least && (p == 0 || need < *least)) {
          *least = need;
          *least_p = p;
        }
        if (need <= static_cast<long double>(in.budget_bytes)) {
          found = p;
          if (!least) break;
        }
        res += static_cast<long double>(in.layers[by_slot[p]].resident_bytes);
      }
      return found;
    };
    const uint64_t min_slots = static_cast<uint64_t>(in.min_slots);
    long double least = 0;
    size_t least_p = 0;
    if (forced_prefix(min_slots, &least, &least_p) > n) {
      const PlannerLayer& L = in.layers[by_slot[0]];
      const uint64_t L_slot = L.streamed_slot_bytes();
      std::string resident_note;
      if (!total_overflow && static_cast<long double>(total_resident) <= least) {
        least = static_cast<long double>(total_resident);  // cheaper than any streaming plan
        resident_note = " (every layer resident)";
      } else if (least_p > 0) {
        const PlannerLayer& S = in.layers[by_slot[least_p]];
        resident_note = " (the least with the " + std::to_string(least_p) + " largest layer(s) resident and " +
                        std::to_string(in.min_slots) + " slots of " + json::quote(S.name) + ", " +
                        format_bytes(S.streamed_slot_bytes()) + ")";
      }
      const uint64_t needed_b = least >= 18446744073709551615.0L ? UINT64_MAX : static_cast<uint64_t>(least);
      LS_FAIL("budget ", format_bytes(in.budget_bytes), " (", in.budget_bytes,
              " bytes) is too small: the largest layer ", json::quote(L.name),
              L_slot > L.bytes ? " needs a slot of " : " is ", format_bytes(L_slot), " (", L_slot, " bytes",
              L_slot > L.bytes ? ": " + format_bytes(L.bytes) + " copied + the weight written on the device, "
                                 "dequantized or cast" : std::string(),
              ") and streaming needs ", in.min_slots, " slots of it",
              in.fixed_resident_bytes ? " plus " + format_bytes(in.fixed_resident_bytes) + " of small resident tensors"
                                      : std::string(),
              "; a budget of at least ", format_bytes(needed_b), " (", needed_b,
              " bytes) is needed", resident_note,
              L_slot > L.bytes && !L.narrow_write
                  ? " (or have the device write a narrower dtype, e.g. dequant_dtype / compute_dtype bfloat16: the "
                    "slot holds that weight too)"
              : L.as_stored ? " (it streams as stored: quantization does not apply to it)"
              : L_slot > L.bytes ? ""
                                 : " (or quantize the weights, e.g. to nf4)");
    }

    // Residency priority: lowest FLOPs per streamed byte first (its transfer
    // hides least behind its compute); unknown FLOPs count as 0; ties: larger
    // first, then execution order.
    std::vector<size_t> order(n);
    std::iota(order.begin(), order.end(), size_t{0});
    std::vector<double> ratio(n);
    for (size_t i = 0; i < n; ++i)
      ratio[i] = in.layers[i].bytes ? in.layers[i].flops / static_cast<double>(in.layers[i].fetch_bytes()) : 0.0;
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      if (ratio[a] != ratio[b]) return ratio[a] < ratio[b];
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
      uint64_t res = in.fixed_resident_bytes;
      for (size_t p = 0; p < forced; ++p) {
        resident[by_slot[p]] = 1;
        res += in.layers[by_slot[p]].resident_bytes;
      }
      for (size_t i = 0; i < n; ++i)
        if (!resident[i] && !in.layers[i].lookup) streamed.insert(in.layers[i].streamed_slot_bytes());
      for (size_t i : order) {
        if (resident[i] || in.layers[i].lookup) continue;
        const PlannerLayer& l = in.layers[i];
        if (l.resident_bytes > in.budget_bytes - res) continue;
        auto it = streamed.find(l.streamed_slot_bytes());
        LS_INTERNAL_CHECK(it != streamed.end());
        streamed.erase(it);
        uint64_t slot = streamed.empty() ? 0 : *streamed.rbegin();
        uint64_t slots = static_cast<uint64_t>(effective_slots(k, in.min_slots, streamed.size()));
        uint64_t new_res = res + l.resident_bytes;
        bool fits = slot == 0 || slots <= (in.budget_bytes - new_res) / slot;
        if (fits) {
          resident[i] = 1;
          res = new_res;
        } else {
          streamed.insert(l.streamed_slot_bytes());
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
  plan.device_bytes = best.device_bytes;
  plan.resident_bytes = best.resident_bytes - in.fixed_resident_bytes;
  plan.host_pinned_bytes = best.streamed_bytes + best.lookup_bytes - best.shared_host_bytes;
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
  for (size_t i = 0; i < n; ++i) {
    const PlannerLayer& l = in.layers[i];
    const bool held = best.held[i] != 0;
    LayerPlacement p;
    p.index = i;
    p.name = l.name;
    p.resident = best.resident[i] != 0 || held;
    p.lookup = l.lookup && !held;
    p.tied_with = tied_with[i];
    p.bytes = l.bytes;
    p.routed_bytes = l.routed_bytes;
    p.resident_bytes = held ? 0 : l.resident_bytes;
    p.flops = l.flops;
    p.compute_s = compute_seconds(in, l);
    p.transfer_s = p.lookup     ? transfer_seconds(in, l.lookup_bytes)
                   : p.resident ? 0.0
                                : transfer_seconds(in, l.fetch_bytes()) * (in.training ? 2 : 1);
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

std::string Plan::explain() const {
  std::string out;
  char buf[512];
  size_t w = 5;
  for (const auto& l : layers) w = std::max(w, std::min<size_t>(l.name.size(), 60));
  const std::string looked = num_lookup ? ", " + std::to_string(num_lookup) + " looked up in host memory" : "";
  std::snprintf(buf, sizeof buf, "placement: %zu layers (%zu resident, %zu streamed%s), budget %s\n", layers.size(),
                num_resident, num_streamed, looked.c_str(), format_bytes(budget_bytes).c_str());
  out += buf;
  std::snprintf(buf, sizeof buf, "%5s  %-*s  %-8s  %12s  %10s  %10s  %10s\n", "#", static_cast<int>(w), "layer",
                "where", "bytes", "FLOPs/B", "compute", "transfer");
  out += buf;
  for (const auto& l : layers) {
    std::string name = l.name.size() > 60 ? l.name.substr(0, 27) + "..." + l.name.substr(l.name.size() - 30) : l.name;
    std::string ratio = l.flops > 0 && l.bytes > 0 ? json_number(l.flops / static_cast<double>(l.bytes)) : "-";
    std::snprintf(buf, sizeof buf, "%5zu  %-*s  %-8s  %12s  %10s  %10s  %10s\n", l.index, static_cast<int>(w),
                  name.c_str(), l.lookup ? "lookup" : l.resident ? "resident" : l.routed_bytes ? "routed" : "streamed",
                  format_bytes(l.resident ? l.resident_bytes : l.bytes).c_str(), ratio.c_str(),
                  format_seconds(l.compute_s).c_str(), l.resident ? "-" : format_seconds(l.transfer_s).c_str());
    out += buf;
  }
  out += "\n";
  double pct = budget_bytes ? 100.0 * static_cast<double>(device_bytes) / static_cast<double>(budget_bytes) : 0.0;
  std::snprintf(buf, sizeof buf,
                "device memory:            %s = resident layers %s + small tensors %s + %d slots x %s "
                "(%.1f%% of budget %s)\n",
                format_bytes(device_bytes).c_str(), format_bytes(resident_bytes).c_str(),
                format_bytes(fixed_resident_bytes).c_str(), num_slots, format_bytes(slot_bytes).c_str(), pct,
                format_bytes(budget_bytes).c_str());
  out += buf;
  const std::string tables = num_lookup ? " + " + std::to_string(num_lookup) + " looked-up tables" : "";
  std::snprintf(buf, sizeof buf, "host RAM needed (pinned): %s (%zu streamed layers%s)\n",
                format_bytes(host_pinned_bytes).c_str(), num_streamed, tables.c_str());
  out += buf;
  std::snprintf(buf, sizeof buf, "slots:                    %d of %s, prefetch depth %d\n", num_slots,
                format_bytes(slot_bytes).c_str(), prefetch_depth);
  out += buf;
  for (const auto& l : layers) {
    if (l.tied_with < 0 || l.lookup || (l.resident && l.resident_bytes == 0)) continue;
    const std::string& other = layers[static_cast<size_t>(l.tied_with)].name;
    out += "tied weights:             " + l.name + (l.resident ? " is resident, and " + other + " with it"
                                                               : " streams the host copy of " + other +
                                                                     " (counted once)") + "\n";
  }
  if (has_time) {
    std::snprintf(buf, sizeof buf,
                  "predicted step time:      %s steady state (first step %s); compute %s, transfer %s "
                  "(%s per step over the link) -> %s-bound%s\n",
                  format_seconds(step_time_s).c_str(), format_seconds(first_step_time_s).c_str(),
                  format_seconds(compute_time_s).c_str(), format_seconds(transfer_time_s).c_str(),
                  format_bytes(bus_bytes_per_step).c_str(), bound().c_str(), training ? " (training)" : "");
  } else {
    std::snprintf(buf, sizeof buf, "predicted step time:      unknown (no link bandwidth given)\n");
  }
  out += buf;
  return out;
}

std::string Plan::to_json() const {
  std::string o = "{";
  auto num = [&](const char* k, uint64_t v, bool comma = true) {
    o += std::string("\"") + k + "\": " + std::to_string(v) + (comma ? ", " : "");
  };
  auto dbl = [&](const char* k, double v, bool comma = true) {
    o += std::string("\"") + k + "\": " + json_number(v) + (comma ? ", " : "");
  };
  num("budget_bytes", budget_bytes);
  num("device_bytes", device_bytes);
  num("resident_bytes", resident_bytes);
  num("small_resident_bytes", fixed_resident_bytes);
  num("slot_bytes", slot_bytes);
  num("num_slots", static_cast<uint64_t>(num_slots));
  num("prefetch_depth", static_cast<uint64_t>(prefetch_depth));
  num("host_pinned_bytes", host_pinned_bytes);
  num("bus_bytes_per_step", bus_bytes_per_step);
  num("num_resident", num_resident);
  num("num_streamed", num_streamed);
  num("num_lookup", num_lookup);
  dbl("link_bytes_per_s", link_bytes_per_s);
  dbl("device_flops_per_s", device_flops_per_s);
  o += std::string("\"training\": ") + (training ? "true" : "false") + ", ";
  if (has_time) {
    o += "\"time\": {";
    dbl("step_s", step_time_s);
    dbl("first_step_s", first_step_time_s);
    dbl("compute_s", compute_time_s);
    dbl("transfer_s", transfer_time_s);
    o += "\"bound\": " + json::quote(bound()) + "}, ";
  } else {
    o += "\"time\": null, ";
  }
  o += "\"layers\": [";
  for (size_t i = 0; i < layers.size(); ++i) {
    const auto& l = layers[i];
    if (i) o += ", ";
    o += "{\"index\": " + std::to_string(l.index) + ", \"name\": " + json::quote(l.name) +
         ", \"placement\": " + (l.lookup ? "\"lookup\"" : l.resident ? "\"resident\"" : "\"streamed\"") + ", ";
    if (l.tied_with >= 0) o += "\"tied_with\": " + json::quote(layers[static_cast<size_t>(l.tied_with)].name) + ", ";
    num("bytes", l.bytes);
    if (l.routed_bytes) num("routed_bytes", l.routed_bytes);
    num("resident_bytes", l.resident_bytes);
    dbl("flops", l.flops);
    dbl("compute_s", l.compute_s);
    dbl("transfer_s", l.transfer_s, false);
    o += "}";
  }
  o += "]}";
  return o;
}

// ------------------------------------------------------ model descriptions

Quantization parse_quantization(const std::string& s) {
  if (s == "none") return Quantization::None;
  if (s == "int8") return Quantization::Int8;
  if (s == "fp8") return Quantization::FP8;
  if (s == "nf4") return Quantization::NF4;
  if (s == "int4") return Quantization::Int4;
  LS_FAIL("unknown quantization ", json::quote(s), " (valid: none, int8, fp8, nf4, int4)");
}

const char* to_string(Quantization q) {
  switch (q) {
    case Quantization::None: return "none";
    case Quantization::Int8: return "int8";
    case Quantization::FP8: return "fp8";
    case Quantization::NF4: return "nf4";
    case Quantization::Int4: return "int4";
  }
  return "?";
}

namespace {
uint64_t numel_of(const std::vector<uint64_t>& shape) {
  uint64_t n = 1;
  for (uint64_t d : shape) n *= d;  // shapes were validated by the header reader
  return n;
}
uint64_t bytes_of(uint64_t numel, const std::string& dtype) {
  unsigned bits = safetensors_dtype_bits(dtype);
  uint32_t id = 0;
  if (bits == 0 && ggml_type_by_name(dtype, id)) {  // a GGUF block type: whole blocks
    const GgmlType t = ggml_type(id);
    return (numel + t.block_elems - 1) / t.block_elems * t.block_bytes;
  }
  LS_CHECK(bits > 0, "unknown dtype ", json::quote(dtype));
  return (numel * bits + 7) / 8;
}
uint64_t ceil_div(uint64_t a, uint64_t b) { return (a + b - 1) / b; }
}  // namespace

uint64_t ModelLayer::weight_numel() const { return numel_of(weight_shape); }
uint64_t ModelLayer::params() const { return group ? group_params : weight_numel() + bias_numel; }
uint64_t ModelLayer::stored_bytes() const {
  if (group) return group_bytes;
  return bytes_of(weight_numel(), weight_dtype) + (bias_dtype.empty() ? 0 : bytes_of(bias_numel, bias_dtype));
}

uint64_t quantized_weight_bytes(const std::vector<uint64_t>& shape, const std::string& dtype, Quantization q) {
  uint64_t numel = numel_of(shape);
  if (q == Quantization::None || !safetensors_dtype_is_wide_float(dtype) || shape.empty())
    return bytes_of(numel, dtype);
  uint64_t rows = shape[0];
  if (rows == 0 || numel == 0) return 0;
  uint64_t in = numel / rows;
  // The exact size of the packed buffer the runtime uses (core/quant.h:
  // sections 256-byte aligned) when the shape is supported; otherwise the
  // formula below plus worst-case alignment padding.
  quant::Format fmt = q == Quantization::Int8  ? quant::Format::Int8
                      : q == Quantization::FP8 ? quant::Format::Fp8E4M3
                      : q == Quantization::NF4 ? quant::Format::NF4
                                               : quant::Format::Int4;
  if (rows <= static_cast<uint64_t>(INT64_MAX) && in <= static_cast<uint64_t>(INT64_MAX) &&
      (q != Quantization::Int4 || in % static_cast<uint64_t>(quant::kInt4GroupSize) == 0)) {
    try {
      return quant::layout_for(fmt, static_cast<int64_t>(rows), static_cast<int64_t>(in)).total_bytes();
    } catch (const Error&) {
      // fall through to the formula
    }
  }
  const uint64_t pad = 3 * quant::kSectionAlign;
  switch (q) {
    case Quantization::Int8:
    case Quantization::FP8: return rows * in + rows * 4 + pad;  // 1 B/param + fp32 scale per row
    case Quantization::NF4: return ceil_div(numel, 2) + ceil_div(numel, 64) * 4 + pad;  // fp32 absmax / 64
    case Quantization::Int4: return rows * ceil_div(in, 2) + rows * ceil_div(in, 128) * 8 + pad;  // scale+zero / 128
    case Quantization::None: break;
  }
  return bytes_of(numel, dtype);
}

double experts_reached(double active, uint64_t tokens) {
  return 1.0 - std::pow(1.0 - active, static_cast<double>(tokens));
}

std::vector<PlannerLayer> layer_specs(const ModelDescription& m, const LayerOptions& opt) {
  std::vector<PlannerLayer> out;
  const double tokens = static_cast<double>(opt.tokens);
  for (const auto& l : m.layers) {
    PlannerLayer s;
    s.name = l.name;
    if (l.group) {
      // A tensor group: all of it in one slot; quantized, each tensor of 2+
      // dimensions crosses packed (a matrix of its last dimension's columns)
      // and is dequantized into the slot's workspace (in compute_dtype, else
      // as stored), as offload() does. Never cast otherwise. Only the active
      // experts compute.
      const auto align = [](uint64_t v) { return (v + quant::kSectionAlign - 1) / quant::kSectionAlign * quant::kSectionAlign; };
      uint64_t bus = 0, workspace = 0;
      bool gguf = false, narrow = true;  // narrow: every tensor written on the device is 2 bytes wide
      for (const auto& [shape, dtype] : l.group_tensors) {
        const uint64_t numel = numel_of(shape);
        const bool pack = opt.quantize != Quantization::None && shape.size() >= 2 && shape.back() > 0 &&
                          safetensors_dtype_is_wide_float(dtype);
        if (!l.dense_dtype.empty() && safetensors_dtype_bits(dtype) == 0) {
          // GGUF blocks (load_gguf): they cross as they are, padded as the
          // engine stores them, and are dequantized into the workspace.
          gguf = true;
          const std::string& written = opt.compute_dtype.empty() ? l.dense_dtype : opt.compute_dtype;
          bus += align(bytes_of(numel, dtype));
          workspace += align(bytes_of(numel, written));
          narrow = narrow && safetensors_dtype_bits(written) <= 16;
        } else if (pack) {
          const std::string& written = opt.compute_dtype.empty() ? dtype : opt.compute_dtype;
          bus += quantized_weight_bytes({numel / shape.back(), shape.back()}, dtype, opt.quantize);
          workspace += align(bytes_of(numel, written));
          narrow = narrow && safetensors_dtype_bits(written) <= 16;
        } else {
          bus += bytes_of(numel, dtype);
        }
      }
      if (l.group_tensors.empty()) bus = l.group_bytes;
      s.bytes = bus;
      if (workspace) s.slot_bytes = bus + workspace + quant::kSectionAlign;
      s.narrow_write = workspace && narrow;
      // Resident, a group with GGUF tensors is dense (group_bytes: dequantized).
      s.resident_bytes = opt.resident_dequantized || gguf ? l.group_bytes : bus;
      s.flops = 2.0 * tokens * static_cast<double>(l.group_params) * l.active * (opt.training ? 3.0 : 1.0);
      s.trainable = opt.training && opt.quantize == Quantization::None && !gguf;  // GGUF tensors are frozen
      s.as_stored = gguf || (opt.quantize != Quantization::None && bus == l.group_bytes);  // nothing to pack
      if (opt.routed_experts && l.active < 1.0) {
        const double share = experts_reached(l.active, opt.tokens);
        if (share <= 0.5) s.routed_bytes = std::max<uint64_t>(1, static_cast<uint64_t>(std::ceil(bus * share)));
      }
      out.push_back(std::move(s));
      continue;
    }
    // A tied layer reads the table's dense host copy: never quantized (as offload()).
    const Quantization quantize = l.tied_to.empty() ? opt.quantize : Quantization::None;
    if (!l.tied_to.empty()) {
      for (size_t j = 0; j < out.size(); ++j)
        if (out[j].name == l.tied_to && out[j].lookup) s.tied_table = static_cast<int>(j);
      LS_CHECK(s.tied_table >= 0, "layer ", json::quote(l.name), " is tied to ", json::quote(l.tied_to),
               ", which is not an embedding table before it");
      s.as_stored = true;
    }
    uint64_t bias = l.bias_dtype.empty() ? 0 : bytes_of(l.bias_numel, l.bias_dtype);
    const uint64_t w_stored = bytes_of(l.weight_numel(), l.weight_dtype);
    const uint64_t w_bus = quantized_weight_bytes(l.weight_shape, l.weight_dtype, quantize);
    s.bytes = w_bus + bias;
    if (!l.dense_dtype.empty() && !l.embedding) {
      // GGUF blocks (load_gguf): they cross as they are (padded to 256 B, as
      // the engine stores them) and are dequantized in the slot to the
      // parameter's dtype (compute_dtype when given); resident, offload()
      // holds the dequantized weight.
      const std::string& dense = opt.compute_dtype.empty() ? l.dense_dtype : opt.compute_dtype;
      const uint64_t packed = (w_stored + quant::kSectionAlign - 1) / quant::kSectionAlign * quant::kSectionAlign;
      const uint64_t dense_w = bytes_of(l.weight_numel(), dense);
      s.bytes = packed + bias;
      s.slot_bytes = s.bytes + (dense_w + quant::kSectionAlign - 1) / quant::kSectionAlign * quant::kSectionAlign +
                     quant::kSectionAlign;
      s.resident_bytes = dense_w + bias;
      s.flops = 2.0 * tokens * static_cast<double>(l.params()) * (opt.training ? 3.0 : 1.0);
      s.trainable = false;  // a GGUF weight is frozen
      s.as_stored = true;
      s.narrow_write = safetensors_dtype_bits(dense) <= 16;
      out.push_back(std::move(s));
      continue;
    }
    // The slot's workspace, written on the device after the copy: a
    // quantized layer's dequantized weight (in compute_dtype, else the stored
    // dtype), or a float weight / bias cast to compute_dtype.
    const std::string& cd = opt.compute_dtype;
    const auto align = [](uint64_t v) { return (v + quant::kSectionAlign - 1) / quant::kSectionAlign * quant::kSectionAlign; };
    uint64_t workspace = 0;
    if (quantize != Quantization::None && w_bus != w_stored) {
      workspace = align(cd.empty() ? w_stored : bytes_of(l.weight_numel(), cd));
      s.narrow_write = safetensors_dtype_bits(cd.empty() ? l.weight_dtype : cd) <= 16;
    } else if (!cd.empty() && l.weight_dtype != cd && safetensors_dtype_is_wide_float(l.weight_dtype)) {
      workspace = align(bytes_of(l.weight_numel(), cd));
      s.narrow_write = safetensors_dtype_bits(cd) <= 16;
    }
    if (!cd.empty() && !l.bias_dtype.empty() && l.bias_dtype != cd && safetensors_dtype_is_wide_float(l.bias_dtype))
      workspace = align(workspace + bytes_of(l.bias_numel, cd));
    if (workspace) s.slot_bytes = s.bytes + workspace + quant::kSectionAlign;
    s.resident_bytes = opt.resident_dequantized ? l.stored_bytes() : s.bytes;
    uint64_t rows = l.weight_shape.empty() ? 0 : l.weight_shape[0];
    uint64_t row_size = rows ? l.weight_numel() / rows : 0;
    s.flops = l.embedding ? tokens * static_cast<double>(row_size) : 2.0 * tokens * static_cast<double>(l.params());
    if (opt.training) s.flops *= 3.0;
    s.trainable = opt.training && opt.quantize == Quantization::None;  // quantizing freezes the model
    if (l.embedding) {
      // As offload() does: a table is looked up in host memory (the rows a
      // step names cross the bus; a trainable one's gradient rows come back),
      // never quantized, never in a slot.
      s.bytes = s.resident_bytes = l.stored_bytes();
      s.slot_bytes = 0;
      s.lookup = true;
      s.lookup_bytes = opt.tokens * (rows ? l.stored_bytes() / rows : 0);
    }
    out.push_back(std::move(s));
  }
  return out;
}

namespace {

// Natural order: digit runs compare as numbers ("layers.2" < "layers.10").
bool natural_less(const std::string& a, const std::string& b) {
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    bool da = std::isdigit(static_cast<unsigned char>(a[i])), db = std::isdigit(static_cast<unsigned char>(b[j]));
    if (da && db) {
      size_t ie = i, je = j;
      while (ie < a.size() && std::isdigit(static_cast<unsigned char>(a[ie]))) ++ie;
      while (je < b.size() && std::isdigit(static_cast<unsigned char>(b[je]))) ++je;
      size_t is = i, js = j;
      while (is + 1 < ie && a[is] == '0') ++is;
      while (js + 1 < je && b[js] == '0') ++js;
      if (ie - is != je - js) return ie - is < je - js;
      int c = a.compare(is, ie - is, b, js, je - js);
      if (c != 0) return c < 0;
      i = ie;
      j = je;
    } else {
      if (a[i] != b[j]) return static_cast<unsigned char>(a[i]) < static_cast<unsigned char>(b[j]);
      ++i;
      ++j;
    }
  }
  if ((a.size() - i) != (b.size() - j)) return a.size() - i < b.size() - j;
  return a < b;
}

std::vector<std::string> split_dots(const std::string& s) {
  std::vector<std::string> out(1);
  for (char c : s) {
    if (c == '.')
      out.emplace_back();
    else
      out.back().push_back(c);
  }
  return out;
}

// Known module names in their usual execution order (attention before MLP,
// q/k/v/o, gate/up/down); -1 when unknown.
int component_rank(const std::string& c) {
  static const std::map<std::string, int> kRank = {
      {"self_attn", 0}, {"attn", 0},    {"attention", 0}, {"cross_attn", 1},   {"mlp", 2},
      {"ffn", 2},       {"feed_forward", 2}, {"q_proj", 10}, {"k_proj", 11}, {"v_proj", 12},
      {"o_proj", 13},   {"gate_proj", 20}, {"up_proj", 21},  {"down_proj", 22}};
  auto it = kRank.find(c);
  return it == kRank.end() ? -1 : it->second;
}

bool looks_like_embedding(const std::string& prefix);

// Approximate execution order of checkpoint layers: embeddings first, the LM
// head last, otherwise component-wise natural order with known module names
// (component_rank) in execution order.
bool execution_less(const std::string& a, const std::string& b) {
  auto top = [](const std::string& n) {
    if (looks_like_embedding(n)) return 0;
    if (n == "lm_head" || (n.size() > 8 && n.compare(n.size() - 8, 8, ".lm_head") == 0)) return 2;
    return 1;
  };
  int ta = top(a), tb = top(b);
  if (ta != tb) return ta < tb;
  std::vector<std::string> ca = split_dots(a), cb = split_dots(b);
  for (size_t i = 0; i < std::min(ca.size(), cb.size()); ++i) {
    if (ca[i] == cb[i]) continue;
    int ra = component_rank(ca[i]), rb = component_rank(cb[i]);
    if (ra >= 0 && rb >= 0 && ra != rb) return ra < rb;
    return natural_less(ca[i], cb[i]);
  }
  if (ca.size() != cb.size()) return ca.size() < cb.size();
  return a < b;
}

bool looks_like_embedding(const std::string& prefix) {
  std::string last = prefix.substr(prefix.rfind('.') == std::string::npos ? 0 : prefix.rfind('.') + 1);
  std::transform(last.begin(), last.end(), last.begin(), [](unsigned char c) { return std::tolower(c); });
  return last.find("embed") != std::string::npos || last == "wte" || last == "wpe" || last == "token_embd";
}

}  // namespace

ModelDescription describe_checkpoint(const Checkpoint& ck) {
  ModelDescription m;
  m.name = ck.path;
  m.files = ck.files;
  std::map<std::string, const TensorInfo*> by_name;
  for (const auto& t : ck.tensors) by_name[t.name] = &t;
  std::set<std::string> used;
  std::vector<ModelLayer> layers;
  // Mixture of experts: every tensor under "<prefix>.experts." (per expert,
  // "experts.7.gate_proj.weight", or fused, "experts.gate_up_proj") joins the
  // group "<prefix>.experts", as offload() streams transformers' *Experts
  // modules (docs/design/torch-glue.md "Tensor groups").
  std::map<std::string, ModelLayer> groups;
  for (const auto& t : ck.tensors) {
    const size_t at = t.name.find(".experts.");
    if (at == std::string::npos) continue;
    ModelLayer& g = groups[t.name.substr(0, at + 8)];
    if (!g.group) {
      g.name = t.name.substr(0, at + 8);
      g.group = true;
      g.weight_dtype = t.dtype;
    }
    g.group_bytes += t.nbytes;
    g.group_params += t.numel;
    g.group_tensors.emplace_back(t.shape, t.dtype);
    used.insert(t.name);
  }
  // torch's nn.MultiheadAttention ("<prefix>.in_proj_weight", or separate
  // "q/k/v_proj_weight", and "<prefix>.out_proj.weight"): one group of all its
  // tensors, its out_proj's included, as offload() streams the module (its
  // forward reads them directly).
  for (const auto& t : ck.tensors) {
    std::string prefix;
    for (const char* s : {".in_proj_weight", ".q_proj_weight"}) {
      const std::string suf = s;
      if (t.name.size() > suf.size() && t.name.compare(t.name.size() - suf.size(), suf.size(), suf) == 0)
        prefix = t.name.substr(0, t.name.size() - suf.size());
    }
    if (prefix.empty() || used.count(t.name) || !by_name.count(prefix + ".out_proj.weight")) continue;
    ModelLayer g;
    g.name = prefix;
    g.group = true;
    g.weight_dtype = t.dtype;
    for (const char* s : {".in_proj_weight", ".q_proj_weight", ".k_proj_weight", ".v_proj_weight", ".in_proj_bias",
                          ".bias_k", ".bias_v", ".out_proj.weight", ".out_proj.bias"}) {
      auto it = by_name.find(prefix + s);
      if (it == by_name.end() || used.count(it->first)) continue;
      g.group_bytes += it->second->nbytes;
      g.group_params += it->second->numel;
      g.group_tensors.emplace_back(it->second->shape, it->second->dtype);
      used.insert(it->first);
    }
    groups[prefix] = std::move(g);
  }
  for (auto& [name, g] : groups) layers.push_back(std::move(g));
  for (const auto& t : ck.tensors) {
    if (used.count(t.name)) continue;
    const std::string suffix = ".weight";
    if (t.shape.size() < 2 || t.name.size() <= suffix.size() ||
        t.name.compare(t.name.size() - suffix.size(), suffix.size(), suffix) != 0)
      continue;
    ModelLayer l;
    l.name = t.name.substr(0, t.name.size() - suffix.size());
    l.weight_shape = t.shape;
    l.weight_dtype = t.dtype;
    used.insert(t.name);
    auto b = by_name.find(l.name + ".bias");
    if (b != by_name.end()) {
      l.bias_numel = b->second->numel;
      l.bias_dtype = b->second->dtype;
      used.insert(b->first);
    }
    // A table: an embedding-like name, a 2-D weight and no bias (Flux's
    // "x_embedder" and "context_embedder" are Linear layers with biases).
    l.embedding = looks_like_embedding(l.name) && t.shape.size() == 2 && l.bias_dtype.empty();
    layers.push_back(std::move(l));
  }
  std::stable_sort(layers.begin(), layers.end(),
                   [](const ModelLayer& a, const ModelLayer& b) { return execution_less(a.name, b.name); });
  m.layers = std::move(layers);
  for (const auto& t : ck.tensors) {
    if (used.count(t.name)) continue;
    m.small_bytes += t.nbytes;
    ++m.small_tensors;
  }
  return m;
}

ModelDescription describe_gguf(const GgufFile& g, const std::string& dense_dtype) {
  LS_CHECK(safetensors_dtype_is_wide_float(dense_dtype), "the dense dtype of GGUF weights must be F32, BF16 or "
           "F16 (the model's parameter dtype), got ", json::quote(dense_dtype));
  Checkpoint ck;
  ck.path = g.path;
  ck.files = {g.path};
  for (const auto& t : g.tensors) {
    const bool plain = safetensors_dtype_bits(t.type_name) > 0;
    LS_CHECK(plain || ggml_type_format(t.type) != quant::Format::None, g.path, ": tensor '", t.name,
             "' is GGUF type ", t.type_name, ", which layerstream cannot read");
    TensorInfo i;
    i.name = t.name;
    // llama.cpp's expert tensors ("blk.7.ffn_up_exps.weight"): one group per
    // block, "blk.7.experts", as load_gguf(rename="llama.cpp") puts them into
    // transformers' experts module, which offload() streams as one group.
    const std::string exps = "_exps.weight";
    const size_t ffn = t.name.find(".ffn_");
    if (t.name.rfind("blk.", 0) == 0 && ffn != std::string::npos && t.name.size() > exps.size() &&
        t.name.compare(t.name.size() - exps.size(), exps.size(), exps) == 0)
      i.name = t.name.substr(0, ffn) + ".experts." + t.name.substr(ffn + 1, t.name.size() - ffn - 1 - 7);
    i.dtype = t.type_name;
    i.shape = t.shape;
    i.numel = t.numel;
    i.nbytes = t.nbytes;
    i.file = g.path;
    ck.tensors.push_back(std::move(i));
  }
  ModelDescription m = describe_checkpoint(ck);
  const auto packed = [](const std::string& dtype) { return safetensors_dtype_bits(dtype) == 0; };
  // The share of experts one token runs, from the file (<arch>.expert_used_count / expert_count).
  double active = 1.0;
  const auto arch = g.metadata.find("general.architecture");
  if (arch != g.metadata.end()) {
    const auto number = [&](const std::string& key) {
      const auto it = g.metadata.find(arch->second + "." + key);
      char* end = nullptr;
      const double v = it == g.metadata.end() ? 0.0 : std::strtod(it->second.c_str(), &end);
      return it != g.metadata.end() && end != it->second.c_str() && *end == '\0' && v > 0 ? v : 0.0;
    };
    const double used = number("expert_used_count"), count = number("expert_count");
    if (used > 0 && count >= used) active = used / count;
  }
  for (auto& l : m.layers) {
    if (l.group) {
      // Tensors in a GGUF block type stay packed (load_gguf) and are
      // dequantized in the slot to dense_dtype; group_bytes is the dense
      // (resident) size.
      l.group_bytes = 0;
      for (const auto& [shape, dtype] : l.group_tensors) {
        if (packed(dtype)) l.dense_dtype = dense_dtype;
        l.group_bytes += bytes_of(numel_of(shape), packed(dtype) ? dense_dtype : dtype);
      }
      if (packed(l.weight_dtype)) l.weight_dtype = dense_dtype;
      l.active = active;
    } else if (packed(l.weight_dtype)) {
      if (l.embedding) l.weight_dtype = dense_dtype;  // dequantized on load
      else l.dense_dtype = dense_dtype;
    }
    if (!l.bias_dtype.empty() && packed(l.bias_dtype)) l.bias_dtype = dense_dtype;
  }
  return m;
}

std::string add_tied_head(ModelDescription& m, const std::string& config_json, const std::string& what) {
  const json::Value cfg = json::parse(config_json, what);
  if (!cfg.is_object()) return "";
  const auto last_part = [](const std::string& n) { return n.substr(n.rfind('.') == std::string::npos ? 0 : n.rfind('.') + 1); };
  for (const auto& l : m.layers)
    if (last_part(l.name) == "lm_head" || !l.tied_to.empty()) return "";  // the head is there
  // tie_word_embeddings: top level, else in text_config (multimodal configs).
  const json::Value* tie = cfg.find("tie_word_embeddings");
  const json::Value* text = cfg.find("text_config");
  if ((tie == nullptr || !tie->is_bool()) && text != nullptr && text->is_object()) tie = text->find("tie_word_embeddings");
  bool tied = false;
  if (tie != nullptr && tie->is_bool()) {
    tied = tie->boolean;
  } else if (const json::Value* archs = cfg.find("architectures"); archs != nullptr && archs->is_array()) {
    for (const auto& a : archs->array) {
      if (!a.is_string()) continue;
      for (const char* suffix : {"ForCausalLM", "LMHeadModel", "ForConditionalGeneration"}) {
        const std::string sfx = suffix;
        if (a.text.size() >= sfx.size() && a.text.compare(a.text.size() - sfx.size(), sfx.size(), sfx) == 0)
          tied = true;
      }
    }
  }
  if (!tied) return "";
  uint64_t vocab = 0;
  const json::Value* v = cfg.find("vocab_size");
  if ((v == nullptr || !v->is_number()) && text != nullptr && text->is_object()) v = text->find("vocab_size");
  const bool know_vocab = v != nullptr && v->to_uint64(vocab);
  const ModelLayer* table = nullptr;
  for (const auto& l : m.layers) {
    const std::string last = last_part(l.name);
    if (!l.embedding || l.weight_shape.size() != 2) continue;
    if (last != "embed_tokens" && last != "wte" && last != "word_embeddings" && last != "shared") continue;
    if (know_vocab && l.weight_shape[0] != vocab) continue;
    if (table == nullptr) table = &l;
  }
  if (table == nullptr) return "";
  ModelLayer head;
  head.name = "lm_head";
  head.weight_shape = table->weight_shape;
  head.weight_dtype = table->weight_dtype;
  head.tied_to = table->name;
  const std::string name = table->name;
  m.layers.push_back(std::move(head));  // last in execution order
  return name;
}

double set_expert_activity(ModelDescription& m, const std::string& config_json, const std::string& what) {
  const json::Value cfg = json::parse(config_json, what);
  if (!cfg.is_object()) return 0.0;
  const json::Value* text = cfg.find("text_config");
  auto number = [&](const char* key) -> double {
    for (const json::Value* c : {&cfg, text}) {
      if (c == nullptr || !c->is_object()) continue;
      uint64_t v = 0;
      if (const json::Value* x = c->find(key); x != nullptr && x->to_uint64(v) && v > 0) return static_cast<double>(v);
    }
    return 0.0;
  };
  const double k = number("num_experts_per_tok");
  double e = number("num_experts");
  if (e == 0.0) e = number("num_local_experts");
  if (e == 0.0) e = number("n_routed_experts");
  if (k == 0.0 || e == 0.0 || k > e) return 0.0;
  bool any = false;
  for (auto& l : m.layers)
    if (l.group) {
      l.active = k / e;
      any = true;
    }
  return any ? k / e : 0.0;
}

namespace {

struct Builder {
  ModelDescription m;
  std::string dtype;
  void linear(const std::string& name, uint64_t out, uint64_t in, bool bias) {
    ModelLayer l;
    l.name = name;
    l.weight_shape = {out, in};
    l.weight_dtype = dtype;
    if (bias) {
      l.bias_numel = out;
      l.bias_dtype = dtype;
    }
    m.layers.push_back(std::move(l));
  }
  void embedding(const std::string& name, uint64_t rows, uint64_t dim) {
    linear(name, rows, dim, false);
    m.layers.back().embedding = true;
  }
  void small(uint64_t numel, int count = 1) {
    m.small_bytes += bytes_of(numel, dtype) * static_cast<uint64_t>(count);
    m.small_tensors += static_cast<size_t>(count);
  }
};

ModelDescription gpt2(const std::string& name, uint64_t d, int n_layers) {
  Builder b;
  b.m.name = name;
  b.dtype = "F32";
  b.embedding("transformer.wte", 50257, d);
  b.embedding("transformer.wpe", 1024, d);
  for (int i = 0; i < n_layers; ++i) {
    std::string p = "transformer.h." + std::to_string(i) + ".";
    b.small(d, 2);  // ln_1 weight + bias
    b.linear(p + "attn.c_attn", 3 * d, d, true);
    b.linear(p + "attn.c_proj", d, d, true);
    b.small(d, 2);  // ln_2
    b.linear(p + "mlp.c_fc", 4 * d, d, true);
    b.linear(p + "mlp.c_proj", d, 4 * d, true);
  }
  b.small(d, 2);  // ln_f
  b.linear("lm_head", 50257, d, false);
  b.m.layers.back().tied_to = "transformer.wte";  // tied: it streams wte's host copy
  return b.m;
}

ModelDescription llama(const std::string& name, uint64_t d, int n_layers, uint64_t ff, uint64_t kv_dim,
                       uint64_t vocab) {
  Builder b;
  b.m.name = name;
  b.dtype = "BF16";
  b.embedding("model.embed_tokens", vocab, d);
  for (int i = 0; i < n_layers; ++i) {
    std::string p = "model.layers." + std::to_string(i) + ".";
    b.small(d);  // input_layernorm
    b.linear(p + "self_attn.q_proj", d, d, false);
    b.linear(p + "self_attn.k_proj", kv_dim, d, false);
    b.linear(p + "self_attn.v_proj", kv_dim, d, false);
    b.linear(p + "self_attn.o_proj", d, d, false);
    b.small(d);  // post_attention_layernorm
    b.linear(p + "mlp.gate_proj", ff, d, false);
    b.linear(p + "mlp.up_proj", ff, d, false);
    b.linear(p + "mlp.down_proj", d, ff, false);
  }
  b.small(d);  // model.norm
  b.linear("lm_head", vocab, d, false);
  return b.m;
}

ModelDescription flux_dev() {
  const uint64_t h = 3072, mlp = 12288;
  Builder b;
  b.m.name = "flux-dev";
  b.dtype = "BF16";
  b.linear("img_in", h, 64, true);
  b.linear("time_in.in_layer", h, 256, true);
  b.linear("time_in.out_layer", h, h, true);
  b.linear("guidance_in.in_layer", h, 256, true);
  b.linear("guidance_in.out_layer", h, h, true);
  b.linear("vector_in.in_layer", h, 768, true);
  b.linear("vector_in.out_layer", h, h, true);
  b.linear("txt_in", h, 4096, true);
  for (int i = 0; i < 19; ++i) {
    std::string p = "double_blocks." + std::to_string(i) + ".";
    for (const char* s : {"img", "txt"}) {
      std::string q = p + s;
      b.linear(q + "_mod.lin", 6 * h, h, true);
      b.linear(q + "_attn.qkv", 3 * h, h, true);
      b.small(128, 2);  // q/k norm scales
      b.linear(q + "_attn.proj", h, h, true);
      b.linear(q + "_mlp.0", mlp, h, true);
      b.linear(q + "_mlp.2", h, mlp, true);
    }
  }
  for (int i = 0; i < 38; ++i) {
    std::string p = "single_blocks." + std::to_string(i) + ".";
    b.linear(p + "modulation.lin", 3 * h, h, true);
    b.linear(p + "linear1", 3 * h + mlp, h, true);
    b.small(128, 2);
    b.linear(p + "linear2", h, h + mlp, true);
  }
  b.linear("final_layer.adaLN_modulation.1", 2 * h, h, true);
  b.linear("final_layer.linear", 64, h, true);
  return b.m;
}

// Qwen3-30B-A3B (transformers' layout): 48 layers of GQA attention (32 query
// heads, 4 key/value heads of 128) and a mixture of 128 experts of width 768,
// 8 per token, fused as transformers holds them (gate_up_proj [experts,
// 2 * 768, 2048], down_proj [experts, 2048, 768]): one tensor group each.
ModelDescription qwen3_30b_a3b() {
  const uint64_t d = 2048, q = 32 * 128, kv = 4 * 128, experts = 128, inter = 768, vocab = 151936;
  Builder b;
  b.m.name = "qwen3-30b-a3b";
  b.dtype = "BF16";
  b.embedding("model.embed_tokens", vocab, d);
  for (int i = 0; i < 48; ++i) {
    std::string p = "model.layers." + std::to_string(i) + ".";
    b.small(d);  // input_layernorm
    b.linear(p + "self_attn.q_proj", q, d, false);
    b.linear(p + "self_attn.k_proj", kv, d, false);
    b.linear(p + "self_attn.v_proj", kv, d, false);
    b.small(128, 2);  // q_norm, k_norm
    b.linear(p + "self_attn.o_proj", d, q, false);
    b.small(d);  // post_attention_layernorm
    b.linear(p + "mlp.gate", experts, d, false);  // the router
    ModelLayer g;
    g.name = p + "mlp.experts";
    g.group = true;
    g.weight_dtype = b.dtype;
    g.group_tensors = {{{experts, 2 * inter, d}, b.dtype}, {{experts, d, inter}, b.dtype}};
    g.group_params = experts * 3 * inter * d;
    g.group_bytes = bytes_of(g.group_params, b.dtype);
    g.active = 8.0 / 128.0;
    b.m.layers.push_back(std::move(g));
  }
  b.small(d);  // model.norm
  b.linear("lm_head", vocab, d, false);
  return b.m;
}

}  // namespace

std::vector<std::string> builtin_model_names() {
  return {"gpt2-small", "gpt2-xl", "llama-7b", "llama-13b", "llama-70b", "flux-dev", "qwen3-30b-a3b"};
}

ModelDescription builtin_model(const std::string& name) {
  if (name == "gpt2-small") return gpt2(name, 768, 12);
  if (name == "gpt2-xl") return gpt2(name, 1600, 48);
  if (name == "llama-7b") return llama(name, 4096, 32, 11008, 4096, 32000);
  if (name == "llama-13b") return llama(name, 5120, 40, 13824, 5120, 32000);
  if (name == "llama-70b") return llama(name, 8192, 80, 28672, 1024, 32000);
  if (name == "flux-dev") return flux_dev();
  if (name == "qwen3-30b-a3b") return qwen3_30b_a3b();
  std::string names;
  for (const auto& n : builtin_model_names()) names += (names.empty() ? "" : ", ") + n;
  LS_FAIL("unknown model ", json::quote(name), " (built-in models: ", names, ")");
}

}  // namespace layerstream
