// layerstream — quantized weight formats: packing, reference dequantization,
// scalar conversions. See quant.h and docs/design/quant-formats.md.
#include "quant.h"

#include "lossless.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <exception>
#include <limits>
#include <thread>
#include <vector>

#include "error.h"
#include "gguf_blocks.h"
#include "quant_elements.h"

namespace layerstream {
namespace quant {

static_assert(static_cast<int>(Format::GgufQ8_0) == gguf::kQ8_0 && static_cast<int>(Format::GgufQ4_0) == gguf::kQ4_0 &&
                  static_cast<int>(Format::GgufQ4_1) == gguf::kQ4_1 && static_cast<int>(Format::GgufQ5_0) == gguf::kQ5_0 &&
                  static_cast<int>(Format::GgufQ5_1) == gguf::kQ5_1 && static_cast<int>(Format::GgufQ2_K) == gguf::kQ2_K &&
                  static_cast<int>(Format::GgufQ3_K) == gguf::kQ3_K && static_cast<int>(Format::GgufQ4_K) == gguf::kQ4_K &&
                  static_cast<int>(Format::GgufQ5_K) == gguf::kQ5_K && static_cast<int>(Format::GgufQ6_K) == gguf::kQ6_K,
              "quant::Format ids and gguf_blocks.h ids must agree");

const float kNF4Codes[16] = {
    -1.0f,
    -0.6961928009986877f,
    -0.5250730514526367f,
    -0.39491748809814453f,
    -0.28444138169288635f,
    -0.18477343022823334f,
    -0.09105003625154495f,
    0.0f,
    0.07958029955625534f,
    0.16093020141124725f,
    0.24611230194568634f,
    0.33791524171829224f,
    0.44070982933044434f,
    0.5626170039176941f,
    0.7229568362236328f,
    1.0f,
};

namespace {

using namespace elements;  // quant_elements.h

struct Fp8Table {
  float v[256];
  Fp8Table() {
    for (int i = 0; i < 256; ++i) v[i] = fp8_decode(static_cast<uint8_t>(i));
  }
};
const Fp8Table& fp8_table() {
  static const Fp8Table t;
  return t;
}

// Midpoints between adjacent NF4 codes, in double so the comparison with a
// float is exact: q = #midpoints strictly below x (ties go to the lower code).
struct NF4Mids {
  double m[15];
  NF4Mids() {
    for (int i = 0; i < 15; ++i)
      m[i] = (static_cast<double>(kNF4Codes[i]) + static_cast<double>(kNF4Codes[i + 1])) / 2.0;
  }
};
const NF4Mids& nf4_mids() {
  static const NF4Mids t;
  return t;
}

inline uint8_t nf4_nearest(float x, const double* mids) {
  // Branch-free binary search for #mids < x (mids ascending).
  const double d = x;
  int q = static_cast<int>(d > mids[7]) << 3;
  q += static_cast<int>(d > mids[q + 3]) << 2;
  q += static_cast<int>(d > mids[q + 1]) << 1;
  q += static_cast<int>(d > mids[q]);
  return static_cast<uint8_t>(q);
}

inline bool finite(float v) { return (f2u(v) & 0x7F800000u) != 0x7F800000u; }

int resolve_threads(int num_threads, int64_t units, int64_t elems) {
  int64_t t;
  if (num_threads > 0) {
    t = num_threads;
  } else {
    const unsigned hw = std::thread::hardware_concurrency();
    t = hw == 0 ? 1 : static_cast<int64_t>(hw);
    // Automatic choice: at least ~64K elements per thread.
    t = std::min<int64_t>(t, std::max<int64_t>(1, elems / 65536));
  }
  t = std::min<int64_t>(t, std::max<int64_t>(1, units));
  return static_cast<int>(std::max<int64_t>(1, t));
}

// Runs fn(begin, end) over [0, units) split into contiguous ranges, one per
// thread. fn returns the flat index of the first non-finite source element in
// its range, or -1. Returns the smallest such index over all ranges (-1 if none).
// Exceptions thrown by fn are rethrown (the first range's first).
template <class Fn>
int64_t parallel_ranges(int64_t units, int threads, const Fn& fn) {
  if (threads <= 1 || units <= 1) return fn(int64_t{0}, units);
  std::vector<int64_t> bad(static_cast<size_t>(threads), -1);
  std::vector<std::exception_ptr> errors(static_cast<size_t>(threads));
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(threads));
  const int64_t per = (units + threads - 1) / threads;
  for (int t = 0; t < threads; ++t) {
    const int64_t b = std::min<int64_t>(units, t * per);
    const int64_t e = std::min<int64_t>(units, b + per);
    pool.emplace_back([&, t, b, e] {
      try {
        bad[static_cast<size_t>(t)] = fn(b, e);
      } catch (...) {
        errors[static_cast<size_t>(t)] = std::current_exception();
      }
    });
  }
  for (auto& th : pool) th.join();
  for (auto& ep : errors)
    if (ep) std::rethrow_exception(ep);
  int64_t first = -1;
  for (int64_t b : bad)
    if (b >= 0 && (first < 0 || b < first)) first = b;
  return first;
}

struct Sections {
  uint8_t* data;
  float* scales;
  float* zeros;
};

// A row whose absmax is near FLT_MAX: absmax / top rounds up, and the top code
// times that scale overflowed to Inf on dequantization. One ulp less is enough
// (the top code then dequantizes a hair below absmax; docs/design/quant-formats.md).
float top_code_finite(float scale, float top) {
  return std::isinf(top * scale) ? std::nextafter(scale, 0.0f) : scale;
}

// pack_*'s failures: the flat index of the first non-finite source element, or
// this bit with the index of an int4 group's first element whose dequantized
// codes would overflow fp32.
constexpr int64_t kOverflowBit = int64_t{1} << 62;

template <class Load>
int64_t pack_int8_rows(const Load& ld, int64_t cols, const Sections& s, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t base = r * cols;
    float absmax = 0.0f;
    for (int64_t c = 0; c < cols; ++c) {
      const float v = ld(base + c);
      if (!finite(v)) return base + c;
      absmax = std::max(absmax, std::fabs(v));
    }
    const float scale = top_code_finite(absmax / 127.0f, 127.0f);
    s.scales[r] = scale;
    int8_t* q = reinterpret_cast<int8_t*>(s.data) + base;
    if (scale == 0.0f) {
      std::memset(q, 0, static_cast<size_t>(cols));
      continue;
    }
    for (int64_t c = 0; c < cols; ++c) {
      float x = ld(base + c) / scale;
      x = std::min(127.0f, std::max(-127.0f, x));
      q[c] = static_cast<int8_t>(rne_small(x));
    }
  }
  return -1;
}

template <class Load>
int64_t pack_fp8_rows(const Load& ld, int64_t cols, const Sections& s, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t base = r * cols;
    float absmax = 0.0f;
    for (int64_t c = 0; c < cols; ++c) {
      const float v = ld(base + c);
      if (!finite(v)) return base + c;
      absmax = std::max(absmax, std::fabs(v));
    }
    const float scale = top_code_finite(absmax / 448.0f, 448.0f);
    s.scales[r] = scale;
    uint8_t* q = s.data + base;
    if (scale == 0.0f) {
      std::memset(q, 0, static_cast<size_t>(cols));
      continue;
    }
    for (int64_t c = 0; c < cols; ++c) q[c] = fp8_encode(ld(base + c) / scale);
  }
  return -1;
}

template <class Load>
int64_t pack_nf4_blocks(const Load& ld, int64_t n, const Sections& s, int64_t b0, int64_t b1) {
  const double* mids = nf4_mids().m;
  uint8_t q[kNF4BlockSize];
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t base = b * kNF4BlockSize;
    // Clamped below too: b < b1 <= blocks keeps n - base > 0, but GCC 13
    // cannot see that and warns (-Wstringop-overflow) on the fill below.
    const int64_t count = std::clamp<int64_t>(n - base, 1, kNF4BlockSize);
    float absmax = 0.0f;
    for (int64_t i = 0; i < count; ++i) {
      const float v = ld(base + i);
      if (!finite(v)) return base + i;
      absmax = std::max(absmax, std::fabs(v));
    }
    s.scales[b] = absmax;
    if (absmax == 0.0f) {
      std::fill(q, q + count, uint8_t{7});  // code 7 is 0.0
    } else {
      for (int64_t i = 0; i < count; ++i) q[i] = nf4_nearest(ld(base + i) / absmax, mids);
    }
    uint8_t* out = s.data + base / 2;
    for (int64_t i = 0; i < count; i += 2) {
      const uint8_t lo = (i + 1 < count) ? q[i + 1] : uint8_t{0};
      out[i / 2] = static_cast<uint8_t>((q[i] << 4) | lo);
    }
  }
  return -1;
}

// Note [An int4 group that holds dequantized int4 values]
// int4's scale is range / 15 of the group's values. Values that detach() restored
// (dequantized into a bf16/fp16 weight, so rounded) quantized again got another scale:
// range / 15 of the rounded extremes is not the scale they came from, and a group whose
// codes spanned 14 steps (the zero point's rounding tied: a symmetric group) gets a
// grid of 15 steps over 14 of the old ones. Each detach()/offload() cycle, or a
// load_state_dict() of a detached model's state dict, changed weights. So when the
// usual packing does not give the group back exactly, one that does is looked for: a
// grid of 15, 14 or 13 steps over the range gives codes and a zero point, and the scales
// that round (q - zero) * scale to each value form an interval (between the midpoints to
// the value's neighbours in its dtype, over q - zero); where the group's intervals meet,
// their middle (or an fp32 next to it) is tried, and kept when dequantizing with it
// gives every value back bit for bit. Other weights leave the intersection empty
// within a few elements and keep the usual packing
// (`QuantKnown.Int4DequantizedValuesQuantizeBackToThemselves`).
template <class Load>
bool int4_gives_back(const Load& ld, int64_t base, const uint8_t* q, float zero, float scale) {
  for (int64_t i = 0; i < kInt4GroupSize; ++i)
    if (f2u(Load::round((static_cast<float>(q[i]) - zero) * scale)) != f2u(ld(base + i))) return false;
  return true;
}

// A packing of the group that gives it back exactly, on a grid of `steps` steps over
// [mn, mx]: true with q, zero and scale set, or false (q clobbered).
template <class Load>
bool int4_exact_packing(const Load& ld, int64_t base, float mn, float mx, int steps, uint8_t* q, float& zero,
                        float& scale) {
  const float grid = static_cast<float>((static_cast<double>(mx) - static_cast<double>(mn)) / steps);
  const float z = std::min(15.0f, std::max(0.0f, rne_small(-mn / grid)));
  double lo = 0.0, hi = std::numeric_limits<double>::infinity();  // scales are positive
  for (int64_t i = 0; i < kInt4GroupSize; ++i) {
    const float v = ld(base + i);
    q[i] = static_cast<uint8_t>(std::min(15.0f, std::max(0.0f, rne_small(v / grid + z))));
    const double d = static_cast<double>(q[i]) - static_cast<double>(z);
    if (d == 0.0 && f2u(v) == 0u) continue;  // +0 for every scale
    if (d == 0.0 || v == 0.0f) return false;  // no scale gives it back
    const double a = (static_cast<double>(v) + Load::step(v, -1)) / 2, b = (static_cast<double>(v) + Load::step(v, 1)) / 2;
    const double below = v > 0.0f ? a : b, above = v > 0.0f ? b : a;  // (a dtype's bits grow away from zero)
    lo = std::max(lo, (d > 0 ? below : above) / d);
    hi = std::min(hi, (d > 0 ? above : below) / d);
    if (!(lo <= hi)) return false;  // (an end may be a tie that rounds to v)
  }
  // The middle, rounded to fp32, may fall outside an intersection a few ulps wide: its
  // neighbours are tried too.
  const float mid = static_cast<float>((lo + hi) / 2);
  for (int by : {0, -1, 1, -2, 2}) {
    const float sc = u2f(static_cast<uint32_t>(static_cast<int64_t>(f2u(mid)) + by));
    if (sc > 0.0f && int4_gives_back(ld, base, q, z, sc)) {
      zero = z;
      scale = sc;
      return true;
    }
  }
  return false;
}

template <class Load>
int64_t pack_int4_rows(const Load& ld, int64_t cols, const Sections& s, int64_t r0, int64_t r1) {
  const int64_t groups = cols / kInt4GroupSize;
  uint8_t q[kInt4GroupSize];
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t base = r * cols + g * kInt4GroupSize;
      float mn = 0.0f, mx = 0.0f;  // the range always includes 0
      for (int64_t i = 0; i < kInt4GroupSize; ++i) {
        const float v = ld(base + i);
        if (!finite(v)) return base + i;
        mn = std::min(mn, v);
        mx = std::max(mx, v);
      }
      // In double so that a range near ±FLT_MAX cannot overflow.
      float scale = static_cast<float>((static_cast<double>(mx) - static_cast<double>(mn)) / 15.0);
      float zero = 0.0f;
      if (scale == 0.0f) {
        std::fill(q, q + kInt4GroupSize, uint8_t{0});
      } else {
        zero = std::min(15.0f, std::max(0.0f, rne_small(-mn / scale)));
        for (int64_t i = 0; i < kInt4GroupSize; ++i) {
          const float x = rne_small(ld(base + i) / scale + zero);
          q[i] = static_cast<uint8_t>(std::min(15.0f, std::max(0.0f, x)));
          // A range near ±FLT_MAX: (q - zero) * scale, as dequantization computes it.
          if (std::isinf((static_cast<float>(q[i]) - zero) * scale)) return kOverflowBit | base;
        }
        if (!int4_gives_back(ld, base, q, zero, scale)) {
          uint8_t exact[kInt4GroupSize];
          for (int steps : {15, 14, 13}) {
            if (int4_exact_packing(ld, base, mn, mx, steps, exact, zero, scale)) {
              std::copy(exact, exact + kInt4GroupSize, q);
              break;
            }
          }
        }
      }
      s.scales[r * groups + g] = scale;
      s.zeros[r * groups + g] = zero;
      uint8_t* out = s.data + base / 2;
      for (int64_t i = 0; i < kInt4GroupSize; i += 2)
        out[i / 2] = static_cast<uint8_t>((q[i] << 4) | q[i + 1]);
    }
  }
  return -1;
}

template <class Load>
void pack_impl(const PackedLayout& L, const Load& ld, void* dst, int num_threads) {
  uint8_t* base = static_cast<uint8_t*>(dst);
  // Zero everything first: padding (between sections, the last nibble of an
  // odd nf4 tensor) must be deterministic.
  std::memset(base, 0, L.total_bytes());
  const Sections s{base + L.data_offset(), reinterpret_cast<float*>(base + L.scale_offset()),
                   reinterpret_cast<float*>(base + L.zero_offset())};
  const int64_t n = L.numel();
  if (n == 0) return;
  int64_t bad = -1;
  switch (L.format) {
    case Format::Int8: {
      const int t = resolve_threads(num_threads, L.rows, n);
      bad = parallel_ranges(L.rows, t, [&](int64_t a, int64_t b) {
        return pack_int8_rows(ld, L.cols, s, a, b);
      });
      break;
    }
    case Format::Fp8E4M3: {
      const int t = resolve_threads(num_threads, L.rows, n);
      bad = parallel_ranges(L.rows, t, [&](int64_t a, int64_t b) {
        return pack_fp8_rows(ld, L.cols, s, a, b);
      });
      break;
    }
    case Format::NF4: {
      const int64_t blocks = L.num_scales();
      const int t = resolve_threads(num_threads, blocks, n);
      bad = parallel_ranges(blocks, t, [&](int64_t a, int64_t b) {
        return pack_nf4_blocks(ld, n, s, a, b);
      });
      break;
    }
    case Format::Int4: {
      const int t = resolve_threads(num_threads, L.rows, n);
      bad = parallel_ranges(L.rows, t, [&](int64_t a, int64_t b) {
        return pack_int4_rows(ld, L.cols, s, a, b);
      });
      break;
    }
    default:  // None and the GGUF formats: pack() refused them
      LS_INTERNAL_CHECK(false, "pack with format ", to_string(L.format));
  }
  if (bad >= 0 && (bad & kOverflowBit)) {
    const int64_t at = bad & ~kOverflowBit;
    LS_FAIL("cannot quantize to ", to_string(L.format), ": the weight [", L.rows, ", ", L.cols, "] has values "
            "near the float32 limit (~3.4e38) in the group at row ", at / L.cols, ", columns ", at % L.cols, "..",
            at % L.cols + kInt4GroupSize - 1, ": its range is too wide for a 4-bit code and a zero point (the "
            "dequantized values would overflow to Inf). Quantize this layer with int8, fp8 or nf4 (scaled by "
            "the largest magnitude), or keep it dense");
  }
  if (bad >= 0) {
    const float v = ld(bad);
    LS_FAIL("cannot quantize to ", to_string(L.format), ": the weight [", L.rows, ", ", L.cols,
            "] has ", (std::isnan(v) ? "NaN" : (v > 0 ? "+Inf" : "-Inf")), " at row ",
            bad / L.cols, ", column ", bad % L.cols,
            " (the first non-finite element); fix or drop the non-finite weights before packing");
  }
}

// ---- dequantization ----
// L: the layout of what is dequantized (rows, cols, format; for a row range
// of a larger tensor, layout_for() of the range); its sections at data /
// scales / zeros.
// GGUF: rows of cols / elems blocks; every element decoded on its own
// (gguf_blocks.h, shared with the CUDA kernels).
template <int kFmt, class Store>
void gguf_rows(const PackedLayout& L, const uint8_t* data, const Store& st, int num_threads) {
  const int64_t elems = gguf::block_elems(kFmt), bytes = gguf::block_bytes(kFmt);
  const int64_t blocks = L.cols / elems;
  parallel_ranges(L.rows, resolve_threads(num_threads, L.rows, L.numel()), [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r)
      for (int64_t k = 0; k < blocks; ++k) {
        const uint8_t* blk = data + (r * blocks + k) * bytes;
        const int64_t i0 = r * L.cols + k * elems;
        for (int e = 0; e < elems; ++e) st(i0 + e, gguf::decode<kFmt>(blk, e));
      }
    return int64_t{-1};
  });
}

template <class Store>
void dequant_impl(const PackedLayout& L, const uint8_t* data, const float* scales, const float* zeros,
                  const Store& st, int num_threads) {
  const int64_t n = L.numel();
  const int64_t cols = L.cols;
  if (n == 0) return;
  switch (L.format) {
    case Format::Int8: {
      const int8_t* q = reinterpret_cast<const int8_t*>(data);
      parallel_ranges(L.rows, resolve_threads(num_threads, L.rows, n), [&](int64_t a, int64_t b) {
        for (int64_t r = a; r < b; ++r) {
          const float s = scales[r];
          for (int64_t c = 0; c < cols; ++c)
            st(r * cols + c, static_cast<float>(q[r * cols + c]) * s);
        }
        return int64_t{-1};
      });
      break;
    }
    case Format::Fp8E4M3: {
      const float* tab = fp8_table().v;
      parallel_ranges(L.rows, resolve_threads(num_threads, L.rows, n), [&](int64_t a, int64_t b) {
        for (int64_t r = a; r < b; ++r) {
          const float s = scales[r];
          for (int64_t c = 0; c < cols; ++c) st(r * cols + c, tab[data[r * cols + c]] * s);
        }
        return int64_t{-1};
      });
      break;
    }
    case Format::NF4: {
      const int64_t blocks = L.num_scales();
      parallel_ranges(blocks, resolve_threads(num_threads, blocks, n), [&](int64_t a, int64_t b) {
        for (int64_t blk = a; blk < b; ++blk) {
          const float amax = scales[blk];
          const int64_t i0 = blk * kNF4BlockSize;
          const int64_t i1 = std::min<int64_t>(n, i0 + kNF4BlockSize);
          for (int64_t i = i0; i < i1; ++i) {
            const uint8_t byte = data[i >> 1];
            const unsigned q = (i & 1) ? (byte & 0xFu) : (byte >> 4);
            st(i, kNF4Codes[q] * amax);
          }
        }
        return int64_t{-1};
      });
      break;
    }
    case Format::Int4: {
      const int64_t groups = cols / kInt4GroupSize;
      parallel_ranges(L.rows, resolve_threads(num_threads, L.rows, n), [&](int64_t a, int64_t b) {
        for (int64_t r = a; r < b; ++r) {
          for (int64_t g = 0; g < groups; ++g) {
            const float s = scales[r * groups + g];
            const float z = zeros[r * groups + g];
            const int64_t i0 = r * cols + g * kInt4GroupSize;
            for (int64_t k = 0; k < kInt4GroupSize; k += 2) {
              const uint8_t byte = data[(i0 + k) >> 1];
              st(i0 + k, (static_cast<float>(byte >> 4) - z) * s);
              st(i0 + k + 1, (static_cast<float>(byte & 0xFu) - z) * s);
            }
          }
        }
        return int64_t{-1};
      });
      break;
    }
    case Format::GgufQ8_0: gguf_rows<gguf::kQ8_0>(L, data, st, num_threads); break;
    case Format::GgufQ4_0: gguf_rows<gguf::kQ4_0>(L, data, st, num_threads); break;
    case Format::GgufQ4_1: gguf_rows<gguf::kQ4_1>(L, data, st, num_threads); break;
    case Format::GgufQ5_0: gguf_rows<gguf::kQ5_0>(L, data, st, num_threads); break;
    case Format::GgufQ5_1: gguf_rows<gguf::kQ5_1>(L, data, st, num_threads); break;
    case Format::GgufQ2_K: gguf_rows<gguf::kQ2_K>(L, data, st, num_threads); break;
    case Format::GgufQ3_K: gguf_rows<gguf::kQ3_K>(L, data, st, num_threads); break;
    case Format::GgufQ4_K: gguf_rows<gguf::kQ4_K>(L, data, st, num_threads); break;
    case Format::GgufQ5_K: gguf_rows<gguf::kQ5_K>(L, data, st, num_threads); break;
    case Format::GgufQ6_K: gguf_rows<gguf::kQ6_K>(L, data, st, num_threads); break;
    case Format::Lossless:  // decoded by dequantize_cpu(), never element by element
    case Format::None:
      LS_INTERNAL_CHECK(false, "dequantize with Format::", to_string(L.format));
  }
}

void check_layout(const PackedLayout& L) {
  if (L.format == Format::Lossless) {  // its size is the coded buffer's: checked by the decoder
    LS_CHECK(L.rows >= 0 && L.cols >= 0 && L.scale_bytes == 0 && L.zero_bytes == 0,
             "inconsistent PackedLayout for lossless [", L.rows, ", ", L.cols, "]: ", describe(L),
             "; build it with quant::lossless_layout()");
    return;
  }
  const PackedLayout want = layout_for(L.format, L.rows, L.cols);
  LS_CHECK(want.block_size == L.block_size && want.data_bytes == L.data_bytes &&
               want.scale_bytes == L.scale_bytes && want.zero_bytes == L.zero_bytes,
           "inconsistent PackedLayout for ", to_string(L.format), " [", L.rows, ", ", L.cols,
           "]: expected ", describe(want), ", got ", describe(L),
           "; build layouts with quant::layout_for()");
}

}  // namespace

// ---- names ----
Format parse_format(const std::string& name) {
  std::string s;
  for (char c : name) s += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (s == "int8") return Format::Int8;
  if (s == "fp8" || s == "fp8_e4m3" || s == "e4m3" || s == "fp8e4m3") return Format::Fp8E4M3;
  if (s == "nf4") return Format::NF4;
  if (s == "int4") return Format::Int4;
  if (s == "lossless") return Format::Lossless;
  if (s == "none") return Format::None;
  for (int id = static_cast<int>(Format::GgufQ8_0); id <= static_cast<int>(Format::GgufQ6_K); ++id)
    if (s == to_string(static_cast<Format>(id)))
      LS_FAIL("'", name, "' is a GGUF format: layerstream streams GGUF weights as they are read "
              "from a .gguf file (layerstream.load_gguf) but does not quantize to it; valid formats "
              "for quantizing are: int8, fp8 (e4m3), nf4, int4, lossless, none");
  LS_FAIL("unknown quantization format '", name,
          "'; valid formats are: int8, fp8 (e4m3), nf4, int4, lossless, none");
}

Format parse_packed_format(const std::string& name) {
  std::string s;
  for (char c : name) s += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  for (int id = static_cast<int>(Format::GgufQ8_0); id <= static_cast<int>(Format::GgufQ6_K); ++id)
    if (s == to_string(static_cast<Format>(id))) return static_cast<Format>(id);
  return parse_format(name);
}

const char* to_string(Format f) {
  switch (f) {
    case Format::None: return "none";
    case Format::Int8: return "int8";
    case Format::Fp8E4M3: return "fp8";
    case Format::NF4: return "nf4";
    case Format::Int4: return "int4";
    case Format::GgufQ8_0: return "q8_0";
    case Format::GgufQ4_0: return "q4_0";
    case Format::GgufQ4_1: return "q4_1";
    case Format::GgufQ5_0: return "q5_0";
    case Format::GgufQ5_1: return "q5_1";
    case Format::GgufQ2_K: return "q2_k";
    case Format::GgufQ3_K: return "q3_k";
    case Format::GgufQ4_K: return "q4_k";
    case Format::GgufQ5_K: return "q5_k";
    case Format::GgufQ6_K: return "q6_k";
    case Format::Lossless: return "lossless";
  }
  return "unknown";
}

OutDtype parse_out_dtype(const std::string& name) {
  std::string s;
  for (char c : name) s += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (s == "f32" || s == "fp32" || s == "float32" || s == "float") return OutDtype::F32;
  if (s == "bf16" || s == "bfloat16") return OutDtype::BF16;
  if (s == "f16" || s == "fp16" || s == "float16" || s == "half") return OutDtype::F16;
  LS_FAIL("unknown output dtype '", name, "'; valid dtypes are: f32, bf16, f16");
}

const char* to_string(OutDtype d) {
  switch (d) {
    case OutDtype::F32: return "f32";
    case OutDtype::BF16: return "bf16";
    case OutDtype::F16: return "f16";
  }
  return "unknown";
}

const char* to_string(SrcDtype d) {
  switch (d) {
    case SrcDtype::F32: return "f32";
    case SrcDtype::BF16: return "bf16";
    case SrcDtype::F16: return "f16";
  }
  return "unknown";
}

size_t out_dtype_bytes(OutDtype d) { return d == OutDtype::F32 ? 4 : 2; }

std::string describe(const PackedLayout& L) {
  return detail::compose(to_string(L.format), " [", L.rows, ", ", L.cols, "] block ", L.block_size,
                         ": data ", L.data_bytes, " B @", L.data_offset(), ", scales ",
                         L.scale_bytes, " B @", L.scale_offset(), ", zeros ", L.zero_bytes, " B @",
                         L.zero_offset(), ", total ", L.total_bytes(), " B");
}

// ---- layout ----
PackedLayout lossless_layout(int64_t rows, int64_t cols, size_t coded_bytes) {
  LS_CHECK(rows >= 0 && cols >= 0, "lossless: a weight of shape [", rows, ", ", cols, "]");
  PackedLayout L;
  L.format = Format::Lossless;
  L.rows = rows;
  L.cols = cols;
  L.data_bytes = coded_bytes;
  return L;
}

size_t packed_bytes(Format format, SrcDtype dtype, const void* src, int64_t rows, int64_t cols) {
  if (format != Format::Lossless) return layout_for(format, rows, cols).total_bytes();
  LS_CHECK(src != nullptr || rows * cols == 0, "packed_bytes: a lossless size needs the weight's values");
  return lossless_layout(rows, cols, lossless::analyze(dtype, src, rows * cols).total_bytes()).total_bytes();
}

PackedLayout layout_for(Format format, int64_t rows, int64_t cols) {
  LS_CHECK(format != Format::None,
           "layout_for: format 'none' has no packed layout; choose int8, fp8, nf4 or int4");
  LS_CHECK(format != Format::Lossless, "the lossless format's size depends on the weight's values "
           "(core/lossless.h), not on its shape alone: build its layout with lossless_layout()");
  LS_CHECK(rows >= 0 && cols >= 0, "cannot quantize a weight of shape [", rows, ", ", cols,
           "] to ", to_string(format), ": dimensions must be non-negative");
  LS_CHECK(rows == 0 || cols <= std::numeric_limits<int64_t>::max() / rows,
           "cannot quantize a weight of shape [", rows, ", ", cols, "]: too many elements");
  PackedLayout L;
  L.format = format;
  L.rows = rows;
  L.cols = cols;
  const int64_t n = rows * cols;
  switch (format) {
    case Format::Int8:
    case Format::Fp8E4M3:
      L.block_size = cols;
      L.data_bytes = static_cast<size_t>(n);
      L.scale_bytes = static_cast<size_t>(rows) * sizeof(float);
      break;
    case Format::NF4:
      L.block_size = kNF4BlockSize;
      L.data_bytes = static_cast<size_t>((n + 1) / 2);
      L.scale_bytes =
          static_cast<size_t>((n + kNF4BlockSize - 1) / kNF4BlockSize) * sizeof(float);
      break;
    case Format::Int4:
      LS_CHECK(cols % kInt4GroupSize == 0, "cannot quantize a weight of shape [", rows, ", ", cols,
               "] (viewed as [out_features, in_features]) to int4: in_features (", cols,
               ") must be divisible by the group size ", kInt4GroupSize,
               "; use nf4, int8 or fp8 for this tensor, or pad in_features");
      L.block_size = kInt4GroupSize;
      L.data_bytes = static_cast<size_t>(n / 2);
      L.scale_bytes = static_cast<size_t>(n / kInt4GroupSize) * sizeof(float);
      L.zero_bytes = L.scale_bytes;
      break;
    case Format::None:
      break;
    default: {  // GGUF: whole blocks along cols
      const int64_t elems = gguf::block_elems(static_cast<int>(format));
      LS_CHECK(cols % elems == 0, "a GGUF ", to_string(format), " tensor of shape [", rows, ", ", cols,
               "] (viewed as [out_features, in_features]) is not whole blocks: in_features (", cols,
               ") must be a multiple of ", elems);
      L.block_size = elems;
      L.data_bytes = static_cast<size_t>(rows) * static_cast<size_t>(cols / elems) *
                     static_cast<size_t>(gguf::block_bytes(static_cast<int>(format)));
      break;
    }
  }
  return L;
}

// ---- pack ----
void pack(Format format, const float* src, int64_t rows, int64_t cols, void* dst,
          int num_threads) {
  pack(format, src, SrcDtype::F32, rows, cols, dst, num_threads);
}

void pack(Format format, const void* src, SrcDtype src_dtype, int64_t rows, int64_t cols,
          void* dst, int num_threads) {
  LS_CHECK(format != Format::Lossless, "pack: lossless weights are coded by lossless::analyze() and "
           "lossless::encode() (their size depends on the values)");
  LS_CHECK(!is_gguf(format), "layerstream does not quantize to GGUF's ", to_string(format),
           " format: GGUF weights stream as they are read from a .gguf file; to quantize, use "
           "int8, fp8, nf4 or int4");
  const PackedLayout L = layout_for(format, rows, cols);
  LS_CHECK(dst != nullptr, "pack: destination buffer is null (needs ", L.total_bytes(), " bytes)");
  LS_CHECK(src != nullptr || L.numel() == 0, "pack: source pointer is null for a [", rows, ", ",
           cols, "] weight");
  switch (src_dtype) {
    case SrcDtype::F32:
      pack_impl(L, LoadF32{static_cast<const float*>(src)}, dst, num_threads);
      break;
    case SrcDtype::BF16:
      pack_impl(L, LoadBF16{static_cast<const uint16_t*>(src)}, dst, num_threads);
      break;
    case SrcDtype::F16:
      pack_impl(L, LoadF16{static_cast<const uint16_t*>(src)}, dst, num_threads);
      break;
  }
}

// ---- dequantize ----
void dequantize_cpu(const PackedLayout& layout, const void* packed, void* out, OutDtype dtype,
                    int num_threads) {
  check_layout(layout);
  if (layout.numel() == 0) return;
  LS_CHECK(packed != nullptr && out != nullptr, "dequantize_cpu: null packed or output pointer");
  if (layout.format == Format::Lossless) {  // bit for bit, into the weight's own dtype
    const lossless::Header h = lossless::read_header(packed, layout.data_bytes);
    LS_CHECK(h.layout.numel == layout.numel(), "lossless: the coded buffer holds ", h.layout.numel,
             " elements, the weight [", layout.rows, ", ", layout.cols, "] ", layout.numel());
    const bool same = (h.layout.dtype == SrcDtype::F32 && dtype == OutDtype::F32) ||
                      (h.layout.dtype == SrcDtype::BF16 && dtype == OutDtype::BF16) ||
                      (h.layout.dtype == SrcDtype::F16 && dtype == OutDtype::F16);
    LS_CHECK(same, "lossless: a ", to_string(h.layout.dtype), " weight decodes to ", to_string(h.layout.dtype),
             " only, not ", to_string(dtype), " (leave dequant_dtype unset)");
    lossless::decode(packed, layout.data_bytes, out,
                     static_cast<size_t>(layout.numel()) * lossless::element_bytes(h.layout.dtype), num_threads);
    return;
  }
  dequantize_rows_cpu(layout, packed, 0, layout.rows, out, dtype, num_threads);
}

RowRange row_range(const PackedLayout& L, int64_t row_begin, int64_t row_end) {
  LS_CHECK(L.format != Format::Lossless, "rows of a lossless-coded weight cannot be fetched alone (it is coded "
           "in blocks of elements); code each row range as its own piece (lossless::analyze_pieces)");
  LS_CHECK(0 <= row_begin && row_begin <= row_end && row_end <= L.rows, "row range [", row_begin, ", ",
           row_end, ") is not inside the ", L.rows, " rows of a packed ", to_string(L.format), " tensor");
  const int64_t e0 = row_begin * L.cols, e1 = row_end * L.cols;
  if (L.format == Format::NF4)
    LS_CHECK(e0 % kNF4BlockSize == 0 && (row_end == L.rows || e1 % kNF4BlockSize == 0), "row range [",
             row_begin, ", ", row_end, ") of an nf4 tensor with ", L.cols, " columns does not start and end "
             "on a block of ", kNF4BlockSize, " elements");
  RowRange r;
  r.row_begin = row_begin;
  r.row_end = row_end;
  const bool last = row_end == L.rows;
  switch (L.format) {
    case Format::Int8:
    case Format::Fp8E4M3:
      r.data_begin = static_cast<size_t>(e0);
      r.data_bytes = static_cast<size_t>(e1 - e0);
      r.scale_begin = static_cast<size_t>(row_begin) * sizeof(float);
      r.scale_bytes = static_cast<size_t>(row_end - row_begin) * sizeof(float);
      break;
    case Format::NF4:
      r.data_begin = static_cast<size_t>(e0 / 2);
      r.data_bytes = (last ? L.data_bytes : static_cast<size_t>(e1 / 2)) - r.data_begin;
      r.scale_begin = static_cast<size_t>(e0 / kNF4BlockSize) * sizeof(float);
      r.scale_bytes = (last ? L.scale_bytes : static_cast<size_t>(e1 / kNF4BlockSize) * sizeof(float)) -
                      r.scale_begin;
      break;
    case Format::Int4:
      r.data_begin = static_cast<size_t>(e0 / 2);
      r.data_bytes = static_cast<size_t>((e1 - e0) / 2);
      r.scale_begin = static_cast<size_t>(e0 / kInt4GroupSize) * sizeof(float);
      r.scale_bytes = static_cast<size_t>((e1 - e0) / kInt4GroupSize) * sizeof(float);
      r.zero_begin = r.scale_begin;
      r.zero_bytes = r.scale_bytes;
      break;
    case Format::None:
      LS_FAIL("row_range: format 'none' has no packed layout");
    default: {  // GGUF: a row is whole blocks
      const size_t row_bytes = L.data_bytes / static_cast<size_t>(std::max<int64_t>(L.rows, 1));
      r.data_begin = static_cast<size_t>(row_begin) * row_bytes;
      r.data_bytes = static_cast<size_t>(row_end - row_begin) * row_bytes;
      break;
    }
  }
  r.data_begin += L.data_offset();
  r.scale_begin += L.scale_offset();
  r.zero_begin += L.zero_offset();
  return r;
}

void dequantize_rows_cpu(const PackedLayout& layout, const void* packed, int64_t row_begin, int64_t row_end,
                         void* out, OutDtype dtype, int num_threads) {
  check_layout(layout);
  const RowRange r = row_range(layout, row_begin, row_end);
  const PackedLayout sub = layout_for(layout.format, row_end - row_begin, layout.cols);
  if (sub.numel() == 0) return;
  LS_CHECK(packed != nullptr && out != nullptr, "dequantize_cpu: null packed or output pointer");
  const uint8_t* base = static_cast<const uint8_t*>(packed);
  const uint8_t* data = base + r.data_begin;
  const float* scales = reinterpret_cast<const float*>(base + r.scale_begin);
  const float* zeros = reinterpret_cast<const float*>(base + r.zero_begin);
  switch (dtype) {
    case OutDtype::F32:
      dequant_impl(sub, data, scales, zeros, StoreF32{static_cast<float*>(out)}, num_threads);
      break;
    case OutDtype::BF16:
      dequant_impl(sub, data, scales, zeros, StoreBF16{static_cast<uint16_t*>(out)}, num_threads);
      break;
    case OutDtype::F16:
      dequant_impl(sub, data, scales, zeros, StoreF16{static_cast<uint16_t*>(out)}, num_threads);
      break;
  }
}

// ---- bounds ----
double error_bound(const PackedLayout& L, const void* packed, int64_t row, int64_t col, float w) {
  LS_CHECK(row >= 0 && row < L.rows && col >= 0 && col < L.cols, "error_bound: element (", row,
           ", ", col, ") is outside the [", L.rows, ", ", L.cols, "] weight");
  if (L.format == Format::Lossless) return 0.0;
  const float* scales =
      reinterpret_cast<const float*>(static_cast<const uint8_t*>(packed) + L.scale_offset());
  double bound = 0.0;
  switch (L.format) {
    case Format::Int8:
      bound = 0.5 * scales[row];
      break;
    case Format::Int4:
      bound = 0.5 * scales[row * (L.cols / kInt4GroupSize) + col / kInt4GroupSize];
      break;
    case Format::NF4:
      bound = kNF4MaxHalfGap * scales[(row * L.cols + col) / kNF4BlockSize];
      break;
    case Format::Fp8E4M3: {
      const double s = scales[row];
      if (s > 0) bound = s * std::max(std::fabs(static_cast<double>(w)) / s / 16.0, 1.0 / 1024.0);
      break;
    }
    case Format::None:
      LS_FAIL("error_bound: format 'none' has no quantization error");
    default:
      LS_FAIL("error_bound: GGUF's ", to_string(L.format), " was not quantized by layerstream; "
              "it has no bound here");
  }
  return bound * (1.0 + 1.0 / 1024.0) + std::ldexp(1.0, -140);
}

// ---- scalar conversions ----
uint8_t fp8_e4m3_encode(float x) { return fp8_encode(x); }
float fp8_e4m3_decode(uint8_t code) { return fp8_decode(code); }
uint16_t float_to_bf16_bits(float x) { return bf16_from_float(x); }
uint16_t float_to_f16_bits(float x) { return f16_from_float(x); }
float bf16_bits_to_float(uint16_t b) { return float_from_bf16(b); }
float f16_bits_to_float(uint16_t h) { return float_from_f16(h); }

}  // namespace quant
}  // namespace layerstream
