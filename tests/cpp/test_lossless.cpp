// Tests for csrc/core/lossless.{h,cpp}: the length-limited code, bit-exact
// round trips (bf16, f16, f32; special values, all-equal tensors, odd sizes),
// thread determinism, the coded size, and corrupt or truncated buffers.
#include "core/lossless.h"
#include "core/lossless_device.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <queue>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/quant.h"

namespace ll = layerstream::lossless;
using ll::Dtype;

namespace {

// A tensor's elements as raw bytes (uint16_t or uint32_t bit patterns).
struct Tensor {
  Dtype dtype;
  std::vector<uint8_t> bytes;
  int64_t numel() const { return int64_t(bytes.size() / ll::element_bytes(dtype)); }
};

template <class T>
Tensor tensor_of(Dtype d, const std::vector<T>& v) {
  Tensor t{d, std::vector<uint8_t>(v.size() * sizeof(T))};
  if (!v.empty()) std::memcpy(t.bytes.data(), v.data(), t.bytes.size());
  return t;
}

Tensor random_bits(Dtype d, int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  Tensor t{d, std::vector<uint8_t>(size_t(n) * ll::element_bytes(d))};
  for (auto& b : t.bytes) b = static_cast<uint8_t>(rng());
  return t;
}

// N(0, sigma) weights rounded to the dtype (bf16 / f16 to nearest even).
Tensor normal_weights(Dtype d, int64_t n, float sigma, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, sigma);
  std::vector<float> f(static_cast<size_t>(n));
  for (float& x : f) x = dist(rng);
  if (d == Dtype::F32) return tensor_of(d, f);
  std::vector<uint16_t> h(f.size());
  for (size_t i = 0; i < f.size(); ++i)
    h[i] = d == Dtype::BF16 ? layerstream::quant::float_to_bf16_bits(f[i])
                            : layerstream::quant::float_to_f16_bits(f[i]);
  return tensor_of(d, h);
}

std::vector<uint8_t> decode_vec(const std::vector<uint8_t>& coded, int threads = 1) {
  const ll::Header h = ll::read_header(coded.data(), coded.size());
  std::vector<uint8_t> out(size_t(h.layout.numel) * ll::element_bytes(h.layout.dtype), 0xCD);
  ll::decode(coded.data(), coded.size(), out.data(), out.size(), threads);
  return out;
}

// The GPU decoder's code (core/lossless_device.h) run on the CPU as the
// kernel runs it (kernels/cuda/lossless.cu): the table from canonical() and
// table_entry() at every index, then decode_block_at() for every block.
// *ok: every block decoded cleanly. Buffers are 16-byte aligned as on the
// device (malloc's alignment).
std::vector<uint8_t> device_decode_on_host(const std::vector<uint8_t>& coded, bool* ok = nullptr) {
  namespace dv = ll::device;
  const ll::Header h = ll::read_header(coded.data(), coded.size());
  const ll::Layout& L = h.layout;
  dv::Canonical canon;
  dv::canonical(h.code_lengths, &canon);
  std::vector<uint32_t> table(dv::kTableSize);
  for (uint32_t i = 0; i < dv::kTableSize; ++i) table[i] = dv::table_entry(canon, i);
  const size_t bytes = size_t(L.numel) * ll::element_bytes(L.dtype);
  std::vector<uint32_t> out((bytes + 3) / 4 + 4, 0xCDCDCDCDu);  // 4-byte elements, aligned
  const dv::Sections sec = dv::sections_of(L, coded.data());
  bool all = true;
  for (int64_t b = 0; b < L.num_blocks; ++b) {
    if (L.dtype == Dtype::BF16)
      all &= dv::decode_block_at<dv::Bf16>(sec, table.data(), h.code_lengths, b, reinterpret_cast<uint16_t*>(out.data()));
    else if (L.dtype == Dtype::F16)
      all &= dv::decode_block_at<dv::F16>(sec, table.data(), h.code_lengths, b, reinterpret_cast<uint16_t*>(out.data()));
    else
      all &= dv::decode_block_at<dv::F32>(sec, table.data(), h.code_lengths, b, out.data());
  }
  if (ok) *ok = all;
  // Nothing written past the tensor.
  const uint8_t* o = reinterpret_cast<const uint8_t*>(out.data());
  for (size_t i = bytes; i < out.size() * 4; ++i) EXPECT_EQ(o[i], 0xCD) << "the device decoder wrote past the tensor";
  return std::vector<uint8_t>(o, o + bytes);
}

// Encodes, checks the header and the round trip; returns the coded buffer.
std::vector<uint8_t> round_trip(const Tensor& t, int threads = 1,
                                int64_t block = 0) {
  const std::vector<uint8_t> coded = ll::encode(t.dtype, t.bytes.data(), t.numel(), threads, block);
  EXPECT_EQ(coded.size() % 256, 0u);
  EXPECT_LE(coded.size(), ll::max_encoded_bytes(t.dtype, t.numel(), block));
  const ll::Header h = ll::read_header(coded.data(), coded.size());
  EXPECT_EQ(h.layout.dtype, t.dtype);
  EXPECT_EQ(h.layout.numel, t.numel());
  EXPECT_EQ(h.layout.block_elems, block ? block : ll::default_block_elems(t.numel()));
  EXPECT_EQ(h.layout.total_bytes(), coded.size());
  EXPECT_TRUE(decode_vec(coded, threads) == t.bytes) << "round trip differs";
  bool ok = false;
  EXPECT_TRUE(device_decode_on_host(coded, &ok) == t.bytes) << "the GPU decoder's code differs";
  EXPECT_TRUE(ok) << "the GPU decoder's code reports a clean buffer as corrupt";
  return coded;
}

// Expects fn to throw layerstream::Error with `part` in its message.
void expect_error(const std::function<void()>& fn, const std::string& part) {
  std::string what = "no layerstream::Error";
  try {
    fn();
  } catch (const layerstream::Error& e) {
    what = e.what();
  }
  EXPECT_NE(what.find(part), std::string::npos) << "expected an error with '" << part << "', got: " << what;
}

uint64_t cost(const uint64_t* freq, const uint8_t* len) {
  uint64_t c = 0;
  for (int s = 0; s < 256; ++s) c += freq[s] * len[s];
  return c;
}

// Kraft sum in units of 2^-12.
uint32_t kraft(const uint8_t* len) {
  uint32_t k = 0;
  for (int s = 0; s < 256; ++s)
    if (len[s]) k += 1u << (12 - len[s]);
  return k;
}

// Cost of an unlimited Huffman code (sum of the merged weights) and its depth.
std::pair<uint64_t, int> huffman(const uint64_t* freq) {
  using Node = std::pair<uint64_t, int>;  // weight, depth
  std::priority_queue<Node, std::vector<Node>, std::greater<Node>> q;
  for (int s = 0; s < 256; ++s)
    if (freq[s]) q.push({freq[s], 0});
  uint64_t c = 0;
  while (q.size() > 1) {
    const Node a = q.top();
    q.pop();
    const Node b = q.top();
    q.pop();
    c += a.first + b.first;
    q.push({a.first + b.first, std::max(a.second, b.second) + 1});
  }
  return {c, q.empty() ? 0 : q.top().second};
}

const Dtype kDtypes[] = {Dtype::BF16, Dtype::F16, Dtype::F32};

}  // namespace

// ---------------------------------------------------------------- the code

TEST(LosslessCode, OptimalWhenHuffmanFitsInTwelveBits) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    uint64_t freq[256] = {};
    const int used = 2 + int(rng() % 255);
    for (int i = 0; i < used; ++i) freq[rng() % 256] = 1 + rng() % (trial % 2 ? 1000000 : 50);
    const auto [hcost, depth] = huffman(freq);
    uint8_t len[256];
    ll::code_lengths(freq, len);
    EXPECT_EQ(kraft(len), 4096u) << "a complete code";
    for (int s = 0; s < 256; ++s) EXPECT_EQ(len[s] != 0, freq[s] != 0);
    if (depth <= 12) {
      EXPECT_EQ(cost(freq, len), hcost) << "trial " << trial;
    } else {
      EXPECT_GE(cost(freq, len), hcost);
    }
  }
}

TEST(LosslessCode, LengthLimitHoldsForSkewedFrequencies) {
  // Fibonacci frequencies make a Huffman code as deep as there are symbols.
  for (int used : {13, 14, 40, 70, 256}) {
    uint64_t freq[256] = {};
    uint64_t a = 1, b = 1;
    for (int s = 0; s < used; ++s) {
      freq[(s * 37) % 256] = a;
      if (b < (uint64_t{1} << 48)) {  // saturate: the total stays below 2^56
        const uint64_t c = a + b;
        a = b;
        b = c;
      }
    }
    uint8_t len[256];
    ll::code_lengths(freq, len);
    int longest = 0;
    for (int s = 0; s < 256; ++s) longest = std::max<int>(longest, len[s]);
    EXPECT_LE(longest, 12) << used << " symbols";
    EXPECT_EQ(kraft(len), 4096u) << used << " symbols";
    EXPECT_GE(huffman(freq).second, std::min(used - 1, 13)) << "the unlimited code is deeper";
  }
  // Powers of two: the same, with every symbol used.
  uint64_t freq[256];
  for (int s = 0; s < 256; ++s) freq[s] = uint64_t{1} << std::min(s, 40);
  uint8_t len[256];
  ll::code_lengths(freq, len);
  for (int s = 0; s < 256; ++s) EXPECT_TRUE(len[s] >= 1 && len[s] <= 12) << s;
  EXPECT_EQ(kraft(len), 4096u);
  // A flat histogram of 256 symbols: 8 bits each.
  std::fill(freq, freq + 256, 5);
  ll::code_lengths(freq, len);
  for (int s = 0; s < 256; ++s) EXPECT_EQ(len[s], 8);
}

TEST(LosslessCode, NoneOneOrTwoSymbols) {
  uint64_t freq[256] = {};
  uint8_t len[256];
  ll::code_lengths(freq, len);
  EXPECT_EQ(kraft(len), 0u);
  freq[200] = 12345;
  ll::code_lengths(freq, len);
  EXPECT_EQ(len[200], 1);
  EXPECT_EQ(kraft(len), 2048u);
  freq[3] = 1;
  ll::code_lengths(freq, len);
  EXPECT_EQ(len[200], 1);
  EXPECT_EQ(len[3], 1);
  freq[4] = uint64_t{1} << 56;
  expect_error([&] { ll::code_lengths(freq, len); }, "2^56");
}

// ---------------------------------------------------------------- round trips

TEST(LosslessRoundTrip, RandomBitsEverySize) {
  uint32_t seed = 1;
  for (Dtype d : kDtypes)
    for (int64_t n : {0, 1, 2, 3, 63, 64, 65, 4095, 4096, 4097, 3 * 4096 + 17, 100000}) {
      SCOPED_TRACE(std::string(layerstream::quant::to_string(d)) + " n=" + std::to_string(n));
      const std::vector<uint8_t> coded = round_trip(random_bits(d, n, seed++));
      // Random bits do not compress, and cost at most their raw size, 12 bytes
      // a block and 1300 bytes of header and section padding.
      const int64_t b = ll::default_block_elems(n);
      const size_t blocks = size_t((n + b - 1) / b);
      EXPECT_LE(coded.size(), size_t(n) * ll::element_bytes(d) + 12 * blocks + 1300);
    }
}

TEST(LosslessRoundTrip, NormalWeightsAndRatio) {
  const int64_t n = 1 << 20;
  for (Dtype d : kDtypes) {
    const Tensor t = normal_weights(d, n, 0.02f, 11);
    // The default blocks (512 elements here) and the largest default (4096):
    // a word of padding and an offset per block cost ~1% of a bf16 tensor.
    for (int64_t block : {int64_t{0}, ll::kDefaultBlockElemsMax}) {
      const double ratio = double(round_trip(t, 2, block).size()) / double(t.bytes.size());
      std::printf("[ ratio    ] %s N(0, 0.02), %lld elements, blocks of %lld: %.4f of raw\n",
                  layerstream::quant::to_string(d), static_cast<long long>(n),
                  static_cast<long long>(block ? block : ll::default_block_elems(n)), ratio);
      EXPECT_LE(ratio, d == Dtype::BF16 ? 0.68 : 0.86);  // issue 28: bf16 <= 0.75
    }
  }
  // Other scales and block sizes.
  for (float sigma : {1e-4f, 1.0f, 300.0f})
    for (int64_t block : {int64_t{64}, int64_t{1024}, int64_t{1} << 20})
      for (Dtype d : kDtypes) round_trip(normal_weights(d, 50000, sigma, 5), 1, block);
}

TEST(LosslessRoundTrip, SpecialValues) {
  // bf16 / f16: ±0, smallest and largest subnormals, smallest normal, max
  // finite, ±Inf, quiet and signalling NaNs with payloads, and every pattern.
  std::vector<uint16_t> bf16 = {0x0000, 0x8000, 0x0001, 0x807F, 0x0080, 0x7F7F, 0xFF7F,
                                0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x7F81, 0x7FFF, 0x3F80};
  std::vector<uint16_t> f16 = {0x0000, 0x8000, 0x0001, 0x83FF, 0x0400, 0x7BFF, 0xFBFF,
                               0x7C00, 0xFC00, 0x7E00, 0xFE01, 0x7C01, 0x7FFF, 0x3C00};
  std::vector<uint32_t> f32 = {0x00000000, 0x80000000, 0x00000001, 0x807FFFFF, 0x00800000,
                               0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000, 0x7FC00000,
                               0xFFC00001, 0x7F800001, 0x7FFFFFFF, 0x3F800000};
  round_trip(tensor_of(Dtype::BF16, bf16));
  round_trip(tensor_of(Dtype::F16, f16));
  round_trip(tensor_of(Dtype::F32, f32));
  std::vector<uint16_t> all(65536);
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint16_t>(i * 40503u);  // a permutation
  round_trip(tensor_of(Dtype::BF16, all));
  round_trip(tensor_of(Dtype::F16, all));
  // Specials sprinkled into normal weights (rare symbols get long codes).
  Tensor t = normal_weights(Dtype::BF16, 20000, 0.02f, 3);
  for (size_t i = 0; i < bf16.size(); ++i) std::memcpy(&t.bytes[(i * 1409) % 20000 * 2], &bf16[i], 2);
  round_trip(t);
}

TEST(LosslessRoundTrip, AllEqualTensors) {
  for (int64_t n : {1, 5, 4096, 4097, 70000}) {
    round_trip(tensor_of(Dtype::BF16, std::vector<uint16_t>(size_t(n), 0x3C23)));
    round_trip(tensor_of(Dtype::F16, std::vector<uint16_t>(size_t(n), 0)));
    round_trip(tensor_of(Dtype::F32, std::vector<uint32_t>(size_t(n), 0xFFC00000)));
  }
  // One symbol: 1 bit per element.
  const std::vector<uint8_t> coded = round_trip(tensor_of(Dtype::BF16, std::vector<uint16_t>(65536, 0x3F80)));
  const ll::Header h = ll::read_header(coded.data(), coded.size());
  EXPECT_EQ(h.max_code_length, 1);
  EXPECT_EQ(h.layout.stream_words, 65536u / 32);
}

TEST(LosslessRoundTrip, UnalignedBuffers) {
  const Tensor t = normal_weights(Dtype::F32, 5000, 0.02f, 9);
  const std::vector<uint8_t> coded = ll::encode(t.dtype, t.bytes.data(), t.numel());
  std::vector<uint8_t> shifted(coded.size() + 3), out(t.bytes.size() + 1);
  std::memcpy(shifted.data() + 3, coded.data(), coded.size());
  ll::decode(shifted.data() + 3, coded.size(), out.data() + 1, t.bytes.size());
  EXPECT_TRUE(std::equal(t.bytes.begin(), t.bytes.end(), out.begin() + 1));
  // An unaligned source and destination for encode.
  std::vector<uint8_t> src(t.bytes.size() + 2);
  std::memcpy(src.data() + 2, t.bytes.data(), t.bytes.size());
  const ll::Analysis a = ll::analyze(t.dtype, src.data() + 2, t.numel());
  std::vector<uint8_t> dst(a.total_bytes() + 1);
  ll::encode(a, src.data() + 2, dst.data() + 1, a.total_bytes());
  EXPECT_TRUE(std::equal(coded.begin(), coded.end(), dst.begin() + 1));
}

// ---------------------------------------------------------------- layout, threads, sizes

// The default block size (lossless.h): enough blocks for the CUDA decoder's
// threads on large tensors, within [512, 4096].
TEST(LosslessLayout, DefaultBlockSizeGrowsWithTheTensor) {
  const int64_t M = int64_t{1} << 20;
  EXPECT_EQ(ll::default_block_elems(0), 512);
  EXPECT_EQ(ll::default_block_elems(16 * M), 512);     // a 4096 x 4096 weight: 32768 blocks
  EXPECT_EQ(ll::default_block_elems(32 * M - 1), 512);
  EXPECT_EQ(ll::default_block_elems(32 * M), 1024);
  EXPECT_EQ(ll::default_block_elems(64 * M), 2048);    // 16384 x 4096
  EXPECT_EQ(ll::default_block_elems(128 * M), 4096);
  EXPECT_EQ(ll::default_block_elems(int64_t{1} << 40), 4096);
  const Tensor t = normal_weights(Dtype::BF16, 5000, 0.02f, 9);
  EXPECT_EQ(ll::analyze(t.dtype, t.bytes.data(), t.numel()).layout.block_elems, 512);
  EXPECT_EQ(ll::analyze(t.dtype, t.bytes.data(), t.numel(), 1, 1024).layout.block_elems, 1024);
}

TEST(LosslessLayout, HeaderSectionsAndPadding) {
  const Tensor t = normal_weights(Dtype::F32, 10000, 0.02f, 4);
  const ll::Analysis a = ll::analyze(t.dtype, t.bytes.data(), t.numel(), 1, 1024);
  const ll::Layout& L = a.layout;
  EXPECT_EQ(L.num_blocks, 10);
  EXPECT_EQ(L.offsets_offset(), 256u);
  EXPECT_EQ(L.raw_offset(), 512u);
  EXPECT_EQ(L.low16_offset(), 512u + 10240);
  EXPECT_EQ(L.stream_offset(), 512u + 10240 + 20224);
  EXPECT_EQ(L.total_bytes() % 256, 0u);
  EXPECT_GE(L.total_bytes(), L.stream_offset() + 4 * L.stream_words + ll::kStreamTailBytes);
  // Garbage in the destination: every byte is written (padding zero), so the
  // bytes are a function of the input.
  std::vector<uint8_t> dirty(a.total_bytes() + 100, 0xAB), clean(a.total_bytes(), 0);
  ll::encode(a, t.bytes.data(), dirty.data(), dirty.size());
  ll::encode(a, t.bytes.data(), clean.data(), clean.size());
  EXPECT_TRUE(std::equal(clean.begin(), clean.end(), dirty.begin()));
  EXPECT_EQ(dirty[a.total_bytes()], 0xAB) << "nothing written past the coded size";
  EXPECT_EQ(std::memcmp(clean.data(), "LSLL", 4), 0);
  EXPECT_EQ(clean[6], 3) << "dtype code of f32";
  for (size_t i = L.stream_offset() + 4 * L.stream_words; i < L.total_bytes(); ++i) EXPECT_EQ(clean[i], 0);
  // The header's code lengths (4 bits per symbol, symbol 2k high) are the analysis's.
  const ll::Header h = ll::read_header(clean.data(), clean.size() + 0);
  for (int s = 0; s < 256; ++s) EXPECT_EQ(h.code_lengths[s], a.code_lengths[s]);
  EXPECT_EQ(clean[64 + 63], uint8_t(a.code_lengths[126] << 4 | a.code_lengths[127]));
  // Raw section of f32: the bf16 split of the high half; low16: the low half.
  uint32_t v0;
  std::memcpy(&v0, t.bytes.data(), 4);
  EXPECT_EQ(clean[L.raw_offset()], uint8_t((v0 >> 24 & 0x80) | (v0 >> 16 & 0x7F)));
  uint16_t lo;
  std::memcpy(&lo, &clean[L.low16_offset()], 2);
  EXPECT_EQ(lo, uint16_t(v0));
}

// Pieces (a mixture-of-experts tensor coded one expert at a time): when a
// tensor is cut, each piece decodes alone, from its own offset, to its own
// elements, and the pieces lie back to back, each 256-byte aligned.
TEST(LosslessPieces, OnePerExpertWhenEachOutputStays16ByteAligned) {
  EXPECT_EQ(ll::expert_pieces(Dtype::BF16, 8 * 64, 8, 8), 8);    // 64 elements: 128 bytes each
  EXPECT_EQ(ll::expert_pieces(Dtype::F32, 8 * 4, 8, 8), 8);      // 16 bytes each
  EXPECT_EQ(ll::expert_pieces(Dtype::BF16, 8 * 12, 8, 8), 1);    // 24 bytes: not aligned
  EXPECT_EQ(ll::expert_pieces(Dtype::F16, 8 * 64, 4, 8), 1);     // dim 0 is not the experts
  EXPECT_EQ(ll::expert_pieces(Dtype::BF16, 8 * 64, 8, 0), 1);    // not indexed by expert
  EXPECT_EQ(ll::expert_pieces(Dtype::BF16, 64, 1, 1), 1);
  EXPECT_EQ(ll::expert_pieces(Dtype::BF16, 0, 8, 8), 1);
}

TEST(LosslessPieces, EachPieceDecodesAloneToItsElements) {
  for (Dtype d : kDtypes) {
    const int64_t count = 6, per = 1000;
    Tensor t = normal_weights(d, count * per, 0.02f, 21);
    // A piece of its own kind: piece 2 all one value, piece 4 random bits.
    const size_t esz = ll::element_bytes(d);
    std::fill(t.bytes.begin() + 2 * per * esz, t.bytes.begin() + 3 * per * esz, uint8_t{0x3C});
    const Tensor noise = random_bits(d, per, 4);
    std::copy(noise.bytes.begin(), noise.bytes.end(), t.bytes.begin() + 4 * per * esz);
    const ll::PiecesAnalysis P = ll::analyze_pieces(d, t.bytes.data(), t.numel(), count, 2);
    ASSERT_EQ(P.pieces.size(), size_t(count));
    ASSERT_EQ(P.offsets.size(), size_t(count) + 1);
    std::vector<uint8_t> coded(P.total_bytes() + 64, 0xEE);
    ll::encode_pieces(P, t.bytes.data(), coded.data(), P.total_bytes(), 2);
    EXPECT_TRUE(std::all_of(coded.begin() + P.total_bytes(), coded.end(), [](uint8_t b) { return b == 0xEE; }))
        << "wrote past the pieces";
    for (int64_t k = 0; k < count; ++k) {
      const size_t at = P.offsets[k], bytes = P.offsets[k + 1] - at;
      EXPECT_EQ(at % 256, 0u);
      EXPECT_EQ(bytes, P.pieces[k].total_bytes());
      const std::vector<uint8_t> piece(coded.begin() + at, coded.begin() + at + bytes);
      // The same bytes as coding the piece as a tensor of its own.
      const std::vector<uint8_t> alone =
          ll::encode(d, t.bytes.data() + k * per * esz, per, 1);
      EXPECT_TRUE(piece == alone) << "piece " << k;
      const std::vector<uint8_t> want(t.bytes.begin() + k * per * esz, t.bytes.begin() + (k + 1) * per * esz);
      EXPECT_TRUE(decode_vec(piece) == want) << "piece " << k;
      EXPECT_TRUE(device_decode_on_host(piece) == want) << "piece " << k << ", the GPU decoder's code";
    }
    EXPECT_GT(P.offsets[5] - P.offsets[4], P.offsets[3] - P.offsets[2]);  // noise codes larger than one value
    // The GPU's kernel of pieces, run on the CPU as it runs: pieces 1, 2 and
    // 4 (a routed call's), each with its code and stream length read from its
    // header bytes, into their places; piece 0, 3 and 5's places untouched.
    const ll::device::Sections shared = ll::device::sections_of(ll::read_header(coded.data(), coded.size()).layout,
                                                                nullptr);
    std::vector<uint32_t> out(t.bytes.size() / 4 + 1, 0xCDCDCDCDu);
    char* out_base = reinterpret_cast<char*>(out.data());
    for (int64_t k : {1, 2, 4}) {
      const ll::device::PieceJob job{P.offsets[k], uint64_t(k * per) * esz};
      const uint8_t* piece = coded.data() + job.coded_offset;
      uint8_t len[256];
      for (int s = 0; s < 256; ++s) len[s] = ll::device::code_length_at(piece, s);
      ll::device::Canonical canon;
      ll::device::canonical(len, &canon);
      std::vector<uint32_t> table(ll::device::kTableSize);
      for (uint32_t i = 0; i < ll::device::kTableSize; ++i) table[i] = ll::device::table_entry(canon, i);
      const ll::device::Sections sec = ll::device::piece_sections(shared, piece);
      for (int64_t b = 0; b < sec.num_blocks; ++b) {
        bool ok = false;
        if (d == Dtype::F32)
          ok = ll::device::decode_block_at<ll::device::F32>(sec, table.data(), len, b,
                                                            reinterpret_cast<uint32_t*>(out_base + job.out_offset));
        else if (d == Dtype::BF16)
          ok = ll::device::decode_block_at<ll::device::Bf16>(sec, table.data(), len, b,
                                                             reinterpret_cast<uint16_t*>(out_base + job.out_offset));
        else
          ok = ll::device::decode_block_at<ll::device::F16>(sec, table.data(), len, b,
                                                            reinterpret_cast<uint16_t*>(out_base + job.out_offset));
        EXPECT_TRUE(ok) << "piece " << k << " block " << b;
      }
    }
    for (int64_t k = 0; k < count; ++k) {
      const uint8_t* got = reinterpret_cast<const uint8_t*>(out_base) + k * per * esz;
      if (k == 1 || k == 2 || k == 4)
        EXPECT_EQ(std::memcmp(got, t.bytes.data() + k * per * esz, per * esz), 0) << "piece " << k;
      else
        EXPECT_TRUE(std::all_of(got, got + per * esz, [](uint8_t b) { return b == 0xCD; })) << "piece " << k;
    }
  }
  EXPECT_THROW(ll::analyze_pieces(Dtype::BF16, nullptr, 10, 3), layerstream::Error);
  EXPECT_THROW(ll::analyze_pieces(Dtype::BF16, nullptr, 10, 0), layerstream::Error);
}

TEST(LosslessThreads, SameBytesForEveryThreadCount) {
  for (Dtype d : kDtypes) {
    const Tensor t = normal_weights(d, 300001, 0.05f, 21);
    const std::vector<uint8_t> one = ll::encode(d, t.bytes.data(), t.numel(), 1, 1024);
    for (int threads : {0, 2, 3, 4, 7}) {
      EXPECT_TRUE(ll::encode(d, t.bytes.data(), t.numel(), threads, 1024) == one) << threads;
      EXPECT_TRUE(decode_vec(one, threads) == t.bytes) << threads;
    }
  }
}

TEST(LosslessSize, BoundAndEstimate) {
  // The bound holds when blocks differ: rare symbols crowd into some blocks.
  std::vector<uint16_t> v(50000);
  std::mt19937 rng(2);
  for (size_t i = 0; i < v.size(); ++i)
    v[i] = static_cast<uint16_t>(i < 45000 ? 0x3F80 : rng());
  round_trip(tensor_of(Dtype::BF16, v), 1, 64);
  // The estimate from a 1% strided sample is within 1% of the coded size.
  for (Dtype d : kDtypes) {
    const Tensor t = normal_weights(d, 1 << 20, 0.02f, 8);
    const size_t es = ll::element_bytes(d);
    std::vector<uint8_t> sample;
    for (int64_t i = 0; i < t.numel(); i += 97)
      sample.insert(sample.end(), t.bytes.begin() + i * int64_t(es), t.bytes.begin() + (i + 1) * int64_t(es));
    const size_t est = ll::estimate_encoded_bytes(d, sample.data(), int64_t(sample.size() / es), t.numel());
    const size_t real = ll::encode(d, t.bytes.data(), t.numel()).size();
    std::printf("[ estimate ] %s: %zu bytes predicted, %zu coded\n", layerstream::quant::to_string(d), est, real);
    EXPECT_NEAR(double(est) / double(real), 1.0, 0.01) << layerstream::quant::to_string(d);
  }
  EXPECT_EQ(ll::max_encoded_bytes(Dtype::BF16, 0), 768u);
}

// ---------------------------------------------------------------- misuse and corruption

TEST(LosslessErrors, BadArguments) {
  const Tensor t = normal_weights(Dtype::BF16, 1000, 0.02f, 1);
  expect_error([&] { ll::encode(Dtype::BF16, t.bytes.data(), 1000, 1, 100); }, "power of two");
  expect_error([&] { ll::encode(Dtype::BF16, t.bytes.data(), -1); }, "-1 elements");
  expect_error([&] { ll::encode(Dtype::BF16, nullptr, 10); }, "null");
  const ll::Analysis a = ll::analyze(Dtype::BF16, t.bytes.data(), 1000);
  std::vector<uint8_t> dst(a.total_bytes());
  expect_error([&] { ll::encode(a, t.bytes.data(), dst.data(), dst.size() - 1); }, "needs");
  // A source that changed after analyze(): a new symbol, or longer codes.
  Tensor changed = t;
  changed.bytes[1] ^= 0x40;  // flips an exponent bit of element 0
  expect_error([&] { ll::encode(a, changed.bytes.data(), dst.data(), dst.size()); }, "source changed");
  // A symbol without a code, in a block whose size did not change: 1.0 (100
  // times, a 1-bit code), 2.0 and 4.0 (50 each, 2 bits); then one 1.0 becomes
  // 8.0 (no code: 1 bit fewer) and another 2.0 (1 bit more).
  std::vector<uint16_t> three(200, 0x3F80);
  std::fill(three.begin() + 100, three.begin() + 150, uint16_t{0x4000});
  std::fill(three.begin() + 150, three.end(), uint16_t{0x4080});
  const ll::Analysis a3 = ll::analyze(Dtype::BF16, three.data(), 200);
  std::vector<uint8_t> dst3(a3.total_bytes());
  three[0] = 0x4100;
  three[1] = 0x4000;
  expect_error([&] { ll::encode(a3, three.data(), dst3.data(), dst3.size()); }, "source changed");
  ll::encode(a, t.bytes.data(), dst.data(), dst.size());
  std::vector<uint8_t> out(1999);
  expect_error([&] { ll::decode(dst.data(), dst.size(), out.data(), out.size()); }, "2000");
}

TEST(LosslessErrors, TruncatedBuffersAreRejected) {
  const Tensor t = normal_weights(Dtype::F16, 3000, 0.02f, 6);
  const std::vector<uint8_t> coded = ll::encode(t.dtype, t.bytes.data(), t.numel(), 1, 256);
  std::vector<uint8_t> out(t.bytes.size());
  for (size_t len = 0; len < coded.size(); len += (len < 300 ? 1 : 37)) {
    const std::vector<uint8_t> cut(coded.begin(), coded.begin() + int64_t(len));  // exact size: ASan sees overruns
    SCOPED_TRACE(len);
    expect_error([&] { ll::decode(cut.data(), cut.size(), out.data(), out.size()); }, "lossless:");
  }
  expect_error([&] { ll::read_header(coded.data(), 100); }, "truncated");
}

TEST(LosslessErrors, EveryHeaderAndOffsetBitFlipIsCaught) {
  const Tensor t = normal_weights(Dtype::BF16, 5000, 0.02f, 12);
  const std::vector<uint8_t> coded = ll::encode(t.dtype, t.bytes.data(), t.numel(), 1, 512);
  const ll::Layout L = ll::read_header(coded.data(), coded.size()).layout;
  const size_t end = L.offsets_offset() + 8 * size_t(L.num_blocks + 1);
  std::vector<uint8_t> out(t.bytes.size());
  int undetected = 0;
  for (size_t byte = 0; byte < end; ++byte) {
    if (byte >= 192 && byte < 256) continue;  // reserved tail: checked below
    for (int bit = 0; bit < 8; ++bit) {
      std::vector<uint8_t> bad = coded;
      bad[byte] ^= uint8_t(1 << bit);
      try {
        ll::decode(bad.data(), bad.size(), out.data(), out.size());
        // (Only a one-symbol code could take a harmless flip: a second length-1 code.)
        ++undetected;
        ADD_FAILURE() << "byte " << byte << " bit " << bit << " not detected; output "
                      << (out == t.bytes ? "intact" : "differs");
      } catch (const layerstream::Error&) {
      }
    }
  }
  EXPECT_EQ(undetected, 0);
  std::vector<uint8_t> bad = coded;
  bad[200] = 1;
  expect_error([&] { ll::read_header(bad.data(), bad.size()); }, "reserved");
  bad = coded;
  bad[0] = 'X';
  expect_error([&] { ll::read_header(bad.data(), bad.size()); }, "LSLL");
}

// Two corrupt blocks far apart, decoded on threads: the error names the
// first one, whichever thread met its block first.
TEST(LosslessErrors, TheFirstCorruptBlockIsTheOneReported) {
  const Tensor t = normal_weights(Dtype::BF16, 64 * 256, 0.02f, 21);
  std::vector<uint8_t> coded = ll::encode(t.dtype, t.bytes.data(), t.numel(), 4, 256);
  const ll::Header h = ll::read_header(coded.data(), coded.size());
  const auto offset = [&](int64_t b) {
    uint64_t w;
    std::memcpy(&w, coded.data() + h.layout.offsets_offset() + 8 * size_t(b), 8);
    return w;
  };
  for (const int64_t b : {60, 5}) {  // the last word of the block: its padding bits set
    const size_t last = h.layout.stream_offset() + 4 * size_t(offset(b + 1) - 1);
    coded[last] = 0xFF;
  }
  std::vector<uint8_t> out(t.bytes.size());
  for (int threads : {1, 2, 4, 7}) {
    SCOPED_TRACE(threads);
    expect_error([&] { ll::decode(coded.data(), coded.size(), out.data(), out.size(), threads); }, "block 5 ");
  }
}

TEST(LosslessErrors, RandomCorruptionNeverCrashes) {
  // Flips anywhere (stream bits included, which no check can always catch:
  // there is no checksum): decode must throw or finish, in bounds (run under
  // ASan / valgrind to see the bounds).
  const Tensor t = normal_weights(Dtype::F32, 4000, 0.02f, 13);
  const std::vector<uint8_t> coded = ll::encode(t.dtype, t.bytes.data(), t.numel(), 1, 128);
  const ll::Layout L = ll::read_header(coded.data(), coded.size()).layout;
  std::mt19937 rng(5);
  std::vector<uint8_t> out(t.bytes.size());
  int thrown = 0, stream_flips = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    std::vector<uint8_t> bad = coded;
    const int flips = 1 + int(rng() % 3);
    bool in_stream = false;
    for (int f = 0; f < flips; ++f) {
      // Half the flips land in the bit stream.
      const size_t pos = trial % 2 ? L.stream_offset() + rng() % (4 * L.stream_words) : rng() % coded.size();
      in_stream |= pos >= L.stream_offset() && pos < L.stream_offset() + 4 * L.stream_words;
      bad[pos] ^= uint8_t(1u << (rng() % 8));
    }
    stream_flips += in_stream;
    try {
      ll::decode(bad.data(), bad.size(), out.data(), out.size(), 1 + trial % 3);
    } catch (const layerstream::Error&) {
      ++thrown;
    }
  }
  std::printf("[ corrupt  ] %d of 3000 corrupted buffers rejected (%d with stream flips)\n", thrown,
              stream_flips);
  EXPECT_GT(thrown, 300);
}

// ---------------------------------------------------------------- the GPU decoder's code on the CPU

TEST(LosslessDeviceCode, FlagsTheStreamCorruptionTheReferenceRejects) {
  // Stream flips leave the header valid: the reference throws exactly when
  // the device code reports a block as corrupt, and otherwise both give the
  // same (wrong) values.
  for (Dtype d : kDtypes) {
    const Tensor t = normal_weights(d, 3000, 0.02f, 21);
    const std::vector<uint8_t> coded = ll::encode(t.dtype, t.bytes.data(), t.numel(), 1, 256);
    const ll::Layout L = ll::read_header(coded.data(), coded.size()).layout;
    std::mt19937 rng(7);
    int rejected = 0;
    for (int trial = 0; trial < 400; ++trial) {
      std::vector<uint8_t> bad = coded;
      bad[L.stream_offset() + rng() % (4 * L.stream_words)] ^= uint8_t(1u << (rng() % 8));
      bool ok = false;
      const std::vector<uint8_t> dev = device_decode_on_host(bad, &ok);
      bool thrown = false;
      std::vector<uint8_t> ref;
      try {
        ref = decode_vec(bad);
      } catch (const layerstream::Error&) {
        thrown = true;
      }
      ASSERT_EQ(ok, !thrown) << "trial " << trial;
      if (!thrown) {
        EXPECT_TRUE(dev == ref);
      }
      rejected += thrown;
    }
    EXPECT_GT(rejected, 20);  // 40-60 of 400 per dtype
  }
}

TEST(LosslessDeviceCode, OffsetsOutsideTheStreamReadNothing) {
  // The kernel trusts the host-validated header; should the device copy's
  // offsets be wrong, a block reads no words rather than outside the buffer
  // (ASan / valgrind see the bounds) and reports itself corrupt.
  namespace dv = ll::device;
  const Tensor t = normal_weights(Dtype::BF16, 1000, 0.02f, 3);
  std::vector<uint8_t> coded = ll::encode(t.dtype, t.bytes.data(), t.numel(), 1, 256);
  const ll::Header h = ll::read_header(coded.data(), coded.size());
  const uint64_t far = uint64_t{1} << 40;
  std::memcpy(coded.data() + h.layout.offsets_offset() + 8 * 2, &far, 8);  // block 1 ends, block 2 starts, far away
  dv::Canonical canon;
  dv::canonical(h.code_lengths, &canon);
  std::vector<uint32_t> table(dv::kTableSize);
  for (uint32_t i = 0; i < dv::kTableSize; ++i) table[i] = dv::table_entry(canon, i);
  std::vector<uint16_t> out(size_t(t.numel()) + 8);
  const dv::Sections sec = dv::sections_of(h.layout, coded.data());
  EXPECT_TRUE(dv::decode_block_at<dv::Bf16>(sec, table.data(), h.code_lengths, 0, out.data()));
  EXPECT_FALSE(dv::decode_block_at<dv::Bf16>(sec, table.data(), h.code_lengths, 1, out.data()));
  EXPECT_FALSE(dv::decode_block_at<dv::Bf16>(sec, table.data(), h.code_lengths, 2, out.data()));
  EXPECT_TRUE(dv::decode_block_at<dv::Bf16>(sec, table.data(), h.code_lengths, 3, out.data()));
  EXPECT_EQ(std::memcmp(out.data(), t.bytes.data(), 2 * 256), 0);
}
