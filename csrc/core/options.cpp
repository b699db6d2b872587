#include "core/options.h"

#include <cctype>
#include <cmath>
#include <string>

#include "core/error.h"
#include "core/planner.h"

namespace layerstream::options {

namespace {
std::string trimmed_lower(const std::string& s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  std::string out;
  for (size_t i = b; i < e; ++i) out.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(s[i]))));
  return out;
}
}  // namespace

bool names_share(const std::string& text) {
  const std::string t = trimmed_lower(text);
  return t == "auto" || (!t.empty() && t.back() == '%');
}

Budget parse_budget(const std::string& text) {
  const std::string t = trimmed_lower(text);
  Budget b;
  if (t == "auto") {
    b.fraction = true;
    b.share = kAutoFraction;
    return b;
  }
  if (names_share(text)) {  // not "auto": a percentage
    const std::string number = t.substr(0, t.size() - 1);
    char* end = nullptr;
    const double pct = std::strtod(number.c_str(), &end);
    LS_CHECK(!number.empty() && end == number.c_str() + number.size() && std::isfinite(pct) && pct > 0 &&
                 pct <= 100,
             "budget '", text, "': a share of free device memory must be a number in (0, 100] followed by %, "
             "e.g. '40%'");
    b.fraction = true;
    b.share = pct / 100.0;
    return b;
  }
  try {
    b.bytes = parse_bytes(text);
  } catch (const Error& e) {
    const bool fractional_count = t.find_first_not_of("0123456789.") == std::string::npos &&
                                  t.find('.') != std::string::npos;
    LS_FAIL("budget: ", e.message(),
            fractional_count ? " (a size without a unit counts bytes; for a share of free device memory "
                               "write a percentage, e.g. '50%', or pass the number 0.5)"
                             : " (or 'auto', or a percentage such as '40%')");
  }
  LS_CHECK(b.bytes < (uint64_t{1} << 63), "budget '", text, "' is too large (at most 2^63 - 1 bytes)");
  return b;
}

Budget budget_from_number(double value) {
  LS_CHECK(std::isfinite(value), "budget must be a finite number of bytes or a share in (0, 1), got ", value);
  LS_CHECK(value >= 0, "budget must be >= 0 bytes, got ", value);
  Budget b;
  if (value > 0 && value < 1) {
    b.fraction = true;
    b.share = value;
    return b;
  }
  LS_CHECK(value < 9223372036854775808.0, "budget of ", value, " bytes is too large (at most 2^63 - 1 bytes)");
  LS_CHECK(std::floor(value) == value, "budget of ", value, " bytes is not a whole number of bytes (a number "
           "in (0, 1) is a share of free device memory)");
  b.bytes = static_cast<uint64_t>(value);
  return b;
}

int check_prefetch(int64_t prefetch) {
  LS_CHECK(prefetch >= 0 && prefetch <= kMaxPrefetch, "prefetch must be in [0, ", kMaxPrefetch,
           "] (layers in flight ahead of use), got ", prefetch);
  return static_cast<int>(prefetch);
}

int check_slots(int64_t slots, bool zero_is_auto) {
  LS_CHECK((zero_is_auto && slots == 0) || (slots >= 2 && slots <= kMaxSlots), "slots must be in [2, ", kMaxSlots,
           "] (or unset: prefetch + 1, at least 2, capped by the budget), got ", slots);
  return static_cast<int>(slots);
}

double check_link_gbps(double gbps, const char* what) {
  LS_CHECK(std::isfinite(gbps) && gbps >= 0, what, " must be a finite bandwidth in GB/s >= 0 (0: copies take no "
           "modelled time), got ", gbps);
  return gbps;
}

double check_latency_us(double us, const char* what) {
  LS_CHECK(std::isfinite(us) && us >= 0, what, " must be a finite latency in microseconds >= 0, got ", us);
  return us;
}

int64_t check_budget_bytes(int64_t bytes) {
  LS_CHECK(bytes >= -1, "budget_bytes must be -1 (no budget) or a byte count >= 0, got ", bytes);
  return bytes;
}

int64_t check_byte_cap(int64_t bytes, const char* what) {
  LS_CHECK(bytes >= -1, what, " must be -1 (no cap) or a byte count >= 0, got ", bytes);
  return bytes;
}

int64_t check_staging_bytes(int64_t bytes) {
  LS_CHECK(bytes >= 0, "staging_bytes must be a byte count >= 0 (0: what the layers read through the staging "
           "entries need at least), got ", bytes);
  return bytes;
}

int64_t check_activation_min_bytes(int64_t bytes) {
  LS_CHECK(bytes >= 0, "activation_min_bytes must be a byte count >= 0 (saved tensors smaller than it stay on "
           "the device; 0: none does), got ", bytes);
  return bytes;
}

int check_reader_threads(int64_t threads) {
  LS_CHECK(threads >= 1 && threads <= INT32_MAX, "reader_threads must be >= 1 (threads reading one layer from "
           "disk, the calling thread included; 1: that thread alone), got ", threads);
  return static_cast<int>(threads);
}

uint64_t budget_bytes(const Budget& budget, uint64_t free_bytes) {
  if (!budget.fraction) return budget.bytes;
  return static_cast<uint64_t>(static_cast<long double>(free_bytes) * static_cast<long double>(budget.share));
}

Dtypes check_dtypes(const std::string& dequant_dtype, const std::string& compute_dtype) {
  auto parse = [](const std::string& text, const char* what) -> std::optional<quant::OutDtype> {
    if (text.empty()) return std::nullopt;
    try {
      return quant::parse_out_dtype(text);
    } catch (const Error& e) {
      LS_FAIL(what, " must be float32, bfloat16 or float16 (or none: each weight's own dtype), got '", text, "'");
    }
  };
  Dtypes d;
  d.dequant = parse(dequant_dtype, "dequant_dtype");
  d.compute = parse(compute_dtype, "compute_dtype");
  if (d.compute) {
    LS_CHECK(!d.dequant || *d.dequant == *d.compute, "dequant_dtype '", dequant_dtype, "' and compute_dtype '",
             compute_dtype, "' disagree; compute_dtype alone is enough (quantized weights are then "
             "dequantized to it)");
    d.dequant = d.compute;
  }
  return d;
}

void check_group_alive(bool alive, const std::string& group_name) {
  LS_CHECK(alive, "the process group '", group_name, "' that offload() works over was destroyed "
           "(torch.distributed.destroy_process_group()); train before destroying it, or offload() again "
           "with the new group");
}

}  // namespace layerstream::options
