// layerstream — the number formats of the host optimizers (torch-free).
//
// * bfloat16: the upper 16 bits of an IEEE fp32. Widening is exact. Narrowing
//   is by stochastic rounding (sr_bf16): the 16 dropped bits are compared
//   with 16 random bits, so a value rounds up with probability equal to its
//   distance from the lower neighbour in units of the gap — unbiased:
//   E[sr_bf16(x)] = x for every finite x (docs/design/optim.md, "Stochastic
//   rounding"). Inf and NaN are kept (NaN stays a quiet NaN).
// * 8-bit block states (Q8): a tensor's state is cut into blocks of kQ8Block
//   elements; each block stores its absolute maximum (fp32) and one byte per
//   element, a small floating-point code of the element divided by the
//   absmax. First moments (signed) use 1 sign bit, 4 exponent bits, 3
//   mantissa bits (relative range 2^-17); second moments (never negative)
//   use 5 exponent bits and 3 mantissa bits (relative range 2^-33). The
//   largest code is exactly the absmax. Codes are chosen by stochastic
//   rounding between the two neighbouring codes (unbiased), so small
//   changes of a moment (a second moment moves by 0.1% per step) are not
//   lost to rounding. A nonzero second moment never becomes code 0 (it
//   would turn the update into m / eps). A block whose absmax is not finite
//   stores absmax NaN: the whole block reads as NaN. This is the role of
//   bitsandbytes' blockwise dynamic quantization, with an encoding that is
//   computed by bit operations (no table search); docs/design/optim.md says
//   why.
//
// The random bits come from a counter-based hash of (key, element index):
// results depend on the optimizer's seed, the tensor, the step and the
// element, never on the thread count or the chunking.
//
// Everything here is inline and branch-free so that loops over it vectorize.
// The functions are `static` on purpose: the kernels are compiled once per
// instruction set (kernels_impl.h), and an inline function with external
// linkage could be merged by the linker into its AVX2 copy.
#pragma once

#include <cstdint>

namespace layerstream {
namespace optim {

static inline float f32_from_bits(uint32_t u) { return __builtin_bit_cast(float, u); }
static inline uint32_t bits_from_f32(float f) { return __builtin_bit_cast(uint32_t, f); }

static inline float bf16_to_f32(uint16_t h) { return f32_from_bits(static_cast<uint32_t>(h) << 16); }

// Round to nearest even (for tests and for reading user data; the optimizers
// write bf16 with sr_bf16).
static inline uint16_t bf16_rne(float f) {
  const uint32_t u = bits_from_f32(f);
  const bool special = (u & 0x7F800000u) == 0x7F800000u;
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const uint32_t kept = (u >> 16) | ((u & 0x007FFFFFu) ? 0x0040u : 0u);
  return static_cast<uint16_t>(special ? kept : rounded);
}

// Stochastic rounding of `f` to bfloat16 with 16 random bits `r` (the low
// 16 bits of r are used): add them below the kept bits, truncate. A NaN gets
// no random bits (a carry could turn it into a number): it stays a NaN as
// long as its payload has a bit among the kept ones -- true of every NaN
// that arithmetic produces (x86 and ARM set the quiet bit). Inf needs no
// exception: its dropped bits are zero, so adding fewer than 2^16 carries
// nothing. (The NaN test is one compare, f != f; testing the exponent for
// all ones took three instructions per vector, in a loop bound by them.)
static inline uint16_t sr_bf16(float f, uint32_t r) {
  const uint32_t u = bits_from_f32(f);
  const uint32_t add = f != f ? 0u : (r & 0xFFFFu);
  return static_cast<uint16_t>((u + add) >> 16);
}

// A counter-based 32-bit hash ("lowbias32"-style xor-shift-multiply mixer
// with full avalanche); `key` selects the stream (seed, tensor, step,
// purpose).
static inline uint32_t hash32(uint32_t x, uint32_t key) {
  x += key;
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

// A 64-bit mix for deriving keys (not per element).
static inline uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// ---- 8-bit block states ----
constexpr int64_t kQ8Block = 256;
static inline int64_t q8_blocks(int64_t n) { return (n + kQ8Block - 1) / kQ8Block; }

// The value of the largest code relative to the code's unit: encoding maps
// |x| / absmax * kQ8Top into the code's range, so the top code is the absmax.
constexpr float kQ8Top = 1.875f;  // (1 + 7/8) * 2^0

// Signed code: s eeee mmm, value (1 + m/8) 2^(e-15) for e > 0, (m/8) 2^-14
// for e = 0. `y` = |x| / absmax * kQ8Top in [0, kQ8Top]; `r` random bits
// (the low 20 are used).
static inline uint32_t q8_code_e4m3(float y, uint32_t r) {
  // Normal range (y >= 2^-14): drop 20 mantissa bits of y, stochastically;
  // the code is then the exponent-and-3-bits field minus the bias shift.
  const uint32_t ny = (bits_from_f32(y) + (r & 0xFFFFFu)) >> 20;
  const int32_t normal = static_cast<int32_t>(ny) - ((127 - 15) << 3);
  // Subnormal range: y + 2^-14 puts y's multiples of 2^-17 into the
  // 3 mantissa bits of an fp32 with exponent -14 (code 8 is 2^-14 itself).
  const uint32_t sy = (bits_from_f32(y + 6.103515625e-05f) + (r & 0xFFFFFu)) >> 20;
  const int32_t sub = static_cast<int32_t>(sy) - ((127 - 15) << 3) - 8;
  int32_t c = y >= 6.103515625e-05f ? normal : sub;
  c = c > 127 ? 127 : c;
  c = c < 0 ? 0 : c;
  return static_cast<uint32_t>(c);
}

// Unsigned code: eeeee mmm, value (1 + m/8) 2^(e-31) for e > 0, (m/8) 2^-30
// for e = 0.
static inline uint32_t q8_code_e5m3(float y, uint32_t r) {
  const uint32_t ny = (bits_from_f32(y) + (r & 0xFFFFFu)) >> 20;
  const int32_t normal = static_cast<int32_t>(ny) - ((127 - 31) << 3);
  const uint32_t sy = (bits_from_f32(y + 9.313225746154785e-10f) + (r & 0xFFFFFu)) >> 20;
  const int32_t sub = static_cast<int32_t>(sy) - ((127 - 31) << 3) - 8;
  int32_t c = y >= 9.313225746154785e-10f ? normal : sub;
  c = c > 255 ? 255 : c;
  c = c < 0 ? 0 : c;
  // A nonzero moment never reads back as zero.
  c = (c == 0 && y > 0.0f) ? 1 : c;
  return static_cast<uint32_t>(c);
}

// Decoding: code -> value / absmax, by arithmetic that vectorizes (a table
// lookup became one scalar load per element: the step ran 1.4x slower). A
// code's magnitude is q/8 * 2^k with q = 8 + mantissa (normal) or the
// mantissa (e = 0), so value / absmax = q/15 * 2^k (kQ8Top = 15/8), rounded
// once to fp32. RN(q/15) without a division: 1/15 split into a 20-bit head
// (q * head is exact for q < 16) and a tail; head and tail products add
// with one rounding, within 2^-44 of q/15, and q/15 is never that close to
// a tie (its bits repeat 0001). The power of two is exact.
// `OptimQ8.DecodingIsTheCodesValueOverTheTop` checks all 256 codes against
// the magnitude / kQ8Top in double, rounded once.
static inline float q8_unit(uint32_t c7, int32_t bias) {
  const uint32_t e = c7 >> 3, m = c7 & 7u;
  const float q = static_cast<float>(static_cast<int32_t>(e != 0 ? 8u + m : m));
  const int32_t k = (e != 0 ? static_cast<int32_t>(e) : 1) - bias;
  const float q15 = q * 0x1.11112p-4f + q * -0x1.dddddep-25f;
  return q15 * f32_from_bits(static_cast<uint32_t>(k + 127) << 23);
}
// Signed: s eeee mmm (bias 15); the top code 127 (255) is 1 (-1).
static inline float q8_value_e4m3(uint32_t c) {
  return f32_from_bits(bits_from_f32(q8_unit(c & 127u, 15)) | ((c & 128u) << 24));
}
// Unsigned: eeeee mmm (bias 31); the top code 255 is 1.
static inline float q8_value_e5m3(uint32_t c) { return q8_unit(c & 255u, 31); }

}  // namespace optim
}  // namespace layerstream
