// Tests for csrc/core/quant.{h,cpp}: layouts, packing, reference dequantization,
// error bounds, scalar conversions, NaN/Inf handling, thread determinism.
#include "core/quant.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"

namespace q = layerstream::quant;
using q::Format;
using q::OutDtype;

namespace {

std::vector<uint8_t> pack_vec(Format f, const std::vector<float>& w, int64_t rows, int64_t cols,
                              int threads = 0) {
  const q::PackedLayout L = q::layout_for(f, rows, cols);
  std::vector<uint8_t> buf(L.total_bytes(), 0xAB);  // garbage: pack must overwrite all
  q::pack(f, w.data(), rows, cols, buf.data(), threads);
  return buf;
}

std::vector<float> dequant_f32(const q::PackedLayout& L, const std::vector<uint8_t>& buf,
                               int threads = 1) {
  std::vector<float> out(static_cast<size_t>(L.numel()));
  q::dequantize_cpu(L, buf.data(), out.data(), OutDtype::F32, threads);
  return out;
}

// Weights with per-row magnitudes spanning 1e-3..1e2, a few outliers and exact zeros.
std::vector<float> make_weights(int64_t rows, int64_t cols, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> w(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    const float mag = std::pow(10.0f, static_cast<float>(r % 6) - 3.0f);
    for (int64_t c = 0; c < cols; ++c) {
      float v = (u(rng) + u(rng) + u(rng)) * mag;
      if ((r * cols + c) % 97 == 0) v *= 8.0f;  // outliers
      if ((r * cols + c) % 13 == 0) v = 0.0f;   // exact zeros
      w[static_cast<size_t>(r * cols + c)] = v;
    }
  }
  return w;
}

std::string throws_message(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const layerstream::Error& e) {
    return e.what();
  }
  return "<no layerstream::Error thrown>";
}

std::string hex16(uint16_t v) {
  char b[8];
  std::snprintf(b, sizeof b, "0x%04X", v);
  return b;
}

}  // namespace

// ---------------------------------------------------------------- names

TEST(QuantNames, ParseAndPrint) {
  for (Format f : {Format::Int8, Format::Fp8E4M3, Format::NF4, Format::Int4, Format::None})
    EXPECT_EQ(q::parse_format(q::to_string(f)), f);
  EXPECT_EQ(q::parse_format("FP8"), Format::Fp8E4M3);
  EXPECT_EQ(q::parse_format("e4m3"), Format::Fp8E4M3);
  const std::string msg = throws_message([] { q::parse_format("int3"); });
  EXPECT_NE(msg.find("'int3'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("int8, fp8 (e4m3), nf4, int4"), std::string::npos) << msg;
  for (OutDtype d : {OutDtype::F32, OutDtype::BF16, OutDtype::F16})
    EXPECT_EQ(q::parse_out_dtype(q::to_string(d)), d);
  EXPECT_NE(throws_message([] { q::parse_out_dtype("f64"); }).find("f32, bf16, f16"),
            std::string::npos);
}

// ---------------------------------------------------------------- layouts

TEST(QuantLayout, BytesPerParameterAndAlignment) {
  const int64_t rows = 96, cols = 384, n = rows * cols;
  struct Want {
    Format f;
    size_t data, scale, zero;
    int64_t block;
  };
  // int8/fp8: 1 + 4/cols bytes per parameter; nf4: 0.5 + 4/64; int4: 0.5 + 8/128.
  const Want wants[] = {
      {Format::Int8, size_t(n), size_t(rows) * 4, 0, cols},
      {Format::Fp8E4M3, size_t(n), size_t(rows) * 4, 0, cols},
      {Format::NF4, size_t(n / 2), size_t(n / 64) * 4, 0, 64},
      {Format::Int4, size_t(n / 2), size_t(n / 128) * 4, size_t(n / 128) * 4, 128},
  };
  const double per_param[] = {1.0 + 4.0 / cols, 1.0 + 4.0 / cols, 0.5 + 4.0 / 64, 0.5 + 8.0 / 128};
  for (int i = 0; i < 4; ++i) {
    const q::PackedLayout L = q::layout_for(wants[i].f, rows, cols);
    SCOPED_TRACE(q::describe(L));
    EXPECT_EQ(L.format, wants[i].f);
    EXPECT_EQ(L.block_size, wants[i].block);
    EXPECT_EQ(L.data_bytes, wants[i].data);
    EXPECT_EQ(L.scale_bytes, wants[i].scale);
    EXPECT_EQ(L.zero_bytes, wants[i].zero);
    const size_t payload = L.data_bytes + L.scale_bytes + L.zero_bytes;
    EXPECT_DOUBLE_EQ(static_cast<double>(payload) / n, per_param[i]);
    EXPECT_EQ(L.data_offset(), 0u);
    EXPECT_EQ(L.scale_offset() % 256, 0u);
    EXPECT_EQ(L.zero_offset() % 256, 0u);
    EXPECT_EQ(L.total_bytes() % 256, 0u);
    EXPECT_GE(L.scale_offset(), L.data_bytes);
    EXPECT_GE(L.zero_offset(), L.scale_offset() + L.scale_bytes);
    EXPECT_GE(L.total_bytes(), L.zero_offset() + L.zero_bytes);
    EXPECT_LT(L.total_bytes(), payload + 3 * 256);  // at most 255 bytes padding per section
  }
  // nf4 on any element count: a partial last block and an odd nibble.
  const q::PackedLayout L = q::layout_for(Format::NF4, 3, 37);
  EXPECT_EQ(L.data_bytes, 56u);       // ceil(111 / 2)
  EXPECT_EQ(L.scale_bytes, 2u * 4u);  // ceil(111 / 64) blocks
}

TEST(QuantLayout, BadShapes) {
  std::string msg = throws_message([] { q::layout_for(Format::Int4, 4, 100); });
  EXPECT_NE(msg.find("[4, 100]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("group size 128"), std::string::npos) << msg;
  EXPECT_NE(msg.find("divisible"), std::string::npos) << msg;
  msg = throws_message([] { q::layout_for(Format::Int8, -1, 10); });
  EXPECT_NE(msg.find("[-1, 10]"), std::string::npos) << msg;
  msg = throws_message([] { q::layout_for(Format::None, 1, 10); });
  EXPECT_NE(msg.find("none"), std::string::npos) << msg;
  // A hand-made inconsistent layout is rejected by dequantize_cpu.
  q::PackedLayout bad = q::layout_for(Format::Int8, 2, 8);
  bad.data_bytes = 3;
  std::vector<uint8_t> buf(4096);
  std::vector<float> out(16);
  msg = throws_message([&] { q::dequantize_cpu(bad, buf.data(), out.data()); });
  EXPECT_NE(msg.find("inconsistent PackedLayout"), std::string::npos) << msg;
}

// ---------------------------------------------------------------- round trip (parameterized)

struct RoundTripCase {
  Format format;
  int64_t rows, cols;
  OutDtype out;
};

std::string case_name(const ::testing::TestParamInfo<RoundTripCase>& info) {
  const RoundTripCase& c = info.param;
  return std::string(q::to_string(c.format)) + "_" + std::to_string(c.rows) + "x" +
         std::to_string(c.cols) + "_" + q::to_string(c.out);
}

std::vector<RoundTripCase> round_trip_cases() {
  const std::pair<int64_t, int64_t> shapes[] = {{1, 128}, {3, 256}, {17, 384}, {64, 1024},
                                                {5, 100}, {3, 37},  {1, 1}};
  std::vector<RoundTripCase> cases;
  for (Format f : {Format::Int8, Format::Fp8E4M3, Format::NF4, Format::Int4})
    for (auto s : shapes)
      for (OutDtype d : {OutDtype::F32, OutDtype::BF16, OutDtype::F16}) {
        if (f == Format::Int4 && s.second % 128 != 0) continue;  // int4 needs cols % 128 == 0
        cases.push_back({f, s.first, s.second, d});
      }
  return cases;
}

class QuantRoundTrip : public ::testing::TestWithParam<RoundTripCase> {};

// Bounds asserted per element (quant.h; error_bound() adds 2^-10 relative slack
// for fp32 rounding in the quantizer):
//   int8: |w - w'| <= scale_row / 2            int4: <= scale_group / 2
//   nf4:  <= absmax_block * 0.1519036 (max half-gap between adjacent codes, -1 .. -0.696)
//   fp8:  <= scale_row * max(2^-4 * |w| / scale_row, 2^-10)
// For bf16/f16 outputs: bit-equal to RNE conversion of the fp32 result, and
// within the bound plus the output's half ulp (bf16 2^-8, f16 2^-11 relative,
// f16 subnormal step 2^-25 absolute).
TEST_P(QuantRoundTrip, WithinBoundAndBitExactConversion) {
  const RoundTripCase c = GetParam();
  const std::vector<float> w = make_weights(c.rows, c.cols, 1234u + static_cast<uint32_t>(c.rows));
  const q::PackedLayout L = q::layout_for(c.format, c.rows, c.cols);
  const std::vector<uint8_t> buf = pack_vec(c.format, w, c.rows, c.cols);
  const std::vector<float> f32 = dequant_f32(L, buf);

  // Scales follow the spec.
  const float* scales = reinterpret_cast<const float*>(buf.data() + L.scale_offset());
  if (c.format == Format::Int8 || c.format == Format::Fp8E4M3) {
    for (int64_t r = 0; r < c.rows; ++r) {
      float amax = 0;
      for (int64_t k = 0; k < c.cols; ++k) amax = std::max(amax, std::fabs(w[r * c.cols + k]));
      EXPECT_EQ(scales[r], amax / (c.format == Format::Int8 ? 127.0f : 448.0f)) << "row " << r;
    }
  } else if (c.format == Format::NF4) {
    for (int64_t b = 0; b < L.num_scales(); ++b) {
      float amax = 0;
      for (int64_t i = b * 64; i < std::min<int64_t>(L.numel(), b * 64 + 64); ++i)
        amax = std::max(amax, std::fabs(w[i]));
      EXPECT_EQ(scales[b], amax) << "block " << b;
    }
  }

  std::vector<uint16_t> half;
  if (c.out != OutDtype::F32) {
    half.resize(w.size());
    q::dequantize_cpu(L, buf.data(), half.data(), c.out, 3);
  }
  int failures = 0;
  for (int64_t r = 0; r < c.rows && failures < 5; ++r) {
    for (int64_t k = 0; k < c.cols && failures < 5; ++k) {
      const size_t i = static_cast<size_t>(r * c.cols + k);
      const double bound = q::error_bound(L, buf.data(), r, k, w[i]);
      const double err = std::fabs(static_cast<double>(f32[i]) - w[i]);
      if (!(err <= bound)) {
        ++failures;
        ADD_FAILURE() << "(" << r << ", " << k << "): w=" << w[i] << " w'=" << f32[i]
                      << " err=" << err << " > bound " << bound;
      }
      if (c.out == OutDtype::F32) continue;
      const uint16_t want = c.out == OutDtype::BF16 ? q::float_to_bf16_bits(f32[i])
                                                    : q::float_to_f16_bits(f32[i]);
      if (half[i] != want) {
        ++failures;
        ADD_FAILURE() << "(" << r << ", " << k << "): " << q::to_string(c.out) << " "
                      << hex16(half[i]) << " != RNE(" << f32[i] << ") = " << hex16(want);
      }
      const double back = c.out == OutDtype::BF16 ? q::bf16_bits_to_float(half[i])
                                                  : q::f16_bits_to_float(half[i]);
      const double conv = c.out == OutDtype::BF16 ? std::ldexp(std::fabs(f32[i]), -8)
                                                  : std::ldexp(std::fabs(f32[i]), -11) + 0x1p-25;
      if (!(std::fabs(back - w[i]) <= bound + conv)) {
        ++failures;
        ADD_FAILURE() << "(" << r << ", " << k << "): " << q::to_string(c.out) << " value " << back
                      << " too far from " << w[i];
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllFormats, QuantRoundTrip, ::testing::ValuesIn(round_trip_cases()),
                         case_name);

// ---------------------------------------------------------------- known vectors

TEST(QuantKnown, Int8RoundHalfEven) {
  // Row absmax 127 -> scale exactly 1, so w/scale is w.
  std::vector<float> w = {127.0f, -63.5f, 0.5f, 1.5f, 2.5f, -2.5f, -127.0f, 0.0f};
  const q::PackedLayout L = q::layout_for(Format::Int8, 1, 8);
  auto buf = pack_vec(Format::Int8, w, 1, 8);
  const int8_t* d = reinterpret_cast<const int8_t*>(buf.data());
  const int8_t want[] = {127, -64, 0, 2, 2, -2, -127, 0};
  for (int i = 0; i < 8; ++i) EXPECT_EQ(d[i], want[i]) << i;
  float scale;
  std::memcpy(&scale, buf.data() + L.scale_offset(), 4);
  EXPECT_EQ(scale, 1.0f);
}

TEST(QuantKnown, Fp8Vectors) {
  struct KV {
    float x;
    uint8_t code;
  };
  const KV kv[] = {
      {0.0f, 0x00},          {-0.0f, 0x80},         {1.0f, 0x38},         {-1.0f, 0xB8},
      {448.0f, 0x7E},        {-448.0f, 0xFE},       {500.0f, 0x7E},       {464.0f, 0x7E},
      {1e30f, 0x7E},         {-1e30f, 0xFE},        {std::numeric_limits<float>::infinity(), 0x7E},
      {0x1p-6f, 0x08},       {0x1p-9f, 0x01},       {-0x1p-9f, 0x81},     {0x1p-10f, 0x00},
      {0x1.8p-9f, 0x02},     {0x1.4p-9f, 0x01},     {0x1.cp-7f, 0x07},    {0x1.ep-7f, 0x08},
      {1.0625f, 0x38},       {1.1875f, 0x3A},       {1.0626f, 0x39},      {0x1p-12f, 0x00},
      {240.0f, 0x77},        {0x1.ep7f, 0x77},      {0x1.fp7f, 0x78},
  };
  for (const KV& k : kv) {
    EXPECT_EQ(q::fp8_e4m3_encode(k.x), k.code) << "x=" << k.x;
  }
  EXPECT_EQ(q::fp8_e4m3_encode(std::numeric_limits<float>::quiet_NaN()) & 0x7F, 0x7F);
  EXPECT_TRUE(std::isnan(q::fp8_e4m3_decode(0x7F)));
  EXPECT_TRUE(std::isnan(q::fp8_e4m3_decode(0xFF)));
  EXPECT_EQ(q::fp8_e4m3_decode(0x7E), 448.0f);
  EXPECT_EQ(q::fp8_e4m3_decode(0x01), 0x1p-9f);
  EXPECT_EQ(q::fp8_e4m3_decode(0x07), 0x1.cp-7f);
  EXPECT_TRUE(std::signbit(q::fp8_e4m3_decode(0x80)));
  // Every code (except NaN) round-trips.
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7F) == 0x7F) continue;
    EXPECT_EQ(q::fp8_e4m3_encode(q::fp8_e4m3_decode(static_cast<uint8_t>(c))), c) << c;
  }
}

// Brute-force reference: nearest of all finite e4m3 values, ties to the even code.
TEST(QuantKnown, Fp8MatchesBruteForce) {
  std::vector<std::pair<double, int>> vals;
  for (int c = 0; c < 0x7F; ++c) vals.push_back({q::fp8_e4m3_decode(static_cast<uint8_t>(c)), c});
  auto reference = [&](float x) -> int {
    const double a = std::min(std::fabs(static_cast<double>(x)), 448.0);
    int best = 0;
    double best_d = 1e300;
    for (auto& v : vals) {
      const double d = std::fabs(v.first - a);
      if (d < best_d || (d == best_d && (v.second & 1) == 0)) {
        best = v.second;
        best_d = d;
      }
    }
    return best | (std::signbit(x) ? 0x80 : 0);
  };
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> e(-14.0f, 9.5f);
  for (int i = 0; i < 20000; ++i) {
    float x = std::exp2(e(rng)) * (rng() & 1 ? -1.0f : 1.0f);
    ASSERT_EQ(q::fp8_e4m3_encode(x), reference(x)) << "x=" << x;
  }
  // Exact midpoints between adjacent codes.
  for (size_t i = 0; i + 1 < vals.size(); ++i) {
    const float mid = static_cast<float>((vals[i].first + vals[i + 1].first) / 2);
    ASSERT_EQ(q::fp8_e4m3_encode(mid), reference(mid)) << "mid=" << mid;
  }
}

TEST(QuantKnown, HalfConversions) {
  EXPECT_EQ(q::float_to_f16_bits(1.0f), 0x3C00);
  EXPECT_EQ(q::float_to_f16_bits(-2.0f), 0xC000);
  EXPECT_EQ(q::float_to_f16_bits(65504.0f), 0x7BFF);
  EXPECT_EQ(q::float_to_f16_bits(65519.99f), 0x7BFF);
  EXPECT_EQ(q::float_to_f16_bits(65520.0f), 0x7C00);
  EXPECT_EQ(q::float_to_f16_bits(-1e10f), 0xFC00);
  EXPECT_EQ(q::float_to_f16_bits(0x1p-24f), 0x0001);
  EXPECT_EQ(q::float_to_f16_bits(0x1p-25f), 0x0000);     // tie -> even (0)
  EXPECT_EQ(q::float_to_f16_bits(0x1.8p-24f), 0x0002);   // tie 1.5 -> 2
  EXPECT_EQ(q::float_to_f16_bits(0x1.ffcp-15f), 0x0400); // rounds up to the smallest normal
  EXPECT_EQ(q::float_to_f16_bits(-0.0f), 0x8000);
  EXPECT_EQ(q::float_to_f16_bits(1.0f + 0x1p-11f), 0x3C00);        // tie -> even
  EXPECT_EQ(q::float_to_f16_bits(1.0f + 0x1.8p-10f), 0x3C02);      // tie -> even (up)
  EXPECT_EQ(q::float_to_f16_bits(std::nanf("")), 0x7FFF);
  EXPECT_EQ(q::float_to_bf16_bits(1.0f), 0x3F80);
  EXPECT_EQ(q::float_to_bf16_bits(1.0f + 0x1p-8f), 0x3F80);        // tie -> even
  EXPECT_EQ(q::float_to_bf16_bits(1.0f + 0x1.8p-7f), 0x3F82);      // tie -> even (up)
  EXPECT_EQ(q::float_to_bf16_bits(3.4e38f), 0x7F80);               // overflow -> Inf
  EXPECT_EQ(q::float_to_bf16_bits(std::nanf("")), 0x7FFF);
  // Every non-NaN 16-bit pattern survives 16 -> 32 -> 16.
  for (uint32_t h = 0; h < 65536; ++h) {
    const uint16_t b = static_cast<uint16_t>(h);
    if ((b & 0x7C00) != 0x7C00 || (b & 0x3FF) == 0) {
      ASSERT_EQ(q::float_to_f16_bits(q::f16_bits_to_float(b)), b) << hex16(b);
    }
    if ((b & 0x7F80) != 0x7F80 || (b & 0x7F) == 0) {
      ASSERT_EQ(q::float_to_bf16_bits(q::bf16_bits_to_float(b)), b) << hex16(b);
    }
  }
}

TEST(QuantKnown, NF4CodesTimesAbsmaxReproduceExactly) {
  // Max half-gap constant matches the table.
  double gap = 0;
  for (int i = 0; i < 15; ++i) gap = std::max(gap, (double(q::kNF4Codes[i + 1]) - q::kNF4Codes[i]) / 2);
  EXPECT_NEAR(gap, q::kNF4MaxHalfGap, 1e-7);
  EXPECT_EQ(q::kNF4Codes[7], 0.0f);
  for (float absmax : {1.0f, 0.37f, 3.0e-3f, 1234.5f}) {
    std::vector<float> w(128);
    for (int i = 0; i < 128; ++i) {
      const int code = (i * 7 + i / 64) % 16;  // every code in both blocks, incl. 0 and 15
      w[i] = q::kNF4Codes[code] * absmax;
    }
    const q::PackedLayout L = q::layout_for(Format::NF4, 2, 64);
    auto buf = pack_vec(Format::NF4, w, 2, 64);
    EXPECT_EQ(dequant_f32(L, buf), w) << "absmax " << absmax;
  }
  // Nibble order: element 2k in the HIGH nibble of byte k.
  std::vector<float> w(64, 0.0f);
  w[0] = -1.0f;                 // code 0
  w[1] = q::kNF4Codes[1];       // code 1
  w[2] = 1.0f;                  // code 15
  auto buf = pack_vec(Format::NF4, w, 1, 64);
  EXPECT_EQ(buf[0], 0x01);
  EXPECT_EQ(buf[1], 0xF7);      // element 3 is 0.0 -> code 7
  EXPECT_EQ(buf[2], 0x77);
}

TEST(QuantKnown, Int4GroupScaleZero) {
  std::vector<float> w(128, 0.0f);
  w[0] = -1.0f;  // min
  w[1] = 2.0f;   // max
  w[2] = 0.5f;
  w[3] = -0.4f;
  const q::PackedLayout L = q::layout_for(Format::Int4, 1, 128);
  auto buf = pack_vec(Format::Int4, w, 1, 128);
  float scale, zero;
  std::memcpy(&scale, buf.data() + L.scale_offset(), 4);
  std::memcpy(&zero, buf.data() + L.zero_offset(), 4);
  EXPECT_EQ(scale, static_cast<float>(3.0 / 15.0));
  EXPECT_EQ(zero, 5.0f);
  // q = round(w/scale + 5): -1 -> 0, 2 -> 15 (high nibble first); 0.5 -> 7.5 -> 8, -0.4 -> 3.
  EXPECT_EQ(buf[0], 0x0F);
  EXPECT_EQ(buf[1], 0x83);
  EXPECT_EQ(buf[2], 0x55);  // zeros map exactly to the zero point
  auto out = dequant_f32(L, buf);
  EXPECT_EQ(out[4], 0.0f);
  EXPECT_EQ(out[0], (0.0f - 5.0f) * scale);
}

// Note [An int4 group that holds dequantized int4 values]: int4 values dequantized into
// the weight's dtype (what detach() restores) quantize to a packing that dequantizes to
// them again, bit for bit, in every source dtype (the usual scale, range / 15 of the
// rounded values, moved some of them by an ulp in bf16 and fp16).
TEST(QuantKnown, Int4DequantizedValuesQuantizeBackToThemselves) {
  const int64_t rows = 64, cols = 1024;
  const q::PackedLayout L = q::layout_for(Format::Int4, rows, cols);
  const std::vector<float> w = make_weights(rows, cols, 17);
  const size_t n = w.size();
  for (OutDtype dt : {OutDtype::F32, OutDtype::BF16, OutDtype::F16}) {
    SCOPED_TRACE(q::to_string(dt));
    // The weight in its dtype, as 16-bit words (fp32: as floats).
    std::vector<uint16_t> src16(n);
    std::vector<float> src32(w);
    for (size_t i = 0; i < n; ++i)
      src16[i] = dt == OutDtype::BF16 ? q::float_to_bf16_bits(w[i]) : q::float_to_f16_bits(w[i]);
    std::vector<uint8_t> buf(L.total_bytes());
    auto pack = [&]() {
      if (dt == OutDtype::F32) q::pack(Format::Int4, src32.data(), rows, cols, buf.data(), 2);
      else if (dt == OutDtype::BF16) q::pack_bf16(Format::Int4, src16.data(), rows, cols, buf.data(), 2);
      else q::pack_f16(Format::Int4, src16.data(), rows, cols, buf.data(), 2);
    };
    auto dequant = [&]() {  // into the source, as detach() restores the weight
      q::dequantize_cpu(L, buf.data(), dt == OutDtype::F32 ? static_cast<void*>(src32.data()) : src16.data(), dt, 2);
    };
    pack();
    dequant();
    const std::vector<uint16_t> first16 = src16;
    const std::vector<float> first32 = src32;
    for (int cycle = 0; cycle < 2; ++cycle) {
      pack();
      dequant();
      if (dt == OutDtype::F32) {
        EXPECT_EQ(std::memcmp(src32.data(), first32.data(), n * sizeof(float)), 0) << cycle;
      } else {
        size_t changed = 0;
        for (size_t i = 0; i < n; ++i) changed += src16[i] != first16[i];
        EXPECT_EQ(changed, 0u) << cycle;
      }
    }
  }
}

// ---------------------------------------------------------------- errors

TEST(QuantErrors, NaNAndInfNameTheElement) {
  for (Format f : {Format::Int8, Format::Fp8E4M3, Format::NF4, Format::Int4}) {
    SCOPED_TRACE(q::to_string(f));
    const int64_t rows = 8, cols = 256;
    std::vector<float> w = make_weights(rows, cols, 3);
    w[2 * cols + 5] = std::numeric_limits<float>::quiet_NaN();
    w[6 * cols + 0] = std::numeric_limits<float>::infinity();
    for (int threads : {1, 4}) {
      std::string msg = throws_message([&] { pack_vec(f, w, rows, cols, threads); });
      EXPECT_NE(msg.find("NaN at row 2, column 5"), std::string::npos) << msg;
    }
    w[2 * cols + 5] = 1.0f;
    std::string msg = throws_message([&] { pack_vec(f, w, rows, cols, 3); });
    EXPECT_NE(msg.find("+Inf at row 6, column 0"), std::string::npos) << msg;
    w[6 * cols + 0] = -std::numeric_limits<float>::infinity();
    msg = throws_message([&] { pack_vec(f, w, rows, cols, 2); });
    EXPECT_NE(msg.find("-Inf at row 6, column 0"), std::string::npos) << msg;
    // 16-bit sources too.
    std::vector<uint16_t> b(static_cast<size_t>(rows * cols), 0x3F80);
    b[7 * cols + 100] = 0x7F80;  // bf16 +Inf
    const q::PackedLayout L = q::layout_for(f, rows, cols);
    std::vector<uint8_t> buf(L.total_bytes());
    msg = throws_message([&] { q::pack_bf16(f, b.data(), rows, cols, buf.data()); });
    EXPECT_NE(msg.find("+Inf at row 7, column 100"), std::string::npos) << msg;
    std::vector<uint16_t> h(static_cast<size_t>(rows * cols), 0x3C00);
    h[1 * cols + 2] = 0x7E00;  // f16 NaN
    msg = throws_message([&] { q::pack_f16(f, h.data(), rows, cols, buf.data()); });
    EXPECT_NE(msg.find("NaN at row 1, column 2"), std::string::npos) << msg;
  }
}

// Finite weights near FLT_MAX: int8's and fp8's top code times a scale rounded up
// dequantized to ±Inf; int4's zero point and a range spanning ±3.2e38 did too.
TEST(QuantErrors, WeightsNearTheFloatLimitNeverDequantizeToInf) {
  const float big = std::numeric_limits<float>::max();
  for (Format f : {Format::Int8, Format::Fp8E4M3, Format::NF4}) {
    SCOPED_TRACE(q::to_string(f));
    std::vector<float> w(256);
    for (size_t i = 0; i < w.size(); ++i) w[i] = (i % 2 ? -1.0f : 1.0f) * big / static_cast<float>(1 + i % 3);
    const q::PackedLayout L = q::layout_for(f, 1, 256);
    const auto out = dequant_f32(L, pack_vec(f, w, 1, 256));
    for (size_t i = 0; i < w.size(); ++i) {
      ASSERT_TRUE(std::isfinite(out[i])) << i << ": " << w[i] << " -> " << out[i];
      // Within the stated bound: half a step (int8: absmax / 127 / 2), the format's relative one (fp8, nf4).
      const double step = f == Format::Int8      ? big / 127.0 / 2
                          : f == Format::Fp8E4M3 ? std::fabs(w[i]) / 16.0 + big / 448 / 1024
                                                 : big * 0.161;
      EXPECT_LE(std::fabs(static_cast<double>(out[i]) - w[i]), step * 1.0001) << i;
    }
  }
  std::vector<float> w2(2 * 128, 1.0f);
  w2[128 + 3] = -3.2e38f;
  w2[128 + 7] = 3.2e38f;
  const std::string msg2 = throws_message([&] { pack_vec(Format::Int4, w2, 2, 128); });
  EXPECT_NE(msg2.find("near the float32 limit (~3.4e38) in the group at row 1, columns 0..127"), std::string::npos)
      << msg2;
  // A range that stays finite still packs: ±1.6e38 (zero point 8, 15 codes of 2.1e37).
  w2[128 + 3] = -1.6e38f;
  w2[128 + 7] = 1.6e38f;
  const q::PackedLayout L = q::layout_for(Format::Int4, 2, 128);
  const auto out = dequant_f32(L, pack_vec(Format::Int4, w2, 2, 128));
  for (float v : out) ASSERT_TRUE(std::isfinite(v));
}

// ---------------------------------------------------------------- determinism, zeros, sources

TEST(QuantThreads, OutputIndependentOfThreadCount) {
  const int64_t rows = 37, cols = 512;
  const std::vector<float> w = make_weights(rows, cols, 99);
  for (Format f : {Format::Int8, Format::Fp8E4M3, Format::NF4, Format::Int4}) {
    SCOPED_TRACE(q::to_string(f));
    const q::PackedLayout L = q::layout_for(f, rows, cols);
    const auto ref = pack_vec(f, w, rows, cols, 1);
    std::vector<uint16_t> ref_out(w.size());
    q::dequantize_cpu(L, ref.data(), ref_out.data(), OutDtype::BF16, 1);
    for (int t : {0, 2, 3, 5, 8, 64}) {
      EXPECT_EQ(pack_vec(f, w, rows, cols, t), ref) << t << " threads";
      std::vector<uint16_t> out(w.size());
      q::dequantize_cpu(L, ref.data(), out.data(), OutDtype::BF16, t);
      EXPECT_EQ(out, ref_out) << t << " threads";
    }
  }
}

TEST(QuantZeros, AllZeroRowsAndGroups) {
  const int64_t rows = 4, cols = 256;
  std::vector<float> w = make_weights(rows, cols, 5);
  for (int64_t k = 0; k < cols; ++k) w[1 * cols + k] = 0.0f;  // a zero row
  for (int64_t k = 0; k < 128; ++k) w[3 * cols + k] = -0.0f;  // a zero int4 group / nf4 blocks
  for (Format f : {Format::Int8, Format::Fp8E4M3, Format::NF4, Format::Int4}) {
    SCOPED_TRACE(q::to_string(f));
    const q::PackedLayout L = q::layout_for(f, rows, cols);
    const auto buf = pack_vec(f, w, rows, cols);
    const auto out = dequant_f32(L, buf);
    for (size_t i = 0; i < out.size(); ++i) ASSERT_FALSE(std::isnan(out[i])) << i;
    for (int64_t k = 0; k < cols; ++k) ASSERT_EQ(out[1 * cols + k], 0.0f) << k;
    for (int64_t k = 0; k < 128; ++k) ASSERT_EQ(out[3 * cols + k], 0.0f) << k;
    // Entirely zero tensor.
    std::vector<float> z(static_cast<size_t>(rows * cols), 0.0f);
    const auto zb = pack_vec(f, z, rows, cols);
    for (float v : dequant_f32(L, zb)) ASSERT_EQ(v, 0.0f);
  }
  // Empty tensors are fine.
  const q::PackedLayout E = q::layout_for(Format::NF4, 0, 64);
  EXPECT_EQ(E.total_bytes(), 0u);
  std::vector<float> none;
  uint8_t unused = 0;
  q::pack(Format::NF4, none.data(), 0, 64, &unused);  // nothing to write
}

TEST(QuantSources, Bf16AndF16MatchFloatPath) {
  const int64_t rows = 6, cols = 256;
  const std::vector<float> w = make_weights(rows, cols, 11);
  std::vector<uint16_t> b(w.size()), h(w.size());
  std::vector<float> wb(w.size()), wh(w.size());
  for (size_t i = 0; i < w.size(); ++i) {
    b[i] = q::float_to_bf16_bits(w[i]);
    h[i] = q::float_to_f16_bits(w[i]);
    wb[i] = q::bf16_bits_to_float(b[i]);
    wh[i] = q::f16_bits_to_float(h[i]);
  }
  for (Format f : {Format::Int8, Format::Fp8E4M3, Format::NF4, Format::Int4}) {
    SCOPED_TRACE(q::to_string(f));
    const q::PackedLayout L = q::layout_for(f, rows, cols);
    std::vector<uint8_t> buf(L.total_bytes());
    q::pack_bf16(f, b.data(), rows, cols, buf.data(), 2);
    EXPECT_EQ(buf, pack_vec(f, wb, rows, cols));
    q::pack_f16(f, h.data(), rows, cols, buf.data(), 3);
    EXPECT_EQ(buf, pack_vec(f, wh, rows, cols));
  }
}

// ---------------------------------------------------------------- row ranges
// An expert's rows of an [experts * rows, cols] tensor, copied on their own
// (row_range) and dequantized where they lie (dequantize_rows_cpu), equal
// those rows of the whole tensor's dequantization, bit for bit; bytes outside
// the range are never read.
TEST(QuantRows, EachExpertsRowsAloneMatchTheWholeTensor) {
  const int64_t experts = 5, rows = 6, cols = 128;  // 768 elements per expert: whole nf4 blocks
  const std::vector<float> w = make_weights(experts * rows, cols, 7);
  for (Format f : {Format::Int8, Format::Fp8E4M3, Format::NF4, Format::Int4}) {
    SCOPED_TRACE(q::to_string(f));
    const q::PackedLayout L = q::layout_for(f, experts * rows, cols);
    const std::vector<uint8_t> buf = pack_vec(f, w, experts * rows, cols);
    for (OutDtype d : {OutDtype::F32, OutDtype::BF16}) {
      const size_t esz = q::out_dtype_bytes(d);
      std::vector<uint8_t> whole(static_cast<size_t>(L.numel()) * esz);
      q::dequantize_cpu(L, buf.data(), whole.data(), d, 1);
      size_t data_end = L.data_offset(), scale_end = L.scale_offset(), zero_end = L.zero_offset();
      for (int64_t e = 0; e < experts; ++e) {
        const q::RowRange r = q::row_range(L, e * rows, (e + 1) * rows);
        // Consecutive ranges tile each section.
        EXPECT_EQ(r.data_begin, data_end);
        EXPECT_EQ(r.scale_begin, scale_end);
        EXPECT_EQ(r.zero_begin, zero_end);
        data_end = r.data_begin + r.data_bytes;
        scale_end = r.scale_begin + r.scale_bytes;
        zero_end = r.zero_begin + r.zero_bytes;
        // Only the range's bytes are present; everything else is garbage.
        std::vector<uint8_t> part(buf.size(), 0xFF);
        std::memcpy(&part[r.data_begin], &buf[r.data_begin], r.data_bytes);
        std::memcpy(&part[r.scale_begin], &buf[r.scale_begin], r.scale_bytes);
        if (r.zero_bytes) std::memcpy(&part[r.zero_begin], &buf[r.zero_begin], r.zero_bytes);
        const size_t n = static_cast<size_t>(rows * cols) * esz;
        std::vector<uint8_t> got(n, 0xCD);
        q::dequantize_rows_cpu(L, part.data(), e * rows, (e + 1) * rows, got.data(), d, 2);
        EXPECT_EQ(0, std::memcmp(got.data(), &whole[static_cast<size_t>(e * rows * cols) * esz], n))
            << "expert " << e << " (" << q::to_string(d) << ")";
      }
      EXPECT_EQ(data_end, L.data_offset() + L.data_bytes);
      EXPECT_EQ(scale_end, L.scale_offset() + L.scale_bytes);
      EXPECT_EQ(zero_end, L.zero_offset() + L.zero_bytes);
    }
  }
}

TEST(QuantRows, RangesThatSplitAnNF4BlockOrLeaveTheTensorAreRefused) {
  const q::PackedLayout L = q::layout_for(Format::NF4, 10, 40);  // 400 elements, blocks of 64
  EXPECT_NE(throws_message([&] { q::row_range(L, 1, 5); }).find("block of 64"), std::string::npos);
  EXPECT_NE(throws_message([&] { q::row_range(L, 0, 11); }).find("not inside the 10 rows"), std::string::npos);
  // 8 rows = 320 elements = 5 blocks; the rest ends at the tensor's end (a partial last block).
  const q::RowRange a = q::row_range(L, 0, 8), b = q::row_range(L, 8, 10);
  EXPECT_EQ(a.data_bytes + b.data_bytes, L.data_bytes);
  EXPECT_EQ(a.scale_bytes + b.scale_bytes, L.scale_bytes);
}
