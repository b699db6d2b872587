// layerstream — GGUF (llama.cpp / ggml) block formats: the decoding of one
// element of one block, shared by the CPU reference (quant.cpp) and the CUDA
// kernels (kernels/cuda/dequant.cu), so both compute the same fp32 operations
// in the same order. Plain header, no torch, no CUDA includes needed on the host.
//
// A GGUF quantized tensor is a sequence of blocks along its innermost
// dimension (in_features): each block holds `elems` consecutive elements of
// one row in `bytes` bytes, its scales inside it (fp16, little-endian). A row
// is cols / elems blocks; cols must be a multiple of elems.
//
//   format  elems bytes  value of element e of a block
//   q8_0     32    34    d * q                 q int8
//   q4_0     32    18    d * (q - 8)           q 4-bit: e < 16 low nibble of byte e, else high nibble of byte e - 16
//   q4_1     32    20    d * q + m
//   q5_0     32    22    d * (q - 16)          q 5-bit: nibble as q4_0, bit 4 = bit e of a uint32
//   q5_1     32    24    d * q + m
//   q2_k    256    84    (d * sc) * q - (dmin * mn)    16 groups of 16, 4-bit sc / mn
//   q3_k    256   110    (d * sc) * q          sc 6-bit - 32, q 2 bits - 4 * !hbit
//   q4_k    256   144    (d * sc) * q - (dmin * mn)    8 groups of 32, 6-bit sc / mn
//   q5_k    256   176    (d * sc) * q - (dmin * mn)    q 4 bits + 1 high bit
//   q6_k    256   210    (d * sc) * (q - 32)   16 groups of 16, int8 sc, q 4 + 2 bits
//
// Every product and difference is one fp32 operation rounded to nearest (no
// fused multiply-add; the CUDA side uses __fmul_rn / __fadd_rn / __fsub_rn and
// quant.cpp is compiled with -ffp-contract=off), in the order of gguf-py's
// numpy reference (gguf/quants.py), so the values equal its dequantize() bit
// for bit. The byte layouts are those of ggml's block_q* structs.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define LS_GGUF_FN __host__ __device__ __forceinline__
#else
#define LS_GGUF_FN inline
#endif

namespace layerstream {
namespace quant {
namespace gguf {

// Format ids as in quant::Format (kept equal; quant.h static_asserts it).
enum : int {
  kQ8_0 = 5, kQ4_0 = 6, kQ4_1 = 7, kQ5_0 = 8, kQ5_1 = 9,
  kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14,
};

LS_GGUF_FN int block_elems(int fmt) { return fmt >= kQ2_K ? 256 : 32; }
LS_GGUF_FN int block_bytes(int fmt) {
  switch (fmt) {
    case kQ8_0: return 34;
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ5_0: return 22;
    case kQ5_1: return 24;
    case kQ2_K: return 84;
    case kQ3_K: return 110;
    case kQ4_K: return 144;
    case kQ5_K: return 176;
    case kQ6_K: return 210;
    default: return 0;
  }
}

// Byte offsets in a block of its fp16 scale fields (d, then dmin or m when
// the format has one), as ggml's block_q* structs place them; returns how
// many there are (1 or 2). For tests and benchmarks that build blocks.
LS_GGUF_FN int half_fields(int fmt, int (&off)[2]) {
  off[0] = fmt == kQ2_K ? 80 : fmt == kQ3_K ? 108 : fmt == kQ6_K ? 208 : 0;
  off[1] = fmt == kQ2_K ? 82 : 2;
  return fmt == kQ4_1 || fmt == kQ5_1 || fmt == kQ2_K || fmt == kQ4_K || fmt == kQ5_K ? 2 : 1;
}

LS_GGUF_FN float mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
LS_GGUF_FN float add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
LS_GGUF_FN float sub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

LS_GGUF_FN float bits_to_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

LS_GGUF_FN uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

// The little-endian IEEE half at p (any alignment), widened exactly (NaN
// payloads kept, as numpy's float16 -> float32 does).
LS_GGUF_FN float half_at(const uint8_t* p) {
  const uint32_t h = static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8);
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1Fu;
  const uint32_t m = h & 0x3FFu;
  if (e == 0) return bits_to_float(float_to_bits(mul(static_cast<float>(m), 5.9604644775390625e-08f)) | sign);
  if (e == 31) return bits_to_float(sign | 0x7F800000u | (m << 13));
  return bits_to_float(sign | ((e + 112u) << 23) | (m << 13));
}

LS_GGUF_FN uint32_t u32_at(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
         (static_cast<uint32_t>(p[2]) << 16) | (static_cast<uint32_t>(p[3]) << 24);
}

// The 6-bit scale and min of group j (0..7) of a q4_k / q5_k block, from its
// 12 scale bytes s.
LS_GGUF_FN void k4_scale_min(const uint8_t* s, int j, uint32_t& sc, uint32_t& mn) {
  if (j < 4) {
    sc = s[j] & 63u;
    mn = s[j + 4] & 63u;
  } else {
    sc = (s[j + 4] & 15u) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Element e of the block at b.
template <int kFmt>
LS_GGUF_FN float decode(const uint8_t* b, int e) {
  if (kFmt == kQ8_0) {
    return mul(static_cast<float>(static_cast<int8_t>(b[2 + e])), half_at(b));
  } else if (kFmt == kQ4_0 || kFmt == kQ4_1) {
    const int off = kFmt == kQ4_0 ? 2 : 4;
    const uint32_t byte = b[off + (e & 15)];
    const uint32_t q = e < 16 ? (byte & 15u) : (byte >> 4);
    if (kFmt == kQ4_0) return mul(half_at(b), static_cast<float>(static_cast<int>(q) - 8));
    return add(mul(half_at(b), static_cast<float>(q)), half_at(b + 2));
  } else if (kFmt == kQ5_0 || kFmt == kQ5_1) {
    const int hoff = kFmt == kQ5_0 ? 2 : 4;
    const uint32_t byte = b[hoff + 4 + (e & 15)];
    const uint32_t q = (e < 16 ? (byte & 15u) : (byte >> 4)) | (((u32_at(b + hoff) >> e) & 1u) << 4);
    if (kFmt == kQ5_0) return mul(half_at(b), static_cast<float>(static_cast<int>(q) - 16));
    return add(mul(half_at(b), static_cast<float>(q)), half_at(b + 2));
  } else if (kFmt == kQ2_K) {
    // scales[16] | qs[64] | d | dmin
    const uint32_t sc = b[e >> 4];
    const float dl = mul(half_at(b + 80), static_cast<float>(sc & 15u));
    const float ml = mul(half_at(b + 82), static_cast<float>(sc >> 4));
    const int r = e & 127;
    const uint32_t q = (b[16 + (e >> 7) * 32 + (r & 31)] >> (2 * (r >> 5))) & 3u;
    return sub(mul(dl, static_cast<float>(q)), ml);
  } else if (kFmt == kQ3_K) {
    // hmask[32] | qs[64] | scales[12] | d
    const uint8_t* s = b + 96;
    const int is = e >> 4;
    const uint32_t lo = is < 8 ? (s[is] & 15u) : (s[is - 8] >> 4);
    const uint32_t hi = (s[8 + (is & 3)] >> (2 * (is >> 2))) & 3u;
    const float dl = mul(half_at(b + 108), static_cast<float>(static_cast<int>(lo | (hi << 4)) - 32));
    const int r = e & 127;
    const int ql = (b[32 + (e >> 7) * 32 + (r & 31)] >> (2 * (r >> 5))) & 3;
    const int hbit = (b[e & 31] >> (e >> 5)) & 1;
    return mul(dl, static_cast<float>(ql - ((hbit ^ 1) << 2)));
  } else if (kFmt == kQ4_K || kFmt == kQ5_K) {
    // d | dmin | scales[12] | (q5_k: qh[32] |) qs[128]
    const int j = e >> 5, l = e & 31;
    uint32_t sc, mn;
    k4_scale_min(b + 4, j, sc, mn);
    const float dd = mul(half_at(b), static_cast<float>(sc));
    const float dm = mul(half_at(b + 2), static_cast<float>(mn));
    const int qoff = kFmt == kQ4_K ? 16 : 48;
    uint32_t q = (b[qoff + (j >> 1) * 32 + l] >> (4 * (j & 1))) & 15u;
    if (kFmt == kQ5_K) q |= ((b[16 + l] >> j) & 1u) << 4;
    return sub(mul(dd, static_cast<float>(q)), dm);
  } else {  // kQ6_K: ql[128] | qh[64] | scales[16] (int8) | d
    const int h = e >> 7, r = e & 127;
    const uint32_t lo = (b[h * 64 + (r & 63)] >> (4 * (r >> 6))) & 15u;
    const uint32_t hi = (b[128 + h * 32 + (r & 31)] >> (2 * (r >> 5))) & 3u;
    const float dd = mul(half_at(b + 208), static_cast<float>(static_cast<int8_t>(b[192 + (e >> 4)])));
    return mul(dd, static_cast<float>(static_cast<int>(lo | (hi << 4)) - 32));
  }
}

}  // namespace gguf
}  // namespace quant
}  // namespace layerstream
