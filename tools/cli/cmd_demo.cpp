// `layerstream demo`: trains a small character-level GPT twice from the same
// initial weights on the same batches, once resident and once with every
// Linear layer streamed from host RAM under a device budget several times
// smaller than the streamed weights, and shows that the losses match.
//
// The model is written with the LibTorch C++ API: token embedding + learned
// positions, N pre-LayerNorm blocks (hand-written causal multi-head
// self-attention with q/k/v/o projections, GELU MLP), final LayerNorm and LM
// head. Every projection is a layerstream::nn::Linear, which computes like
// torch::nn::Linear until offload() attaches it to an engine.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "commands.h"
#include "core/error.h"
#include "core/slot_layout.h"
#include "progress.h"

#ifdef LS_HAVE_TORCH
#include <torch/torch.h>

#include <cstdlib>
#include <random>
#include <thread>

#include "layerstream/offload.h"
#include "layerstream/host_optim.h"
#endif

namespace {

using layerstream::cli::UsageError;

const char* kHelp =
    "usage: layerstream demo [options]\n"
    "\n"
    "Trains a small character-level GPT (LibTorch C++) twice from the same seed on\n"
    "the same batches: once resident, once with every Linear layer streamed from\n"
    "pinned host RAM by layerstream under a device budget about 4x smaller than the\n"
    "streamed weights. Prints both losses per step (they must agree to 1e-5) and the\n"
    "engine's telemetry. Without a GPU it runs on the simulated device with a\n"
    "modelled PCIe 4.0 x16 link (25 GB/s, 5 us latency).\n"
    "\n"
    "  --steps N        training steps (default 30)\n"
    "  --device D       auto | sim | cuda | cuda:N (default auto: CUDA when visible)\n"
    "  --budget SIZE    device bytes, e.g. 2MiB (a byte count), as offload() takes\n"
    "                   it: the resident tensors (embeddings, norms; with --full their\n"
    "                   gradients and AdamW states too) and the streamed weights'\n"
    "                   slots (default: the resident tensors plus 1/4 of the streamed\n"
    "                   bytes, at least 3 slots of the largest layer)\n"
    "  --layers N       transformer blocks (default 4)\n"
    "  --seed N         seed of the initial weights and batches (default 0)\n"
    "  --text PATH      training text (default /usr/share/common-licenses/GPL-3, else\n"
    "                   data/demo.txt of the repository)\n"
    "  --full           full fine-tune with layerstream's host optimizer: the streamed\n"
    "                   model steps with layerstream::optim::AdamW (C++ kernels on host\n"
    "                   threads) and clips gradients to norm 1; the resident one with\n"
    "                   torch::nn::utils::clip_grad_norm_ + torch::optim::AdamW. Prints\n"
    "                   the time of each optimizer step (losses must agree to 1e-4)\n"
    "  -h, --help       this help\n"
    "\n"
    "Exit status: 0 losses match, 1 mismatch or runtime error, 2 bad usage.\n";

int usage_error(const std::string& msg) {
  std::fprintf(stderr, "layerstream demo: error: %s (run 'layerstream demo --help')\n", msg.c_str());
  return 2;
}

struct DemoOptions {
  int steps = 30;
  std::string device = "auto";
  int64_t budget = -1;
  int layers = 4;
  int seed = 0;
  std::string text;
  bool full = false;
};

#ifdef LS_HAVE_TORCH

namespace F = torch::nn::functional;

constexpr int64_t kDModel = 192;
constexpr int64_t kHeads = 6;
constexpr int64_t kContext = 64;
constexpr int64_t kBatch = 16;
constexpr double kLr = 3e-3;
constexpr double kTolerance = 1e-5;
// --full: the two optimizers round differently (torch::optim::AdamW's first
// moment is m * beta1 + (1 - beta1) * g, layerstream's torch.optim.AdamW's lerp).
constexpr double kFullTolerance = 1e-4;
constexpr double kMaxGradNorm = 1.0;

struct GPTConfig {
  int64_t vocab = 0;
  int64_t context = kContext;
  int64_t d_model = kDModel;
  int64_t heads = kHeads;
  int64_t layers = 4;
};

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(const GPTConfig& c) : heads(c.heads) {
    const int64_t d = c.d_model;
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    q = register_module("q", layerstream::nn::Linear(d, d));
    k = register_module("k", layerstream::nn::Linear(d, d));
    v = register_module("v", layerstream::nn::Linear(d, d));
    o = register_module("o", layerstream::nn::Linear(d, d));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    fc = register_module("fc", layerstream::nn::Linear(d, 4 * d));
    proj = register_module("proj", layerstream::nn::Linear(4 * d, d));
  }

  torch::Tensor attention(const torch::Tensor& x) {
    const int64_t B = x.size(0), T = x.size(1), C = x.size(2), hd = C / heads;
    auto split = [&](const torch::Tensor& t) { return t.view({B, T, heads, hd}).transpose(1, 2); };
    const torch::Tensor qh = split(q(x)), kh = split(k(x)), vh = split(v(x));  // [B, H, T, hd]
    torch::Tensor att = torch::matmul(qh, kh.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(hd)));
    const torch::Tensor future =
        torch::ones({T, T}, torch::TensorOptions().dtype(torch::kBool).device(x.device())).triu(1);
    att = torch::softmax(att.masked_fill(future, -std::numeric_limits<float>::infinity()), -1);
    const torch::Tensor y = torch::matmul(att, vh).transpose(1, 2).contiguous().view({B, T, C});
    return o(y);
  }

  torch::Tensor forward(torch::Tensor x) {
    x = x + attention(ln1(x));
    return x + proj(torch::gelu(fc(ln2(x))));
  }

  int64_t heads;
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  layerstream::nn::Linear q{nullptr}, k{nullptr}, v{nullptr}, o{nullptr}, fc{nullptr}, proj{nullptr};
};
TORCH_MODULE(Block);

struct GPTImpl : torch::nn::Module {
  explicit GPTImpl(const GPTConfig& c) {
    tok = register_module("tok", torch::nn::Embedding(c.vocab, c.d_model));
    pos = register_parameter("pos", torch::zeros({c.context, c.d_model}));
    // Registered one by one (not in a ModuleList) so each is a named child.
    for (int64_t i = 0; i < c.layers; ++i)
      blocks.push_back(register_module("h" + std::to_string(i), Block(c)));
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model})));
    head = register_module("head", layerstream::nn::Linear(c.d_model, c.vocab));
    // GPT-2 style initialisation.
    torch::NoGradGuard no_grad;
    for (auto& p : named_parameters()) {
      const std::string& name = p.key();
      torch::Tensor t = p.value();
      if (name.find("ln") != std::string::npos) continue;  // LayerNorm: ones / zeros
      if (name.size() > 5 && name.compare(name.size() - 5, 5, ".bias") == 0) t.zero_();
      else t.normal_(0.0, 0.02);
    }
  }

  torch::Tensor forward(const torch::Tensor& idx) {  // [B, T] -> logits [B, T, vocab]
    const int64_t T = idx.size(1);
    torch::Tensor x = tok(idx) + pos.narrow(0, 0, T);
    for (auto& b : blocks) x = b(x);
    return head(ln_f(x));
  }

  torch::nn::Embedding tok{nullptr};
  torch::Tensor pos;
  std::vector<Block> blocks;
  torch::nn::LayerNorm ln_f{nullptr};
  layerstream::nn::Linear head{nullptr};
};
TORCH_MODULE(GPT);

struct StreamedSize {
  int layers = 0;
  size_t bytes = 0;       // weight + bias bytes of every streamed Linear
  size_t slot_bytes = 0;  // the engine's slot size: largest layer, 256-aligned parts
  std::string largest;
  size_t rest_bytes = 0;  // every other parameter and buffer: resident, inside the budget
};

StreamedSize streamed_size(GPT& model) {
  StreamedSize s;
  for (const auto& item : model->named_modules()) {
    auto* lin = item.value()->as<layerstream::nn::LinearImpl>();
    if (!lin) continue;
    const size_t w = static_cast<size_t>(lin->weight.numel() * lin->weight.element_size());
    const size_t b = lin->bias.defined() ? static_cast<size_t>(lin->bias.numel() * lin->bias.element_size()) : 0;
    ++s.layers;
    s.bytes += w + b;
    const size_t slot = layerstream::slot_layout::of({{w, 0}, {b, 0}}).slot_bytes();
    if (slot > s.slot_bytes) {
      s.slot_bytes = slot;
      s.largest = item.key();
    }
  }
  size_t all = 0;
  for (const auto& p : model->parameters()) all += static_cast<size_t>(p.numel() * p.element_size());
  for (const auto& t : model->buffers()) all += static_cast<size_t>(t.numel() * t.element_size());
  s.rest_bytes = all - s.bytes;
  return s;
}

std::string mib(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f MiB", bytes / 1048576.0);
  return buf;
}

bool read_file(const std::string& path, std::string& out) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return false;
  std::ostringstream ss;
  ss << f.rdbuf();
  out = ss.str();
  return f.good() || f.eof();
}

// The training text: --text, else GPL-3 from Debian's common-licenses, else
// the repository's data/demo.txt (next to the binary's build dir, or the
// source dir it was configured from).
std::string load_text(const std::string& requested, std::string& source) {
  std::string text;
  if (!requested.empty()) {
    std::error_code ec;
    if (std::filesystem::is_directory(requested, ec))
      throw UsageError{"--text '" + requested + "' is a directory: give a text file"};
    if (!read_file(requested, text)) throw UsageError{"cannot read --text file '" + requested + "'"};
    if (text.size() <= static_cast<size_t>(kContext))  // the batches are windows of kContext + 1 characters
      throw UsageError{"--text file '" + requested + "' has " + std::to_string(text.size()) +
                       " characters; the demo trains on windows of " + std::to_string(kContext + 1) +
                       ": give a longer text"};
    source = requested;
    return text;
  }
  std::vector<std::string> candidates = {"/usr/share/common-licenses/GPL-3"};
  char exe[4096];
  const ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n > 0) {
    std::string dir(exe, static_cast<size_t>(n));
    dir = dir.substr(0, dir.find_last_of('/'));
    candidates.push_back(dir + "/../data/demo.txt");
    candidates.push_back(dir + "/data/demo.txt");
  }
#ifdef LS_SOURCE_DIR
  candidates.push_back(std::string(LS_SOURCE_DIR) + "/data/demo.txt");
#endif
  for (const std::string& c : candidates) {
    if (read_file(c, text) && text.size() > static_cast<size_t>(kContext) * 4) {
      source = c;
      return text;
    }
  }
  LS_FAIL("no training text found: /usr/share/common-licenses/GPL-3 and data/demo.txt are missing; "
          "pass one with --text PATH");
}

const char* kSimLink = "a modelled PCIe 4.0 x16 link (25 GB/s, 5 us latency)";

int run_demo(const DemoOptions& o) {
  // Intra-op threads: half the cores unless OMP_NUM_THREADS says otherwise.
  // Busy-waiting OpenMP workers on every core make small matmuls several
  // times slower on a loaded 2-core machine than one thread does.
  if (!std::getenv("OMP_NUM_THREADS"))
    at::set_num_threads(std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / 2));
  // ---- device ----
  const std::string resolved = layerstream::resolve_device(o.device, layerstream::DeviceSpelling::Cli);
  const bool sim = resolved == "sim";
  const torch::Device dev = sim ? torch::Device(torch::kCPU) : torch::Device(resolved);
  std::string device_line;
  if (sim && o.device == "auto")
    device_line = std::string("no GPU visible: running on the simulated device with ") + kSimLink;
  else if (sim)
    device_line = std::string("running on the simulated device (--device sim) with ") + kSimLink;
  else
    device_line = "running on " + resolved + " (CUDA GPU); streamed weights cross the real PCIe link";

  // ---- data ----
  std::string source;
  const std::string text = load_text(o.text, source);
  std::vector<int> code(256, -1);
  std::vector<unsigned char> chars;
  for (unsigned char ch : text)
    if (code[ch] < 0) code[ch] = 0, chars.push_back(ch);
  std::sort(chars.begin(), chars.end());
  for (size_t i = 0; i < chars.size(); ++i) code[chars[i]] = static_cast<int>(i);
  std::vector<int64_t> tokens(text.size());
  for (size_t i = 0; i < text.size(); ++i) tokens[i] = code[static_cast<unsigned char>(text[i])];

  GPTConfig cfg;
  cfg.vocab = static_cast<int64_t>(chars.size());
  cfg.layers = o.layers;

  // Same batches for both models: random windows of kContext + 1 characters.
  std::mt19937_64 rng(static_cast<uint64_t>(o.seed));
  std::uniform_int_distribution<size_t> start(0, tokens.size() - static_cast<size_t>(kContext) - 1);
  std::vector<std::pair<torch::Tensor, torch::Tensor>> batches;
  for (int s = 0; s < o.steps; ++s) {
    torch::Tensor b = torch::empty({kBatch, kContext + 1}, torch::kLong);
    auto* p = b.data_ptr<int64_t>();
    for (int64_t r = 0; r < kBatch; ++r) {
      const size_t at = start(rng);
      std::copy(tokens.begin() + static_cast<std::ptrdiff_t>(at),
                tokens.begin() + static_cast<std::ptrdiff_t>(at) + kContext + 1, p + r * (kContext + 1));
    }
    batches.emplace_back(b.narrow(1, 0, kContext).contiguous().to(dev),
                         b.narrow(1, 1, kContext).contiguous().to(dev));
  }

  // ---- two identical models ----
  torch::manual_seed(static_cast<uint64_t>(o.seed));
  GPT resident(cfg);
  GPT streamed(cfg);
  {
    torch::NoGradGuard no_grad;
    auto src = resident->named_parameters();
    for (auto& p : streamed->named_parameters()) p.value().copy_(src[p.key()]);
  }
  const StreamedSize size = streamed_size(streamed);
  int64_t params = 0;
  for (const auto& p : resident->parameters()) params += p.numel();
  int64_t budget = o.budget;
  const int64_t two_slots = static_cast<int64_t>(2 * size.slot_bytes);
  // The budget holds the resident tensors too (offload(budget=)); with --full their
  // gradients and two fp32 AdamW states (all fp32 here), as the planner counts them.
  // Every bound below counts them, as offload() does.
  const int64_t resident_bytes = static_cast<int64_t>(size.rest_bytes) * (o.full ? 4 : 1);
  const int64_t min_budget = two_slots + resident_bytes;
  if (budget < 0) {
    budget = std::max<int64_t>(static_cast<int64_t>(size.bytes / 4), static_cast<int64_t>(3 * size.slot_bytes));
    budget = static_cast<int64_t>(layerstream::slot_layout::align(static_cast<uint64_t>(budget)));
    if (static_cast<uint64_t>(budget) >= size.bytes) budget = two_slots;  // a small model: 2 slots
    budget += resident_bytes;
  }
  if (o.budget < 0 && static_cast<uint64_t>(budget - resident_bytes) >= size.bytes) {
    throw UsageError{"the model's weights (" + std::to_string(size.bytes) + " bytes) fit in 2 slots of its "
                     "largest layer: nothing would stream. Pass more --layers"};
  } else if (budget < min_budget) {
    throw UsageError{"--budget " + std::to_string(budget) + " bytes is below 2 slots of the largest streamed "
                     "layer '" + size.largest + "' plus the tensors that stay resident (" +
                     std::to_string(min_budget) + " bytes)"};
  } else if (static_cast<uint64_t>(budget - resident_bytes) >= size.bytes) {
    throw UsageError{"--budget " + std::to_string(budget) + " bytes holds every weight of the model (" +
                     std::to_string(size.bytes) + " bytes streamed, " + std::to_string(resident_bytes) +
                     " resident): nothing would stream. Pass a smaller budget (default: a quarter of the "
                     "weights), or more --layers"};
  }

  std::printf("layerstream demo: character-level GPT, LibTorch C++ API, fp32\n");
  std::printf("device   %s\n", device_line.c_str());
  std::printf("text     %s (%zu characters, vocabulary %lld)\n", source.c_str(), text.size(),
              static_cast<long long>(cfg.vocab));
  std::printf("model    %d blocks, d_model %lld, %lld heads, context %lld, %.2f M parameters\n", o.layers,
              static_cast<long long>(cfg.d_model), static_cast<long long>(cfg.heads),
              static_cast<long long>(cfg.context), static_cast<double>(params) / 1e6);
  std::printf("streamed %d Linear layers, %s of weights (largest '%s': one slot = %s)\n", size.layers,
              mib(static_cast<double>(size.bytes)).c_str(), size.largest.c_str(),
              mib(static_cast<double>(size.slot_bytes)).c_str());
  std::printf("budget   %s = %lld bytes (%.1fx smaller than the streamed weights; %s of resident tensors%s, "
              "then room for %lld slots)\n",
              mib(static_cast<double>(budget)).c_str(), static_cast<long long>(budget),
              static_cast<double>(size.bytes) / static_cast<double>(budget),
              mib(static_cast<double>(resident_bytes)).c_str(), o.full ? " with their gradients and AdamW states" : "",
              static_cast<long long>(std::max<int64_t>(budget - resident_bytes, 0) / static_cast<int64_t>(size.slot_bytes)));
  std::printf("training %d steps, batch %lld x %lld tokens, AdamW lr %g, same batches for both models "
              "(CPU threads: %d)\n",
              o.steps, static_cast<long long>(kBatch), static_cast<long long>(kContext), kLr, at::get_num_threads());
  if (o.full)
    std::printf("full     fine-tune: streamed model steps with layerstream::optim::AdamW (host C++ kernels, %d "
                "threads, %s), both clip to norm %g\n",
                layerstream::optim::ThreadPool::shared().threads(), layerstream::optim::kernel_isa(), kMaxGradNorm);
  std::printf("\n");

  resident->to(dev);
  layerstream::OffloadOptions opts;
  opts.device = o.device;
  opts.budget_bytes = budget;
  if (o.full) opts.train = "adamw";  // the budget holds resident weights' gradients and AdamW states too
  opts.trace = true;  // timeline -> overlap fraction per step
  // sim link defaults of EngineOptions: 25 GB/s each way, 5 us latency.
  auto handle = layerstream::offload(*streamed, opts);

  torch::optim::AdamW opt_r(resident->parameters(), torch::optim::AdamWOptions(kLr));
  torch::optim::AdamW opt_s(streamed->parameters(), torch::optim::AdamWOptions(kLr));
  // --full: the streamed model's optimizer is layerstream's (host kernels),
  // and both clip their gradients to kMaxGradNorm first.
  layerstream::optim::AdamWOptions ls_opts;
  ls_opts.lr = kLr;
  ls_opts.weight_decay = 1e-2;  // torch::optim::AdamW's default
  ls_opts.max_grad_norm = kMaxGradNorm;
  layerstream::optim::AdamW ls_opt(streamed->parameters(), ls_opts);
  double opt_seconds_r = 0, opt_seconds_s = 0;
  using Clock = std::chrono::steady_clock;
  auto train_step = [&](GPT& model, torch::optim::Optimizer& opt, const torch::Tensor& x, const torch::Tensor& y,
                        bool streamed_model) {
    opt.zero_grad();
    if (o.full && streamed_model) ls_opt.zero_grad();
    torch::Tensor loss = F::cross_entropy(model(x).view({-1, cfg.vocab}), y.view({-1}));
    loss.backward();
    const auto t0 = Clock::now();
    if (o.full && streamed_model) {
      ls_opt.step();
    } else {
      if (o.full) torch::nn::utils::clip_grad_norm_(model->parameters(), kMaxGradNorm);
      opt.step();
    }
    (streamed_model ? opt_seconds_s : opt_seconds_r) += std::chrono::duration<double>(Clock::now() - t0).count();
    return loss.item<double>();
  };
  const double tolerance = o.full ? kFullTolerance : kTolerance;

  layerstream::cli::Progress progress(o.steps);
  std::printf("%*s  %13s  %13s  %9s\n", 29 + 2 * static_cast<int>(std::to_string(o.steps).size()), "",
              "loss resident", "loss streamed", "|diff|");
  double worst = 0, t_resident = 0, t_streamed = 0;
  int first_bad = -1;
  for (int s = 0; s < o.steps; ++s) {
    progress.running(s + 1, "training...");
    const auto t0 = Clock::now();
    const double lr_loss = train_step(resident, opt_r, batches[static_cast<size_t>(s)].first,
                                      batches[static_cast<size_t>(s)].second, false);
    const auto t1 = Clock::now();
    const double ls_loss = train_step(streamed, opt_s, batches[static_cast<size_t>(s)].first,
                                      batches[static_cast<size_t>(s)].second, true);
    const auto t2 = Clock::now();
    t_resident += std::chrono::duration<double>(t1 - t0).count();
    t_streamed += std::chrono::duration<double>(t2 - t1).count();
    const double diff = std::abs(lr_loss - ls_loss);
    if (!(diff <= tolerance) && first_bad < 0) first_bad = s + 1;
    worst = std::max(worst, std::isnan(diff) ? INFINITY : diff);
    char cols[128];
    std::snprintf(cols, sizeof cols, "%13.6f  %13.6f  %9.2e%s", lr_loss, ls_loss, diff,
                  diff <= tolerance ? "" : "  MISMATCH");
    progress.done(s + 1, cols);
  }
  handle->synchronize();
  auto st = handle->stats();
  const double peak = static_cast<double>(st.peak_device_bytes);
  const double steps = static_cast<double>(std::max(1, o.steps));
  const double acquires = static_cast<double>(st.acquires);
  std::printf("\n");
  std::printf("device               %s%s\n", sim ? "sim (simulated device, " : resolved.c_str(),
              sim ? "modelled PCIe 4.0 x16: 25 GB/s, 5 us)" : "");
  std::printf("peak device bytes    %.0f (%s) vs budget %lld (%s): %s\n", peak, mib(peak).c_str(),
              static_cast<long long>(budget), mib(static_cast<double>(budget)).c_str(),
              peak <= static_cast<double>(budget) ? "within budget" : "OVER BUDGET");
  // The depth the engine ran with: a slot per layer in flight beside the one in use.
  const long long depth = std::max<long long>(0, std::min<long long>(opts.prefetch, static_cast<long long>(st.slots) - 1));
  std::printf("slots                %.0f x %s, prefetch %lld\n", static_cast<double>(st.slots),
              mib(static_cast<double>(st.slot_bytes)).c_str(), depth);
  std::printf("host->device         %s per step (%.0f bytes in %d steps)\n", mib(static_cast<double>(st.h2d_bytes) / steps).c_str(),
              static_cast<double>(st.h2d_bytes), o.steps);
  std::printf("device->host         %s per step (weight gradients)\n", mib(static_cast<double>(st.d2h_bytes) / steps).c_str());
  std::printf("stall                %.3f s total (%.1f ms per step waiting for weights)\n", st.stall_seconds,
              st.stall_seconds / steps * 1e3);
  std::printf("prefetch hit rate    %.1f%% (%.0f hits / %.0f acquires)\n",
              acquires > 0 ? 100.0 * static_cast<double>(st.hits) / acquires : 0.0, static_cast<double>(st.hits), acquires);
  {
    double sum = 0;
    int n = 0;
    for (const auto& [step, overlap] : handle->engine()->step_stats())
      if (!std::isnan(overlap)) {
        sum += overlap;
        n++;
      }
    if (n > 0)
      std::printf("overlap              %.1f%% of host->device copy time hidden behind compute (mean of %d steps)\n",
                  100.0 * sum / n, n);
  }
  std::printf("time per step        resident %.3f s, streamed %.3f s\n", t_resident / steps, t_streamed / steps);
  std::printf("optimizer step       resident %.2f ms (%s), streamed %.2f ms (%s)\n", opt_seconds_r / steps * 1e3,
              o.full ? "clip_grad_norm_ + torch::optim::AdamW" : "torch::optim::AdamW", opt_seconds_s / steps * 1e3,
              o.full ? "layerstream::optim::AdamW, clipping included" : "torch::optim::AdamW");
  if (sim)
    std::printf("ordering checker     %.0f races\n", static_cast<double>(st.ordering_errors));
  std::printf("max |loss diff|      %.2e (tolerance %.0e)\n", worst, tolerance);
  const bool races = static_cast<double>(st.ordering_errors) > 0;
  const bool over = peak > static_cast<double>(budget);  // resident layers included (OffloadHandle::stats)
  const bool none_streamed = st.h2d_bytes == 0;
  handle->detach();
  if (first_bad > 0) {
    std::fprintf(stderr, "layerstream demo: error: streamed loss differs from resident loss by more than %.0e "
                 "(first at step %d)\n", tolerance, first_bad);
    return 1;
  }
  if (over || races || none_streamed) {
    std::fprintf(stderr, "layerstream demo: error: %s\n",
                 over ? "peak device bytes exceeded the budget"
                      : races ? "the ordering checker reported races" : "nothing streamed (0 bytes host to device)");
    return 1;
  }
  std::printf("OK: streamed training matches resident training under a %.1fx smaller device budget\n",
              static_cast<double>(size.bytes) / static_cast<double>(budget));
  return 0;
}

#endif  // LS_HAVE_TORCH

bool valid_device(const std::string& d) {
  if (d == "auto" || d == "sim" || d == "cuda") return true;
  if (d.rfind("cuda:", 0) != 0 || d.size() == 5) return false;
  return d.find_first_not_of("0123456789", 5) == std::string::npos;
}

int cmd_demo(int argc, char** argv) {
  DemoOptions o;
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      std::string v;
      if (a == "-h" || a == "--help") {
        std::fputs(kHelp, stdout);
        return 0;
      } else if (layerstream::cli::take_option(argc, argv, i, "--steps", v)) {
        o.steps = layerstream::cli::parse_int("--steps", v, 1, 1000000);
      } else if (layerstream::cli::take_option(argc, argv, i, "--device", v)) {
        if (!valid_device(v)) throw UsageError{"--device expects auto, sim, cuda or cuda:N, got '" + v + "'"};
        o.device = v;
      } else if (layerstream::cli::take_option(argc, argv, i, "--budget", v)) {
        layerstream::cli::refuse_budget_share("--budget", v, "layerstream demo",
                                              "its budget bounds the streamed weights in bytes, not as a "
                                              "share of free device memory");
        o.budget = layerstream::cli::parse_size("--budget", v);
      } else if (layerstream::cli::take_option(argc, argv, i, "--layers", v)) {
        o.layers = layerstream::cli::parse_int("--layers", v, 1, 64);
      } else if (layerstream::cli::take_option(argc, argv, i, "--seed", v)) {
        o.seed = layerstream::cli::parse_int("--seed", v, 0, 2147483647);
      } else if (layerstream::cli::take_option(argc, argv, i, "--text", v)) {
        o.text = v;
      } else if (a == "--full") {
        o.full = true;
      } else {
        throw UsageError{"unknown option '" + a + "'"};
      }
    }
#ifdef LS_HAVE_TORCH
    return run_demo(o);
#else
    std::fprintf(stderr, "layerstream demo: error: this layerstream was built without LibTorch; the demo "
                 "needs it (install LibTorch / torch and rebuild)\n");
    return 1;
#endif
  } catch (const UsageError& e) {
    return usage_error(e.message);
  }
}

}  // namespace

LS_REGISTER_COMMAND("demo", cmd_demo,
                    "train a small GPT resident and streamed under a budget; losses must match");
