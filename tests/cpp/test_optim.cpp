// Tests for csrc/core/optim/: the thread pool, bf16 stochastic rounding, the
// 8-bit state codes, AdamW (fp32 against a scalar reference written here in
// torch's order of operations, bit for bit; bf16 and 8-bit states), the
// gradient norm and clip coefficient, Adafactor against a scalar reference,
// and the independence of results from thread count and instruction set.
#include "core/optim/optim.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "core/optim/internal.h"
#include "core/optim/kernels.h"

namespace o = layerstream::optim;

namespace {

std::string throws_message(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const layerstream::Error& e) {
    return e.message();
  }
  return "<no layerstream::Error thrown>";
}

std::vector<float> randn(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

// The optimizer loops this CPU runs: the generic ones first, then AVX2 and
// AVX-512 where the CPU has them.
std::vector<const o::detail::Kernels*> instruction_sets() {
  std::vector<const o::detail::Kernels*> v{&o::detail::generic::kKernels};
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2")) v.push_back(&o::detail::avx2::kKernels);
  if (o::detail::avx512_usable()) v.push_back(&o::detail::avx512::kKernels);
#endif
  return v;
}

// ---------------------------------------------------------------- thread pool
TEST(OptimThreadPool, RunsEveryTaskOnceAndRethrowsTheFirstError) {
  o::ThreadPool pool(3);
  EXPECT_EQ(pool.threads(), 3);
  std::vector<std::atomic<int>> hits(1000);
  pool.run(1000, [&](int64_t t) { hits[static_cast<size_t>(t)]++; });
  for (auto& h : hits) EXPECT_EQ(h.load(), 1);
  std::atomic<int> ran{0};
  try {
    pool.run(50, [&](int64_t t) {
      ran++;
      if (t == 7 || t == 30) throw std::runtime_error("task " + std::to_string(t));
    });
    FAIL() << "no exception";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "task 7");
  }
  EXPECT_EQ(ran.load(), 50);  // the other tasks still ran
  // Still usable afterwards; a task may not run the pool again.
  EXPECT_NE(throws_message([&] { pool.run(2, [&](int64_t) { pool.run(1, [](int64_t) {}); }); })
                .find("from one of its own tasks"),
            std::string::npos);
}

TEST(OptimThreadPool, ConcurrentCallersRunOneAfterAnother) {
  o::ThreadPool pool(2);
  std::atomic<int> active[2] = {{0}, {0}};
  std::atomic<int> total{0};
  std::atomic<bool> overlap{false};
  auto job = [&](int id) {
    for (int r = 0; r < 50; ++r)
      pool.run(8, [&](int64_t) {
        active[id]++;
        if (active[1 - id].load() != 0) overlap = true;
        std::this_thread::yield();
        total++;
        active[id]--;
      });
  };
  std::thread a(job, 0), b(job, 1);
  a.join();
  b.join();
  EXPECT_EQ(total.load(), 2 * 50 * 8);
  EXPECT_FALSE(overlap.load());
}

// ---------------------------------------------------------------- bf16
// A param group: the host and one device (an offloaded model's split), not two devices.
TEST(OptimGroups, TheHostAndOneDeviceShareAGroupTwoDevicesDoNot) {
  EXPECT_NO_THROW(o::check_group_devices({"cpu", "cuda:0", "cpu", "cuda:0"}, 0));
  EXPECT_NO_THROW(o::check_group_devices({"cuda:1"}, 0));
  EXPECT_NO_THROW(o::check_group_devices({}, 0));
  try {
    o::check_group_devices({"cuda:1", "cpu", "cuda:0"}, 2);
    FAIL() << "two devices besides the host were accepted";
  } catch (const layerstream::Error& e) {
    EXPECT_NE(std::string(e.what()).find("param group 2 are on several devices besides the host (cuda:0, cuda:1)"),
              std::string::npos)
        << e.what();
  }
}

// offload(train=...): a trainable weight's gradient and states on the device.
// The sizes are checked against the tensors layerstream.optim allocates in
// tests/python/test_optim.py::test_train_bytes_are_what_the_optimizers_allocate.
TEST(OptimTrainSpec, GradientAndStateBytesPerSpec) {
  const std::vector<int64_t> w{6, 10};  // 60 elements
  auto bytes = [&](const std::string& spec, const std::vector<int64_t>& shape, uint64_t elem) {
    return o::train_bytes(o::parse_train_spec(spec), shape, elem);
  };
  EXPECT_EQ(bytes("", w, 2), 0u);
  EXPECT_EQ(bytes("none", w, 2), 0u);
  EXPECT_EQ(bytes("grads", w, 2), 120u);
  EXPECT_EQ(bytes("adamw", w, 4), 240u + 2 * 240u);
  EXPECT_EQ(bytes("adamw-fp32", w, 2), 120u + 2 * 240u);
  EXPECT_EQ(bytes("adamw-bf16", w, 2), 120u + 2 * 120u);
  EXPECT_EQ(bytes("adamw-8bit", w, 2), 120u + 2 * (60u + 4u));  // codes + one fp32 absmax per block of 256
  EXPECT_EQ(bytes("adafactor", w, 2), 120u + 4u * (6 + 10));      // row and column second moments, fp32
  EXPECT_EQ(bytes("adafactor", {3, 6, 10}, 4), 720u + 4u * (18 + 30));
  EXPECT_EQ(bytes("adafactor", {10}, 4), 40u + 40u);  // 1-D: the full second moment
  EXPECT_EQ(bytes("adafactor-beta1", w, 2), 120u + 4u * (6 + 10) + 240u);  // and the first moment, fp32
  EXPECT_EQ(bytes("8", w, 4), 240u + 480u);
  EXPECT_EQ(bytes("2.5", {3}, 2), 6u + 8u);  // rounded up
  EXPECT_EQ(bytes("adamw", {0, 10}, 4), 0u);
  for (const char* bad : {"sgd", "adamw-fp16", "-1", "8 bytes", "nan"}) {
    try {
      o::parse_train_spec(bad);
      ADD_FAILURE() << bad << " was accepted";
    } catch (const layerstream::Error& e) {
      EXPECT_NE(std::string(e.what()).find("'grads' (gradients only), 'adamw'"), std::string::npos) << e.what();
    }
  }
}

TEST(OptimBf16, RoundToNearestEvenAndSpecials) {
  EXPECT_EQ(o::bf16_rne(1.0f), 0x3F80);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1).
  EXPECT_EQ(o::bf16_rne(1.0f + std::ldexp(1.0f, -8)), 0x3F80);
  EXPECT_EQ(o::bf16_rne(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3F82);
  EXPECT_EQ(o::bf16_rne(std::numeric_limits<float>::infinity()), 0x7F80);
  EXPECT_TRUE(std::isnan(o::bf16_to_f32(o::bf16_rne(std::nanf("")))));
}

TEST(OptimBf16, StochasticRoundingIsUnbiased) {
  // x = 1 + 0.3 ulp(bf16): the mean of sr_bf16 over all 2^16 random values is
  // exactly x (each of the 65536 offsets is one step of the dropped bits).
  const float lo = 1.0f, ulp = std::ldexp(1.0f, -7);
  const float x = lo + 0.3f * ulp;
  double sum = 0;
  for (uint32_t r = 0; r < 65536; ++r) sum += o::bf16_to_f32(o::sr_bf16(x, r));
  EXPECT_DOUBLE_EQ(sum / 65536.0, static_cast<double>(x));
  // Negative numbers, and a value just below a power of two.
  for (float y : {-x, std::nextafter(2.0f, 0.0f), 3e-39f /* subnormal */}) {
    double s = 0;
    for (uint32_t r = 0; r < 65536; ++r) s += o::bf16_to_f32(o::sr_bf16(y, r));
    EXPECT_DOUBLE_EQ(s / 65536.0, static_cast<double>(y)) << y;
  }
  // Exactly representable values never move; specials are kept.
  for (uint32_t r : {0u, 1u, 0xFFFFu}) {
    EXPECT_EQ(o::sr_bf16(1.5f, r), 0x3FC0);
    EXPECT_EQ(o::sr_bf16(-std::numeric_limits<float>::infinity(), r), 0xFF80);
    EXPECT_TRUE(std::isnan(o::bf16_to_f32(o::sr_bf16(std::nanf(""), r))));
  }
}

// ---------------------------------------------------------------- 8-bit codes
// The codes' values by their definition (numerics.h), in double, rounded once.
static float q8_reference(int c, bool is_signed) {
  const int bias = is_signed ? 15 : 31;
  const int mag_bits = is_signed ? (c & 127) : c;
  const int e = mag_bits >> 3, m = mag_bits & 7;
  const double mag = e == 0 ? (m / 8.0) * std::ldexp(1.0, 1 - bias) : (1.0 + m / 8.0) * std::ldexp(1.0, e - bias);
  const double v = mag / static_cast<double>(o::kQ8Top);
  return static_cast<float>(is_signed && (c & 128) ? -v : v);
}

TEST(OptimQ8, DecodingIsTheCodesValueOverTheTop) {
  for (int c = 0; c < 256; ++c) {
    const float s = o::q8_value_e4m3(static_cast<uint32_t>(c)), u = o::q8_value_e5m3(static_cast<uint32_t>(c));
    EXPECT_EQ(__builtin_bit_cast(uint32_t, s), __builtin_bit_cast(uint32_t, q8_reference(c, true))) << c;
    EXPECT_EQ(__builtin_bit_cast(uint32_t, u), __builtin_bit_cast(uint32_t, q8_reference(c, false))) << c;
  }
}

TEST(OptimQ8, CodesCoverTheirRangeExactlyAndUnbiased) {
  float signed_e4m3[256], unsigned_e5m3[256];
  for (uint32_t c = 0; c < 256; ++c) {
    signed_e4m3[c] = o::q8_value_e4m3(c);
    unsigned_e5m3[c] = o::q8_value_e5m3(c);
  }
  EXPECT_EQ(signed_e4m3[127], 1.0f);
  EXPECT_EQ(signed_e4m3[255], -1.0f);
  EXPECT_EQ(unsigned_e5m3[255], 1.0f);
  EXPECT_EQ(signed_e4m3[0], 0.0f);
  EXPECT_EQ(unsigned_e5m3[0], 0.0f);
  // Monotone.
  for (int c = 1; c < 128; ++c) EXPECT_LT(signed_e4m3[c - 1], signed_e4m3[c]);
  for (int c = 1; c < 256; ++c) EXPECT_LT(unsigned_e5m3[c - 1], unsigned_e5m3[c]);
  // Every code's own value encodes to itself, whatever the random bits.
  for (int c = 0; c < 128; ++c)
    for (uint32_t r : {0u, 12345u, 0xFFFFFu})
      EXPECT_EQ(o::q8_code_e4m3(signed_e4m3[c] * o::kQ8Top, r), static_cast<uint32_t>(c)) << c;
  for (int c = 1; c < 256; ++c)
    for (uint32_t r : {0u, 12345u, 0xFFFFFu})
      EXPECT_EQ(o::q8_code_e5m3(unsigned_e5m3[c] * o::kQ8Top, r), static_cast<uint32_t>(c)) << c;
  // Between two codes: the mean over all 2^20 random values is the value
  // (up to the codes' fp32 rounding), in the normal and subnormal ranges.
  for (float y : {0.7f, 1.3f, 3e-5f, 1e-3f}) {
    double s = 0;
    for (uint32_t r = 0; r < (1u << 20); r += 1) s += signed_e4m3[o::q8_code_e4m3(y, r)];
    EXPECT_NEAR(s / (1u << 20) * o::kQ8Top, y, 1e-6 * y) << y;
  }
  for (float y : {0.7f, 1e-6f, 5e-10f}) {
    double s = 0;
    for (uint32_t r = 0; r < (1u << 20); r += 1) s += unsigned_e5m3[o::q8_code_e5m3(y, r)];
    EXPECT_NEAR(s / (1u << 20) * o::kQ8Top, y, 1e-6 * y) << y;
  }
  // A nonzero second moment never becomes 0; zero stays zero.
  EXPECT_EQ(o::q8_code_e5m3(1e-30f, 0), 1u);
  EXPECT_EQ(o::q8_code_e5m3(0.0f, 0xFFFFFu), 0u);
  EXPECT_EQ(o::q8_code_e4m3(0.0f, 0xFFFFFu), 0u);
}

// ---------------------------------------------------------------- AdamW
struct Problem {
  std::vector<float> p, g, m, v;
};

Problem make_problem(size_t n, uint32_t seed) {
  Problem pr;
  pr.p = randn(n, seed);
  pr.m.assign(n, 0.0f);
  pr.v.assign(n, 0.0f);
  return pr;
}

// torch.optim.AdamW (single tensor, decoupled weight decay), written out
// operation by operation in fp32 with torch's Python-double scalars.
void reference_adamw(std::vector<float>& p, const std::vector<float>& g0, std::vector<float>& m,
                     std::vector<float>& v, const o::AdamWConfig& c, int64_t step, float grad_scale) {
  const double bc1 = 1.0 - std::pow(c.beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(c.beta2, static_cast<double>(step));
  const float neg_step = static_cast<float>(-(c.lr / bc1));
  const float bc2s = static_cast<float>(std::pow(bc2, 0.5));
  const float w = static_cast<float>(1.0 - c.beta1);
  for (size_t i = 0; i < p.size(); ++i) {
    const float g = g0[i] * grad_scale;
    if (c.weight_decay != 0) p[i] = p[i] * static_cast<float>(1.0 - c.lr * c.weight_decay);
    m[i] = std::fabs(w) < 0.5f ? m[i] + w * (g - m[i]) : g - (g - m[i]) * (1.0f - w);
    const float a = static_cast<float>(1.0 - c.beta2) * g;
    v[i] = v[i] * static_cast<float>(c.beta2) + a * g;
    const float sq = std::sqrt(v[i]);
    const float d = sq / bc2s + static_cast<float>(c.eps);
    const float num = neg_step * m[i];
    p[i] = p[i] + num / d;
  }
}

o::AdamWTensor f32_tensor(Problem& pr) {
  o::AdamWTensor t;
  t.param = pr.p.data();
  t.grad = pr.g.data();
  t.exp_avg = pr.m.data();
  t.exp_avg_sq = pr.v.data();
  t.numel = static_cast<int64_t>(pr.p.size());
  return t;
}

TEST(OptimAdamW, Fp32MatchesTorchOrderBitForBit) {
  // Sizes around the chunk size and odd tails; betas on both sides of
  // torch's lerp switch (1 - beta1 < 0.5 and >= 0.5); weight decay on/off;
  // clip coefficients.
  for (double beta1 : {0.9, 0.3}) {
    for (double wd : {0.0, 0.1}) {
      const size_t n = 3 * 65536 + 77;
      Problem a = make_problem(n, 1), r = make_problem(n, 1);
      o::AdamWConfig c;
      c.lr = 1e-2;
      c.beta1 = beta1;
      c.weight_decay = wd;
      for (int64_t step = 1; step <= 5; ++step) {
        a.g = randn(n, 100 + static_cast<uint32_t>(step));
        const float scale = step == 3 ? 0.37f : 1.0f;
        o::AdamWTensor t = f32_tensor(a);
        t.step = step;
        o::adamw_step(c, o::StateFormat::F32, {t}, scale);
        reference_adamw(r.p, a.g, r.m, r.v, c, step, scale);
      }
      EXPECT_TRUE(same_bits(a.p, r.p)) << "beta1 " << beta1 << " wd " << wd;
      EXPECT_TRUE(same_bits(a.m, r.m));
      EXPECT_TRUE(same_bits(a.v, r.v));
    }
  }
}

TEST(OptimAdamW, NanAndInfPropagateLikeTorch) {
  const size_t n = 300;
  Problem a = make_problem(n, 2), r = make_problem(n, 2);
  a.g = randn(n, 3);
  a.g[5] = std::nanf("");
  a.g[9] = std::numeric_limits<float>::infinity();
  o::AdamWConfig c;
  o::AdamWTensor t = f32_tensor(a);
  o::adamw_step(c, o::StateFormat::F32, {t});
  reference_adamw(r.p, a.g, r.m, r.v, c, 1, 1.0f);
  for (size_t i = 0; i < n; ++i) {
    if (std::isnan(r.p[i])) {
      EXPECT_TRUE(std::isnan(a.p[i])) << i;
    } else {
      EXPECT_EQ(a.p[i], r.p[i]) << i;
    }
  }
  EXPECT_TRUE(std::isnan(a.p[5]));
  EXPECT_TRUE(std::isnan(a.p[9]));  // inf / inf
  EXPECT_FALSE(std::isnan(a.p[0]));
}

TEST(OptimAdamW, ResultsDoNotDependOnThreadsOrInstructionSet) {
  const size_t n = 5 * 65536 + 1000;
  for (o::StateFormat f : {o::StateFormat::F32, o::StateFormat::BF16, o::StateFormat::Q8}) {
    std::vector<std::vector<float>> results;
    for (int variant = 0; variant < 3; ++variant) {
      // bf16 parameters in one tensor, fp32 in another, to cover both.
      std::vector<float> p32 = randn(n, 7), g32 = randn(n, 8);
      std::vector<uint16_t> p16(n), g16(n);
      for (size_t i = 0; i < n; ++i) {
        p16[i] = o::bf16_rne(p32[i]);
        g16[i] = o::bf16_rne(g32[i]);
      }
      const int64_t sb = o::state_bytes(f, static_cast<int64_t>(n));
      std::vector<uint8_t> s[4];
      for (auto& x : s) x.assign(static_cast<size_t>(sb), 0);
      std::vector<float> ab[4];
      for (auto& x : ab) x.assign(static_cast<size_t>(o::state_absmax_count(f, static_cast<int64_t>(n))), 0.0f);
      o::AdamWTensor a, b;
      a.param = p32.data();
      a.grad = g32.data();
      b.param = p16.data();
      b.param_dtype = o::Dtype::BF16;
      b.grad = g16.data();
      b.grad_dtype = o::Dtype::BF16;
      a.exp_avg = s[0].data(); a.exp_avg_sq = s[1].data(); a.exp_avg_absmax = ab[0].data(); a.exp_avg_sq_absmax = ab[1].data();
      b.exp_avg = s[2].data(); b.exp_avg_sq = s[3].data(); b.exp_avg_absmax = ab[2].data(); b.exp_avg_sq_absmax = ab[3].data();
      a.numel = b.numel = static_cast<int64_t>(n);
      b.key = 1;
      o::AdamWConfig c;
      for (int64_t step = 1; step <= 3; ++step) {
        a.step = b.step = step;
        o::ThreadPool pool(variant == 0 ? 1 : variant == 1 ? 4 : 2);
        o::adamw_step(c, f, {a, b}, 1.0f, 42, &pool);
      }
      std::vector<float> out(p32);
      for (size_t i = 0; i < n; ++i) out.push_back(o::bf16_to_f32(p16[i]));
      results.push_back(out);
    }
    EXPECT_TRUE(same_bits(results[0], results[1])) << o::state_format_name(f);
    EXPECT_TRUE(same_bits(results[0], results[2])) << o::state_format_name(f);
  }
}

// The generic loops and every wider copy this CPU runs (AVX2, AVX-512; the
// AVX2 bf16 block by hand, kernels_avx2_sr.h) give identical bits: fp32 and
// bf16 gradients, both of torch's lerp formulas, NaN and Inf among the values.
TEST(OptimAdamW, EveryInstructionSetGivesTheSameBits) {
  const std::vector<const o::detail::Kernels*> isas = instruction_sets();
  if (isas.size() < 2) GTEST_SKIP() << "this CPU runs only the generic loops";
  const int64_t n = 4096 + 13;
  for (int variant = 0; variant < 3; ++variant)
  for (o::StateFormat f : {o::StateFormat::F32, o::StateFormat::BF16, o::StateFormat::Q8}) {
    const bool bf16_grad = variant >= 1, small_w1 = variant != 2;
    std::vector<std::vector<uint8_t>> outs;
    for (const o::detail::Kernels* k : isas) {
      std::vector<float> p = randn(static_cast<size_t>(n), 11), g = randn(static_cast<size_t>(n), 12);
      // Non-finite values: NaN and infinite gradients, a NaN and an infinite
      // parameter. The NaN of payload all ones reaches the states (fp32
      // gradients): a stochastic rounding that added bits to it would carry
      // into the sign and turn it into -0.
      g[100] = NAN;
      g[777] = INFINITY;
      g[3000] = o::f32_from_bits(0x7FFFFFFFu);
      p[1500] = NAN;
      p[2222] = -INFINITY;
      std::vector<uint16_t> pb(static_cast<size_t>(n)), gb(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) pb[static_cast<size_t>(i)] = o::bf16_rne(p[static_cast<size_t>(i)] * 3.0f);
      for (int64_t i = 0; i < n; ++i) gb[static_cast<size_t>(i)] = o::bf16_rne(g[static_cast<size_t>(i)]);
      const int64_t sb = o::state_bytes(f, n);
      std::vector<uint8_t> m(static_cast<size_t>(sb), 0), v(static_cast<size_t>(sb), 0);
      std::vector<float> am(static_cast<size_t>(o::state_absmax_count(f, n)) + 1, 0.0f), av(am);
      for (int64_t step = 1; step <= 3; ++step) {
        for (int pass = 0; pass < 2; ++pass) {
          o::AdamWTensor t;
          t.param = pass ? static_cast<void*>(pb.data()) : static_cast<void*>(p.data());
          t.param_dtype = pass ? o::Dtype::BF16 : o::Dtype::F32;
          t.grad = bf16_grad ? static_cast<const void*>(gb.data()) : static_cast<const void*>(g.data());
          t.grad_dtype = bf16_grad ? o::Dtype::BF16 : o::Dtype::F32;
          t.exp_avg = m.data();
          t.exp_avg_sq = v.data();
          t.exp_avg_absmax = am.data();
          t.exp_avg_sq_absmax = av.data();
          t.numel = n;
          t.step = step;
          o::detail::AdamWScalars s;
          s.neg_step = -1e-3f * static_cast<float>(step);
          s.neg_step_bc2 = -0.7e-3f * static_cast<float>(step);
          s.bc2_sqrt = 0.5f;
          if (!small_w1) {  // beta1 0.4: torch's lerp with a weight >= 0.5
            s.small_w1 = false;
            s.w1 = 0.6f;
            s.one_minus_w1 = 0.4f;
          }
          k->adamw(t, nullptr, f, s, o::detail::chunk_keys(5, 0, step, 0), 0, n);
        }
      }
      std::vector<uint8_t> all(reinterpret_cast<uint8_t*>(p.data()), reinterpret_cast<uint8_t*>(p.data() + n));
      all.insert(all.end(), reinterpret_cast<uint8_t*>(pb.data()), reinterpret_cast<uint8_t*>(pb.data() + n));
      all.insert(all.end(), m.begin(), m.end());
      all.insert(all.end(), v.begin(), v.end());
      outs.push_back(all);
    }
    for (size_t i = 1; i < outs.size(); ++i)
      EXPECT_EQ(outs[0], outs[i]) << o::state_format_name(f) << " " << isas[i]->isa << " variant " << variant;
  }
}

// The fused pass (the overlapped step's, docs/design/optim.md "Fusion") gives
// the bits of the separate passes it replaces: the gradient assembled as
// torch adds it (prior + landed), its sum of squares, the copy of parameter and
// states, and the step -- for fp32 and bf16 parameters, every state format,
// with and without a prior gradient, kept or not, several chunks and a tail.
TEST(OptimAdamW, FusedPassEqualsTheSeparatePasses) {
  const int64_t n = 2 * 65536 + 300;
  const size_t un = static_cast<size_t>(n);
  for (o::StateFormat f : {o::StateFormat::F32, o::StateFormat::BF16, o::StateFormat::Q8}) {
    for (bool bf16 : {false, true}) {
      for (int variant = 0; variant < 4; ++variant) {
        const bool has_prior = variant & 1, keep = variant & 2;
        const int64_t es = bf16 ? 2 : 4, sb = o::state_bytes(f, n);
        const size_t blocks = static_cast<size_t>(o::state_absmax_count(f, n));
        // Two identical problems: [0] fused, [1] separate passes.
        std::vector<uint8_t> p[2], prior[2], m[2], v[2], landed(un * es);
        std::vector<float> am[2], av[2];
        const std::vector<float> p0 = randn(un, 21), g0 = randn(un, 22), h0 = randn(un, 23, 0.5f);
        for (int k = 0; k < 2; ++k) {
          p[k].resize(un * es);
          prior[k].resize(un * es);
          m[k].assign(static_cast<size_t>(sb), 0);
          v[k].assign(static_cast<size_t>(sb), 0);
          am[k].assign(blocks, 0.0f);
          av[k].assign(blocks, 0.0f);
        }
        for (size_t i = 0; i < un; ++i)
          for (int k = 0; k < 2; ++k) {
            if (bf16) {
              reinterpret_cast<uint16_t*>(p[k].data())[i] = o::bf16_rne(p0[i]);
              reinterpret_cast<uint16_t*>(prior[k].data())[i] = o::bf16_rne(h0[i]);
              reinterpret_cast<uint16_t*>(landed.data())[i] = o::bf16_rne(g0[i]);
            } else {
              reinterpret_cast<float*>(p[k].data())[i] = p0[i];
              reinterpret_cast<float*>(prior[k].data())[i] = h0[i];
              reinterpret_cast<float*>(landed.data())[i] = g0[i];
            }
          }
        auto tensor = [&](int k) {
          o::AdamWTensor t;
          t.param = p[k].data();
          t.param_dtype = t.grad_dtype = bf16 ? o::Dtype::BF16 : o::Dtype::F32;
          t.exp_avg = m[k].data();
          t.exp_avg_sq = v[k].data();
          t.exp_avg_absmax = am[k].data();
          t.exp_avg_sq_absmax = av[k].data();
          t.numel = n;
          t.key = 3;
          return t;
        };
        o::AdamWConfig c;
        c.lr = 1e-2;
        std::vector<uint8_t> out(un * es), copy_p(un * es), copy_m(static_cast<size_t>(sb)), copy_v(copy_m);
        std::vector<float> copy_am(blocks), copy_av(blocks);
        for (int64_t step = 1; step <= 2; ++step) {
          // Fused.
          o::AdamWTensor t = tensor(0);
          t.step = step;
          o::AdamWFused src;
          src.landed = landed.data();
          src.prior = has_prior ? prior[0].data() : nullptr;
          src.out = keep ? (has_prior ? prior[0].data() : out.data()) : nullptr;
          src.copy_param = copy_p.data();
          src.copy_exp_avg = copy_m.data();
          src.copy_exp_avg_sq = copy_v.data();
          src.copy_exp_avg_absmax = copy_am.data();
          src.copy_exp_avg_sq_absmax = copy_av.data();
          o::ThreadPool pool(step == 1 ? 3 : 1);
          const double sum = o::adamw_fused(c, f, {t}, {src}, o::FusedWork{true, true}, 0.5f, 9, &pool).at(0);
          // Separate: the gradient, its norm, the copy, the step.
          std::vector<uint8_t> g(landed);
          if (has_prior)
            for (size_t i = 0; i < un; ++i) {
              if (bf16) {
                auto* gp = reinterpret_cast<uint16_t*>(g.data());
                const auto* hp = reinterpret_cast<const uint16_t*>(prior[1].data());
                gp[i] = o::bf16_rne(o::bf16_to_f32(hp[i]) + o::bf16_to_f32(gp[i]));
              } else {
                reinterpret_cast<float*>(g.data())[i] += reinterpret_cast<const float*>(prior[1].data())[i];
              }
            }
          if (has_prior && keep) prior[1] = g;  // accumulated in place
          const double want = o::sum_of_squares({o::Span{g.data(), t.grad_dtype, n}});
          EXPECT_EQ(sum, want);
          EXPECT_EQ(copy_p, p[1]);
          EXPECT_EQ(copy_m, m[1]);
          EXPECT_EQ(copy_v, v[1]);
          if (f == o::StateFormat::Q8) {
            EXPECT_TRUE(same_bits(copy_am, am[1]));
          }
          o::AdamWTensor r = tensor(1);
          r.grad = g.data();
          r.step = step;
          o::adamw_step(c, f, {r}, 0.5f, 9);
          if (keep) {
            EXPECT_EQ(has_prior ? prior[0] : out, g);
          } else {
            EXPECT_EQ(prior[0], prior[1]);  // the prior is only read
          }
        }
        const std::string what = std::string(o::state_format_name(f)) + (bf16 ? " bf16" : " fp32") +
                                 (has_prior ? " prior" : "") + (keep ? " keep" : "");
        EXPECT_EQ(p[0], p[1]) << what;
        EXPECT_EQ(m[0], m[1]) << what;
        EXPECT_EQ(v[0], v[1]) << what;
        EXPECT_TRUE(same_bits(am[0], am[1])) << what;
        // Without the update: only the gradient and its sum.
        o::AdamWTensor t = tensor(0);
        o::AdamWFused src;
        src.landed = landed.data();
        std::vector<uint8_t> before = p[0];
        const double sum = o::adamw_fused(c, f, {t}, {src}, o::FusedWork{true, false}).at(0);
        EXPECT_EQ(sum, o::sum_of_squares({o::Span{landed.data(), t.grad_dtype, n}})) << what;
        EXPECT_EQ(p[0], before) << what;
      }
    }
  }
}

// The gradient additions of every instruction set this CPU runs agree.
TEST(OptimAdamW, EveryInstructionSetAddsGradientsAlike) {
  const std::vector<const o::detail::Kernels*> isas = instruction_sets();
  if (isas.size() < 2) GTEST_SKIP() << "this CPU runs only the generic loops";
  const size_t n = 1000 + 7;
  std::vector<float> a = randn(n, 31), b = randn(n, 32);
  a[3] = std::nanf("");
  b[4] = std::numeric_limits<float>::infinity();
  std::vector<uint16_t> a16(n), b16(n);
  for (size_t i = 0; i < n; ++i) {
    a16[i] = o::bf16_rne(a[i]);
    b16[i] = o::bf16_rne(b[i]);
  }
  std::vector<std::vector<float>> out(isas.size(), std::vector<float>(n));
  std::vector<std::vector<uint16_t>> out16(isas.size(), std::vector<uint16_t>(n));
  for (size_t k = 0; k < isas.size(); ++k) {
    isas[k]->grad_add(out[k].data(), a.data(), b.data(), o::Dtype::F32, static_cast<int64_t>(n));
    isas[k]->grad_add(out16[k].data(), a16.data(), b16.data(), o::Dtype::BF16, static_cast<int64_t>(n));
  }
  for (size_t k = 1; k < isas.size(); ++k) {
    EXPECT_TRUE(same_bits(out[0], out[k])) << isas[k]->isa;
    EXPECT_EQ(out16[0], out16[k]) << isas[k]->isa;
  }
  EXPECT_EQ(out[0][10], a[10] + b[10]);
}

// Adafactor's loops (row/column statistics, the update's sum of squares, the
// update) give identical bits on every instruction set this CPU runs, for
// fp32 and bf16 parameters, factored or not, with a first moment and weight
// decay, on sizes that leave tails.
TEST(OptimAdafactor, EveryInstructionSetGivesTheSameBits) {
  const std::vector<const o::detail::Kernels*> isas = instruction_sets();
  if (isas.size() < 2) GTEST_SKIP() << "this CPU runs only the generic loops";
  const int64_t R = 19, C = 77, n = R * C;
  for (int variant = 0; variant < 4; ++variant) {
    const bool factored = variant % 2 == 0, bf16 = variant >= 2;
    std::vector<std::vector<uint8_t>> outs;
    for (const o::detail::Kernels* k : isas) {
      std::vector<float> p = randn(static_cast<size_t>(n), 5), g = randn(static_cast<size_t>(n), 6, 0.1f);
      std::vector<uint16_t> pb(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) pb[static_cast<size_t>(i)] = o::bf16_rne(p[static_cast<size_t>(i)]);
      std::vector<float> v(static_cast<size_t>(n), 0.01f), m(static_cast<size_t>(n), 0.0f);
      o::AdafactorTensor t;
      t.param = bf16 ? static_cast<void*>(pb.data()) : static_cast<void*>(p.data());
      t.param_dtype = bf16 ? o::Dtype::BF16 : o::Dtype::F32;
      t.grad = g.data();
      t.factored = factored;
      t.rows = factored ? R : 1;
      t.cols = factored ? C : n;
      t.exp_avg_sq = v.data();
      t.exp_avg = m.data();
      o::detail::AdafactorScalars s;
      s.grad_scale = 0.5f;
      s.b2t = 0.9f;
      s.om_b2t = 0.1f;
      s.clip_div = 1.25f;
      s.lr = 1e-2f;
      s.first_moment = true;
      s.beta1 = 0.9f;
      s.om_beta1 = 0.1f;
      s.weight_decay = true;
      s.neg_wd_lr = -1e-4f;
      std::vector<double> rows(static_cast<size_t>(R), 0.0), cols(static_cast<size_t>(C), 0.0);
      if (factored) k->af_stats(t, s, 0, 0, R, rows.data(), cols.data());
      std::vector<float> rf(static_cast<size_t>(R)), cf(static_cast<size_t>(C));
      for (int64_t r = 0; r < R; ++r) rf[static_cast<size_t>(r)] = 1.0f / (1.0f + static_cast<float>(r) * 0.01f);
      for (int64_t c = 0; c < C; ++c) cf[static_cast<size_t>(c)] = 1.0f + static_cast<float>(c) * 0.003f;
      const double ss = k->af_update_sumsq(t, s, rf.data(), cf.data(), 0, n);
      k->af_apply(t, s, rf.data(), cf.data(), o::detail::chunk_keys(9, 1, 1, 0), 0, n);
      std::vector<uint8_t> all;
      const auto put = [&all](const void* d, size_t bytes) {
        all.insert(all.end(), static_cast<const uint8_t*>(d), static_cast<const uint8_t*>(d) + bytes);
      };
      put(rows.data(), rows.size() * 8);
      put(cols.data(), cols.size() * 8);
      put(&ss, 8);
      put(p.data(), p.size() * 4);
      put(pb.data(), pb.size() * 2);
      put(v.data(), v.size() * 4);
      put(m.data(), m.size() * 4);
      outs.push_back(all);
    }
    for (size_t i = 1; i < outs.size(); ++i) EXPECT_EQ(outs[0], outs[i]) << "variant " << variant << " " << isas[i]->isa;
  }
}

// bf16 parameters: many small steps whose updates are far below one bf16 ulp
// still move the weight on average as the fp32 computation does.
TEST(OptimAdamW, Bf16StochasticRoundingTracksFp32OnAverage) {
  const int64_t n = 4096;
  std::vector<uint16_t> p(static_cast<size_t>(n), o::bf16_rne(1.0f));
  std::vector<uint16_t> g(static_cast<size_t>(n), o::bf16_rne(1.0f));
  std::vector<float> m(static_cast<size_t>(n), 0.0f), v(m);
  o::AdamWConfig c;
  c.lr = 1e-4;  // 1/78 of a bf16 ulp at 1.0 per step
  c.weight_decay = 0;
  const int steps = 200;
  for (int64_t step = 1; step <= steps; ++step) {
    o::AdamWTensor t;
    t.param = p.data();
    t.param_dtype = o::Dtype::BF16;
    t.grad = g.data();
    t.grad_dtype = o::Dtype::BF16;
    t.exp_avg = m.data();
    t.exp_avg_sq = v.data();
    t.numel = n;
    t.step = step;
    o::adamw_step(c, o::StateFormat::F32, {t}, 1.0f, 9);
  }
  // The update with a constant gradient is lr * 1 / (1 + eps') per step.
  double mean = 0;
  for (uint16_t x : p) mean += o::bf16_to_f32(x);
  mean /= static_cast<double>(n);
  const double expected = 1.0 - steps * c.lr;  // 0.98
  // Each weight is a sum of `steps` independent roundings, each with
  // variance <= ulp^2 / 4 (ulp = 2^-7 near 1, 2^-8 below 1): the mean over
  // n weights has a standard deviation <= 2^-7 / 2 * sqrt(steps / n) =
  // 8.6e-4; 5 sigma is 4.3e-3. Round to nearest would leave every weight at
  // 1.0 (an error of 0.02).
  EXPECT_NEAR(mean, expected, 4.3e-3);
  EXPECT_GT(std::fabs(mean - 1.0), 0.01);
}

// Stochastic rounding of equal values x to codes: `patterns` are the codes
// of blocks of elements; every code is `lo` or `lo + 1`, the share rounded
// up is within 5 sigma of the probability `f` (the dropped bits of x), and
// no two blocks have the same up/down pattern (a block reusing another's
// random bits would repeat it; with f in [0.3, 0.7] a chance repeat of 64
// elements has probability below 0.58^64 = 1e-15 per pair).
void expect_own_rounding_bits(std::vector<std::vector<uint32_t>> patterns, uint32_t lo, double f,
                              const std::string& what) {
  ASSERT_GT(f, 0.3) << what;
  ASSERT_LT(f, 0.7) << what;
  int64_t up = 0, count = 0;
  for (const auto& pat : patterns)
    for (uint32_t y : pat) {
      ASSERT_TRUE(y == lo || y == lo + 1) << what << ": " << y << " from " << lo;
      up += y != lo;
      ++count;
    }
  const double share = static_cast<double>(up) / static_cast<double>(count);
  EXPECT_NEAR(share, f, 5 * std::sqrt(f * (1 - f) / static_cast<double>(count))) << what;
  std::sort(patterns.begin(), patterns.end());
  EXPECT_EQ(std::adjacent_find(patterns.begin(), patterns.end()), patterns.end()) << what << ": two blocks rounded alike";
}

// Elements [b + skip, b + len) of each block of `len` elements (the last may
// be shorter).
template <class T>
std::vector<std::vector<uint32_t>> blocks_of(const std::vector<T>& a, size_t len, size_t skip) {
  std::vector<std::vector<uint32_t>> out;
  for (size_t b = 0; b < a.size(); b += len)
    out.emplace_back(a.begin() + static_cast<std::ptrdiff_t>(b + skip),
                     a.begin() + static_cast<std::ptrdiff_t>(std::min(a.size(), b + len)));
  return out;
}

// An optimizer tensor (AdamWTensor, AdafactorTensor) of bf16 parameter `p`
// with fp32 gradient `g`.
template <class T>
T bf16_with_grad(std::vector<uint16_t>& p, std::vector<float>& g) {
  T t;
  t.param = p.data();
  t.param_dtype = o::Dtype::BF16;
  t.grad = g.data();
  return t;
}

// An AdamW tensor of it with state buffers m, v (absmax arrays for 8-bit
// states), at step 0.
o::AdamWTensor bf16_param_tensor(std::vector<uint16_t>& p, std::vector<float>& g, void* m, void* v) {
  o::AdamWTensor t = bf16_with_grad<o::AdamWTensor>(p, g);
  t.exp_avg = m;
  t.exp_avg_sq = v;
  t.numel = static_cast<int64_t>(p.size());
  return t;
}

uint32_t high16(float x) { return __builtin_bit_cast(uint32_t, x) >> 16; }
double dropped_fraction(float x, int bits) {
  return (__builtin_bit_cast(uint32_t, x) & ((1u << bits) - 1)) / static_cast<double>(1u << bits);
}

// Equal elements get their own rounding bits: every element of a tensor
// holds the same value and gradient, so before rounding the parameter,
// exp_avg and exp_avg_sq are the same everywhere (x); each element rounds x
// up with probability (low 16 bits of x) / 2^16, independently of the other
// elements. The loops run in blocks of 64 elements, checked as above for
// each array and instruction set.
TEST(OptimAdamW, Bf16RoundingBitsDifferAcrossElements) {
  const int64_t n = 64 * 64 + 5;
  o::detail::AdamWScalars s;
  s.neg_step_bc2 = -3e-3f;  // fractions 0.57 (p), 0.55 (m), 0.55 (v)
  s.eps_bc2 = 1e-8f;
  const float g0 = 0.37f;
  // The values before rounding, as the kernel computes them.
  const float mx = 0.0f + s.w1 * (g0 - 0.0f);
  const float vx = 0.0f * s.beta2 + s.omb2 * g0 * g0;
  const float px = 1.0f * s.decay + s.neg_step_bc2 * mx / (std::sqrt(vx) + s.eps_bc2);
  for (const o::detail::Kernels* k : instruction_sets()) {
    std::vector<uint16_t> p(static_cast<size_t>(n), o::bf16_rne(1.0f));
    std::vector<float> g(static_cast<size_t>(n), g0);
    std::vector<uint16_t> m(static_cast<size_t>(n), 0), v(m);
    k->adamw(bf16_param_tensor(p, g, m.data(), v.data()), nullptr, o::StateFormat::BF16, s,
             o::detail::chunk_keys(3, 0, 1, 0), 0, n);
    const std::string isa = k->isa;
    expect_own_rounding_bits(blocks_of(p, 64, 0), high16(px), dropped_fraction(px, 16), isa + " param");
    expect_own_rounding_bits(blocks_of(m, 64, 0), high16(mx), dropped_fraction(mx, 16), isa + " exp_avg");
    expect_own_rounding_bits(blocks_of(v, 64, 0), high16(vx), dropped_fraction(vx, 16), isa + " exp_avg_sq");
  }
}

// The same for 8-bit states: in each 256-element block the first element's
// gradient (1) sets the absmax and the others are equal (g0), so before
// encoding their exp_avg and exp_avg_sq are one value y (relative to the
// absmax, times kQ8Top) everywhere; each element's code rounds y up with
// probability (the 20 bits the code drops) / 2^20. bf16 parameters as above.
TEST(OptimAdamW, EightBitRoundingBitsDifferAcrossElements) {
  const int64_t blocks = 48, n = blocks * o::kQ8Block;
  o::detail::AdamWScalars s;
  s.neg_step_bc2 = -3e-3f;
  s.eps_bc2 = 1e-8f;
  const float g0 = 0.418f;  // fractions 0.54 (m), 0.48 (v), 0.57 (p)
  const float mx = 0.0f + s.w1 * (g0 - 0.0f), mtop = 0.0f + s.w1 * (1.0f - 0.0f);
  const float vx = 0.0f * s.beta2 + s.omb2 * g0 * g0, vtop = 0.0f * s.beta2 + s.omb2 * 1.0f * 1.0f;
  const float ym = mx * (o::kQ8Top / mtop), yv = vx * (o::kQ8Top / vtop);
  const float px = 1.0f * s.decay + s.neg_step_bc2 * mx / (std::sqrt(vx) + s.eps_bc2);
  for (const o::detail::Kernels* k : instruction_sets()) {
    std::vector<uint16_t> p(static_cast<size_t>(n), o::bf16_rne(1.0f));
    std::vector<float> g(static_cast<size_t>(n), g0);
    for (int64_t b = 0; b < n; b += o::kQ8Block) g[static_cast<size_t>(b)] = 1.0f;
    std::vector<uint8_t> m(static_cast<size_t>(n), 0), v(m);
    std::vector<float> ma(static_cast<size_t>(blocks), 0.0f), va(ma);
    o::AdamWTensor t = bf16_param_tensor(p, g, m.data(), v.data());
    t.exp_avg_absmax = ma.data();
    t.exp_avg_sq_absmax = va.data();
    k->adamw(t, nullptr, o::StateFormat::Q8, s, o::detail::chunk_keys(3, 0, 1, 0), 0, n);
    ASSERT_EQ(ma[0], mtop);
    ASSERT_EQ(va[0], vtop);
    const std::string isa = k->isa;
    const size_t len = static_cast<size_t>(o::kQ8Block);
    expect_own_rounding_bits(blocks_of(m, len, 1), o::q8_code_e4m3(ym, 0), dropped_fraction(ym, 20), isa + " exp_avg");
    expect_own_rounding_bits(blocks_of(v, len, 1), o::q8_code_e5m3(yv, 0), dropped_fraction(yv, 20),
                             isa + " exp_avg_sq");
    expect_own_rounding_bits(blocks_of(p, len, 1), high16(px), dropped_fraction(px, 16), isa + " param");
  }
}

// Adafactor's bf16 parameters too: equal gradients and factors give every
// element the same update, so the same value before rounding; its loop runs
// per row in tiles of 256 elements (rows of 1000 here), and the checks above
// apply to 64-element blocks of the flat array.
TEST(OptimAdafactor, Bf16RoundingBitsDifferAcrossElements) {
  const int64_t R = 8, C = 1000, n = R * C;
  o::detail::AdafactorScalars s;
  s.lr = 1.0f;
  const float g0 = 0.0017f;  // fraction 0.56
  const float px = 1.0f + -(((1.0f * 1.0f) * (g0 * s.grad_scale)) / s.clip_div * s.lr);
  for (const o::detail::Kernels* k : instruction_sets()) {
    std::vector<uint16_t> p(static_cast<size_t>(n), o::bf16_rne(1.0f));
    std::vector<float> g(static_cast<size_t>(n), g0), rf(static_cast<size_t>(R), 1.0f), cf(static_cast<size_t>(C), 1.0f);
    o::AdafactorTensor t = bf16_with_grad<o::AdafactorTensor>(p, g);
    t.factored = true;
    t.rows = R;
    t.cols = C;
    k->af_apply(t, s, rf.data(), cf.data(), o::detail::chunk_keys(5, 2, 1, 0), 0, n);
    expect_own_rounding_bits(blocks_of(p, 64, 0), high16(px), dropped_fraction(px, 16), std::string(k->isa) + " param");
  }
}

// 8-bit states follow fp32 states closely on a quadratic problem.
// An fp32 parameter, its gradient and its states (absmax values: empty unless 8-bit) as
// one tensor of a step.
static o::AdamWTensor with_states(std::vector<float>& p, std::vector<float>& g, void* m, void* v,
                                  std::vector<float>& am, std::vector<float>& av, int64_t step) {
  o::AdamWTensor t;
  t.param = p.data();
  t.grad = g.data();
  t.exp_avg = m;
  t.exp_avg_sq = v;
  t.exp_avg_absmax = am.empty() ? nullptr : am.data();
  t.exp_avg_sq_absmax = av.empty() ? nullptr : av.data();
  t.numel = static_cast<int64_t>(p.size());
  t.step = step;
  return t;
}

TEST(OptimAdamW, EightBitStatesStayCloseToFp32) {
  const int64_t n = 10000;
  std::vector<float> target = randn(static_cast<size_t>(n), 21);
  auto run = [&](o::StateFormat f) {
    std::vector<float> p(static_cast<size_t>(n), 0.0f), g(p);
    const int64_t sb = o::state_bytes(f, n);
    std::vector<uint8_t> m(static_cast<size_t>(sb), 0), v(m);
    std::vector<float> am(static_cast<size_t>(o::state_absmax_count(f, n)), 0.0f), av(am);
    o::AdamWConfig c;
    c.lr = 0.05;
    c.weight_decay = 0;
    for (int64_t step = 1; step <= 100; ++step) {
      for (int64_t i = 0; i < n; ++i) g[static_cast<size_t>(i)] = p[static_cast<size_t>(i)] - target[static_cast<size_t>(i)];
      o::adamw_step(c, f, {with_states(p, g, m.data(), v.data(), am, av, step)}, 1.0f, 3);
    }
    double loss = 0;
    for (int64_t i = 0; i < n; ++i) {
      const double d = p[static_cast<size_t>(i)] - target[static_cast<size_t>(i)];
      loss += d * d;
    }
    return loss / static_cast<double>(n);
  };
  const double l32 = run(o::StateFormat::F32), l16 = run(o::StateFormat::BF16), l8 = run(o::StateFormat::Q8);
  // The start loss is 1 (unit normal targets).
  EXPECT_LT(l32, 0.05);
  EXPECT_LT(std::fabs(l16 - l32), 0.1 * l32 + 1e-3) << l16 << " vs " << l32;
  EXPECT_LT(std::fabs(l8 - l32), 0.25 * l32 + 2e-3) << l8 << " vs " << l32;
}

TEST(OptimAdamW, EightBitBlockWithNanReadsAsNan) {
  const int64_t n = 600;  // blocks [0,256) [256,512) [512,600)
  std::vector<float> p(static_cast<size_t>(n), 1.0f), g = randn(static_cast<size_t>(n), 4);
  g[300] = std::nanf("");
  std::vector<uint8_t> m(static_cast<size_t>(n), 0), v(m);
  std::vector<float> am(3, 0.0f), av(am);
  o::AdamWTensor t;
  t.param = p.data();
  t.grad = g.data();
  t.exp_avg = m.data();
  t.exp_avg_sq = v.data();
  t.exp_avg_absmax = am.data();
  t.exp_avg_sq_absmax = av.data();
  t.numel = n;
  o::adamw_step(o::AdamWConfig{}, o::StateFormat::Q8, {t});
  EXPECT_TRUE(std::isnan(p[300]));
  EXPECT_FALSE(std::isnan(p[299]));  // this step used the element's own values
  EXPECT_TRUE(std::isnan(am[1]) && std::isnan(av[1]));
  EXPECT_FALSE(std::isnan(am[0]) || std::isnan(am[2]));
}

// q8_encode / q8_decode: the conversion of loaded states (docs/design/optim.md,
// "Converting states").
TEST(OptimQ8, ConversionIsNearestAndGivesAStepsCodesBack) {
  const int64_t n = 600;  // blocks [0,256) [256,512) [512,600)
  const size_t un = static_cast<size_t>(n);
  // States a few 8-bit steps wrote: decoded, then encoded, they are the same codes.
  std::vector<float> p = randn(un, 5);
  std::vector<uint8_t> m(un, 0), v(un, 0);
  std::vector<float> am(3, 0.0f), av(am);
  for (int64_t step = 1; step <= 3; ++step) {
    std::vector<float> g = randn(un, static_cast<uint32_t>(40 + step));
    g[7] *= 1e-4f;  // small moments too, in the codes' subnormal range
    o::adamw_step(o::AdamWConfig{}, o::StateFormat::Q8, {with_states(p, g, m.data(), v.data(), am, av, step)}, 1.0f, 9);
  }
  for (bool first : {true, false}) {
    const std::vector<uint8_t>& codes = first ? m : v;
    const std::vector<float>& absmax = first ? am : av;
    std::vector<float> x(un), back(3);
    std::vector<uint8_t> again(un);
    o::q8_decode(codes.data(), absmax.data(), n, first, x.data());
    ASSERT_TRUE(o::q8_encode(x.data(), n, first, again.data(), back.data()));
    EXPECT_EQ(again, codes) << first;
    EXPECT_TRUE(same_bits(back, absmax)) << first;
  }
  // Floats: each element gets the code nearest to it (checked against all codes of its
  // block), the block's absmax is its largest magnitude.
  for (bool first : {true, false}) {
    std::vector<float> x = randn(un, first ? 6 : 7);
    for (size_t i = 0; i < un; ++i) x[i] = first ? x[i] * std::exp2(-static_cast<float>(i % 20))
                                               : x[i] * x[i] * std::exp2(-static_cast<float>(i % 40));
    std::vector<uint8_t> codes(un);
    std::vector<float> absmax(3), d(un);
    ASSERT_TRUE(o::q8_encode(x.data(), n, first, codes.data(), absmax.data()));
    o::q8_decode(codes.data(), absmax.data(), n, first, d.data());
    for (int64_t b = 0; b < 3; ++b) {
      float top = 0;
      for (int64_t i = b * 256; i < std::min(n, b * 256 + 256); ++i) top = std::max(top, std::fabs(x[static_cast<size_t>(i)]));
      EXPECT_EQ(absmax[static_cast<size_t>(b)], top) << b;
    }
    for (size_t i = 0; i < un; ++i) {
      float best = std::numeric_limits<float>::infinity();
      for (uint32_t c = !first && x[i] > 0 ? 1 : 0; c < 256; ++c) {  // code 0 only for a zero second moment
        const float value = (first ? o::q8_value_e4m3(c) : o::q8_value_e5m3(c)) * absmax[i / 256];
        best = std::min(best, std::fabs(value - x[i]));
      }
      EXPECT_LE(std::fabs(d[i] - x[i]), best * (1 + 1e-6f) + 1e-30f) << first << " " << i;
      if (!first && x[i] > 0) {
        EXPECT_GT(codes[i], 0) << i;  // a nonzero second moment keeps a nonzero code
      }
    }
  }
  // A NaN makes its block NaN, the others keep their values; a negative second moment is refused.
  std::vector<float> x = randn(un, 8);
  for (float& e : x) e = std::fabs(e);
  x[300] = std::nanf("");
  std::vector<uint8_t> codes(un);
  std::vector<float> absmax(3), d(un);
  ASSERT_TRUE(o::q8_encode(x.data(), n, false, codes.data(), absmax.data()));
  o::q8_decode(codes.data(), absmax.data(), n, false, d.data());
  EXPECT_TRUE(std::isnan(absmax[1]) && std::isnan(d[256]) && std::isnan(d[511]));
  EXPECT_FALSE(std::isnan(d[255]) || std::isnan(d[512]));
  x[300] = -1.0f;
  EXPECT_FALSE(o::q8_encode(x.data(), n, false, codes.data(), absmax.data()));
  EXPECT_TRUE(o::q8_encode(x.data(), n, true, codes.data(), absmax.data()));  // a first moment may be negative
}

TEST(OptimAdamW, ArgumentRules) {
  o::AdamWConfig c;
  c.lr = -1;
  EXPECT_NE(throws_message([&] { o::check_adamw(c); }).find("Invalid learning rate"), std::string::npos);
  c = o::AdamWConfig{};
  c.beta2 = 1.0;
  EXPECT_NE(throws_message([&] { o::check_adamw(c); }).find("beta parameter at index 1"), std::string::npos);
  c = o::AdamWConfig{};
  c.eps = std::nan("");
  EXPECT_NE(throws_message([&] { o::check_adamw(c); }).find("epsilon"), std::string::npos);
  c = o::AdamWConfig{};
  c.weight_decay = -0.1;
  EXPECT_NE(throws_message([&] { o::check_adamw(c); }).find("weight_decay"), std::string::npos);
  EXPECT_NE(throws_message([] { o::parse_state_format("int4"); }).find("'fp32', 'bf16' or '8bit'"),
            std::string::npos);
  EXPECT_EQ(o::parse_state_format("8bit"), o::StateFormat::Q8);
  o::AdamWTensor t;
  std::vector<float> x(4);
  t.param = t.exp_avg = t.exp_avg_sq = x.data();
  t.grad = x.data();
  t.numel = 4;
  t.step = 0;
  EXPECT_NE(throws_message([&] { o::adamw_step(o::AdamWConfig{}, o::StateFormat::F32, {t}); }).find("step must be >= 1"),
            std::string::npos);
  EXPECT_DOUBLE_EQ(o::adamw_bytes_per_element(o::Dtype::F32, o::Dtype::F32, o::StateFormat::F32), 28.0);
  EXPECT_DOUBLE_EQ(o::adamw_bytes_per_element(o::Dtype::BF16, o::Dtype::BF16, o::StateFormat::BF16), 14.0);
}

// ---------------------------------------------------------------- norm
TEST(OptimNorm, SumOfSquaresAndClipCoefficient) {
  std::vector<float> a = randn(200001, 5);
  std::vector<uint16_t> b(1000);
  for (size_t i = 0; i < b.size(); ++i) b[i] = o::bf16_rne(static_cast<float>(i) * 0.01f);
  double ref = 0;
  for (float x : a) ref += static_cast<double>(x) * x;
  for (uint16_t x : b) ref += static_cast<double>(o::bf16_to_f32(x)) * o::bf16_to_f32(x);
  o::ThreadPool one(1), three(3);
  const double s1 = o::sum_of_squares({{a.data(), o::Dtype::F32, 200001}, {b.data(), o::Dtype::BF16, 1000}}, &one);
  const double s3 = o::sum_of_squares({{a.data(), o::Dtype::F32, 200001}, {b.data(), o::Dtype::BF16, 1000}}, &three);
  EXPECT_EQ(s1, s3);  // same chunks, same order
  EXPECT_NEAR(s1, ref, 1e-12 * ref);
  a[17] = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(std::isinf(o::sum_of_squares({{a.data(), o::Dtype::F32, 200001}})));
  a[18] = std::nanf("");
  EXPECT_TRUE(std::isnan(o::sum_of_squares({{a.data(), o::Dtype::F32, 200001}})));
  // torch: min(max_norm / (norm + 1e-6), 1) as reciprocal * max_norm in fp32.
  EXPECT_EQ(o::clip_coefficient(0.5, 1.0), 1.0f);
  EXPECT_EQ(o::clip_coefficient(4.0, 1.0), (1.0f / (4.0f + 1e-6f)) * 1.0f);
  EXPECT_TRUE(std::isnan(o::clip_coefficient(std::nan(""), 1.0)));
  EXPECT_EQ(o::clip_coefficient(std::numeric_limits<double>::infinity(), 1.0), 0.0f);
}

// ---------------------------------------------------------------- Adafactor
// transformers' Adafactor.step for one fp32 tensor, written out in double
// (the tolerance covers fp32 rounding and summation order).
void reference_adafactor(std::vector<double>& p, const std::vector<float>& g, std::vector<double>& row,
                         std::vector<double>& col, std::vector<double>& v, std::vector<double>& m, int64_t R,
                         int64_t C, bool factored, const o::AdafactorConfig& c, int64_t step) {
  const size_t n = p.size();
  double ss = 0;
  for (double x : p) ss += x * x;
  const double rms = std::sqrt(ss) / std::sqrt(static_cast<double>(n));
  double rel = c.lr;
  if (c.relative_step) rel = std::min(c.warmup_init ? 1e-6 * step : 1e-2, 1.0 / std::sqrt(static_cast<double>(step)));
  const double lr = (c.scale_parameter ? std::max(c.eps2, rms) : 1.0) * rel;
  const double b2t = 1.0 - std::pow(static_cast<double>(step), c.decay_rate);
  std::vector<double> u(n);
  if (factored) {
    for (int64_t r = 0; r < R; ++r) {
      double s = 0;
      for (int64_t k = 0; k < C; ++k) s += static_cast<double>(g[r * C + k]) * g[r * C + k] + c.eps1;
      row[r] = row[r] * b2t + (1 - b2t) * s / C;
    }
    for (int64_t k = 0; k < C; ++k) {
      double s = 0;
      for (int64_t r = 0; r < R; ++r) s += static_cast<double>(g[r * C + k]) * g[r * C + k] + c.eps1;
      col[k] = col[k] * b2t + (1 - b2t) * s / R;
    }
    double rm = 0;
    for (int64_t r = 0; r < R; ++r) rm += row[r];
    rm /= R;
    for (int64_t r = 0; r < R; ++r)
      for (int64_t k = 0; k < C; ++k) u[r * C + k] = 1.0 / std::sqrt(row[r] / rm) / std::sqrt(col[k]) * g[r * C + k];
  } else {
    for (size_t i = 0; i < n; ++i) {
      v[i] = v[i] * b2t + (1 - b2t) * (static_cast<double>(g[i]) * g[i] + c.eps1);
      u[i] = g[i] / std::sqrt(v[i]);
    }
  }
  double us = 0;
  for (double x : u) us += x * x;
  const double div = std::max(std::sqrt(us / n) / c.clip_threshold, 1.0);
  for (size_t i = 0; i < n; ++i) {
    double x = u[i] / div * lr;
    if (c.beta1 >= 0) {
      m[i] = m[i] * c.beta1 + (1 - c.beta1) * x;
      x = m[i];
    }
    if (c.weight_decay != 0) p[i] += -c.weight_decay * lr * p[i];
    p[i] -= x;
  }
}

TEST(OptimAdafactor, MatchesAScalarReference) {
  for (int variant = 0; variant < 3; ++variant) {
    const bool factored = variant != 1;
    const int64_t R = 37, C = variant == 2 ? 300 : 23;
    const int64_t n = R * C;
    o::AdafactorConfig c;
    if (variant == 2) {  // manual lr, first moment, weight decay, no parameter scale
      c.relative_step = false;
      c.lr = 1e-2;
      c.beta1 = 0.9;
      c.weight_decay = 0.01;
      c.scale_parameter = false;
    }
    std::vector<float> p = randn(static_cast<size_t>(n), 31), row(static_cast<size_t>(R), 0.0f),
                       col(static_cast<size_t>(C), 0.0f), v(static_cast<size_t>(n), 0.0f), m(v);
    std::vector<double> rp(p.begin(), p.end()), rrow(static_cast<size_t>(R), 0.0), rcol(static_cast<size_t>(C), 0.0),
        rv(static_cast<size_t>(n), 0.0), rm(rv);
    for (int64_t step = 1; step <= 10; ++step) {
      std::vector<float> g = randn(static_cast<size_t>(n), 40 + static_cast<uint32_t>(step), 0.1f);
      std::vector<o::AdafactorTensor> ts(1);
      o::AdafactorTensor& t = ts[0];
      t.param = p.data();
      t.grad = g.data();
      t.factored = factored;
      t.rows = factored ? R : 1;
      t.cols = factored ? C : n;
      t.exp_avg_sq_row = row.data();
      t.exp_avg_sq_col = col.data();
      t.exp_avg_sq = v.data();
      t.exp_avg = m.data();
      t.step = step;
      o::adafactor_step(c, ts);
      reference_adafactor(rp, g, rrow, rcol, rv, rm, R, C, factored, c, step);
    }
    double err = 0, scale = 0;
    for (int64_t i = 0; i < n; ++i) {
      err = std::max(err, std::fabs(p[static_cast<size_t>(i)] - rp[static_cast<size_t>(i)]));
      scale = std::max(scale, std::fabs(rp[static_cast<size_t>(i)]));
    }
    EXPECT_LT(err, 2e-6 * scale) << "variant " << variant;
  }
}

TEST(OptimAdafactor, ArgumentRules) {
  o::AdafactorConfig c;
  c.lr = 1e-3;  // with relative_step (default)
  EXPECT_NE(throws_message([&] { o::check_adafactor(c); }).find("cannot combine a manual lr"), std::string::npos);
  c = o::AdafactorConfig{};
  c.relative_step = false;
  EXPECT_NE(throws_message([&] { o::check_adafactor(c); }).find("lr=None needs relative_step"), std::string::npos);
  c.lr = 1e-3;
  c.warmup_init = true;
  EXPECT_NE(throws_message([&] { o::check_adafactor(c); }).find("warmup_init"), std::string::npos);
}

TEST(OptimAdafactor, ThreadCountDoesNotChangeResults) {
  const int64_t B = 3, R = 700, C = 200;  // several row chunks per matrix
  std::vector<std::vector<float>> out;
  for (int threads : {1, 4}) {
    std::vector<float> p = randn(static_cast<size_t>(B * R * C), 51), g = randn(p.size(), 52);
    std::vector<float> row(static_cast<size_t>(B * R), 0.0f), col(static_cast<size_t>(B * C), 0.0f);
    o::ThreadPool pool(threads);
    for (int64_t step = 1; step <= 2; ++step) {
      std::vector<o::AdafactorTensor> ts(1);
      ts[0].param = p.data();
      ts[0].grad = g.data();
      ts[0].factored = true;
      ts[0].batch = B;
      ts[0].rows = R;
      ts[0].cols = C;
      ts[0].exp_avg_sq_row = row.data();
      ts[0].exp_avg_sq_col = col.data();
      ts[0].step = step;
      o::adafactor_step(o::AdafactorConfig{}, ts, 1.0f, 0, &pool);
    }
    out.push_back(p);
  }
  EXPECT_TRUE(same_bits(out[0], out[1]));
}

}  // namespace
