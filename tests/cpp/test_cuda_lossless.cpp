// The CUDA decoder of the lossless format (kernels/cuda/lossless.cu) vs the
// CPU reference: bit-identical on every dtype and edge case, nothing written
// outside the output. Skips without a CUDA device (on the GPU machine a skip
// is a failure: bench/gpu/skip_policy.py). Its per-block code also runs on the
// CPU in test_lossless.cpp (LosslessDeviceCode, and every round trip there).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/lossless.h"
#include "core/quant.h"
#include "kernels/cuda/lossless.h"

namespace ll = layerstream::lossless;
using ll::Dtype;

namespace {

bool have_device() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
}

#define CUDA_OK(expr)                                                      \
  do {                                                                     \
    const cudaError_t e_ = (expr);                                         \
    ASSERT_EQ(e_, cudaSuccess) << #expr << ": " << cudaGetErrorString(e_); \
  } while (0)

std::vector<uint8_t> random_bits(size_t bytes, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> v(bytes);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

std::vector<uint8_t> normal_weights(Dtype d, int64_t n, float sigma, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, sigma);
  std::vector<uint8_t> v(size_t(n) * ll::element_bytes(d));
  for (int64_t i = 0; i < n; ++i) {
    const float x = dist(rng);
    if (d == Dtype::F32) {
      std::memcpy(&v[size_t(i) * 4], &x, 4);
    } else {
      const uint16_t h = d == Dtype::BF16 ? layerstream::quant::float_to_bf16_bits(x)
                                          : layerstream::quant::float_to_f16_bits(x);
      std::memcpy(&v[size_t(i) * 2], &h, 2);
    }
  }
  return v;
}

// Codes `src` (numel elements of d) with `block` elements a block, decodes it
// on the device between two guard zones, and compares bit for bit.
void expect_device_round_trip(Dtype d, const std::vector<uint8_t>& src, int64_t block) {
  const int64_t numel = int64_t(src.size() / ll::element_bytes(d));
  SCOPED_TRACE(std::string(layerstream::quant::to_string(d)) + " numel=" + std::to_string(numel) +
               " block=" + std::to_string(block));
  const std::vector<uint8_t> coded = ll::encode(d, src.data(), numel, 0, block);
  const ll::Header h = ll::read_header(coded.data(), coded.size());
  constexpr size_t kGuard = 256;
  const size_t span = kGuard + src.size() + kGuard;
  void* dcoded = nullptr;
  void* dout = nullptr;
  CUDA_OK(cudaMalloc(&dcoded, coded.size()));
  CUDA_OK(cudaMalloc(&dout, span));
  CUDA_OK(cudaMemset(dout, 0xCD, span));
  CUDA_OK(cudaMemcpy(dcoded, coded.data(), coded.size(), cudaMemcpyHostToDevice));
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreate(&stream));
  ll::decode_cuda(h, dcoded, coded.size(), static_cast<uint8_t*>(dout) + kGuard, stream);
  CUDA_OK(cudaStreamSynchronize(stream));
  std::vector<uint8_t> whole(span);
  CUDA_OK(cudaMemcpy(whole.data(), dout, span, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaStreamDestroy(stream));
  CUDA_OK(cudaFree(dcoded));
  CUDA_OK(cudaFree(dout));
  for (size_t b = 0; b < span; ++b)
    if ((b < kGuard || b >= kGuard + src.size()) && whole[b] != 0xCD) {
      ADD_FAILURE() << "the kernel wrote outside the output, at byte " << (long long)b - (long long)kGuard;
      break;
    }
  const size_t esz = ll::element_bytes(d);
  int shown = 0;
  for (int64_t i = 0; i < numel && shown < 5; ++i)
    if (std::memcmp(&whole[kGuard + size_t(i) * esz], &src[size_t(i) * esz], esz) != 0) {
      ++shown;
      ADD_FAILURE() << "element " << i << " differs from the source";
    }
}

class CudaLossless : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_device()) GTEST_SKIP() << "no CUDA device available";
  }
};

const Dtype kDtypes[] = {Dtype::BF16, Dtype::F16, Dtype::F32};

}  // namespace

TEST_F(CudaLossless, RandomBitsEverySizeAndBlockSize) {
  uint32_t seed = 1;
  for (Dtype d : kDtypes)
    for (int64_t n : {1, 2, 3, 7, 8, 9, 63, 64, 65, 4095, 4096, 4097, 3 * 4096 + 17, 100000})
      for (int64_t block : {int64_t{64}, int64_t{4096}})
        expect_device_round_trip(d, random_bits(size_t(n) * ll::element_bytes(d), seed++), block);
}

TEST_F(CudaLossless, NormalWeightsAtSeveralScales) {
  for (Dtype d : kDtypes)
    for (float sigma : {1e-4f, 0.02f, 1.0f, 300.0f})
      for (int64_t block : {int64_t{256}, int64_t{4096}, int64_t{1} << 16})
        expect_device_round_trip(d, normal_weights(d, 300001, sigma, 7), block);
}

TEST_F(CudaLossless, SpecialValuesAndAllEqualTensors) {
  // Every 16-bit pattern (NaN payloads, ±0, subnormals, ±Inf) in a permuted order.
  std::vector<uint8_t> all(65536 * 2);
  for (uint32_t i = 0; i < 65536; ++i) {
    const uint16_t v = static_cast<uint16_t>(i * 40503u);
    std::memcpy(&all[2 * i], &v, 2);
  }
  expect_device_round_trip(Dtype::BF16, all, 4096);
  expect_device_round_trip(Dtype::F16, all, 4096);
  const uint32_t f32[] = {0x00000000, 0x80000000, 0x00000001, 0x807FFFFF, 0x00800000, 0x7F7FFFFF, 0xFF7FFFFF,
                          0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F800001, 0x7FFFFFFF, 0x3F800000};
  std::vector<uint8_t> specials(sizeof f32);
  std::memcpy(specials.data(), f32, sizeof f32);
  expect_device_round_trip(Dtype::F32, specials, 4096);
  // One symbol (a 1-bit code) and two symbols.
  for (int64_t n : {1, 5, 4097, 70000}) {
    std::vector<uint8_t> same(size_t(n) * 2);
    for (int64_t i = 0; i < n; ++i) same[size_t(2 * i)] = 0x80, same[size_t(2 * i + 1)] = 0x3F;
    expect_device_round_trip(Dtype::BF16, same, 4096);
    for (int64_t i = 0; i < n; i += 3) same[size_t(2 * i + 1)] = 0x40;
    expect_device_round_trip(Dtype::BF16, same, 1024);
  }
}

namespace {
// Codes a bf16 weight with `block` elements a block (0: the default), decodes
// it on the device (best of 10) and checks the output bit for bit. *best_ms:
// the best time; *ratio: coded bytes over raw. (void: CUDA_OK asserts.)
void timed_decode(const std::vector<uint8_t>& src, int64_t block, float* best_ms, double* ratio) {
  const int64_t n = int64_t(src.size() / 2);
  const std::vector<uint8_t> coded = ll::encode(Dtype::BF16, src.data(), n, 0, block);
  const ll::Header h = ll::read_header(coded.data(), coded.size());
  void* dcoded = nullptr;
  void* dout = nullptr;
  CUDA_OK(cudaMalloc(&dcoded, coded.size()));
  CUDA_OK(cudaMalloc(&dout, src.size()));
  CUDA_OK(cudaMemcpy(dcoded, coded.data(), coded.size(), cudaMemcpyHostToDevice));
  cudaEvent_t a, b;
  CUDA_OK(cudaEventCreate(&a));
  CUDA_OK(cudaEventCreate(&b));
  ll::decode_cuda(h, dcoded, coded.size(), dout, nullptr);
  float best = 1e30f;
  for (int r = 0; r < 10; ++r) {
    CUDA_OK(cudaEventRecord(a));
    ll::decode_cuda(h, dcoded, coded.size(), dout, nullptr);
    CUDA_OK(cudaEventRecord(b));
    CUDA_OK(cudaEventSynchronize(b));
    float ms = 0;
    CUDA_OK(cudaEventElapsedTime(&ms, a, b));
    best = std::min(best, ms);
  }
  std::vector<uint8_t> back(src.size());
  CUDA_OK(cudaMemcpy(back.data(), dout, back.size(), cudaMemcpyDeviceToHost));
  EXPECT_TRUE(back == src) << "block " << block;
  CUDA_OK(cudaEventDestroy(a));
  CUDA_OK(cudaEventDestroy(b));
  CUDA_OK(cudaFree(dcoded));
  CUDA_OK(cudaFree(dout));
  *ratio = double(coded.size()) / double(src.size());
  *best_ms = best;
}
}  // namespace

TEST_F(CudaLossless, ThroughputOfALargeWeight) {
  // Informational (speed goals live in bench/gpu/run.sh): GB/s of bf16 output.
  const std::vector<uint8_t> src = normal_weights(Dtype::BF16, int64_t{16384} * 4096, 0.02f, 3);
  double ratio = 0;
  float best = 0;
  timed_decode(src, 0, &best, &ratio);
  // bench/gpu/run.sh (the cpp stage) reads this line into results.md: keep its format.
  std::printf("[ lossless ] decode 16384 x 4096 bf16 on the device: %.3f ms, %.1f GB/s of output (coded %.3f of raw)\n",
              best, double(src.size()) / (best * 1e-3) / 1e9, ratio);
}

TEST_F(CudaLossless, ThroughputByBlockSize) {
  // Informational: the default block size's rule (lossless::default_block_elems)
  // against the others, on a 4096 x 4096 and a 16384 x 4096 weight. run.sh reads
  // these lines too (the format is theirs).
  for (int64_t rows : {int64_t{4096}, int64_t{16384}}) {
    const std::vector<uint8_t> src = normal_weights(Dtype::BF16, rows * 4096, 0.02f, 7);
    for (int64_t block : {int64_t{512}, int64_t{1024}, int64_t{2048}, int64_t{4096}}) {
      double ratio = 0;
      float ms = 0;
      timed_decode(src, block, &ms, &ratio);
      std::printf("[ lossless sweep ] %lld x 4096 bf16, blocks of %lld%s: %.3f ms, %.1f GB/s of output (coded %.4f of raw)\n",
                  static_cast<long long>(rows), static_cast<long long>(block),
                  block == ll::default_block_elems(rows * 4096) ? " (default)" : "", ms,
                  double(src.size()) / (ms * 1e-3) / 1e9, ratio);
    }
  }
}

// Pieces (analyze_pieces): decode_pieces_cuda decodes all of them, or some
// (a routed call's experts), in one launch per 128, each from its own header
// in device memory into its place; the other pieces' outputs stay untouched.
// 200 pieces: two launches. Also a piece per expert of realistic size.
TEST_F(CudaLossless, PiecesDecodeTogetherIntoTheirPlaces) {
  struct Case {
    Dtype d;
    int64_t count, per;
  };
  for (const Case c : {Case{Dtype::BF16, 200, 1000}, Case{Dtype::F16, 3, 4096}, Case{Dtype::F32, 8, 2048},
                       Case{Dtype::BF16, 16, 768 * 64}}) {
    SCOPED_TRACE(std::string(layerstream::quant::to_string(c.d)) + " pieces=" + std::to_string(c.count));
    const size_t esz = ll::element_bytes(c.d);
    std::vector<uint8_t> src = normal_weights(c.d, c.count * c.per, 0.02f, 5);
    const std::vector<uint8_t> noise = random_bits(size_t(c.per) * esz, 9);  // piece 1 codes differently
    std::copy(noise.begin(), noise.end(), src.begin() + size_t(c.per) * esz);
    const ll::PiecesAnalysis P = ll::analyze_pieces(c.d, src.data(), c.count * c.per, c.count);
    std::vector<uint8_t> coded(P.total_bytes());
    ll::encode_pieces(P, src.data(), coded.data(), coded.size());
    const ll::Layout shared = ll::read_header(coded.data(), coded.size()).layout;
    for (bool some : {false, true}) {
      std::vector<ll::device::PieceJob> jobs;
      std::vector<bool> chosen(size_t(c.count), !some);
      for (int64_t k = 0; k < c.count; ++k)
        if (!some || k % 3 != 0) {
          chosen[size_t(k)] = true;
          jobs.push_back({P.offsets[size_t(k)], uint64_t(k) * uint64_t(c.per) * esz});
        }
      void* dcoded = nullptr;
      void* dout = nullptr;
      CUDA_OK(cudaMalloc(&dcoded, coded.size()));
      CUDA_OK(cudaMalloc(&dout, src.size()));
      CUDA_OK(cudaMemset(dout, 0xCD, src.size()));
      CUDA_OK(cudaMemcpy(dcoded, coded.data(), coded.size(), cudaMemcpyHostToDevice));
      ll::decode_pieces_cuda(shared, dcoded, jobs.data(), jobs.size(), dout, nullptr);
      CUDA_OK(cudaDeviceSynchronize());
      std::vector<uint8_t> out(src.size());
      CUDA_OK(cudaMemcpy(out.data(), dout, out.size(), cudaMemcpyDeviceToHost));
      CUDA_OK(cudaFree(dcoded));
      CUDA_OK(cudaFree(dout));
      for (int64_t k = 0; k < c.count; ++k) {
        const size_t at = size_t(k) * size_t(c.per) * esz, n = size_t(c.per) * esz;
        if (chosen[size_t(k)])
          EXPECT_EQ(std::memcmp(out.data() + at, src.data() + at, n), 0) << "piece " << k << " differs";
        else
          EXPECT_TRUE(std::all_of(out.begin() + at, out.begin() + at + n, [](uint8_t b) { return b == 0xCD; }))
              << "piece " << k << " was not asked for but written";
      }
    }
  }
}

namespace {
std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const layerstream::Error& e) {
    return e.what();
  }
  return "no error";
}
void* fake_device_ptr(uintptr_t addr) { return reinterpret_cast<void*>(addr); }
}  // namespace

// Argument checks come before any CUDA call: they run without a device too.
TEST(CudaLosslessArgs, BadArgumentsAreRejectedBeforeAnyLaunch) {
  const std::vector<uint8_t> src = normal_weights(Dtype::BF16, 1000, 0.02f, 1);
  const std::vector<uint8_t> coded = ll::encode(Dtype::BF16, src.data(), 1000);
  const ll::Header h = ll::read_header(coded.data(), coded.size());
  std::string msg = error_of([&] { ll::decode_cuda(h, fake_device_ptr(0x10008), coded.size(), fake_device_ptr(0x20000), nullptr); });
  EXPECT_NE(msg.find("16-byte aligned"), std::string::npos) << msg;
  msg = error_of([&] { ll::decode_cuda(h, fake_device_ptr(0x10000), coded.size(), fake_device_ptr(0x20002), nullptr); });
  EXPECT_NE(msg.find("16-byte"), std::string::npos) << msg;
  msg = error_of([&] { ll::decode_cuda(h, fake_device_ptr(0x10000), coded.size() - 1, fake_device_ptr(0x20000), nullptr); });
  EXPECT_NE(msg.find("its header says"), std::string::npos) << msg;
  msg = error_of([&] { ll::decode_cuda(h, nullptr, coded.size(), fake_device_ptr(0x20000), nullptr); });
  EXPECT_NE(msg.find("null"), std::string::npos) << msg;
  // Pieces: a misaligned piece is refused before any launch.
  const ll::Layout L = h.layout;
  const ll::device::PieceJob bad[] = {{0, 0}, {256, 8}};
  msg = error_of([&] { ll::decode_pieces_cuda(L, fake_device_ptr(0x10000), bad, 2, fake_device_ptr(0x20000), nullptr); });
  EXPECT_NE(msg.find("piece 1's coded buffer and output must be 16-byte aligned"), std::string::npos) << msg;
  // An empty tensor: nothing is looked at or launched.
  const std::vector<uint8_t> empty = ll::encode(Dtype::F32, nullptr, 0);
  EXPECT_NO_THROW(ll::decode_cuda(ll::read_header(empty.data(), empty.size()), nullptr, empty.size(), nullptr, nullptr));
}
