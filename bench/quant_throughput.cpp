#include "quant_throughput.h"

#include "core/error.h"
#include "core/gguf_blocks.h"
#include "core/lossless.h"

#include <algorithm>
#include <chrono>
#include <random>
#include <vector>

namespace layerstream::bench {

namespace {
template <class Fn>
double best_of(int reps, const Fn& fn) {
  double best = 1e300;
  for (int i = 0; i < std::max(1, reps); ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

// N(0, 0.02) fp32 weights, the measurements' source.
std::vector<float> normal_weights(int64_t n, std::mt19937& rng) {
  std::vector<float> w(static_cast<size_t>(n));
  std::normal_distribution<float> nd(0.0f, 0.02f);
  for (auto& v : w) v = nd(rng);
  return w;
}
}  // namespace

std::vector<QuantThroughput> measure_quant(int64_t rows, int64_t cols, int reps, int threads,
                                           const DeviceDequantFn& device, bool gguf) {
  namespace q = layerstream::quant;
  const int64_t n = rows * cols;
  std::mt19937 rng(42);
  const std::vector<float> w = normal_weights(n, rng);
  std::vector<uint16_t> out(static_cast<size_t>(n));
  std::vector<QuantThroughput> results;
  for (q::Format f : {q::Format::Int8, q::Format::Fp8E4M3, q::Format::NF4, q::Format::Int4}) {
    const q::PackedLayout L = q::layout_for(f, rows, cols);
    std::vector<uint8_t> packed(L.total_bytes());
    QuantThroughput r;
    r.format = q::to_string(f);
    r.rows = rows;
    r.cols = cols;
    r.packed_bytes = L.total_bytes();
    r.pack_s = best_of(reps, [&] { q::pack(f, w.data(), rows, cols, packed.data(), threads); });
    r.dequant_s = best_of(reps, [&] {
      q::dequantize_cpu(L, packed.data(), out.data(), q::OutDtype::BF16, threads);
    });
    if (device) r.device_s = device(L, packed);
    results.push_back(r);
  }
  {
    // Lossless (core/lossless.h) from the same weights in bf16: coding time
    // (analysis + encode) and decoding to bf16, on the CPU and the device.
    std::vector<uint16_t> src(static_cast<size_t>(n));
    for (size_t i = 0; i < src.size(); ++i) src[i] = q::float_to_bf16_bits(w[i]);
    std::vector<uint8_t> coded;
    QuantThroughput r;
    r.format = q::to_string(q::Format::Lossless);
    r.rows = rows;
    r.cols = cols;
    r.source_bf16 = true;
    r.pack_s = best_of(reps, [&] { coded = lossless::encode(q::SrcDtype::BF16, src.data(), n, threads); });
    r.packed_bytes = coded.size();
    r.dequant_s = best_of(reps, [&] {
      lossless::decode(coded.data(), coded.size(), out.data(), out.size() * sizeof(uint16_t), threads);
    });
    LS_CHECK(out == src, "bench: the lossless round trip changed the weights");
    if (device) r.device_s = device(q::lossless_layout(rows, cols, coded.size()), coded);
    results.push_back(r);
  }
  if (!gguf) return results;
  std::uniform_int_distribution<int> byte(0, 255);
  const uint16_t d = q::float_to_f16_bits(0.01f);
  for (int id = static_cast<int>(q::Format::GgufQ8_0); id <= static_cast<int>(q::Format::GgufQ6_K); ++id) {
    const q::Format f = static_cast<q::Format>(id);
    const q::PackedLayout L = q::layout_for(f, rows, cols);
    std::vector<uint8_t> packed(L.total_bytes(), 0);
    for (size_t i = 0; i < L.data_bytes; ++i) packed[i] = static_cast<uint8_t>(byte(rng));
    int off[2];
    const int fields = q::gguf::half_fields(id, off);
    const size_t block = static_cast<size_t>(q::gguf::block_bytes(id));
    for (size_t b = 0; b + block <= L.data_bytes; b += block)
      for (int k = 0; k < fields; ++k) {
        packed[b + static_cast<size_t>(off[k])] = static_cast<uint8_t>(d & 0xFF);
        packed[b + static_cast<size_t>(off[k]) + 1] = static_cast<uint8_t>(d >> 8);
      }
    QuantThroughput r;
    r.format = q::to_string(f);
    r.rows = rows;
    r.cols = cols;
    r.packed_bytes = L.data_bytes;
    r.dequant_s = best_of(reps, [&] {
      q::dequantize_cpu(L, packed.data(), out.data(), q::OutDtype::BF16, threads);
    });
    if (device) r.device_s = device(L, packed);
    results.push_back(r);
  }
  return results;
}

std::vector<LosslessThroughput> measure_lossless(int64_t n, int reps, int threads) {
  namespace q = layerstream::quant;
  std::mt19937 rng(42);
  const std::vector<float> f32 = normal_weights(n, rng);
  std::vector<uint16_t> bf16(f32.size()), f16(f32.size());
  for (size_t i = 0; i < f32.size(); ++i) {
    bf16[i] = q::float_to_bf16_bits(f32[i]);
    f16[i] = q::float_to_f16_bits(f32[i]);
  }
  const struct {
    lossless::Dtype dtype;
    const void* src;
  } cases[] = {{q::SrcDtype::BF16, bf16.data()}, {q::SrcDtype::F16, f16.data()}, {q::SrcDtype::F32, f32.data()}};
  std::vector<LosslessThroughput> results;
  for (const auto& c : cases) {
    LosslessThroughput r;
    r.dtype = q::to_string(c.dtype);
    r.raw_bytes = static_cast<size_t>(n) * lossless::element_bytes(c.dtype);
    std::vector<uint8_t> coded(lossless::max_encoded_bytes(c.dtype, n)), back(r.raw_bytes);
    r.encode_s = best_of(reps, [&] {
      const lossless::Analysis a = lossless::analyze(c.dtype, c.src, n, threads);
      lossless::encode(a, c.src, coded.data(), coded.size(), threads);
      r.coded_bytes = a.total_bytes();
    });
    r.decode_s = best_of(reps, [&] { lossless::decode(coded.data(), coded.size(), back.data(), back.size(), threads); });
    LS_CHECK(std::equal(back.begin(), back.end(), static_cast<const uint8_t*>(c.src)),
             "bench: the lossless round trip of ", r.dtype, " changed the weights");
    results.push_back(r);
  }
  return results;
}

}  // namespace layerstream::bench
