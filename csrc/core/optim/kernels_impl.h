// layerstream — internal: the optimizer loops (see kernels.h). Included once
// per instruction set with LS_OPTIM_ISA naming the namespace; everything here
// has internal linkage or lives in that namespace, so the two compilations
// never mix (an inline function with external linkage could be merged by the
// linker into the AVX2 copy and run on a CPU without AVX2).
//
// Written for the compiler's vectorizer: plain loops over restrict pointers,
// no calls, no branches in the loop bodies (selects only), fixed-size inner
// loops for the sums (8 or 16 double accumulators, combined in a fixed order).
#ifndef LS_OPTIM_ISA
#error "define LS_OPTIM_ISA before including kernels_impl.h"
#endif

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels.h"
#ifdef LS_OPTIM_AVX2_SR
#include <immintrin.h>
#endif
#include "numerics.h"

namespace layerstream {
namespace optim {
namespace detail {
namespace LS_OPTIM_ISA {
namespace {

inline float ld(const float* p, int64_t i) { return p[i]; }
inline float ld(const uint16_t* p, int64_t i) { return bf16_to_f32(p[i]); }

// One element of torch's single-tensor AdamW (torch/optim/adam.py with
// decoupled weight decay), operation for operation, each rounded (torch's
// vectorized CPU kernels fuse some: ~1 ulp apart, docs/design/optim.md):
//   param.mul_(1 - lr * wd); exp_avg.lerp_(grad, 1 - beta1);
//   exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2);
//   denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps);
//   param.addcdiv_(exp_avg, denom, value=-step_size)
// (ATen's CPU kernels: lerp is self + w * (end - self) for |w| < 0.5, else
// end - (end - self) * (1 - w); addcmul is self + value * t1 * t2; addcdiv is
// self + value * t1 / t2.)
template <bool kSmallW>
inline void adam_math(float& p, float& m, float& v, float g, const AdamWScalars& s) {
  g = g * s.grad_scale;
  p = p * s.decay;
  m = kSmallW ? m + s.w1 * (g - m) : g - (g - m) * s.one_minus_w1;
  v = v * s.beta2 + s.omb2 * g * g;
  const float d = std::sqrt(v) / s.bc2_sqrt + s.eps;
  p = p + s.neg_step * m / d;
}

// bf16 parameters (written by stochastic rounding, whose noise is 2^8 times
// an fp32 rounding): the same update with one division instead of two,
//   p - lr/bc1 * m / (sqrt(v)/bc2s + eps) = p + (-lr/bc1 * bc2s) * m / (sqrt(v) + eps * bc2s),
// the scalars folded in double (AdamWScalars::neg_step_bc2, eps_bc2).
template <bool kSmallW>
inline void adam_math_1div(float& p, float& m, float& v, float g, const AdamWScalars& s) {
  g = g * s.grad_scale;
  p = p * s.decay;
  m = kSmallW ? m + s.w1 * (g - m) : g - (g - m) * s.one_minus_w1;
  v = v * s.beta2 + s.omb2 * g * g;
  p = p + s.neg_step_bc2 * m / (std::sqrt(v) + s.eps_bc2);
}

// The dense AdamW loops run in blocks of kBlock elements (a constant trip
// count that the compiler unrolls; in the stochastic-rounding loops the
// hash's element counters become constants plus the block's key), and each
// block first touches the arrays kPfAhead elements ahead: with a long loop
// body (widening, the hash, three roundings) the out-of-order window reaches
// only a few cache lines ahead, and the hardware prefetcher alone left the
// core waiting on memory. Measured on 2 Xeon cores, 100M bf16 parameters
// with bf16 states, through adamw_step: 1600 Mparam/s as one loop per chunk
// (with a third multiply for the random bits), 2000 in blocks, 2600 in blocks
// with the prefetch (the AVX2 copy: 1250 -> 1800); 32 to 128 elements per
// block and 512 to 4096 elements ahead gave the same within the noise; fp32
// (bound by memory) gains a few percent (docs/design/optim.md, "Kernels"). A
// prefetch never faults and changes no result; it stays inside the arrays.
constexpr uint32_t kBlock = 64, kPfAhead = 2048;

// always_inline: GCC's analysis sees no side effect in a function that only
// prefetches (a prefetch changes no value) and drops calls to it that it has
// not inlined yet -- measured: no prefetch instruction left in the object.
template <int kWrite, uint32_t kCount, class T>
__attribute__((always_inline)) inline void prefetch_ahead(const T* x) {
  const char* c = reinterpret_cast<const char*>(x + kPfAhead);
  for (uint32_t o = 0; o < kCount * sizeof(T); o += 64) __builtin_prefetch(c + o, kWrite);
}

// Before the block at `b` (kCount elements) of arrays of n elements: the
// block kPfAhead ahead (the gradient for reading, the rest for writing).
template <uint32_t kCount = kBlock, class P, class G, class S>
__attribute__((always_inline)) inline void prefetch_block(const P* p, const G* g, const S* m, const S* v, uint32_t b,
                                                          uint32_t n) {
  if (b + kPfAhead + kCount > n) return;
  prefetch_ahead<1, kCount>(p + b);
  prefetch_ahead<0, kCount>(g + b);
  prefetch_ahead<1, kCount>(m + b);
  prefetch_ahead<1, kCount>(v + b);
}

// Element counters are 32-bit and relative to the chunk (the chunk's key
// covers its position): 32-bit vector lanes, no 64-bit index arithmetic.

// [p, g, m, v] point at the chunk's first element; n <= kChunk.
// fp32 everything: one pass.
template <bool kSmallW>
inline void adamw_f32_elems(float* __restrict p, const float* __restrict g, float* __restrict m, float* __restrict v,
                            uint32_t n, const AdamWScalars& s) {
  for (uint32_t i = 0; i < n; ++i) {
    float pp = p[i], mm = m[i], vv = v[i];
    adam_math<kSmallW>(pp, mm, vv, g[i], s);
    m[i] = mm;
    v[i] = vv;
    p[i] = pp;
  }
}

template <bool kSmallW>
void adamw_f32(float* __restrict p, const float* __restrict g, float* __restrict m, float* __restrict v, uint32_t n,
               const AdamWScalars& scalars) {
  const AdamWScalars s = scalars;  // locals: no aliasing with the arrays
  uint32_t b = 0;
  for (; b + kBlock <= n; b += kBlock) {
    prefetch_block(p, g, m, v, b, n);
    adamw_f32_elems<kSmallW>(p + b, g + b, m + b, v + b, kBlock, s);
  }
  adamw_f32_elems<kSmallW>(p + b, g + b, m + b, v + b, n - b, s);
}

// Elements [0, n) of a bf16-parameter or bf16-state step; `key` is the
// chunk's parameter key plus the position of p[0] in the chunk, so that
// hash32(i, key) is the hash of the element's chunk position.
template <class P, class G, class S, bool kSmallW>
inline void adamw_sr_elems(P* __restrict p, const G* __restrict g, S* __restrict m, S* __restrict v, uint32_t n,
                           const AdamWScalars& s, uint32_t key) {
  // One hash per element: its low 16 bits round the parameter, its high
  // 16 bits exp_avg, its middle 16 bits exp_avg_sq (each rounding sees
  // uniform bits, which is all unbiasedness needs; a third multiply for
  // independent bits cost a quarter of this loop's time over cached data on
  // AVX-512; docs/design/optim.md "bf16 weights: stochastic rounding").
  for (uint32_t i = 0; i < n; ++i) {
    float pp = ld(p, i), mm = ld(m, i), vv = ld(v, i);
    if constexpr (std::is_same_v<P, float>)
      adam_math<kSmallW>(pp, mm, vv, ld(g, i), s);
    else
      adam_math_1div<kSmallW>(pp, mm, vv, ld(g, i), s);
    const uint32_t h = hash32(i, key);
    if constexpr (std::is_same_v<S, float>) {
      m[i] = mm;
      v[i] = vv;
    } else {
      m[i] = sr_bf16(mm, h >> 16);
      v[i] = sr_bf16(vv, h >> 8);
    }
    if constexpr (std::is_same_v<P, float>) {
      p[i] = pp;
    } else {
      p[i] = sr_bf16(pp, h);
    }
  }
}

#ifdef LS_OPTIM_AVX2_SR
#include "kernels_avx2_sr.h"
#endif

template <class P, class G, class S, bool kSmallW>
void adamw_dense(P* __restrict p, const G* __restrict g, S* __restrict m, S* __restrict v, uint32_t n,
                 const AdamWScalars& scalars, const Keys& keys) {
  if constexpr (std::is_same_v<P, float> && std::is_same_v<G, float> && std::is_same_v<S, float>) {
    adamw_f32<kSmallW>(p, g, m, v, n, scalars);
  } else {
    const AdamWScalars s = scalars;
    const uint32_t key = keys.param;
    uint32_t b = 0;
    for (; b + kBlock <= n; b += kBlock) {
      prefetch_block(p, g, m, v, b, n);
#ifdef LS_OPTIM_AVX2_SR
      if constexpr (std::is_same_v<P, uint16_t> && std::is_same_v<S, uint16_t>) {
        adamw_bf16_block_avx2<G, kSmallW>(p + b, g + b, m + b, v + b, s, key + b);
        continue;
      }
#endif
      adamw_sr_elems<P, G, S, kSmallW>(p + b, g + b, m + b, v + b, kBlock, s, key + b);
    }
    adamw_sr_elems<P, G, S, kSmallW>(p + b, g + b, m + b, v + b, n - b, s, key + b);
  }
}

inline float abs_f(float x) { return f32_from_bits(bits_from_f32(x) & 0x7FFFFFFFu); }

// 8-bit states: block by block, decode, step, new absmax, encode (three
// passes over L1; docs/design/optim.md, "8-bit block states"). The update
// takes the one-division form for fp32 weights too (an ulp against the
// states' 3-bit mantissas), and one hash gives both codes their 20 random
// bits (exp_avg the low, exp_avg_sq the high: each uniform, which is all
// that unbiasedness needs). The pointers start at the chunk (a whole number
// of blocks); ma/va at its first block.
template <class P, class G, bool kSmallW>
void adamw_q8(P* __restrict p, const G* __restrict g, uint8_t* __restrict mc, uint8_t* __restrict vc,
              float* __restrict ma, float* __restrict va, uint32_t e, const AdamWScalars& scalars,
              const Keys& keys) {
  const AdamWScalars s = scalars;
  const Keys k = keys;
  alignas(64) float mm[kQ8Block];
  alignas(64) float vv[kQ8Block];
  for (uint32_t b0 = 0; b0 < e; b0 += kQ8Block) {
    const uint32_t n = e - b0 < kQ8Block ? e - b0 : static_cast<uint32_t>(kQ8Block);
    const uint32_t j = b0 / kQ8Block;
    prefetch_block<static_cast<uint32_t>(kQ8Block)>(p, g, mc, vc, b0, e);
    // This block's elements (pointer offsets keep the inner indices simple
    // for the vectorizer).
    P* __restrict pb = p + b0;
    const G* __restrict gb = g + b0;
    uint8_t* __restrict mcb = mc + b0;
    uint8_t* __restrict vcb = vc + b0;
    const float am = ma[j], av = va[j];
    for (uint32_t t = 0; t < n; ++t) {
      mm[t] = q8_value_e4m3(mcb[t]) * am;
      vv[t] = q8_value_e5m3(vcb[t]) * av;
    }
    // The absmax as the bits of |x| (non-negative floats order as their
    // bits; an integer max vectorizes, and NaN/Inf show as >= 0x7F800000).
    uint32_t amax_m = 0, amax_v = 0;
    for (uint32_t t = 0; t < n; ++t) {
      float pp = ld(pb, t), m1 = mm[t], v1 = vv[t];
      adam_math_1div<kSmallW>(pp, m1, v1, ld(gb, t), s);
      if constexpr (std::is_same_v<P, float>) {
        pb[t] = pp;
      } else {
        pb[t] = sr_bf16(pp, hash32(b0 + t, k.param));
      }
      mm[t] = m1;
      vv[t] = v1;
      const uint32_t a1 = bits_from_f32(m1) & 0x7FFFFFFFu, a2 = bits_from_f32(v1) & 0x7FFFFFFFu;
      amax_m = a1 > amax_m ? a1 : amax_m;
      amax_v = a2 > amax_v ? a2 : amax_v;
    }
    const bool bad = amax_m >= 0x7F800000u || amax_v >= 0x7F800000u;
    const float nan = f32_from_bits(0x7FC00000u);
    const float new_m = bad ? nan : f32_from_bits(amax_m), new_v = bad ? nan : f32_from_bits(amax_v);
    const float sm = new_m > 0.0f ? kQ8Top / new_m : 0.0f;
    const float sv = new_v > 0.0f ? kQ8Top / new_v : 0.0f;
    for (uint32_t t = 0; t < n; ++t) {
      const uint32_t i = b0 + t;
      const uint32_t sign = (bits_from_f32(mm[t]) >> 31) << 7;
      const uint32_t h = hash32(i, k.q8);
      mcb[t] = static_cast<uint8_t>(q8_code_e4m3(abs_f(mm[t]) * sm, h) | sign);
      vcb[t] = static_cast<uint8_t>(q8_code_e5m3(vv[t] * sv, h >> 12));
    }
    ma[j] = new_m;
    va[j] = new_v;
  }
}

template <class P, class G, bool kSmallW>
void adamw_states(const AdamWTensor& t, const void* gc, StateFormat f, const AdamWScalars& s, const Keys& k,
                  int64_t b, int64_t e) {
  P* p = static_cast<P*>(t.param) + b;
  const G* g = gc ? static_cast<const G*>(gc) : static_cast<const G*>(t.grad) + b;
  const uint32_t n = static_cast<uint32_t>(e - b);
  switch (f) {
    case StateFormat::F32:
      adamw_dense<P, G, float, kSmallW>(p, g, static_cast<float*>(t.exp_avg) + b, static_cast<float*>(t.exp_avg_sq) + b,
                                        n, s, k);
      break;
    case StateFormat::BF16:
      adamw_dense<P, G, uint16_t, kSmallW>(p, g, static_cast<uint16_t*>(t.exp_avg) + b,
                                           static_cast<uint16_t*>(t.exp_avg_sq) + b, n, s, k);
      break;
    case StateFormat::Q8:
      adamw_q8<P, G, kSmallW>(p, g, static_cast<uint8_t*>(t.exp_avg) + b, static_cast<uint8_t*>(t.exp_avg_sq) + b,
                              t.exp_avg_absmax + b / kQ8Block, t.exp_avg_sq_absmax + b / kQ8Block, n, s, k);
      break;
  }
}

template <class P, class G>
void adamw_pg(const AdamWTensor& t, const void* gc, StateFormat f, const AdamWScalars& s, const Keys& k, int64_t b,
              int64_t e) {
  if (s.small_w1)
    adamw_states<P, G, true>(t, gc, f, s, k, b, e);
  else
    adamw_states<P, G, false>(t, gc, f, s, k, b, e);
}

void adamw(const AdamWTensor& t, const void* gc, StateFormat f, const AdamWScalars& s, const Keys& k, int64_t b,
           int64_t e) {
  const bool pb = t.param_dtype == Dtype::BF16, gb = t.grad_dtype == Dtype::BF16;
  if (!pb && !gb) adamw_pg<float, float>(t, gc, f, s, k, b, e);
  else if (!pb && gb) adamw_pg<float, uint16_t>(t, gc, f, s, k, b, e);
  else if (pb && !gb) adamw_pg<uint16_t, float>(t, gc, f, s, k, b, e);
  else adamw_pg<uint16_t, uint16_t>(t, gc, f, s, k, b, e);
}

// ---------------------------------------------------------------- gradient accumulation
// `out` may alias `a` (accumulation in place): no restrict on those two.
void grad_add_f32(float* out, const float* a, const float* __restrict b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}
void grad_add_bf16(uint16_t* out, const uint16_t* a, const uint16_t* __restrict b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_rne(bf16_to_f32(a[i]) + bf16_to_f32(b[i]));
}
void grad_add(void* out, const void* a, const void* b, Dtype dt, int64_t n) {
  if (dt == Dtype::BF16)
    grad_add_bf16(static_cast<uint16_t*>(out), static_cast<const uint16_t*>(a), static_cast<const uint16_t*>(b), n);
  else
    grad_add_f32(static_cast<float*>(out), static_cast<const float*>(a), static_cast<const float*>(b), n);
}

// ---------------------------------------------------------------- sums
// The reductions below and Adafactor's loops run in tiles of kTile
// elements, each prefetching kPfAhead ahead as the AdamW blocks do, and
// widen bf16 inputs into an L1 tile first: GCC vectorized the loops that mix
// 16-bit loads with double sums at a quarter of the vector width (one Xeon
// core, 32M elements: the bf16 sum of squares 0.96 -> 0.19 ns per element,
// Adafactor's row/column statistics 0.95 -> 0.24; docs/design/optim.md,
// "Kernels"). A tile holds whole groups of lanes, so which lane an element
// is summed in does not change.
constexpr int64_t kTile = 256;
inline const float* as_f32(const float* x, int64_t, float*) { return x; }
inline const float* as_f32(const uint16_t* __restrict x, int64_t n, float* __restrict tile) {
  for (int64_t j = 0; j < n; ++j) tile[j] = bf16_to_f32(x[j]);
  return tile;
}

// Sums of squares in 16 double lanes (element i of the run in lane i % 16;
// 16 rather than 8: the fp32 sum ran 1.6x faster), combined in a fixed order.
template <class T>
double sumsq_t(const T* __restrict x, int64_t b, int64_t e) {
  double acc[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  const int64_t whole = b + (e - b) / 16 * 16;
  alignas(64) float tile[kTile];
  for (int64_t t0 = b; t0 < whole; t0 += kTile) {
    const int64_t n = whole - t0 < kTile ? whole - t0 : kTile;
    if (t0 + kPfAhead + kTile <= e) prefetch_ahead<0, kTile>(x + t0);
    const float* __restrict xs = as_f32(x + t0, n, tile);
    for (int64_t i = 0; i + 16 <= n; i += 16)
      for (int l = 0; l < 16; ++l) {
        const double d = xs[i + l];
        acc[l] += d * d;
      }
  }
  double tail = 0;
  for (int64_t i = whole; i < e; ++i) {
    const double d = ld(x, i);
    tail += d * d;
  }
  for (int l = 0; l < 8; ++l) acc[l] += acc[l + 8];
  return (((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))) + tail;
}

double sumsq(const Span& s, int64_t b, int64_t e) {
  if (s.dtype == Dtype::BF16) return sumsq_t(static_cast<const uint16_t*>(s.data), b, e);
  return sumsq_t(static_cast<const float*>(s.data), b, e);
}

// ---------------------------------------------------------------- Adafactor
// transformers' Adafactor.step, element by element (fp32 as torch computes):
//   update = grad**2 + eps1
//   factored: row = row * b2t + (1 - b2t) * update.mean(-1), col likewise
//             with mean(-2); update = (rsqrt(row / row.mean(-1)) outer
//             rsqrt(col)) * grad
//   else:     v = v * b2t + (1 - b2t) * update; update = rsqrt(v) * grad
//   update /= max(rms(update) / clip_threshold, 1); update *= lr
//   beta1:    m = m * beta1 + (1 - beta1) * update; update = m
//   p += -wd * lr * p (if wd); p += -update
template <class G>
void af_stats_t(const G* __restrict g, const AdafactorScalars& scalars, int64_t cols, int64_t base, int64_t r0,
                int64_t r1, double* __restrict row_sums, double* __restrict col_sums) {
  const float grad_scale = scalars.grad_scale, eps1 = scalars.eps1;
  alignas(64) float tile[kTile];
  for (int64_t r = r0; r < r1; ++r) {
    const G* __restrict gr = g + base + r * cols;
    double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    double tail = 0;
    for (int64_t t0 = 0; t0 < cols; t0 += kTile) {
      const int64_t n = cols - t0 < kTile ? cols - t0 : kTile;
      if ((r - r0) * cols + t0 + kPfAhead + kTile <= (r1 - r0) * cols) prefetch_ahead<0, kTile>(gr + t0);
      const float* __restrict xs = as_f32(gr + t0, n, tile);
      double* __restrict cs = col_sums + t0;
      int64_t c = 0;
      for (; c + 8 <= n; c += 8)
        for (int l = 0; l < 8; ++l) {
          const float gg = xs[c + l] * grad_scale;
          const float u = gg * gg + eps1;
          acc[l] += u;
          cs[c + l] += u;
        }
      for (; c < n; ++c) {  // only in the row's last tile
        const float gg = xs[c] * grad_scale;
        const float u = gg * gg + eps1;
        tail += u;
        cs[c] += u;
      }
    }
    row_sums[r - r0] =
        (((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))) + tail;
  }
}

void af_stats(const AdafactorTensor& t, const AdafactorScalars& s, int64_t b, int64_t r0, int64_t r1,
              double* row_sums, double* col_sums) {
  const int64_t base = b * t.rows * t.cols;
  if (t.grad_dtype == Dtype::BF16)
    af_stats_t(static_cast<const uint16_t*>(t.grad), s, t.cols, base, r0, r1, row_sums, col_sums);
  else
    af_stats_t(static_cast<const float*>(t.grad), s, t.cols, base, r0, r1, row_sums, col_sums);
}

// The update before clipping, for element i (row-major within its matrix).
template <class G>
double af_update_sumsq_t(const AdafactorTensor& t, const G* __restrict g, const AdafactorScalars& scalars,
                         const float* __restrict rf, const float* __restrict cf, int64_t b, int64_t e) {
  const AdafactorScalars s = scalars;
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  double tail = 0;
  alignas(64) float tile[kTile];
  if (t.factored) {
    // Walk row by row so the column factor is a contiguous run.
    const int64_t cols = t.cols;
    int64_t i = b;
    while (i < e) {
      const int64_t row = i / cols;  // global row: batch * rows + r
      const int64_t c0 = i - row * cols;
      const int64_t n = (e - i) < (cols - c0) ? (e - i) : (cols - c0);
      const int64_t b_idx = row / t.rows;
      const float r = rf[row];
      for (int64_t t0 = 0; t0 < n; t0 += kTile) {
        const int64_t m = n - t0 < kTile ? n - t0 : kTile;
        if (i + t0 + kPfAhead + kTile <= e) prefetch_ahead<0, kTile>(g + i + t0);
        const float* __restrict xs = as_f32(g + i + t0, m, tile);
        const float* __restrict cfr = cf + b_idx * cols + c0 + t0;
        int64_t c = 0;
        for (; c + 8 <= m; c += 8)
          for (int l = 0; l < 8; ++l) {
            const float u = (r * cfr[c + l]) * (xs[c + l] * s.grad_scale);
            acc[l] += static_cast<double>(u) * u;
          }
        for (; c < m; ++c) {  // only in the run's last tile
          const float u = (r * cfr[c]) * (xs[c] * s.grad_scale);
          tail += static_cast<double>(u) * u;
        }
      }
      i += n;
    }
  } else {
    float* __restrict v = t.exp_avg_sq;
    for (int64_t t0 = b; t0 < e; t0 += kTile) {
      const int64_t m = e - t0 < kTile ? e - t0 : kTile;
      if (t0 + kPfAhead + kTile <= e) {
        prefetch_ahead<0, kTile>(g + t0);
        prefetch_ahead<1, kTile>(v + t0);
      }
      const float* __restrict xs = as_f32(g + t0, m, tile);
      float* __restrict vt = v + t0;
      int64_t j = 0;
      for (; j + 8 <= m; j += 8)
        for (int l = 0; l < 8; ++l) {
          const float gg = xs[j + l] * s.grad_scale;
          const float vv = vt[j + l] * s.b2t + s.om_b2t * (gg * gg + s.eps1);
          vt[j + l] = vv;
          const float u = (1.0f / std::sqrt(vv)) * gg;
          acc[l] += static_cast<double>(u) * u;
        }
      for (; j < m; ++j) {  // only in the last tile
        const float gg = xs[j] * s.grad_scale;
        const float vv = vt[j] * s.b2t + s.om_b2t * (gg * gg + s.eps1);
        vt[j] = vv;
        const float u = (1.0f / std::sqrt(vv)) * gg;
        tail += static_cast<double>(u) * u;
      }
    }
  }
  return (((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))) + tail;
}

double af_update_sumsq(const AdafactorTensor& t, const AdafactorScalars& s, const float* rf, const float* cf,
                       int64_t b, int64_t e) {
  if (t.grad_dtype == Dtype::BF16)
    return af_update_sumsq_t(t, static_cast<const uint16_t*>(t.grad), s, rf, cf, b, e);
  return af_update_sumsq_t(t, static_cast<const float*>(t.grad), s, rf, cf, b, e);
}

// Applies the final update u (clipped, times lr) to element i (of arrays
// that start at the run; `counter` is its position in the chunk).
template <class P>
inline void af_apply_one(P* __restrict p, float* __restrict m, uint32_t i, float u, const AdafactorScalars& s,
                         uint32_t key, uint32_t counter) {
  u = u / s.clip_div;
  u = u * s.lr;
  if (s.first_moment) {
    const float mm = m[i] * s.beta1 + s.om_beta1 * u;
    m[i] = mm;
    u = mm;
  }
  float pp = ld(p, i);
  if (s.weight_decay) pp = pp + s.neg_wd_lr * pp;
  pp = pp + -u;
  if constexpr (std::is_same_v<P, float>) {
    p[i] = pp;
  } else {
    p[i] = sr_bf16(pp, hash32(counter, key));
  }
}

// The loops run over runs of at most a row (factored) or a chunk, with
// pointers offset to the run and 32-bit indices and counters, and the
// scalars in a local copy (a reference could alias the stores): GCC
// otherwise kept 64-bit index vectors and reloaded the scalars, and the
// bf16 loop ran 4x slower than the fp32 one.
template <class P, class G>
void af_apply_t(const AdafactorTensor& t, P* __restrict p, const G* __restrict g, const AdafactorScalars& scalars,
                const float* __restrict rf, const float* __restrict cf, uint32_t key, int64_t b, int64_t e) {
  const AdafactorScalars s = scalars;
  float* const m = t.exp_avg;  // null without a first moment
  if (t.factored) {
    const int64_t cols = t.cols;
    int64_t i = b;
    while (i < e) {
      const int64_t row = i / cols;
      const int64_t c0 = i - row * cols;
      const uint32_t n = static_cast<uint32_t>((e - i) < (cols - c0) ? (e - i) : (cols - c0));
      const int64_t b_idx = row / t.rows;
      const float r = rf[row];
      const float* __restrict cfr = cf + b_idx * cols + c0;
      for (uint32_t t0 = 0; t0 < n; t0 += kTile) {
        const uint32_t len = n - t0 < kTile ? n - t0 : static_cast<uint32_t>(kTile);
        const int64_t at = i + t0;
        if (at + kPfAhead + kTile <= e) {
          prefetch_ahead<1, kTile>(p + at);
          prefetch_ahead<0, kTile>(g + at);
        }
        P* __restrict pr = p + at;
        const G* __restrict gr = g + at;
        float* __restrict mr = m ? m + at : nullptr;
        const float* __restrict cft = cfr + t0;
        const uint32_t counter = static_cast<uint32_t>(at - b);
        for (uint32_t c = 0; c < len; ++c)
          af_apply_one(pr, mr, c, (r * cft[c]) * (ld(gr, c) * s.grad_scale), s, key, counter + c);
      }
      i += n;
    }
  } else {
    const float* __restrict v = t.exp_avg_sq + b;
    P* __restrict pr = p + b;
    const G* __restrict gr = g + b;
    float* __restrict mr = m ? m + b : nullptr;
    const uint32_t n = static_cast<uint32_t>(e - b);
    for (uint32_t j = 0; j < n; ++j)
      af_apply_one(pr, mr, j, (1.0f / std::sqrt(v[j])) * (ld(gr, j) * s.grad_scale), s, key, j);
  }
}

void af_apply(const AdafactorTensor& t, const AdafactorScalars& s, const float* rf, const float* cf, const Keys& k,
              int64_t b, int64_t e) {
  const bool pb = t.param_dtype == Dtype::BF16, gb = t.grad_dtype == Dtype::BF16;
  if (!pb && !gb) af_apply_t(t, static_cast<float*>(t.param), static_cast<const float*>(t.grad), s, rf, cf, k.param, b, e);
  else if (!pb && gb) af_apply_t(t, static_cast<float*>(t.param), static_cast<const uint16_t*>(t.grad), s, rf, cf, k.param, b, e);
  else if (pb && !gb) af_apply_t(t, static_cast<uint16_t*>(t.param), static_cast<const float*>(t.grad), s, rf, cf, k.param, b, e);
  else af_apply_t(t, static_cast<uint16_t*>(t.param), static_cast<const uint16_t*>(t.grad), s, rf, cf, k.param, b, e);
}

}  // namespace

extern const Kernels kKernels;
const Kernels kKernels = {LS_OPTIM_ISA_NAME, &adamw, &grad_add, &sumsq, &af_stats, &af_update_sumsq, &af_apply};

}  // namespace LS_OPTIM_ISA
}  // namespace detail
}  // namespace optim
}  // namespace layerstream
