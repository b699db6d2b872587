// bench_quant — pack / dequantize throughput for every quantized format.
//
//   bench_quant [--rows R] [--cols C] [--threads N] [--reps K] [--json]
//   bench_quant --lossless [--rows R] [--cols C] [--threads N] [--reps K]   (a table; no --json)
//
// For each format: CPU pack throughput (GB/s of fp32 source read, and the
// same time expressed as bf16-source GB/s), CPU dequant-to-bf16 throughput
// (GB/s of bf16 written), and, when built with CUDA and a device is present,
// device dequant-to-bf16 throughput (GB/s of packed read + bf16 written).
// Times are the best of K repetitions. GGUF's block formats (q8_0 .. q6_k,
// when cols is a multiple of 256) follow, dequantization only (layerstream
// reads them from .gguf files, it does not pack them: pack columns "-", 0 in
// JSON). --lossless instead prints the lossless codec alone for each dtype it
// codes (bf16, f16, f32; N(0, 0.02) weights): encode (analyze() + encode())
// and CPU decode, GB/s of raw tensor bytes.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bench/quant_throughput.h"
#include "core/error.h"
#include "core/quant.h"

#ifdef LS_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/cuda/dequant.h"
#include "kernels/cuda/lossless.h"
#endif

namespace q = layerstream::quant;

namespace {

using Row = layerstream::bench::QuantThroughput;

#ifdef LS_HAVE_CUDA
// Device dequant time in seconds (best of reps), or -1 without a device.
double device_dequant(const q::PackedLayout& L, const std::vector<uint8_t>& packed, int reps) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    return -1;
  }
  void* dp = nullptr;
  void* dout = nullptr;
  if (cudaMalloc(&dp, packed.size()) != cudaSuccess ||
      cudaMalloc(&dout, static_cast<size_t>(L.numel()) * 2) != cudaSuccess)
    return -1;
  cudaMemcpy(dp, packed.data(), packed.size(), cudaMemcpyHostToDevice);
  cudaStream_t s;
  cudaStreamCreate(&s);
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  // Lossless: the header is read on the host, as the engine does once per weight.
  const bool coded = L.format == q::Format::Lossless;
  const layerstream::lossless::Header h =
      coded ? layerstream::lossless::read_header(packed.data(), packed.size()) : layerstream::lossless::Header{};
  const auto run = [&] {
    if (coded)
      layerstream::lossless::decode_cuda(h, dp, packed.size(), dout, s);
    else
      q::dequantize_cuda(L, dp, dout, q::OutDtype::BF16, s);
  };
  run();  // warm-up
  cudaStreamSynchronize(s);
  double best = 1e300;
  for (int i = 0; i < std::max(reps, 10); ++i) {
    cudaEventRecord(a, s);
    run();
    cudaEventRecord(b, s);
    cudaEventSynchronize(b);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    best = std::min(best, ms * 1e-3);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  cudaStreamDestroy(s);
  cudaFree(dp);
  cudaFree(dout);
  return best;
}
#endif

// The lossless codec per dtype: encode and CPU decode GB/s of raw bytes.
void lossless_table(int64_t n, int threads, int reps) {
  std::printf("lossless codec: %lld elements, threads %d (0 = all), best of %d, GB/s of raw bytes\n",
              static_cast<long long>(n), threads, reps);
  std::printf("%-6s %8s %12s %12s\n", "dtype", "ratio", "encode GB/s", "decode GB/s");
  for (const auto& r : layerstream::bench::measure_lossless(n, reps, threads))
    std::printf("%-6s %8.4f %12.2f %12.2f\n", r.dtype.c_str(), double(r.coded_bytes) / double(r.raw_bytes),
                r.raw_bytes / r.encode_s / 1e9, r.raw_bytes / r.decode_s / 1e9);
}

void usage() {
  std::fprintf(stderr,
               "usage: bench_quant [--lossless] [--rows R] [--cols C] [--threads N] [--reps K] [--json]\n"
               "  defaults: 4096 x 4096, threads 0 (= all hardware threads), reps 5\n");
}

}  // namespace

int main(int argc, char** argv) {
  int64_t rows = 4096, cols = 4096;
  int threads = 0, reps = 5;
  bool json = false, lossless = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        usage();
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--rows") rows = std::atoll(next());
    else if (a == "--cols") cols = std::atoll(next());
    else if (a == "--threads") threads = std::atoi(next());
    else if (a == "--reps") reps = std::max(1, std::atoi(next()));
    else if (a == "--json") json = true;
    else if (a == "--lossless") lossless = true;
    else {
      usage();
      return a == "--help" || a == "-h" ? 0 : 2;
    }
  }
  try {
    const int64_t n = rows * cols;
    if (lossless) {
      if (json) {
        std::fprintf(stderr, "bench_quant: --lossless prints a table only (no --json)\n");
        return 2;
      }
      lossless_table(n, threads, reps);
      return 0;
    }
    layerstream::bench::DeviceDequantFn device;
#ifdef LS_HAVE_CUDA
    device = [reps](const q::PackedLayout& L, const std::vector<uint8_t>& packed) {
      return device_dequant(L, packed, reps);
    };
#endif
    const std::vector<Row> results =
        layerstream::bench::measure_quant(rows, cols, reps, threads, device, cols % 256 == 0);

    const double f32_bytes = static_cast<double>(n) * 4, bf16_bytes = static_cast<double>(n) * 2;
    if (json) {
      std::printf("{\"rows\": %lld, \"cols\": %lld, \"threads\": %d, \"results\": [",
                  static_cast<long long>(rows), static_cast<long long>(cols), threads);
      for (size_t i = 0; i < results.size(); ++i) {
        const Row& r = results[i];
        std::printf(
            "%s{\"format\": \"%s\", \"packed_bytes\": %zu, \"pack_s\": %.6g, "
            "\"pack_gbps_f32_src\": %.4g, \"pack_gbps_bf16_src\": %.4g, \"dequant_cpu_s\": %.6g, "
            "\"dequant_cpu_gbps_bf16_out\": %.4g, \"dequant_cuda_s\": %.6g, "
            "\"dequant_cuda_gbps\": %.4g}",
            i ? ", " : "", r.format.c_str(), r.packed_bytes, r.pack_s,
            r.pack_s > 0 && !r.source_bf16 ? f32_bytes / r.pack_s / 1e9 : 0.0,
            r.pack_s > 0 ? bf16_bytes / r.pack_s / 1e9 : 0.0,
            r.dequant_s, bf16_bytes / r.dequant_s / 1e9, r.device_s,
            r.device_s > 0 ? (bf16_bytes + r.packed_bytes) / r.device_s / 1e9 : -1.0);
      }
      std::printf("]}\n");
    } else {
      std::printf("bench_quant: %lld x %lld, threads %d (0 = all), best of %d\n",
                  static_cast<long long>(rows), static_cast<long long>(cols), threads, reps);
      std::printf("%-8s %12s %10s %14s %14s %16s %18s\n", "format", "packed MiB", "pack ms",
                  "pack GB/s f32", "pack GB/s bf16", "cpu deq GB/s bf16", "cuda deq GB/s (r+w)");
      for (const Row& r : results) {
        char dev[32];
        if (r.device_s > 0)
          std::snprintf(dev, sizeof dev, "%.1f", (bf16_bytes + r.packed_bytes) / r.device_s / 1e9);
        else
          std::snprintf(dev, sizeof dev, "-");
        if (r.pack_s > 0 && r.source_bf16)
          std::printf("%-8s %12.2f %10.2f %14s %14.2f %16.2f %18s\n", r.format.c_str(),
                      r.packed_bytes / 1048576.0, r.pack_s * 1e3, "-", bf16_bytes / r.pack_s / 1e9,
                      bf16_bytes / r.dequant_s / 1e9, dev);
        else if (r.pack_s > 0)
          std::printf("%-8s %12.2f %10.2f %14.2f %14.2f %16.2f %18s\n", r.format.c_str(),
                      r.packed_bytes / 1048576.0, r.pack_s * 1e3, f32_bytes / r.pack_s / 1e9,
                      bf16_bytes / r.pack_s / 1e9, bf16_bytes / r.dequant_s / 1e9, dev);
        else
          std::printf("%-8s %12.2f %10s %14s %14s %16.2f %18s\n", r.format.c_str(), r.packed_bytes / 1048576.0,
                      "-", "-", "-", bf16_bytes / r.dequant_s / 1e9, dev);
      }
    }
  } catch (const layerstream::Error& e) {
    std::fprintf(stderr, "bench_quant: %s\n", e.message().c_str());
    return 1;
  }
  return 0;
}
