// layerstream — internal to quant.cpp: one element's number formats (fp32 bits,
// bfloat16, float16 and fp8 e4m3 conversions, round half to even) and the loaders
// and stores the packers and the reference dequantization read sources and write
// outputs through, per dtype. quant.cpp alone includes it: it is compiled with
// -ffp-contract=off (csrc/core/CMakeLists.txt), which these functions' exact rounding
// relies on.
#pragma once

#include <cstdint>
#include <cstring>

namespace layerstream {
namespace quant {
namespace elements {

inline uint32_t f2u(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
inline float u2f(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Round half to even for |x| < 2^22 (default FE_TONEAREST rounding mode; the
// compiler may not fold this without -ffast-math, which we never use).
inline float rne_small(float x) {
  const float magic = 12582912.0f;  // 1.5 * 2^23: adding it leaves no fraction bits
  const float t = x + magic;
  return t - magic;
}

inline uint16_t bf16_from_float(float x) {
  uint32_t u = f2u(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FFF;
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline uint16_t f16_from_float(float x) {
  const uint32_t u = f2u(x);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return 0x7FFF;               // NaN (canonical, like CUDA)
  if (a >= 0x477FF000u) return sign | 0x7C00u;      // >= 65520 rounds to Inf
  if (a >= 0x38800000u) {                           // >= 2^-14: normal half
    // Branch-free RNE of the 13 dropped mantissa bits (a carry bumps the exponent).
    const uint32_t t = a + 0xFFFu + ((a >> 13) & 1u);
    return static_cast<uint16_t>(sign | ((t >> 13) - ((127u - 15u) << 10)));
  }
  // Half subnormal (or rounds up to the smallest normal): units of 2^-24.
  // a * 2^24 is exact; the result is in [0, 1024].
  uint32_t m = static_cast<uint32_t>(rne_small(u2f(a) * 16777216.0f));
  return static_cast<uint16_t>(sign | m);
}

inline float float_from_bf16(uint16_t b) { return u2f(static_cast<uint32_t>(b) << 16); }

inline float float_from_f16(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1Fu;
  const uint32_t m = h & 0x3FFu;
  if (e == 0) {
    float v = static_cast<float>(m) * (1.0f / 16777216.0f);  // exact
    return u2f(f2u(v) | sign);
  }
  if (e == 31) return u2f(sign | 0x7F800000u | (m << 13));
  return u2f(sign | ((e - 15u + 127u) << 23) | (m << 13));
}

inline uint8_t fp8_encode(float x) {
  const uint32_t u = f2u(x);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<uint8_t>(sign | 0x7Fu);  // NaN
  if (a >= 0x43E00000u) return static_cast<uint8_t>(sign | 0x7Eu); // >= 448: saturate
  if (a < 0x3C800000u) {  // < 2^-6: e4m3 subnormal, units of 2^-9; code 8 = 2^-6 (normal)
    const uint32_t m = static_cast<uint32_t>(rne_small(u2f(a) * 512.0f));  // exact scaling
    return static_cast<uint8_t>(sign | m);
  }
  // Normal: branch-free RNE of the 20 dropped mantissa bits (a carry bumps the
  // exponent), rebias 127 -> 7, saturate to 448 (0x7E).
  const uint32_t t = a + 0x7FFFFu + ((a >> 20) & 1u);
  const uint32_t code = std::min<uint32_t>((t >> 20) - ((127u - 7u) << 3), 0x7Eu);
  return static_cast<uint8_t>(sign | code);
}

inline float fp8_decode(uint8_t c) {
  const uint32_t sign = static_cast<uint32_t>(c & 0x80u) << 24;
  const uint32_t e = (c >> 3) & 0xFu;
  const uint32_t m = c & 7u;
  if (e == 15 && m == 7) return std::numeric_limits<float>::quiet_NaN();
  if (e == 0) return u2f(f2u(static_cast<float>(m) * (1.0f / 512.0f)) | sign);
  return u2f(sign | ((e + 120u) << 23) | (m << 20));
}

// ---- source loaders ----
// Each also rounds an fp32 to its dtype (as dequantizing into it does) and gives a
// value's neighbours in its dtype (below, above; ±Inf past the largest).
struct LoadF32 {
  const float* p;
  float operator()(int64_t i) const { return p[i]; }
  static float round(float x) { return x; }
  static float step(float v, int by) { return u2f(static_cast<uint32_t>(static_cast<int64_t>(f2u(v)) + by)); }
};
struct LoadBF16 {
  const uint16_t* p;
  float operator()(int64_t i) const { return float_from_bf16(p[i]); }
  static float round(float x) { return float_from_bf16(bf16_from_float(x)); }
  static float step(float v, int by) {
    return float_from_bf16(static_cast<uint16_t>(static_cast<int>(bf16_from_float(v)) + by));
  }
};
struct LoadF16 {
  const uint16_t* p;
  float operator()(int64_t i) const { return float_from_f16(p[i]); }
  static float round(float x) { return float_from_f16(f16_from_float(x)); }
  static float step(float v, int by) {
    return float_from_f16(static_cast<uint16_t>(static_cast<int>(f16_from_float(v)) + by));
  }
};

// ---- output stores ----
struct StoreF32 {
  float* p;
  void operator()(int64_t i, float v) const { p[i] = v; }
};
struct StoreBF16 {
  uint16_t* p;
  void operator()(int64_t i, float v) const { p[i] = bf16_from_float(v); }
};
struct StoreF16 {
  uint16_t* p;
  void operator()(int64_t i, float v) const { p[i] = f16_from_float(v); }
};

}  // namespace elements
}  // namespace quant
}  // namespace layerstream
