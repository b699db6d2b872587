// Overlap benchmark on the sim device (a benchmark, not a test).
//
// A stack of N layers, each with a fixed compute time (a sleep on the compute
// stream) and a fixed weight size; the link bandwidth is set so that total
// transfer time / total compute time is 0.5, 1 and 2. For each ratio and
// prefetch depth it prints step time / max(total compute, total transfer):
// 1.00 is perfect overlap. Goal: <= 1.10 at every ratio with prefetch >= 2.
//
//   build/bench/bench_overlap [--layers 24] [--compute-ms 3] [--layer-mib 1]
//                             [--steps 5] [--json] [--no-versions] [--quant] [--dequant]
//                             [--transformer]
// --quant: bf16 vs int8/fp8/nf4/int4 bytes over one transfer-bound link.
// --dequant: where the dequantization runs (transfer path vs at use), with
//            the real CPU kernel, on a compute-bound stack.
// --transformer: layers in transformer blocks (q, k, v, o, then an MLP's up
//            and down with 4x the bytes and the compute), transfer/compute
//            0.355 (the H200 measurement: 55.2 GB/s pinned, 643 TFLOP/s at
//            32768 tokens), 0.5 and 1, prefetch 1-3: what a shallow prefetch
//            costs when a big layer follows a small one.
// --no-versions: the scheduler is not told that weights are unchanged, so
// it drops slot content and stops prefetching at every step boundary. [--no-versions]
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench/overlap.h"
#include "core/quant.h"

using layerstream::bench::OverlapConfig;
using layerstream::bench::OverlapResult;

namespace {

struct Config : OverlapConfig {
  bool json = false;
  bool quant = false;
  bool dequant = false;
  bool transformer = false;
};

// --dequant: each format, dequantized on the transfer path (a post-copy step
// on the dequant stream) vs at use (on the compute stream before the layer's
// compute), link at transfer/compute = 0.5 per packed layer. On the transfer
// path the dequantization hides behind compute; at use it adds to every layer.
int run_dequant(const Config& c) {
  using namespace layerstream;
  using layerstream::bench::DequantAt;
  const double ratio = 0.5;
  if (!c.json)
    std::printf("sim, dequantization placement: %d layers x %.2f ms compute, %.2f MiB bf16 weights each, "
                "link: packed layer transfer = %.1f x compute, prefetch 2, median of %d steps\n"
                "%-6s %-14s %-9s %-9s %-15s %-10s %s\n",
                c.layers, c.compute_ms, c.layer_mib, ratio, c.steps, "format", "dequant at", "step ms",
                "ideal ms", "dequant ms/lyr", "step/ideal", "use/transfer-path");
  else
    std::printf("[");
  bool first = true;
  for (const char* f : {"int8", "fp8", "nf4", "int4"}) {
    double path_ms = 0;
    for (DequantAt at : {DequantAt::TransferPath, DequantAt::Use}) {
      const auto r = layerstream::bench::run_dequant_case(c, f, ratio, at);
      if (r.ordering_errors) {
        std::fprintf(stderr, "ordering errors: %zu, first: %s\n", r.ordering_errors, r.first_ordering_error.c_str());
        return 1;
      }
      const bool tp = at == DequantAt::TransferPath;
      if (tp) path_ms = r.step_ms;
      if (c.json) {
        std::printf("%s{\"format\": \"%s\", \"dequant_at\": \"%s\", \"step_ms\": %.3f, \"ideal_ms\": %.3f, "
                    "\"dequant_ms_per_layer\": %.3f, \"overlap_ratio\": %.4f}",
                    first ? "" : ", ", f, tp ? "transfer_path" : "use", r.step_ms, r.ideal_ms, r.dequant_ms,
                    r.step_ms / r.ideal_ms);
      } else {
        std::printf("%-6s %-14s %-9.2f %-9.2f %-15.3f %-10.3f %s\n", f, tp ? "transfer path" : "use",
                    r.step_ms, r.ideal_ms, r.dequant_ms, r.step_ms / r.ideal_ms,
                    tp ? "" : std::to_string(r.step_ms / path_ms).substr(0, 5).c_str());
      }
      first = false;
    }
  }
  if (c.json) std::printf("]\n");
  return 0;
}

// --quant: the same stack with its weights in bf16 and in each packed format,
// over one fixed link chosen so that bf16 is strongly transfer-bound (transfer/compute
// = 4). Fewer bytes per step must show as a shorter step, down to the compute
// bound. Packed sizes are the exact layouts of core/quant.h.
int run_quant(const Config& c) {
  using namespace layerstream;
  const double bf16_bytes = c.layer_mib * 1024 * 1024;
  const int64_t cols = 1024;
  const int64_t rows = static_cast<int64_t>(bf16_bytes / 2) / cols;
  struct Row {
    const char* name;
    double bytes;
  };
  std::vector<Row> rows_out = {{"bf16", static_cast<double>(rows * cols * 2)}};
  for (auto f : {quant::Format::Int8, quant::Format::Fp8E4M3, quant::Format::NF4, quant::Format::Int4})
    rows_out.push_back({quant::to_string(f), static_cast<double>(quant::layout_for(f, rows, cols).total_bytes())});
  const double base_ratio = 4.0;
  if (!c.json) {
    std::printf("sim overlap, quantized weights: %d layers x %.2f ms compute, %lldx%lld weights, one link "
                "(bf16 transfer/compute = %.1f), prefetch 2, median of %d steps\n",
                c.layers, c.compute_ms, static_cast<long long>(rows), static_cast<long long>(cols),
                base_ratio, c.steps);
    std::printf("%-8s %-12s %-12s %-10s %-10s %-12s %s\n", "format", "bytes/param", "MiB/layer", "step ms",
                "ideal ms", "step/ideal", "step vs bf16");
  } else {
    std::printf("[");
  }
  double bf16_step = 0;
  for (size_t i = 0; i < rows_out.size(); ++i) {
    Config cc = c;
    const double scale = rows_out[i].bytes / rows_out[0].bytes;
    cc.layer_mib = rows_out[i].bytes / (1024.0 * 1024.0);
    // Same link bandwidth for every format: the transfer/compute ratio scales with the bytes.
    const OverlapResult r = layerstream::bench::run_overlap_case(cc, base_ratio * scale, 2);
    if (r.ordering_errors) {
      std::fprintf(stderr, "ordering errors: %zu, first: %s\n", r.ordering_errors, r.first_ordering_error.c_str());
      return 1;
    }
    if (i == 0) bf16_step = r.step_ms;
    const double bpp = rows_out[i].bytes / static_cast<double>(rows * cols);
    if (c.json) {
      std::printf("%s{\"format\": \"%s\", \"bytes_per_param\": %.4f, \"step_ms\": %.3f, \"ideal_ms\": %.3f, "
                  "\"overlap_ratio\": %.4f, \"step_vs_bf16\": %.4f}",
                  i ? ", " : "", rows_out[i].name, bpp, r.step_ms, r.ideal_ms, r.overlap_ratio,
                  r.step_ms / bf16_step);
    } else {
      std::printf("%-8s %-12.4f %-12.3f %-10.2f %-10.2f %-12.3f %.3f\n", rows_out[i].name, bpp,
                  cc.layer_mib, r.step_ms, r.ideal_ms, r.overlap_ratio, r.step_ms / bf16_step);
    }
  }
  if (c.json) std::printf("]\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Config c;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "bench_overlap: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--layers") c.layers = std::atoi(next());
    else if (a == "--compute-ms") c.compute_ms = std::atof(next());
    else if (a == "--layer-mib") c.layer_mib = std::atof(next());
    else if (a == "--steps") c.steps = std::atoi(next());
    else if (a == "--json") c.json = true;
    else if (a == "--no-versions") c.versioned = false;
    else if (a == "--quant") c.quant = true;
    else if (a == "--dequant") c.dequant = true;
    else if (a == "--transformer") c.transformer = true;
    else {
      std::fprintf(stderr, "usage: bench_overlap [--layers N] [--compute-ms MS] [--layer-mib MIB] [--steps N] [--json] [--no-versions] [--quant] [--dequant] [--transformer]\n");
      return 2;
    }
  }
  if (c.layers < 1 || c.compute_ms <= 0 || c.layer_mib <= 0 || c.steps < 1) {
    std::fprintf(stderr, "bench_overlap: layers, compute-ms, layer-mib and steps must be positive\n");
    return 2;
  }
  if (c.transformer && (c.quant || c.dequant)) {
    std::fprintf(stderr, "bench_overlap: --transformer applies to the plain overlap table, not --quant/--dequant\n");
    return 2;
  }
  if (c.quant) return run_quant(c);
  if (c.dequant) return run_dequant(c);
  std::vector<double> ratios = {0.5, 1.0, 2.0};
  std::vector<int> prefetches = {0, 1, 2, 3};
  if (c.transformer) {
    c.pattern = {1, 1, 1, 1, 4, 4};
    ratios = {0.355, 0.5, 1.0};
    prefetches = {1, 2, 3};
  }
  std::vector<OverlapResult> results;
  for (double ratio : ratios)
    for (int k : prefetches) {
      results.push_back(layerstream::bench::run_overlap_case(c, ratio, k));
      const OverlapResult& r = results.back();
      if (r.ordering_errors) {
        std::fprintf(stderr, "ordering errors: %zu, first: %s\n", r.ordering_errors,
                     r.first_ordering_error.c_str());
        return 1;
      }
    }

  if (c.json) {
    std::printf("[");
    for (size_t i = 0; i < results.size(); ++i) {
      const OverlapResult& r = results[i];
      std::printf("%s{\"transfer_over_compute\": %.2f, \"prefetch\": %d, \"slots\": %d, "
                  "\"step_ms\": %.3f, \"ideal_ms\": %.3f, \"overlap_ratio\": %.4f, \"hit_rate\": %.3f}",
                  i ? ", " : "", r.ratio, r.prefetch, r.slots, r.step_ms, r.ideal_ms,
                  r.overlap_ratio, r.hit_rate);
    }
    std::printf("]\n");
    return 0;
  }
  if (c.transformer)
    std::printf("sim overlap, transformer blocks: %d layers (q, k, v, o: %.2f ms compute and %.2f MiB each; "
                "MLP up, down: 4x both), median of %d steps\n",
                c.layers, c.compute_ms, c.layer_mib, c.steps);
  else
    std::printf("sim overlap: %d layers x %.2f ms compute, %.2f MiB each, median of %d steps\n",
                c.layers, c.compute_ms, c.layer_mib, c.steps);
  std::printf("%-18s %-9s %-6s %-10s %-10s %-14s %s\n", "transfer/compute", "prefetch", "slots",
              "step ms", "ideal ms", "step/ideal", "hit rate");
  for (const OverlapResult& r : results)
    std::printf("%-18.2f %-9d %-6d %-10.2f %-10.2f %-14.3f %.2f\n", r.ratio, r.prefetch, r.slots,
                r.step_ms, r.ideal_ms, r.overlap_ratio, r.hit_rate);
  return 0;
}
