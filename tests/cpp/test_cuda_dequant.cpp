// CUDA dequantization kernels vs the CPU reference: bit-exact for every
// format and output dtype. Skips cleanly when no CUDA device is usable.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/gguf_blocks.h"
#include "core/quant.h"
#include "kernels/cuda/dequant.h"

namespace q = layerstream::quant;
namespace gguf = layerstream::quant::gguf;
using q::Format;
using q::OutDtype;

namespace {

bool have_device() {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear the error so later CUDA calls start clean
    return false;
  }
  return n > 0;
}

// Parameterized device tests: each skips without a CUDA device.
template <class Param>
class DeviceTest : public ::testing::TestWithParam<Param> {
 protected:
  void SetUp() override {
    if (!have_device()) GTEST_SKIP() << "no CUDA device available";
  }
};

#define CUDA_OK(expr)                                                                  \
  do {                                                                                 \
    const cudaError_t e_ = (expr);                                                     \
    ASSERT_EQ(e_, cudaSuccess) << #expr << ": " << cudaGetErrorString(e_);             \
  } while (0)

struct Case {
  Format format;
  int64_t rows, cols;
  OutDtype out;
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return std::string(q::to_string(c.format)) + "_" + std::to_string(c.rows) + "x" +
         std::to_string(c.cols) + "_" + q::to_string(c.out);
}

std::vector<Case> cases() {
  // 3x37 and 5x100: partial chunks, rows that do not divide 16, odd nf4 nibble.
  // 37x3 and 45x1: several row changes inside one 16-element chunk (int8/fp8
  // fetch a new scale mid-chunk). 1000x1003: many blocks, partial last chunk.
  const std::pair<int64_t, int64_t> shapes[] = {{1, 128}, {3, 37},   {5, 100},    {37, 3},
                                                {45, 1},  {33, 384}, {256, 1024}, {1000, 1003}};
  std::vector<Case> v;
  for (Format f : {Format::Int8, Format::Fp8E4M3, Format::NF4, Format::Int4})
    for (auto s : shapes)
      for (OutDtype d : {OutDtype::F32, OutDtype::BF16, OutDtype::F16}) {
        if (f == Format::Int4 && s.second % 128 != 0) continue;
        v.push_back({f, s.first, s.second, d});
      }
  return v;
}

class CudaDequant : public DeviceTest<Case> {};

TEST_P(CudaDequant, BitExactVsCpu) {
  const Case c = GetParam();
  const int64_t n = c.rows * c.cols;
  std::mt19937 rng(static_cast<uint32_t>(n));
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> w(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const float mag = (i / c.cols) % 3 == 0 ? 1e-3f : ((i / c.cols) % 3 == 1 ? 1.0f : 300.0f);
    w[static_cast<size_t>(i)] = (i % 11 == 0) ? 0.0f : nd(rng) * mag;  // 300*N(0,1): f16 overflow
  }
  const q::PackedLayout L = q::layout_for(c.format, c.rows, c.cols);
  std::vector<uint8_t> packed(L.total_bytes());
  q::pack(c.format, w.data(), c.rows, c.cols, packed.data());
  const size_t esz = q::out_dtype_bytes(c.out);
  std::vector<uint8_t> want(static_cast<size_t>(n) * esz), got(want.size(), 0xCD);
  q::dequantize_cpu(L, packed.data(), want.data(), c.out, 0);

  // Aligned output (vector stores) and an output offset by one element (scalar
  // stores). The output sits between two guard zones that must stay untouched.
  constexpr size_t kGuard = 256;
  for (size_t offset_elems : {size_t{0}, size_t{1}}) {
    SCOPED_TRACE("output offset " + std::to_string(offset_elems) + " elements");
    void* dpacked = nullptr;
    void* dout = nullptr;
    const size_t lead = kGuard + offset_elems * esz;
    const size_t span = lead + want.size() + kGuard;
    CUDA_OK(cudaMalloc(&dpacked, packed.size()));
    CUDA_OK(cudaMalloc(&dout, span));
    CUDA_OK(cudaMemset(dout, 0xCD, span));
    cudaStream_t stream;
    CUDA_OK(cudaStreamCreate(&stream));
    CUDA_OK(cudaMemcpy(dpacked, packed.data(), packed.size(), cudaMemcpyHostToDevice));
    void* out = static_cast<uint8_t*>(dout) + lead;
    q::dequantize_cuda(L, dpacked, out, c.out, stream);
    CUDA_OK(cudaStreamSynchronize(stream));
    std::vector<uint8_t> whole(span);
    CUDA_OK(cudaMemcpy(whole.data(), dout, span, cudaMemcpyDeviceToHost));
    std::memcpy(got.data(), whole.data() + lead, got.size());
    CUDA_OK(cudaStreamDestroy(stream));
    CUDA_OK(cudaFree(dpacked));
    CUDA_OK(cudaFree(dout));
    for (size_t b = 0; b < span; ++b) {
      if (b >= lead && b < lead + want.size()) continue;
      if (whole[b] != 0xCD) {
        ADD_FAILURE() << "the kernel wrote outside the output, at byte " << static_cast<long long>(b) - static_cast<long long>(lead)
                      << " relative to its start";
        break;
      }
    }
    int shown = 0;
    for (int64_t i = 0; i < n && shown < 5; ++i) {
      if (std::memcmp(&want[static_cast<size_t>(i) * esz], &got[static_cast<size_t>(i) * esz], esz) != 0) {
        ++shown;
        ADD_FAILURE() << "element " << i << " (row " << i / c.cols << ", col " << i % c.cols
                      << ") differs from the CPU reference";
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllFormats, CudaDequant, ::testing::ValuesIn(cases()), case_name);

// One expert's rows of an [experts * rows, cols] tensor dequantized on the
// device where they lie equal the CPU reference's rows, bit for bit.
TEST(CudaDequantRows, ExpertRowsMatchTheCpuReference) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device available";
  const int64_t experts = 4, rows = 6, cols = 256;
  const int64_t n = experts * rows * cols;
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> w(static_cast<size_t>(n));
  for (float& v : w) v = nd(rng);
  for (Format f : {Format::Int8, Format::Fp8E4M3, Format::NF4, Format::Int4}) {
    SCOPED_TRACE(q::to_string(f));
    const q::PackedLayout L = q::layout_for(f, experts * rows, cols);
    std::vector<uint8_t> packed(L.total_bytes());
    q::pack(f, w.data(), experts * rows, cols, packed.data());
    void* dpacked = nullptr;
    void* dout = nullptr;
    CUDA_OK(cudaMalloc(&dpacked, packed.size()));
    CUDA_OK(cudaMalloc(&dout, static_cast<size_t>(rows * cols) * 2));
    CUDA_OK(cudaMemcpy(dpacked, packed.data(), packed.size(), cudaMemcpyHostToDevice));
    for (int64_t e = 0; e < experts; ++e) {
      std::vector<uint8_t> want(static_cast<size_t>(rows * cols) * 2), got(want.size());
      q::dequantize_rows_cpu(L, packed.data(), e * rows, (e + 1) * rows, want.data(), OutDtype::BF16, 1);
      q::dequantize_rows_cuda(L, dpacked, e * rows, (e + 1) * rows, dout, OutDtype::BF16, nullptr);
      CUDA_OK(cudaDeviceSynchronize());
      CUDA_OK(cudaMemcpy(got.data(), dout, got.size(), cudaMemcpyDeviceToHost));
      EXPECT_EQ(0, std::memcmp(want.data(), got.data(), want.size())) << "expert " << e;
    }
    CUDA_OK(cudaFree(dpacked));
    CUDA_OK(cudaFree(dout));
  }
}

// Hand-built packed buffers (not from pack()) so that every code value is
// decoded: all 256 int8 / fp8 bytes (int8 -128 and the fp8 NaN codes 0x7F /
// 0xFF included), every nf4 / int4 nibble pair, int4 zero points 0..15 and a
// fractional one, and scales from 0 and fp32 subnormals up to values whose
// products overflow f16, bf16 and fp32 (finite scales only: a NaN or Inf scale
// is outside the bit-identity contract, see dequant.cu).
std::vector<float> edge_scales() {
  std::vector<float> v = {0.0f,    1.0f,    0.5f,     1.0f / 127.0f, 1e-3f,   1e-5f,
                          6e-8f,   1e-30f,  1e-40f,   1.4e-45f,      300.0f,  65504.0f / 127.0f,
                          516.0f,  1e30f,   3.4e38f,  -2.5f,         -0.0f,   0.0078125f};
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> ex(-40.0f, 40.0f);
  for (int i = 0; i < 14; ++i) v.push_back(std::ldexp(1.0f + ex(rng) / 80.0f, static_cast<int>(ex(rng))));
  return v;
}

std::vector<uint8_t> all_codes_buffer(const q::PackedLayout& L) {
  std::vector<uint8_t> buf(L.total_bytes(), 0);
  for (size_t j = 0; j < L.data_bytes; ++j)  // 7 is odd: every 256 bytes hold every value
    buf[j] = static_cast<uint8_t>(j * 7 + (j / 256) * 13);
  const std::vector<float> sc = edge_scales();
  float* scales = reinterpret_cast<float*>(buf.data() + L.scale_offset());
  for (int64_t k = 0; k < L.num_scales(); ++k) scales[k] = sc[static_cast<size_t>(k) % sc.size()];
  if (L.zero_bytes > 0) {
    float* zeros = reinterpret_cast<float*>(buf.data() + L.zero_offset());
    for (int64_t k = 0; k < L.num_scales(); ++k)
      zeros[k] = (k % 17 == 16) ? 7.5f : static_cast<float>(k % 17);
  }
  return buf;
}

class CudaDequantCodes : public DeviceTest<Format> {};

TEST_P(CudaDequantCodes, EveryCodeAndEdgeScaleBitExact) {
  const Format f = GetParam();
  // int4 needs cols % 128 == 0; the others get a ragged shape (partial chunk,
  // odd nf4 element count).
  const int64_t rows = 63, cols = f == Format::Int4 ? 512 : 515;  // 63 x 515 is odd
  const q::PackedLayout L = q::layout_for(f, rows, cols);
  const std::vector<uint8_t> packed = all_codes_buffer(L);
  const int64_t n = L.numel();
  void* dpacked = nullptr;
  CUDA_OK(cudaMalloc(&dpacked, packed.size()));
  CUDA_OK(cudaMemcpy(dpacked, packed.data(), packed.size(), cudaMemcpyHostToDevice));
  for (OutDtype d : {OutDtype::F32, OutDtype::BF16, OutDtype::F16}) {
    const size_t esz = q::out_dtype_bytes(d);
    std::vector<uint8_t> want(static_cast<size_t>(n) * esz), got(want.size());
    q::dequantize_cpu(L, packed.data(), want.data(), d, 1);
    for (size_t offset_elems : {size_t{0}, size_t{1}}) {
      SCOPED_TRACE(std::string(q::to_string(d)) + ", output offset " + std::to_string(offset_elems));
      void* dout = nullptr;
      CUDA_OK(cudaMalloc(&dout, want.size() + 16));
      void* out = static_cast<uint8_t*>(dout) + offset_elems * esz;
      q::dequantize_cuda(L, dpacked, out, d, nullptr);
      CUDA_OK(cudaDeviceSynchronize());
      CUDA_OK(cudaMemcpy(got.data(), out, got.size(), cudaMemcpyDeviceToHost));
      CUDA_OK(cudaFree(dout));
      int shown = 0;
      for (int64_t i = 0; i < n && shown < 5; ++i) {
        const size_t at = static_cast<size_t>(i) * esz;
        if (std::memcmp(&want[at], &got[at], esz) != 0) {
          uint32_t w = 0, g = 0;
          std::memcpy(&w, &want[at], esz);
          std::memcpy(&g, &got[at], esz);
          ++shown;
          ADD_FAILURE() << "element " << i << ": CPU bits 0x" << std::hex << w << ", GPU bits 0x" << g;
        }
      }
    }
  }
  CUDA_OK(cudaFree(dpacked));
}

INSTANTIATE_TEST_SUITE_P(AllFormats, CudaDequantCodes,
                         ::testing::Values(Format::Int8, Format::Fp8E4M3, Format::NF4, Format::Int4),
                         [](const ::testing::TestParamInfo<Format>& info) {
                           return std::string(q::to_string(info.param));
                         });

// More than 2^31 elements (an lm_head or embedding of 128k x 16k is 2^31):
// 64-bit element, byte, row, block and group offsets and the grid size. The
// packed buffer is filled with a constant; random codes and scales go into
// three windows (the start, across element 2^31, the end with its partial
// chunk), each compared with dequantize_cpu of the same elements on their own.
struct BigCase {
  Format format;
  int64_t rows, cols;
};

// Window [e0, e1) of flat elements; e0 (and e1 unless it is n) on a whole
// unit: a row for int8/fp8/int4, a 64-element block for nf4.
struct WindowMap {
  q::PackedLayout sub;   // the window as a tensor of its own
  size_t data_off = 0;   // byte offset of its codes in the full data section
  int64_t scale0 = 0;    // index of its first scale (and zero point)
};

WindowMap window_map(const q::PackedLayout& L, int64_t e0, int64_t e1) {
  WindowMap m;
  if (L.format == Format::NF4) {
    m.sub = q::layout_for(Format::NF4, 1, e1 - e0);
    m.data_off = static_cast<size_t>(e0 / 2);
    m.scale0 = e0 / q::kNF4BlockSize;
  } else {
    m.sub = q::layout_for(L.format, (e1 - e0) / L.cols, L.cols);
    m.data_off = static_cast<size_t>(L.format == Format::Int4 ? e0 / 2 : e0);
    m.scale0 = L.format == Format::Int4 ? e0 / q::kInt4GroupSize : e0 / L.cols;
  }
  return m;
}

TEST(CudaDequantLarge, MoreThan2To31Elements) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device available";
  const BigCase cases[] = {
      {Format::Int8, 262147, 8193},            // 2^31 + 286723 elements, cols odd
      {Format::Fp8E4M3, 262147, 8193},
      {Format::NF4, 1, (int64_t{1} << 31) + (1 << 20) + 4097},  // odd: partial last byte
      {Format::Int4, 16400, 131072},           // 2^31 + 2^21 elements
  };
  int64_t max_n = 0;
  size_t max_packed = 0;
  for (const BigCase& c : cases) {
    const q::PackedLayout L = q::layout_for(c.format, c.rows, c.cols);
    max_n = std::max(max_n, L.numel());
    max_packed = std::max(max_packed, L.total_bytes());
  }
  constexpr size_t kGuard = 256;
  const size_t out_bytes = static_cast<size_t>(max_n) * 2;  // bf16
  size_t free_b = 0, total_b = 0;
  CUDA_OK(cudaMemGetInfo(&free_b, &total_b));
  if (free_b < max_packed + out_bytes + kGuard + (size_t{1} << 30))
    GTEST_SKIP() << "needs " << (max_packed + out_bytes) / (1 << 20) << " MiB of free device memory";

  void* dpacked = nullptr;
  void* dout = nullptr;
  CUDA_OK(cudaMalloc(&dpacked, max_packed));
  CUDA_OK(cudaMalloc(&dout, out_bytes + kGuard));
  std::mt19937 rng(12345);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> sc(0.001f, 2.0f);
  for (const BigCase& c : cases) {
    const q::PackedLayout L = q::layout_for(c.format, c.rows, c.cols);
    const int64_t n = L.numel();
    SCOPED_TRACE(q::describe(L));
    ASSERT_GT(n, int64_t{1} << 31);
    const int64_t unit = c.format == Format::NF4 ? q::kNF4BlockSize : c.cols;
    const int64_t mid = (int64_t{1} << 31) / unit * unit;  // the unit holding element 2^31
    const int64_t span = std::max<int64_t>(unit * 4, 4096 / unit * unit);
    const std::pair<int64_t, int64_t> windows[] = {
        {0, span}, {mid - span, mid + span}, {(n - 1) / unit * unit - span, n}};
    ASSERT_TRUE(windows[0].second <= windows[1].first && windows[1].second <= windows[2].first)
        << "the windows must not overlap";

    CUDA_OK(cudaMemset(dpacked, 0x3F, L.total_bytes()));
    CUDA_OK(cudaMemset(dout, 0xCD, out_bytes + kGuard));
    std::vector<std::vector<uint8_t>> subs;
    for (const auto& w : windows) {
      const WindowMap m = window_map(L, w.first, w.second);
      std::vector<uint8_t> buf(m.sub.total_bytes(), 0);
      for (size_t j = 0; j < m.sub.data_bytes; ++j) buf[j] = static_cast<uint8_t>(byte(rng));
      if (c.format == Format::NF4 && m.sub.numel() % 2 == 1) buf[m.sub.data_bytes - 1] &= 0xF0;
      float* scales = reinterpret_cast<float*>(buf.data() + m.sub.scale_offset());
      float* zeros = reinterpret_cast<float*>(buf.data() + m.sub.zero_offset());
      for (int64_t k = 0; k < m.sub.num_scales(); ++k) {
        scales[k] = sc(rng);
        if (m.sub.zero_bytes) zeros[k] = static_cast<float>(byte(rng) % 16);
      }
      uint8_t* base = static_cast<uint8_t*>(dpacked);
      CUDA_OK(cudaMemcpy(base + L.data_offset() + m.data_off, buf.data(), m.sub.data_bytes,
                         cudaMemcpyHostToDevice));
      CUDA_OK(cudaMemcpy(base + L.scale_offset() + m.scale0 * 4, scales, m.sub.scale_bytes,
                         cudaMemcpyHostToDevice));
      if (m.sub.zero_bytes)
        CUDA_OK(cudaMemcpy(base + L.zero_offset() + m.scale0 * 4, zeros, m.sub.zero_bytes,
                           cudaMemcpyHostToDevice));
      subs.push_back(std::move(buf));
    }
    q::dequantize_cuda(L, dpacked, dout, OutDtype::BF16, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    for (size_t k = 0; k < subs.size(); ++k) {
      const WindowMap m = window_map(L, windows[k].first, windows[k].second);
      const size_t count = static_cast<size_t>(windows[k].second - windows[k].first);
      std::vector<uint16_t> want(count), got(count);
      q::dequantize_cpu(m.sub, subs[k].data(), want.data(), OutDtype::BF16, 1);
      CUDA_OK(cudaMemcpy(got.data(), static_cast<uint16_t*>(dout) + windows[k].first, count * 2,
                         cudaMemcpyDeviceToHost));
      size_t bad = 0;
      for (size_t i = 0; i < count; ++i) bad += want[i] != got[i];
      EXPECT_EQ(bad, 0u) << "window [" << windows[k].first << ", " << windows[k].second
                         << ") differs from the CPU reference in " << bad << " elements";
    }
    std::vector<uint8_t> tail(kGuard);
    CUDA_OK(cudaMemcpy(tail.data(), static_cast<uint8_t*>(dout) + static_cast<size_t>(n) * 2, kGuard,
                       cudaMemcpyDeviceToHost));
    for (uint8_t b : tail) {
      if (b != 0xCD) {
        ADD_FAILURE() << "the kernel wrote past the end of the output";
        break;
      }
    }
  }
  CUDA_OK(cudaFree(dpacked));
  CUDA_OK(cudaFree(dout));
}

// Argument checks run before any CUDA call, so they are tested without a GPU
// (fake, never dereferenced device addresses).
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const layerstream::Error& e) {
    return e.what();
  }
  return "<no layerstream::Error thrown>";
}

void* fake_device_ptr(uintptr_t addr) { return reinterpret_cast<void*>(addr); }

TEST(CudaDequantArgs, MisalignedPackedBufferIsRejected) {
  const q::PackedLayout L = q::layout_for(Format::Int8, 4, 64);
  const std::string msg = error_of(
      [&] { q::dequantize_cuda(L, fake_device_ptr(0x10004), fake_device_ptr(0x20000), OutDtype::F32, nullptr); });
  EXPECT_NE(msg.find("16-byte aligned"), std::string::npos) << msg;
}

TEST(CudaDequantArgs, MisalignedOutputIsRejected) {
  const q::PackedLayout L = q::layout_for(Format::NF4, 3, 37);
  std::string msg = error_of(
      [&] { q::dequantize_cuda(L, fake_device_ptr(0x10000), fake_device_ptr(0x20002), OutDtype::F32, nullptr); });
  EXPECT_NE(msg.find("not aligned to its element size"), std::string::npos) << msg;
  msg = error_of(
      [&] { q::dequantize_cuda(L, fake_device_ptr(0x10000), fake_device_ptr(0x20001), OutDtype::BF16, nullptr); });
  EXPECT_NE(msg.find("not aligned to its element size"), std::string::npos) << msg;
}

TEST(CudaDequantArgs, InconsistentLayoutAndNullPointersAreRejected) {
  q::PackedLayout L = q::layout_for(Format::Int4, 2, 256);
  L.zero_bytes = 0;  // e.g. a hand-built layout that forgot the zero points
  std::string msg = error_of(
      [&] { q::dequantize_cuda(L, fake_device_ptr(0x10000), fake_device_ptr(0x20000), OutDtype::F16, nullptr); });
  EXPECT_NE(msg.find("inconsistent PackedLayout"), std::string::npos) << msg;

  L = q::layout_for(Format::Fp8E4M3, 2, 16);
  msg = error_of([&] { q::dequantize_cuda(L, nullptr, fake_device_ptr(0x20000), OutDtype::F16, nullptr); });
  EXPECT_NE(msg.find("null"), std::string::npos) << msg;
  msg = error_of([&] { q::dequantize_cuda(L, fake_device_ptr(0x10000), nullptr, OutDtype::F16, nullptr); });
  EXPECT_NE(msg.find("null"), std::string::npos) << msg;

  q::PackedLayout none;
  msg = error_of(
      [&] { q::dequantize_cuda(none, fake_device_ptr(0x10000), fake_device_ptr(0x20000), OutDtype::F32, nullptr); });
  EXPECT_NE(msg.find("'none'"), std::string::npos) << msg;
}

TEST(CudaDequantArgs, EmptyTensorIsANoOp) {
  // Nothing to do: no pointer is looked at and nothing is launched.
  for (Format f : {Format::Int8, Format::Fp8E4M3, Format::NF4, Format::Int4, Format::GgufQ8_0,
                   Format::GgufQ4_0, Format::GgufQ4_1, Format::GgufQ5_0, Format::GgufQ5_1,
                   Format::GgufQ2_K, Format::GgufQ3_K, Format::GgufQ4_K, Format::GgufQ5_K,
                   Format::GgufQ6_K}) {
    const q::PackedLayout L = q::layout_for(f, 0, 256);
    EXPECT_NO_THROW(q::dequantize_cuda(L, nullptr, nullptr, OutDtype::BF16, nullptr)) << q::to_string(f);
  }
}

// With two or more GPUs: the kernel runs on the stream's device (for the
// default stream: the output's device) even when the calling thread has
// another device current, and that device stays current.
TEST(CudaDequantDevices, LaunchesOnTheStreamsDevice) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device available";
  int count = 0;
  CUDA_OK(cudaGetDeviceCount(&count));
  if (count < 2) GTEST_SKIP() << "needs two CUDA devices";
  const int dev = count - 1;
  const q::PackedLayout L = q::layout_for(Format::NF4, 17, 300);
  std::vector<float> w(static_cast<size_t>(L.numel()));
  for (size_t i = 0; i < w.size(); ++i) w[i] = std::sin(static_cast<float>(i)) * 3.0f;
  std::vector<uint8_t> packed(L.total_bytes());
  q::pack(Format::NF4, w.data(), L.rows, L.cols, packed.data());
  std::vector<uint16_t> want(w.size()), got(w.size());
  q::dequantize_cpu(L, packed.data(), want.data(), OutDtype::BF16, 1);

  CUDA_OK(cudaSetDevice(dev));
  void* dpacked = nullptr;
  void* dout = nullptr;
  cudaStream_t stream = nullptr;
  CUDA_OK(cudaMalloc(&dpacked, packed.size()));
  CUDA_OK(cudaMalloc(&dout, got.size() * 2));
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  CUDA_OK(cudaMemcpy(dpacked, packed.data(), packed.size(), cudaMemcpyHostToDevice));
  CUDA_OK(cudaSetDevice(0));
  q::dequantize_cuda(L, dpacked, dout, OutDtype::BF16, stream);
  int cur = -1;
  CUDA_OK(cudaGetDevice(&cur));
  EXPECT_EQ(cur, 0) << "dequantize_cuda must restore the caller's current device";
  CUDA_OK(cudaStreamSynchronize(stream));
  CUDA_OK(cudaMemcpy(got.data(), dout, got.size() * 2, cudaMemcpyDeviceToHost));
  EXPECT_EQ(std::memcmp(want.data(), got.data(), got.size() * 2), 0);

  // nullptr (torch's "default stream of cuda:N"): the output's device's default stream.
  CUDA_OK(cudaSetDevice(dev));
  CUDA_OK(cudaMemset(dout, 0, got.size() * 2));
  CUDA_OK(cudaDeviceSynchronize());
  CUDA_OK(cudaSetDevice(0));
  q::dequantize_cuda(L, dpacked, dout, OutDtype::BF16, nullptr);
  CUDA_OK(cudaGetDevice(&cur));
  EXPECT_EQ(cur, 0);
  CUDA_OK(cudaSetDevice(dev));
  CUDA_OK(cudaDeviceSynchronize());
  CUDA_OK(cudaMemcpy(got.data(), dout, got.size() * 2, cudaMemcpyDeviceToHost));
  EXPECT_EQ(std::memcmp(want.data(), got.data(), got.size() * 2), 0);
  CUDA_OK(cudaStreamDestroy(stream));
  CUDA_OK(cudaFree(dpacked));
  CUDA_OK(cudaFree(dout));
  CUDA_OK(cudaSetDevice(0));
}

// ---- GGUF block formats (q8_0 .. q6_k) ----
// Blocks of random bytes whose fp16 scale fields (d, dmin, m) hold random
// finite halves of both signs (zeros and subnormals included): every code and
// scale byte pattern the bit-identity contract covers.
struct GgufInfo {
  Format format;
  int elems, bytes;
  int halves[2];  // byte offsets of the fp16 fields inside a block
  int num_halves;
};

const GgufInfo& gguf_info(Format f) {
  static const std::vector<GgufInfo> infos = [] {
    std::vector<GgufInfo> v;
    for (int id = static_cast<int>(Format::GgufQ8_0); id <= static_cast<int>(Format::GgufQ6_K); ++id) {
      GgufInfo g{static_cast<Format>(id), gguf::block_elems(id), gguf::block_bytes(id), {0, 0}, 0};
      g.num_halves = gguf::half_fields(id, g.halves);
      v.push_back(g);
    }
    return v;
  }();
  for (const GgufInfo& g : infos)
    if (g.format == f) return g;
  throw std::logic_error("not a GGUF format");
}

// Every GGUF format, as gguf_info() describes it.
std::vector<GgufInfo> gguf_infos() {
  std::vector<GgufInfo> v;
  for (int id = static_cast<int>(Format::GgufQ8_0); id <= static_cast<int>(Format::GgufQ6_K); ++id)
    v.push_back(gguf_info(static_cast<Format>(id)));
  return v;
}

uint16_t random_finite_half(std::mt19937& rng) {
  static const uint16_t kSpecial[] = {0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x83FF,
                                      0x0400, 0x8400, 0x3C00, 0xBC00, 0x7BFF, 0xFBFF};
  const uint32_t u = static_cast<uint32_t>(rng());
  if (u % 4 == 0) return kSpecial[(u >> 8) % (sizeof kSpecial / sizeof kSpecial[0])];
  uint16_t h = static_cast<uint16_t>(u >> 16);
  if (u % 8 == 1) h &= 0x83FF;                     // a subnormal (or zero)
  if (((h >> 10) & 0x1F) == 0x1F) h ^= 0x0400;     // Inf / NaN exponent 31 -> 30
  return h;
}

// A whole packed buffer of layout L (padding zero).
std::vector<uint8_t> gguf_buffer(const q::PackedLayout& L, uint32_t seed) {
  const GgufInfo& g = gguf_info(L.format);
  std::vector<uint8_t> buf(L.total_bytes(), 0);
  std::mt19937 rng(seed);
  for (size_t j = 0; j < L.data_bytes; ++j) buf[j] = static_cast<uint8_t>(rng() >> 24);
  const size_t blocks = L.data_bytes / static_cast<size_t>(g.bytes);
  for (size_t k = 0; k < blocks; ++k)
    for (int h = 0; h < g.num_halves; ++h) {
      const uint16_t v = random_finite_half(rng);
      uint8_t* p = buf.data() + k * static_cast<size_t>(g.bytes) + g.halves[h];
      p[0] = static_cast<uint8_t>(v & 0xFF);
      p[1] = static_cast<uint8_t>(v >> 8);
    }
  return buf;
}

// Rows [r0, r1) of `packed` (the whole tensor, copied to the device as is)
// dequantized on the device into an output `offset_elems` elements past a
// 256-byte aligned address, between two guard zones that must stay
// untouched; the whole tensor goes through dequantize_cuda, a proper range
// through dequantize_rows_cuda. `got` receives the output.
void gguf_on_device(const q::PackedLayout& L, const std::vector<uint8_t>& packed, int64_t r0, int64_t r1,
                    OutDtype d, size_t offset_elems, std::vector<uint8_t>& got) {
  constexpr size_t kGuard = 256;
  const size_t esz = q::out_dtype_bytes(d);
  const size_t bytes = static_cast<size_t>((r1 - r0) * L.cols) * esz;
  const size_t lead = kGuard + offset_elems * esz;
  const size_t span = lead + bytes + kGuard;
  void* dpacked = nullptr;
  void* dout = nullptr;
  CUDA_OK(cudaMalloc(&dpacked, packed.size()));
  CUDA_OK(cudaMalloc(&dout, span));
  CUDA_OK(cudaMemset(dout, 0xCD, span));
  CUDA_OK(cudaMemcpy(dpacked, packed.data(), packed.size(), cudaMemcpyHostToDevice));
  void* out = static_cast<uint8_t*>(dout) + lead;
  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreate(&stream));
  if (r0 == 0 && r1 == L.rows)
    q::dequantize_cuda(L, dpacked, out, d, stream);
  else
    q::dequantize_rows_cuda(L, dpacked, r0, r1, out, d, stream);
  CUDA_OK(cudaStreamSynchronize(stream));
  CUDA_OK(cudaStreamDestroy(stream));
  std::vector<uint8_t> whole(span);
  CUDA_OK(cudaMemcpy(whole.data(), dout, span, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaFree(dpacked));
  CUDA_OK(cudaFree(dout));
  got.assign(whole.begin() + static_cast<std::ptrdiff_t>(lead),
             whole.begin() + static_cast<std::ptrdiff_t>(lead + bytes));
  for (size_t b = 0; b < span; ++b) {
    if (b >= lead && b < lead + bytes) continue;
    if (whole[b] != 0xCD) {
      ADD_FAILURE() << "the kernel wrote outside the output, at byte "
                    << static_cast<long long>(b) - static_cast<long long>(lead) << " relative to its start";
      break;
    }
  }
}

void expect_same_bits(const std::vector<uint8_t>& want, const std::vector<uint8_t>& got, size_t esz,
                      int64_t cols) {
  ASSERT_EQ(want.size(), got.size());
  if (std::memcmp(want.data(), got.data(), want.size()) == 0) return;
  int shown = 0;
  for (size_t i = 0; i * esz < want.size() && shown < 5; ++i) {
    const size_t at = i * esz;
    if (std::memcmp(&want[at], &got[at], esz) != 0) {
      uint32_t w = 0, g = 0;
      std::memcpy(&w, &want[at], esz);
      std::memcpy(&g, &got[at], esz);
      ++shown;
      ADD_FAILURE() << "element " << i << " (row " << static_cast<int64_t>(i) / cols << ", col "
                    << static_cast<int64_t>(i) % cols << "): CPU bits 0x" << std::hex << w << ", GPU bits 0x" << g;
    }
  }
}

struct GgufCase {
  Format format;
  int64_t rows, blocks;  // cols = blocks * the format's block elements
  OutDtype out;
};

std::vector<GgufCase> gguf_cases() {
  std::vector<GgufCase> v;
  for (const GgufInfo& g : gguf_infos())
    for (int64_t rows : {1, 3, 67})
      for (int64_t blocks : {1, 2, 7})
        for (OutDtype d : {OutDtype::F32, OutDtype::BF16, OutDtype::F16}) v.push_back({g.format, rows, blocks, d});
  return v;
}

class CudaDequantGguf : public DeviceTest<GgufCase> {};

TEST_P(CudaDequantGguf, BitExactVsCpu) {
  const GgufCase c = GetParam();
  const GgufInfo& g = gguf_info(c.format);
  const int64_t cols = c.blocks * g.elems;
  const q::PackedLayout L = q::layout_for(c.format, c.rows, cols);
  ASSERT_EQ(L.data_bytes, static_cast<size_t>(c.rows * c.blocks * g.bytes));
  const std::vector<uint8_t> packed =
      gguf_buffer(L, static_cast<uint32_t>(static_cast<int>(c.format) * 1000 + c.rows * 10 + c.blocks));
  const size_t esz = q::out_dtype_bytes(c.out);
  std::vector<uint8_t> want(static_cast<size_t>(L.numel()) * esz, 0), got;
  q::dequantize_cpu(L, packed.data(), want.data(), c.out, 1);
  // Aligned output (vector stores) and one offset by one element (not 16-byte
  // aligned: scalar stores).
  for (size_t offset_elems : {size_t{0}, size_t{1}}) {
    SCOPED_TRACE("output offset " + std::to_string(offset_elems) + " elements");
    ASSERT_NO_FATAL_FAILURE(gguf_on_device(L, packed, 0, c.rows, c.out, offset_elems, got));
    expect_same_bits(want, got, esz, cols);
  }
}

INSTANTIATE_TEST_SUITE_P(AllGgufFormats, CudaDequantGguf, ::testing::ValuesIn(gguf_cases()),
                         [](const ::testing::TestParamInfo<GgufCase>& info) {
                           const GgufCase& c = info.param;
                           return std::string(q::to_string(c.format)) + "_" + std::to_string(c.rows) + "x" +
                                  std::to_string(c.blocks) + "blocks_" + q::to_string(c.out);
                         });

// Row ranges of a GGUF tensor, starting where the byte offset of the rows'
// blocks is not a multiple of 16 wherever the format allows it (q4_k and q5_k
// blocks are 144 / 176 bytes, so their rows always start on 16 bytes).
TEST(CudaDequantGgufRows, RowRangesMatchTheCpuReference) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device available";
  const int64_t rows = 67, blocks = 3;
  for (const GgufInfo& g : gguf_infos()) {
    const int64_t cols = blocks * g.elems;
    const q::PackedLayout L = q::layout_for(g.format, rows, cols);
    const std::vector<uint8_t> packed = gguf_buffer(L, 99u + static_cast<uint32_t>(g.format));
    int64_t r0 = 1;
    for (int64_t r = 1; r < 16; ++r)
      if (q::row_range(L, r, rows).data_begin % 16 != 0) {
        r0 = r;
        break;
      }
    if (g.bytes % 16 != 0) {
      ASSERT_NE(q::row_range(L, r0, rows).data_begin % 16, 0u) << q::to_string(g.format);
    }
    const std::pair<int64_t, int64_t> ranges[] = {{r0, rows - 2}, {r0, r0 + 1}, {rows - 1, rows}};
    for (OutDtype d : {OutDtype::F32, OutDtype::BF16, OutDtype::F16}) {
      const size_t esz = q::out_dtype_bytes(d);
      for (const auto& rr : ranges) {
        for (size_t offset_elems : {size_t{0}, size_t{1}}) {
          SCOPED_TRACE(std::string(q::to_string(g.format)) + " rows [" + std::to_string(rr.first) + ", " +
                       std::to_string(rr.second) + ") at byte " +
                       std::to_string(q::row_range(L, rr.first, rr.second).data_begin) + ", " +
                       q::to_string(d) + ", output offset " + std::to_string(offset_elems));
          std::vector<uint8_t> want(static_cast<size_t>((rr.second - rr.first) * cols) * esz, 0), got;
          q::dequantize_rows_cpu(L, packed.data(), rr.first, rr.second, want.data(), d, 1);
          ASSERT_NO_FATAL_FAILURE(gguf_on_device(L, packed, rr.first, rr.second, d, offset_elems, got));
          expect_same_bits(want, got, esz, cols);
        }
      }
    }
  }
}

// More than 2^31 elements of a 32-element and a 256-element GGUF format
// (64-bit chunk, block and byte offsets). cols = 8448: element 2^31 falls
// inside a row. The device buffer is a constant (0x3C bytes: finite scales),
// with random blocks in three row windows (the start, around element 2^31,
// the end), each compared with dequantize_cpu of its rows on their own.
TEST(CudaDequantGgufLarge, MoreThan2To31Elements) {
  if (!have_device()) GTEST_SKIP() << "no CUDA device available";
  const int64_t cols = 8448, rows = 254264;  // 2^31 / 8448 = 254200.2
  size_t max_packed = 0;
  for (Format f : {Format::GgufQ4_0, Format::GgufQ6_K})
    max_packed = std::max(max_packed, q::layout_for(f, rows, cols).total_bytes());
  const size_t out_bytes = static_cast<size_t>(rows * cols) * 2;  // bf16
  constexpr size_t kGuard = 256;
  size_t free_b = 0, total_b = 0;
  CUDA_OK(cudaMemGetInfo(&free_b, &total_b));
  if (free_b < max_packed + out_bytes + kGuard + (size_t{1} << 30))
    GTEST_SKIP() << "needs " << (max_packed + out_bytes) / (1 << 20) << " MiB of free device memory";
  void* dpacked = nullptr;
  void* dout = nullptr;
  CUDA_OK(cudaMalloc(&dpacked, max_packed));
  CUDA_OK(cudaMalloc(&dout, out_bytes + kGuard));
  for (Format f : {Format::GgufQ4_0, Format::GgufQ6_K}) {
    const q::PackedLayout L = q::layout_for(f, rows, cols);
    SCOPED_TRACE(q::describe(L));
    ASSERT_GT(L.numel(), int64_t{1} << 31);
    const int64_t mid = (int64_t{1} << 31) / cols;  // the row holding element 2^31
    const std::pair<int64_t, int64_t> windows[] = {{0, 3}, {mid - 2, mid + 3}, {rows - 3, rows}};
    ASSERT_TRUE(windows[0].second <= windows[1].first && windows[1].second <= windows[2].first)
        << "the windows must not overlap";
    CUDA_OK(cudaMemset(dpacked, 0x3C, L.total_bytes()));
    CUDA_OK(cudaMemset(dout, 0xCD, out_bytes + kGuard));
    std::vector<std::vector<uint8_t>> subs;
    for (const auto& w : windows) {
      const q::PackedLayout sub = q::layout_for(f, w.second - w.first, cols);
      subs.push_back(gguf_buffer(sub, static_cast<uint32_t>(w.first)));
      const q::RowRange r = q::row_range(L, w.first, w.second);
      ASSERT_EQ(r.data_bytes, sub.data_bytes);
      CUDA_OK(cudaMemcpy(static_cast<uint8_t*>(dpacked) + r.data_begin, subs.back().data(), sub.data_bytes,
                         cudaMemcpyHostToDevice));
    }
    q::dequantize_cuda(L, dpacked, dout, OutDtype::BF16, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    for (size_t k = 0; k < subs.size(); ++k) {
      const q::PackedLayout sub = q::layout_for(f, windows[k].second - windows[k].first, cols);
      const size_t count = static_cast<size_t>(sub.numel());
      std::vector<uint16_t> want(count), got(count);
      q::dequantize_cpu(sub, subs[k].data(), want.data(), OutDtype::BF16, 1);
      CUDA_OK(cudaMemcpy(got.data(), static_cast<uint16_t*>(dout) + windows[k].first * cols, count * 2,
                         cudaMemcpyDeviceToHost));
      size_t bad = 0;
      for (size_t i = 0; i < count; ++i) bad += want[i] != got[i];
      EXPECT_EQ(bad, 0u) << "rows [" << windows[k].first << ", " << windows[k].second
                         << ") differ from the CPU reference in " << bad << " elements";
    }
    std::vector<uint8_t> tail(kGuard);
    CUDA_OK(cudaMemcpy(tail.data(), static_cast<uint8_t*>(dout) + static_cast<size_t>(L.numel()) * 2, kGuard,
                       cudaMemcpyDeviceToHost));
    for (uint8_t b : tail) {
      if (b != 0xCD) {
        ADD_FAILURE() << "the kernel wrote past the end of the output";
        break;
      }
    }
  }
  CUDA_OK(cudaFree(dpacked));
  CUDA_OK(cudaFree(dout));
}

// No device needed: layout_for() (and so dequantize_cuda, which rebuilds the
// layout before any CUDA call) rejects GGUF shapes that are not whole blocks.
TEST(CudaDequantGgufArgs, ColsNotWholeBlocksAreRejected) {
  for (const GgufInfo& g : gguf_infos()) {
    SCOPED_TRACE(q::to_string(g.format));
    for (int64_t cols : {int64_t{1}, int64_t{g.elems / 2}, int64_t{g.elems + 16}, int64_t{3 * g.elems - 1}}) {
      const std::string msg = error_of([&] { (void)q::layout_for(g.format, 4, cols); });
      EXPECT_NE(msg.find("multiple of " + std::to_string(g.elems)), std::string::npos) << msg;
    }
    EXPECT_NO_THROW((void)q::layout_for(g.format, 4, 2 * g.elems));
    q::PackedLayout L = q::layout_for(g.format, 4, 2 * g.elems);
    L.cols = g.elems + 16;  // a hand-edited layout
    const std::string msg = error_of(
        [&] { q::dequantize_cuda(L, fake_device_ptr(0x10000), fake_device_ptr(0x20000), OutDtype::F32, nullptr); });
    EXPECT_NE(msg.find("multiple of " + std::to_string(g.elems)), std::string::npos) << msg;
  }
}

// The 16-byte start rule for row ranges applies to int8 / fp8 / nf4 / int4
// only. Without a device the GGUF call passes the argument checks and fails
// at the launch instead (with a device it would launch on fake addresses, and
// CudaDequantGgufRows covers it for real).
TEST(CudaDequantGgufArgs, RowRangeOffTheSixteenByteGridPassesTheChecks) {
  if (have_device()) GTEST_SKIP() << "runs only without a device (see CudaDequantGgufRows)";
  const q::PackedLayout I = q::layout_for(Format::Int8, 4, 24);
  std::string msg = error_of([&] {
    q::dequantize_rows_cuda(I, fake_device_ptr(0x10000), 1, 2, fake_device_ptr(0x20000), OutDtype::F32, nullptr);
  });
  EXPECT_NE(msg.find("not a multiple of 16"), std::string::npos) << msg;
  const q::PackedLayout G = q::layout_for(Format::GgufQ8_0, 4, 32);
  ASSERT_EQ(q::row_range(G, 1, 2).data_begin % 16, 2u);
  msg = error_of([&] {
    q::dequantize_rows_cuda(G, fake_device_ptr(0x10000), 1, 2, fake_device_ptr(0x20000), OutDtype::F32, nullptr);
  });
  EXPECT_EQ(msg.find("multiple of 16"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("16-byte aligned"), std::string::npos) << msg;
}

}  // namespace
