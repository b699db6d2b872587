// `layerstream bench`: the project's three benchmarks in one run.
//
//  (a) overlap  — the sim overlap benchmark (bench/overlap.h): a stack of
//      layers with fixed compute time and weight size, link bandwidth set so
//      transfer/compute = 0.5, 1, 2; prefetch depth 0-3; overlap_ratio =
//      step time / max(total compute, total transfer), 1.00 = perfect.
//  (b) overhead — per-call cost of an offloaded layerstream::nn::Linear vs
//      torch::nn::Linear on the CPU (sim device, infinite link, no latency),
//      tiny shapes (1 x 64) so the time is the machinery, not the matmul.
//  (c) quant    — pack and CPU dequantize throughput of every quantized
//      format (core/quant.h).
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "bench/overlap.h"
#include "bench/quant_throughput.h"
#include "commands.h"
#include "core/error.h"
#include "core/json.h"
#include "core/quant.h"
#include "progress.h"

#ifdef LS_HAVE_TORCH
#include <torch/torch.h>

#include "layerstream/offload.h"
#endif

namespace {

using layerstream::cli::UsageError;
using Clock = std::chrono::steady_clock;
namespace q = layerstream::quant;

const char* kHelp =
    "usage: layerstream bench [--quick] [--json] [--only overlap|overhead|quant] [--plot FILE.png]\n"
    "\n"
    "Runs the benchmarks and prints a table (or one JSON object with keys\n"
    "\"overlap\", \"overhead\" and \"quant\", each a list):\n"
    "  overlap   sim device: layers with fixed compute time and weight size, link\n"
    "            bandwidth set so transfer/compute = 0.5, 1, 2; prefetch 0-3;\n"
    "            overlap_ratio = step time / max(total compute, total transfer)\n"
    "            (1.00 = transfers fully hidden behind compute)\n"
    "  overhead  time per call of an offloaded layerstream::nn::Linear vs\n"
    "            torch::nn::Linear, 1 x 64 -> 64, sim device with an infinite link\n"
    "            (needs LibTorch)\n"
    "  quant     pack and CPU dequantize (to bf16) throughput per format\n"
    "\n"
    "  --quick         a shorter run (smaller sizes, fewer repetitions)\n"
    "  --json          print one JSON object instead of tables\n"
    "  --only NAME     run one benchmark (the others are empty lists)\n"
    "  --plot FILE     also draw the results (.png, .pdf or .svg: overlap ratio against prefetch depth,\n"
    "                  per-call overhead) with Python's matplotlib (layerstream.bench_plot;\n"
    "                  the interpreter: $LS_PYTHON, else the one layerstream was built with)\n"
    "  -h, --help      this help\n";

int usage_error(const std::string& msg) {
  std::fprintf(stderr, "layerstream bench: error: %s (run 'layerstream bench --help')\n", msg.c_str());
  return 2;
}

std::string num(double v, const char* fmt = "%.6g") {
  char buf[64];
  std::snprintf(buf, sizeof buf, fmt, v);
  return buf;
}

// ---- (b) per-call overhead ----

struct OverheadRow {
  std::string system;
  int layers = 1;
  double forward_us = 0, fwd_bwd_us = 0;
  double forward_ratio = 1, fwd_bwd_ratio = 1;
};

template <class Fn>
double us_per_call(const Fn& fn, int n, int repeats) {
  for (int i = 0; i < std::max(20, n / 10); ++i) fn();
  std::vector<double> runs;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = Clock::now();
    for (int i = 0; i < n; ++i) fn();
    runs.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / n);
  }
  std::sort(runs.begin(), runs.end());
  return runs[runs.size() / 2];
}

#ifdef LS_HAVE_TORCH
// `layers` Linear layers in a chain, all of type M.
template <class M>
struct Stack : torch::nn::Module {
  Stack(int n, int64_t f) {
    for (int i = 0; i < n; ++i) {
      // Not "l" + std::to_string(i): GCC 12 at -O3 reports a false -Wrestrict there.
      std::string name = std::to_string(i);
      name.insert(name.begin(), 'l');
      mods.push_back(register_module(name, M(f, f)));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& m : mods) x = m(x);
    return x;
  }
  std::vector<M> mods;
};

std::vector<OverheadRow> run_overhead(bool quick) {
  const int64_t f = 64;
  const int calls = quick ? 300 : 2000;
  const int repeats = quick ? 3 : 5;
  const int saved_threads = at::get_num_threads();
  at::set_num_threads(1);
  torch::manual_seed(0);
  const torch::Tensor x = torch::randn({1, f});
  const torch::Tensor xg = torch::randn({1, f}).requires_grad_(true);
  std::vector<OverheadRow> rows;
  for (int layers : {1, 8}) {
    auto measure = [&](const std::function<torch::Tensor(const torch::Tensor&)>& fwd, const std::string& system) {
      OverheadRow r;
      r.system = system;
      r.layers = layers;
      r.forward_us = us_per_call(
                         [&] {
                           torch::NoGradGuard no_grad;
                           fwd(x);
                         },
                         calls / layers, repeats) /
                     layers;
      r.fwd_bwd_us = us_per_call([&] { fwd(xg).sum().backward(); }, std::max(10, calls / (4 * layers)), repeats) /
                     layers;
      return r;
    };
    auto plain = std::make_shared<Stack<torch::nn::Linear>>(layers, f);
    OverheadRow base = measure([&](const torch::Tensor& t) { return plain->forward(t); },
                               "torch::nn::Linear");
    auto streamed = std::make_shared<Stack<layerstream::nn::Linear>>(layers, f);
    layerstream::OffloadOptions opts;
    opts.device = "sim";
    opts.checker = false;
    opts.sim_h2d_gbps = 0;  // infinite link: measure the machinery, not the link
    opts.sim_d2h_gbps = 0;
    opts.sim_latency_us = 0;
    auto handle = layerstream::offload(*streamed, opts);
    OverheadRow ls = measure([&](const torch::Tensor& t) { return streamed->forward(t); },
                             "layerstream::nn::Linear (offloaded, sim)");
    handle->detach();
    ls.forward_ratio = ls.forward_us / base.forward_us;
    ls.fwd_bwd_ratio = ls.fwd_bwd_us / base.fwd_bwd_us;
    rows.push_back(base);
    rows.push_back(ls);
  }
  at::set_num_threads(saved_threads);
  return rows;
}
#endif

// ---- (c) quantization ----

struct QuantRow {
  std::string format;
  int64_t rows = 0, cols = 0;
  size_t packed_bytes = 0;
  double pack_s = 0, dequant_s = 0;
  std::string source;       // the weights' dtype it packs from: "f32" ("bf16" for lossless)
  double pack_gbps = 0;     // GB/s of source read
  double dequant_gbps = 0;  // GB/s of bf16 written
};

std::vector<QuantRow> run_quant(bool quick) {
  const int64_t size = quick ? 512 : 2048;
  std::vector<QuantRow> result;
  for (const auto& t : layerstream::bench::measure_quant(size, size, quick ? 2 : 3, 0)) {
    QuantRow r;
    r.format = t.format;
    r.rows = t.rows;
    r.cols = t.cols;
    r.packed_bytes = t.packed_bytes;
    r.pack_s = t.pack_s;
    r.dequant_s = t.dequant_s;
    const double n = static_cast<double>(t.rows * t.cols);
    r.source = t.source_bf16 ? "bf16" : "f32";
    r.pack_gbps = n * (t.source_bf16 ? 2 : 4) / t.pack_s / 1e9;
    r.dequant_gbps = n * 2 / t.dequant_s / 1e9;
    result.push_back(r);
  }
  return result;
}

// Draws `json` (this command's --json output) into `png` with
// layerstream.bench_plot, run by Python: plotting is presentation, which the
// Python package does (matplotlib), as for the timeline. Returns an exit status.
int plot(const std::string& json, const std::string& png) {
  const char* env = std::getenv("LS_PYTHON");
#ifdef LS_PYTHON
  const std::string python = env && *env ? env : LS_PYTHON;
#else
  const std::string python = env && *env ? env : "python3";
#endif
  char tmpl[] = "/tmp/layerstream-bench-XXXXXX";
  const int fd = ::mkstemp(tmpl);
  if (fd < 0 || ::write(fd, json.data(), json.size()) != static_cast<ssize_t>(json.size())) {
    std::fprintf(stderr, "layerstream bench: error: cannot write a temporary file for --plot\n");
    return 1;
  }
  ::close(fd);
  // The source tree's package when layerstream is not installed.
  std::string pythonpath = std::string(LS_SOURCE_DIR) + "/python";
  if (const char* p = std::getenv("PYTHONPATH"); p && *p) pythonpath += std::string(":") + p;
  ::setenv("PYTHONPATH", pythonpath.c_str(), 1);
  std::vector<std::string> args = {python, "-m", "layerstream.bench_plot", tmpl, png};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  int status = 0;
  const int rc = ::posix_spawnp(&pid, python.c_str(), nullptr, nullptr, argv.data(), environ);
  if (rc == 0) ::waitpid(pid, &status, 0);
  ::unlink(tmpl);
  if (rc != 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    std::fprintf(stderr, "layerstream bench: error: --plot: '%s -m layerstream.bench_plot' failed%s; it needs a "
                 "Python with matplotlib and layerstream (set LS_PYTHON to one)\n", python.c_str(),
                 rc != 0 ? " to start" : "");
    return 1;
  }
  std::fprintf(stderr, "wrote %s\n", png.c_str());
  return 0;
}

int cmd_bench(int argc, char** argv) {
  bool quick = false, json = false;
  std::string only, plot_file;
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      std::string v;
      if (a == "-h" || a == "--help") {
        std::fputs(kHelp, stdout);
        return 0;
      } else if (a == "--quick") {
        quick = true;
      } else if (a == "--json") {
        json = true;
      } else if (layerstream::cli::take_option(argc, argv, i, "--plot", v)) {
        if (v.empty()) throw UsageError{"--plot needs a file name"};
        // Checked before the benchmark runs (matplotlib would refuse them only after it).
        const size_t dot = v.rfind('.'), slash = v.rfind('/');
        const std::string ext = dot == std::string::npos || (slash != std::string::npos && dot < slash)
                                    ? std::string() : v.substr(dot + 1);
        if (ext != "png" && ext != "pdf" && ext != "svg")
          throw UsageError{"--plot " + v + ": the file name must end in .png, .pdf or .svg"};
        const std::string dir = slash == std::string::npos ? "." : v.substr(0, std::max<size_t>(slash, 1));
        if (access(dir.c_str(), W_OK) != 0)
          throw UsageError{"--plot " + v + ": cannot write into " + dir + " (" + std::strerror(errno) + ")"};
        struct stat st {};
        if (stat(v.c_str(), &st) == 0 && S_ISDIR(st.st_mode))
          throw UsageError{"--plot " + v + ": is a directory; give the name of the image file to write"};
        plot_file = v;
      } else if (layerstream::cli::take_option(argc, argv, i, "--only", v)) {
        if (v != "overlap" && v != "overhead" && v != "quant")
          throw UsageError{"--only expects overlap, overhead or quant, got '" + v + "'"};
        only = v;
      } else {
        throw UsageError{"unknown option '" + a + "'"};
      }
    }
  } catch (const UsageError& e) {
    return usage_error(e.message);
  }
  auto wanted = [&](const char* name) { return only.empty() || only == name; };
  auto note = [&](const char* what) {
    if (!json) {
      std::fprintf(stderr, "running %s benchmark...\n", what);
      std::fflush(stderr);
    }
  };

  // (a) overlap
  layerstream::bench::OverlapConfig oc;
  if (quick) {
    oc.layers = 8;
    oc.compute_ms = 2.0;
    oc.layer_mib = 0.25;
    oc.steps = 2;
  }
  std::vector<layerstream::bench::OverlapResult> overlap;
  if (wanted("overlap")) {
    note("overlap");
    overlap = layerstream::bench::run_overlap(oc);
    for (const auto& r : overlap)
      LS_CHECK(r.ordering_errors == 0, "overlap benchmark: the sim ordering checker found ", r.ordering_errors,
               " races; first: ", r.first_ordering_error);
  }

  // (b) overhead
  std::vector<OverheadRow> overhead;
  bool have_torch = false;
#ifdef LS_HAVE_TORCH
  have_torch = true;
  if (wanted("overhead")) {
    note("overhead");
    overhead = run_overhead(quick);
  }
#endif

  // (c) quant
  std::vector<QuantRow> quant;
  if (wanted("quant")) {
    note("quant");
    quant = run_quant(quick);
  }

  int plot_rc = 0;  // --plot's status, returned after the results are out
  if (json || !plot_file.empty()) {
    std::string s = "{\"quick\": " + std::string(quick ? "true" : "false") + ", \"overlap_config\": {\"layers\": " +
                    std::to_string(oc.layers) + ", \"compute_ms\": " + num(oc.compute_ms) +
                    ", \"layer_mib\": " + num(oc.layer_mib) + ", \"steps\": " + std::to_string(oc.steps) +
                    "}, \"overlap\": [";
    for (size_t i = 0; i < overlap.size(); ++i) {
      const auto& r = overlap[i];
      s += std::string(i ? ", " : "") + "{\"transfer_over_compute\": " + num(r.ratio) +
           ", \"prefetch\": " + std::to_string(r.prefetch) + ", \"slots\": " + std::to_string(r.slots) +
           ", \"step_ms\": " + num(r.step_ms) + ", \"ideal_ms\": " + num(r.ideal_ms) +
           ", \"overlap_ratio\": " + num(r.overlap_ratio) + ", \"hit_rate\": " + num(r.hit_rate) + "}";
    }
    s += "], \"overhead_available\": " + std::string(have_torch ? "true" : "false") + ", \"overhead\": [";
    for (size_t i = 0; i < overhead.size(); ++i) {
      const auto& r = overhead[i];
      s += std::string(i ? ", " : "") + "{\"system\": " + layerstream::json::quote(r.system) +
           ", \"layers\": " + std::to_string(r.layers) + ", \"batch\": 1, \"features\": 64" +
           ", \"forward_us\": " + num(r.forward_us) + ", \"fwd_bwd_us\": " + num(r.fwd_bwd_us) +
           ", \"forward_ratio\": " + num(r.forward_ratio) + ", \"fwd_bwd_ratio\": " + num(r.fwd_bwd_ratio) + "}";
    }
    s += "], \"quant\": [";
    for (size_t i = 0; i < quant.size(); ++i) {
      const auto& r = quant[i];
      s += std::string(i ? ", " : "") + "{\"format\": " + layerstream::json::quote(r.format) +
           ", \"rows\": " + std::to_string(r.rows) + ", \"cols\": " + std::to_string(r.cols) +
           ", \"packed_bytes\": " + std::to_string(r.packed_bytes) + ", \"pack_s\": " + num(r.pack_s) +
           ", \"source\": \"" + r.source + "\", \"pack_gbps_src\": " + num(r.pack_gbps) +
           ", \"dequant_cpu_s\": " + num(r.dequant_s) +
           ", \"dequant_cpu_gbps_bf16_out\": " + num(r.dequant_gbps) + "}";
    }
    s += "]}";
    // The results first: a plot that fails (no matplotlib) lost a run of minutes.
    if (json) std::printf("%s\n", s.c_str());
    std::fflush(stdout);
    if (!plot_file.empty()) plot_rc = plot(s, plot_file);
    if (json) return plot_rc;
  }

  if (!overlap.empty()) {
    std::printf("== overlap (sim device): %d layers x %.2f ms compute, %.2f MiB each, median of %d steps ==\n",
                oc.layers, oc.compute_ms, oc.layer_mib, oc.steps);
    std::printf("%-18s %-9s %-6s %-10s %-10s %-14s %s\n", "transfer/compute", "prefetch", "slots", "step ms",
                "ideal ms", "overlap_ratio", "hit rate");
    for (const auto& r : overlap)
      std::printf("%-18.2f %-9d %-6d %-10.2f %-10.2f %-14.3f %.2f\n", r.ratio, r.prefetch, r.slots, r.step_ms,
                  r.ideal_ms, r.overlap_ratio, r.hit_rate);
    std::printf("(overlap_ratio = step time / max(total compute, total transfer); 1.00 = perfect overlap)\n\n");
  }
  if (wanted("overhead")) {
    if (!have_torch) {
      std::printf("== overhead: skipped (this layerstream was built without LibTorch) ==\n\n");
    } else {
      std::printf("== per-call overhead: Linear 64 -> 64, batch 1, CPU, 1 thread (sim device, infinite link, "
                  "no latency); us per layer call ==\n");
      std::printf("%-42s %6s %10s %7s %12s %7s\n", "system", "layers", "fwd us", "ratio", "fwd+bwd us", "ratio");
      for (const auto& r : overhead)
        std::printf("%-42s %6d %10.2f %7.2f %12.2f %7.2f\n", r.system.c_str(), r.layers, r.forward_us,
                    r.forward_ratio, r.fwd_bwd_us, r.fwd_bwd_ratio);
      std::printf("\n");
    }
  }
  if (!quant.empty()) {
    std::printf("== quant: %lld x %lld fp32 weights (lossless: the same in bf16), all threads, best of %d ==\n",
                static_cast<long long>(quant[0].rows), static_cast<long long>(quant[0].cols), quick ? 2 : 3);
    std::printf("%-8s %12s %10s %16s %12s %22s\n", "format", "packed MiB", "pack ms", "pack GB/s (src)",
                "dequant ms", "cpu dequant GB/s bf16");
    for (const auto& r : quant)
      std::printf("%-8s %12.2f %10.2f %16.2f %12.2f %22.2f\n", r.format.c_str(),
                  static_cast<double>(r.packed_bytes) / 1048576.0, r.pack_s * 1e3, r.pack_gbps,
                  r.dequant_s * 1e3, r.dequant_gbps);
  }
  return plot_rc;
}

}  // namespace

LS_REGISTER_COMMAND("bench", cmd_bench, "run the overlap, per-call overhead and quantization benchmarks");
