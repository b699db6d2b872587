// layerstream — internal: AdamW's bf16 block (bf16 parameters and bf16
// states) written with AVX2 intrinsics, for kernels_avx2.cpp only (included
// by kernels_impl.h inside its per-ISA namespace when LS_OPTIM_AVX2_SR is
// defined).
//
// Why by hand (docs/design/optim.md, "Kernels"): GCC's vectorization of
// adamw_sr_elems widens bf16 with a cross-lane zero extension plus a shift,
// narrows with a mask, a saturating pack and a cross-lane permute, and
// selects the NaN case with a blend: about 150 instructions per 16 elements,
// in a loop bound by instruction throughput (the divider is busy ~40% of it).
// Here a bf16 vector is widened in-lane (unpacking with zero puts each value
// in the high half of a 32-bit lane: elements 0-3 and 8-11 in one vector,
// 4-7 and 12-15 in the other), and the saturating pack of the two results
// restores the memory order, so no permute, shift or mask is needed; the
// hash is computed for each lane's own element index. Measured on one
// Xeon core over 50M bf16 parameters and states: 0.87 -> 0.65 ns per element.
//
// The arithmetic is adam_math_1div, hash32 and sr_bf16 (numerics.h) operation
// for operation, in the same order; tests/cpp/test_optim.cpp
// (EveryInstructionSetGivesTheSameBits) checks the bits against the generic
// loops, NaN and Inf included. Threads: pure functions of their arguments.
// Included inside kernels_impl.h's namespace, after adamw_sr_elems (it uses
// AdamWScalars and kBlock); <immintrin.h> is included there, at the top.
#pragma once

// One kBlock-element block: p, g, m, v point at its first element; `key` as
// for adamw_sr_elems (the chunk's key plus the block's position).
template <class G, bool kSmallW>
inline void adamw_bf16_block_avx2(uint16_t* __restrict p, const G* __restrict g, uint16_t* __restrict m,
                                  uint16_t* __restrict v, const AdamWScalars& s, uint32_t key) {
  static_assert(kBlock % 16 == 0, "the block is processed 16 elements at a time");
  const __m256i zero = _mm256_setzero_si256(), low16 = _mm256_set1_epi32(0xFFFF);
  const __m256 grad_scale = _mm256_set1_ps(s.grad_scale), decay = _mm256_set1_ps(s.decay);
  const __m256 w1 = _mm256_set1_ps(s.w1), one_minus_w1 = _mm256_set1_ps(s.one_minus_w1);
  const __m256 beta2 = _mm256_set1_ps(s.beta2), omb2 = _mm256_set1_ps(s.omb2);
  const __m256 neg_step_bc2 = _mm256_set1_ps(s.neg_step_bc2), eps_bc2 = _mm256_set1_ps(s.eps_bc2);
  const __m256i c1 = _mm256_set1_epi32(0x7FEB352D), c2 = _mm256_set1_epi32(static_cast<int>(0x846CA68Bu));
  // The element (within the block) of each lane of the two halves.
  const __m256i lanes_lo = _mm256_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11);
  const __m256i lanes_hi = _mm256_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15);
  // (bits(f) + (NaN ? 0 : r)) >> 16 per 32-bit lane (sr_bf16; r < 2^16).
  const auto round = [&](__m256 f, __m256i r) {
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
    return _mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(f), _mm256_andnot_si256(nan, r)), 16);
  };
  // Eight elements: the update, the hash of their indices, the three roundings.
  const auto eight = [&](__m256 pp, __m256 mm, __m256 vv, __m256 gg, __m256i index, __m256i& po, __m256i& mo,
                         __m256i& vo) {
    gg = _mm256_mul_ps(gg, grad_scale);
    pp = _mm256_mul_ps(pp, decay);
    mm = kSmallW ? _mm256_add_ps(mm, _mm256_mul_ps(w1, _mm256_sub_ps(gg, mm)))
                 : _mm256_sub_ps(gg, _mm256_mul_ps(_mm256_sub_ps(gg, mm), one_minus_w1));
    vv = _mm256_add_ps(_mm256_mul_ps(vv, beta2), _mm256_mul_ps(_mm256_mul_ps(omb2, gg), gg));
    const __m256 d = _mm256_add_ps(_mm256_sqrt_ps(vv), eps_bc2);
    pp = _mm256_add_ps(pp, _mm256_div_ps(_mm256_mul_ps(neg_step_bc2, mm), d));
    __m256i h = index;  // hash32(index, 0): the key is already added
    h = _mm256_mullo_epi32(_mm256_xor_si256(h, _mm256_srli_epi32(h, 16)), c1);
    h = _mm256_mullo_epi32(_mm256_xor_si256(h, _mm256_srli_epi32(h, 15)), c2);
    h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
    mo = round(mm, _mm256_srli_epi32(h, 16));
    vo = round(vv, _mm256_and_si256(_mm256_srli_epi32(h, 8), low16));
    po = round(pp, _mm256_and_si256(h, low16));
  };
  // A bf16 vector's elements in the two halves' lane order, as fp32.
  const auto lo_half = [&](__m256i x) { return _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, x)); };
  const auto hi_half = [&](__m256i x) { return _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, x)); };
  const auto load16 = [](const uint16_t* x) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)); };
  for (uint32_t j = 0; j < kBlock; j += 16) {
    const __m256i P = load16(p + j), M = load16(m + j), V = load16(v + j);
    __m256 g_lo, g_hi;
    if constexpr (std::is_same_v<G, uint16_t>) {
      const __m256i Gv = load16(g + j);
      g_lo = lo_half(Gv);
      g_hi = hi_half(Gv);
    } else {  // fp32 gradients: elements 0-7 and 8-15, regrouped into the halves' order
      const __m256 a = _mm256_loadu_ps(g + j), b = _mm256_loadu_ps(g + j + 8);
      g_lo = _mm256_permute2f128_ps(a, b, 0x20);
      g_hi = _mm256_permute2f128_ps(a, b, 0x31);
      // a = [0-3 | 4-7], b = [8-11 | 12-15]: lo wants [0-3 | 8-11], hi [4-7 | 12-15].
    }
    const __m256i base = _mm256_set1_epi32(static_cast<int>(key + j));
    __m256i p0, m0, v0, p1, m1, v1;
    eight(lo_half(P), lo_half(M), lo_half(V), g_lo, _mm256_add_epi32(base, lanes_lo), p0, m0, v0);
    eight(hi_half(P), hi_half(M), hi_half(V), g_hi, _mm256_add_epi32(base, lanes_hi), p1, m1, v1);
    // Values < 2^16 in signed 32-bit lanes: the saturating pack keeps them,
    // and in-lane packing of the two halves is the memory order again.
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(m + j), _mm256_packus_epi32(m0, m1));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(v + j), _mm256_packus_epi32(v0, v1));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + j), _mm256_packus_epi32(p0, p1));
  }
}
