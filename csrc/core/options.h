// layerstream — the rules for user options, in one place.
//
// Python's offload(), the C++ EngineOptions/OffloadOptions and the command
// line all validate through these functions, so an option means the same
// and fails with the same message everywhere. Each check returns the value
// it accepted or throws layerstream::Error with a sentence that says what to
// change. Torch-free; thread-safe (no state).
#pragma once

#include <cstdint>
#include <string>

#include <optional>

#include "quant.h"

namespace layerstream::options {

// Most layers kept in flight ahead of use. A deeper prefetch only holds more
// slots: with weights copied in layer order, one layer ahead hides a copy
// as long as the copy is shorter than a layer's compute.
constexpr int64_t kMaxPrefetch = 64;
// Most device slots (a slot holds one layer's weights).
constexpr int64_t kMaxSlots = kMaxPrefetch + 2;  // (prefetch + 1, and one spare for slots=)

// A device budget: a byte count, or a share of the device's free memory
// ("auto" is kAutoFraction of it).
struct Budget {
  bool fraction = false;
  uint64_t bytes = 0;  // when !fraction
  double share = 0;    // when fraction: in (0, 1]
};
constexpr double kAutoFraction = 0.6;

// Text: "auto", "40%", or a size ("12GiB", "500MB", "1.5e9", "123"; see
// parse_bytes in planner.h: whole bytes, so "0.5" is refused and names "50%").
Budget parse_budget(const std::string& text);
// Whether `text` is a budget form that takes a share of free device memory
// ("auto" or a percentage) rather than a byte count: parse_budget's test, for
// callers that know no device (the command line's plan and demo take byte
// counts only).
bool names_share(const std::string& text);
// A number (Python's int or float): 0 < value < 1 is a share of free device
// memory; otherwise a whole, non-negative byte count below 2^63.
Budget budget_from_number(double value);

// The bytes of a budget on a device with `free_bytes` free: the byte count,
// or the share of free_bytes (rounded down).
uint64_t budget_bytes(const Budget& budget, uint64_t free_bytes);

// prefetch in [0, kMaxPrefetch]; slots in [2, kMaxSlots], or 0 (automatic)
// where the caller represents "unset" that way (C++ EngineOptions; Python
// uses None and passes zero_is_auto = false).
int check_prefetch(int64_t prefetch);
int check_slots(int64_t slots, bool zero_is_auto = true);
// Slots when `slots` is unset: one in use and `prefetch` in flight (at least
// 2), capped by the budget; the planner reserves as many (plan_slots_first).
constexpr int default_slots(int prefetch) { return prefetch + 1 > 2 ? prefetch + 1 : 2; }
// The simulated link: bandwidth in GB/s (10^9 bytes/s), finite and >= 0 (0:
// no link model, copies take no modelled time); latency in microseconds,
// finite and >= 0. `what` names the option in the message.
double check_link_gbps(double gbps, const char* what = "sim_link_gbps");
double check_latency_us(double us, const char* what = "sim_latency_us");
// A C++ budget in bytes: -1 (none) or >= 0.
int64_t check_budget_bytes(int64_t bytes);

// EngineOptions' host-memory fields (each names itself in the message):
// a cap in bytes is -1 (no cap) or >= 0 (store_pinned_cap,
// activation_host_cap, activation_pinned_cap, grad_staging_pinned_cap);
// staging_bytes and activation_min_bytes are byte counts >= 0 (staging_bytes
// 0: what the layers read through the staging entries need at least);
// reader_threads is >= 1 (threads reading one layer from disk, the calling
// thread included).
int64_t check_byte_cap(int64_t bytes, const char* what);
int64_t check_staging_bytes(int64_t bytes);
int64_t check_activation_min_bytes(int64_t bytes);
int check_reader_threads(int64_t threads);

// dequant_dtype and compute_dtype: "" (none: each weight's own dtype) or a
// float dtype ("float32", "bfloat16", "float16"; quant::parse_out_dtype's
// spellings). compute_dtype implies dequant_dtype (quantized weights are
// dequantized to it); both given must agree. Returns the effective pair.
struct Dtypes {
  std::optional<quant::OutDtype> dequant, compute;
};
Dtypes check_dtypes(const std::string& dequant_dtype, const std::string& compute_dtype);

// process_group: the group offload() works over (held weakly, in C++ and in
// Python) must still exist when it is used; `alive` false fails, naming it.
void check_group_alive(bool alive, const std::string& group_name);

}  // namespace layerstream::options
