// Quantization throughput measurement, shared by bench/bench_quant.cpp and
// `layerstream bench`: CPU pack and CPU dequantize-to-bf16 time per format on
// N(0, 0.02) fp32 weights, best of `reps`.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/quant.h"

namespace layerstream::bench {

struct QuantThroughput {
  std::string format;
  int64_t rows = 0, cols = 0;
  size_t packed_bytes = 0;
  double pack_s = 0, dequant_s = 0;
  double device_s = -1;  // device dequant time when measured, else -1
  bool source_bf16 = false;  // packed from bf16 weights (lossless), else from fp32
};

// Optional: device dequant time (seconds) of one packed weight, -1 if none.
using DeviceDequantFn = std::function<double(const quant::PackedLayout&, const std::vector<uint8_t>&)>;

// Every format (int8, fp8, nf4, int4, and lossless from the same weights in
// bf16); threads 0 = all cores. With `gguf`
// also the GGUF block formats (q8_0 .. q6_k; cols must be a multiple of 256):
// layerstream does not pack those, so their blocks are random bytes with
// small finite scales and pack_s is 0 (not measured).
std::vector<QuantThroughput> measure_quant(int64_t rows, int64_t cols, int reps, int threads,
                                           const DeviceDequantFn& device = {}, bool gguf = false);

// The lossless codec alone, per dtype it codes (bf16, f16, f32) of the same
// N(0, 0.02) weights: coded bytes, encode (analyze() + encode()) and CPU
// decode seconds, best of `reps` each; threads 0 = all cores.
struct LosslessThroughput {
  std::string dtype;
  size_t raw_bytes = 0, coded_bytes = 0;
  double encode_s = 0, decode_s = 0;
};
std::vector<LosslessThroughput> measure_lossless(int64_t n, int reps, int threads);

}  // namespace layerstream::bench
