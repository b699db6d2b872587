// layerstream core — the placement planner: parsing and printing sizes, the plan as text and JSON
// (planner.h; the files: docs/design/README.md).
#include "planner.h"
#include "planner_impl.h"
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <numeric>
#include <set>

#include "error.h"
#include "slot_layout.h"
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

std::string format_seconds(double s) {
  char buf[32];
  if (s == 0.0)
    return "0 s";
  else if (s < 1e-3)
    std::snprintf(buf, sizeof buf, "%.1f us", s * 1e6);
  else if (s < 1.0)
    std::snprintf(buf, sizeof buf, "%.2f ms", s * 1e3);
  else if (s < 1e6)
    std::snprintf(buf, sizeof buf, "%.3f s", s);
  else  // a day and a half or more (an absurd --link-gbps): the unit must survive the buffer
    std::snprintf(buf, sizeof buf, "%.3g s", s);
  return buf;
}

std::string json_number(double v) {
  if (!std::isfinite(v)) return "null";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}

std::string Plan::explain(bool host_budget) const {
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
                  device_flops_per_s > 0 ? format_seconds(l.compute_s).c_str() : "-",
                  l.resident || !has_time ? "-" : format_seconds(l.transfer_s).c_str());
    out += buf;
  }
  out += "\n";
  double pct = budget_bytes ? 100.0 * static_cast<double>(device_bytes) / static_cast<double>(budget_bytes) : 0.0;
  const std::string train = train_bytes ? " + gradients and optimizer states " + format_bytes(train_bytes) : "";
  std::snprintf(buf, sizeof buf,
                "device memory:            %s = resident layers %s + small tensors %s%s + %d slots x %s "
                "(%.1f%% of budget %s)\n",
                format_bytes(device_bytes).c_str(), format_bytes(resident_bytes).c_str(),
                format_bytes(fixed_resident_bytes).c_str(), train.c_str(), num_slots, format_bytes(slot_bytes).c_str(),
                pct, format_bytes(budget_bytes).c_str());
  out += buf;
  const std::string tables = num_lookup ? " + " + std::to_string(num_lookup) + " looked-up tables" : "";
  if (host_budget)
    std::snprintf(buf, sizeof buf,
                  "host RAM needed (pinned): %s without a host budget (%zu streamed layers%s, all in RAM); "
                  "under the host budget: see the host lines below\n",
                  format_bytes(host_pinned_bytes).c_str(), num_streamed, tables.c_str());
  else
    std::snprintf(buf, sizeof buf, "host RAM needed (pinned): %s (%zu streamed layers%s)\n",
                  format_bytes(host_pinned_bytes).c_str(), num_streamed, tables.c_str());
  out += buf;
  std::snprintf(buf, sizeof buf, "slots:                    %d of %s, prefetch depth %d\n", num_slots,
                format_bytes(slot_bytes).c_str(), prefetch_depth);
  out += buf;
  for (const auto& l : layers) {
    if (l.tied_with < 0 || l.lookup || (!l.shares_weight && l.resident && l.resident_bytes == 0))
      continue;  // a table held by its resident tied layer: said on that layer's line
    const std::string& other = layers[static_cast<size_t>(l.tied_with)].name;
    if (l.shares_weight)  // PlannerLayer::tied_layer: placed with `other`, whose bytes hold the weight
      out += "tied weights:             " + l.name + (l.resident ? " is resident with " : " streams with ") + other +
             ", whose weight it shares (counted once)\n";
    else
      out += "tied weights:             " + l.name + (l.resident ? " is resident, and " + other + " with it"
                                                                 : " streams the host copy of " + other +
                                                                       " (counted once)") + "\n";
  }
  if (activation_bytes_per_step) {
    std::snprintf(buf, sizeof buf,
                  "saved activations:        %s per step to the host in the forward and back in the backward "
                  "(device->host and host->device)\n",
                  format_bytes(activation_bytes_per_step).c_str());
    out += buf;
  }
  if (has_time && device_flops_per_s <= 0) {
    std::snprintf(buf, sizeof buf,
                  "predicted copy time:      %s per step over the %g GB/s link (%s per step%s); compute not "
                  "modelled (no device FLOP/s)\n",
                  format_seconds(transfer_time_s).c_str(), link_bytes_per_s / 1e9,
                  format_bytes(bus_bytes_per_step).c_str(), training ? ", training" : "");
  } else if (has_time) {
    std::snprintf(buf, sizeof buf,
                  "predicted step time:      %s steady state (first step %s); compute %s, transfer %s "
                  "(%s per step over the link), stalls %s -> %s-bound%s\n",
                  format_seconds(step_time_s).c_str(), format_seconds(first_step_time_s).c_str(),
                  format_seconds(compute_time_s).c_str(), format_seconds(transfer_time_s).c_str(),
                  format_bytes(bus_bytes_per_step).c_str(), format_seconds(stall_s()).c_str(), bound().c_str(),
                  training ? " (training)" : "");
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
  num("train_bytes", train_bytes);
  num("slot_bytes", slot_bytes);
  num("num_slots", static_cast<uint64_t>(num_slots));
  num("prefetch_depth", static_cast<uint64_t>(prefetch_depth));
  num("host_pinned_bytes", host_pinned_bytes);
  num("bus_bytes_per_step", bus_bytes_per_step);
  num("activation_bytes_per_step", activation_bytes_per_step);
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
    if (l.train_bytes) num("train_bytes", l.train_bytes);
    dbl("flops", l.flops);
    dbl("compute_s", l.compute_s);
    dbl("transfer_s", l.transfer_s, false);
    o += "}";
  }
  o += "]}";
  return o;
}

}  // namespace layerstream
