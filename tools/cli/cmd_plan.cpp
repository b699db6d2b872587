// `layerstream plan`: placement plan for a checkpoint or a built-in model
// under a device-memory budget (see docs/design/planner.md).
#include <algorithm>
#include <climits>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <string>

#include "commands.h"
#include "core/error.h"
#include "core/gguf.h"
#include "core/host_memory.h"
#include "core/host_tier.h"
#include "core/json.h"
#include "core/options.h"
#include "core/optim/optim.h"
#include "core/planner.h"
#include "core/safetensors.h"
#include "progress.h"

namespace {

using namespace layerstream;

const char* kHelp =
    "usage: layerstream plan (--checkpoint PATH | --model NAME) --budget SIZE [options]\n"
    "\n"
    "Decides which layers stay resident on the device and which are streamed from\n"
    "pinned host RAM, under a hard device-memory budget, and predicts the step time.\n"
    "\n"
    "  --checkpoint PATH     a .safetensors file, a *.safetensors.index.json, or a\n"
    "                        directory holding one of them (only headers are read;\n"
    "                        a config.json beside it tells whether lm_head is tied),\n"
    "                        or a .gguf file (its Q8_0..Q6_K weights cross as they are,\n"
    "                        as load_gguf() + offload() stream them)\n"
    "  --dense-dtype D       the model's parameter dtype, fp32|bf16|fp16: .gguf weights are\n"
    "                        dequantized to it in their slot (default bf16); a .safetensors\n"
    "                        checkpoint's (or a built-in model's) floating-point tensors of\n"
    "                        another dtype are cast to it as offload() reads them (default:\n"
    "                        as stored)\n"
    "  --model NAME          a built-in model description (--list-models)\n"
    "  --budget SIZE         device memory for weights, e.g. 12GiB, 500MB, 1.5e9 (bytes:\n"
    "                        plan has no device to take a share such as 40% of)\n"
    "  --link-gbps X         host->device bandwidth in GB/s (10^9 bytes/s; default 25;\n"
    "                        0 = unknown, no time prediction)\n"
    "  --tflops X            device throughput in TFLOP/s (default 100; 0 = unknown)\n"
    "  --tokens N            tokens per step; FLOPs of a layer = 2 * tokens * params\n"
    "                        (default 4096)\n"
    "  --train[=SPEC]        full fine-tuning step: FLOPs x3, weights cross the link twice, and\n"
    "                        the budget also holds what resident weights need to train, as\n"
    "                        offload(train=SPEC): grads (default), adamw, adamw-bf16, adamw-8bit,\n"
    "                        adafactor, adafactor-beta1, or optimizer-state bytes per\n"
    "                        parameter (e.g. 8)\n"
    "  --activations host    with --train, as offload(activations=\"host\"): each linear\n"
    "                        layer's saved input (tokens x in_features) goes to the host in\n"
    "                        the forward and comes back over the link in the backward\n"
    "  --quantize Q          stream weights as int8|fp8|nf4|int4|lossless (default: as stored;\n"
    "                        lossless: the coded size measured from a sample of each weight)\n"
    "  --resident-dequantized  the default, kept for older scripts: resident quantized layers\n"
    "                        take their stored size, as offload() holds them (dense)\n"
    "  --compute-dtype D     fp32|bf16|fp16: the activations' dtype, as offload(compute_dtype=)\n"
    "                        (slots also hold weights cast to it; quantized ones dequantize to it)\n"
    "  --experts MODE        routed (default) | all, as offload(experts=): with routed, a\n"
    "                        mixture-of-experts group whose step reaches at most half of its\n"
    "                        experts copies only those (uniform routing assumed)\n"
    "  --max-prefetch N      at most N layers prefetched ahead (slots <= N+1, at least 2);\n"
    "                        0 to 64, default 4; 0 as offload(prefetch=0): none ahead\n"
    "  --host-budget SIZE    host RAM for streamed weights, as offload(host_budget=): streamed\n"
    "                        Linear weights of a .safetensors checkpoint that do not fit stay\n"
    "                        in the file and are read on every use (inference; with --train\n"
    "                        every weight must fit in RAM; with --quantize they are read packed\n"
    "                        from offload(cache_dir=)'s cache file; cast ones, convolutions,\n"
    "                        tensor groups and lossless ones are read into RAM)\n"
    "  --disk-gbps X         the disk's read bandwidth in GB/s for the disk tier (default 2)\n"
    "  --json                print the plan as one JSON object\n"
    "  --list-models         print the built-in model names and exit\n"
    "  -h, --help            this help\n"
    "\n"
    "Exit status: 0 ok, 2 bad usage, 1 any other error (bad checkpoint, budget too small).\n";

struct Usage {
  std::string message;
};

// The model's config.json next to a checkpoint (in the directory given, or
// beside the file given); "" when there is none.
std::string config_json_beside(const std::string& checkpoint) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path p(checkpoint);
  const fs::path dir = fs::is_directory(p, ec) ? p : p.parent_path();
  const fs::path config = (dir.empty() ? fs::path(".") : dir) / "config.json";
  return fs::is_regular_file(config, ec) ? config.string() : std::string();
}

double parse_number(const std::string& flag, const std::string& v, bool positive = false) {
  const char* s = v.c_str();
  char* end = nullptr;
  double d = std::strtod(s, &end);
  if (v.empty() || end != s + v.size() || !std::isfinite(d) || d < 0 || (positive && d == 0))
    throw Usage{flag + (positive ? " expects a positive number, got " : " expects a non-negative number, got ") +
                json::quote(v)};
  return d;
}

// A whole number in [lo, hi] for `flag`: one that is not a whole number >= lo
// says what it expects, one above hi that it is too large (and the limit).
uint64_t parse_count(const std::string& flag, const std::string& v, uint64_t lo, uint64_t hi) {
  const std::string expects = lo == 1 ? "a positive integer" : "an integer >= " + std::to_string(lo);
  if (v.empty() || v.find_first_not_of("0123456789") != std::string::npos)
    throw Usage{flag + " expects " + expects + ", got " + json::quote(v)};
  const uint64_t n = std::strtoull(v.c_str(), nullptr, 10);  // beyond 2^64 - 1: 2^64 - 1, too large too
  if (n < lo) throw Usage{flag + " expects " + expects + ", got " + json::quote(v)};
  if (n > hi)
    throw Usage{flag + " " + v + " is too large (at most " + std::to_string(hi) + ")"};
  return n;
}

// Tokens per step (--tokens): a bound that keeps the planner's byte counts
// (tokens x row bytes of a table or an activation) far from overflowing.
constexpr uint64_t kMaxTokens = uint64_t{1} << 40;

int usage_error(const std::string& msg) {
  std::fprintf(stderr, "layerstream plan: error: %s (run 'layerstream plan --help')\n", msg.c_str());
  return 2;
}

// The host tier (core/host_tier.h) of a plan's streamed layers under
// `host_budget`: which layers come from disk, the RAM it takes, and the step
// time with the disk read (an estimate: a cyclic schedule over e staging
// entries reads about disk bytes - staging bytes + read-ahead per pass).
void host_disk_section(const Plan& plan, const std::vector<PlannerLayer>& specs, const std::vector<bool>& disk_ok,
                       int64_t host_budget, double disk_gbps, std::string* text, std::string* json_out) {
  std::vector<host_tier::Layer> layers;
  std::vector<std::string> names;
  uint64_t largest = 0;
  for (const auto& l : plan.layers) {
    if (l.resident) continue;
    // Training: a trainable streamed layer's gradient is staged on the host (its bytes).
    const bool grad = specs[l.index].trainable && !l.lookup;
    layers.push_back({l.name, l.bytes, disk_ok[l.index] && !l.lookup, grad ? l.bytes : 0});
    names.push_back(l.name);
  }
  const host_tier::Plan h = host_tier::plan(layers, host_budget, host_tier::kUnlimited, plan.prefetch_depth);
  std::vector<std::string> from_disk;
  for (size_t i = 0; i < layers.size(); ++i)
    if (h.on_disk[i]) from_disk.push_back(names[i]), largest = std::max(largest, layers[i].bytes);
  const uint64_t ahead = static_cast<uint64_t>(plan.prefetch_depth + 1) * largest;
  uint64_t per_pass = h.disk_bytes > h.staging_bytes ? h.disk_bytes - h.staging_bytes + ahead : 0;
  per_pass = std::min(per_pass, h.disk_bytes);
  const uint64_t read = per_pass * (plan.training ? 2 : 1);
  const double disk_s = static_cast<double>(read) / (disk_gbps * 1e9);
  const double step_s = std::max(plan.step_time_s, disk_s);
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "\nhost:   budget %s: %s in RAM (the store), %zu layer(s) of %s stay in the checkpoint and are read "
                "on every use through %s of staging entries\n",
                format_bytes(static_cast<uint64_t>(host_budget)).c_str(), format_bytes(h.store_bytes).c_str(),
                from_disk.size(), format_bytes(h.disk_bytes).c_str(), format_bytes(h.staging_bytes).c_str());
  *text = buf;
  if (h.grad_staging_bytes) {
    std::snprintf(buf, sizeof buf, "        and %s of gradient staging buffers (training)\n",
                  format_bytes(h.grad_staging_bytes).c_str());
    *text += buf;
  }
  if (!from_disk.empty()) {
    std::string list;
    for (size_t i = 0; i < from_disk.size() && i < 4; ++i) list += (i ? ", " : "") + from_disk[i];
    if (from_disk.size() > 4) list += ", ...";
    std::snprintf(buf, sizeof buf,
                  "        from disk: %s\n        disk read ~%s per step at %g GB/s = %.3g s; predicted step with "
                  "the disk: %.3g s (%s-bound)\n",
                  list.c_str(), format_bytes(read).c_str(), disk_gbps, disk_s, step_s,
                  disk_s > plan.step_time_s ? "disk" : plan.bound().c_str());
    *text += buf;
  }
  const HostMemory host = host_memory();
  if (host.available_bytes > 0 && h.host_bytes() > host.available_bytes) {
    std::snprintf(buf, sizeof buf, "        warning: this needs %s of host RAM, more than this machine has "
                  "available (%s): lower --host-budget\n", format_bytes(h.host_bytes()).c_str(),
                  format_bytes(host.available_bytes).c_str());
    *text += buf;
  }
  auto number = [](double v) {
    char b[32];
    std::snprintf(b, sizeof b, "%.6g", v);
    return std::string(b);
  };
  std::string j = "{\"budget_bytes\": " + std::to_string(host_budget) + ", \"store_bytes\": " +
                  std::to_string(h.store_bytes) + ", \"disk_bytes\": " + std::to_string(h.disk_bytes) +
                  ", \"staging_bytes\": " + std::to_string(h.staging_bytes) +
                  ", \"grad_staging_bytes\": " + std::to_string(h.grad_staging_bytes) + ", \"disk_gbps\": " +
                  number(disk_gbps) + ", \"disk_read_bytes_per_step\": " + std::to_string(read) +
                  ", \"step_time_s\": " + number(step_s) + ", \"from_disk\": [";
  for (size_t i = 0; i < from_disk.size(); ++i) j += (i ? ", " : "") + json::quote(from_disk[i]);
  *json_out = j + "]}";
}

// Whether the file at `path` begins with GGUF's magic ("GGUF"), whatever its
// name ends with (a ".GGUF" was read as a damaged safetensors file); anything
// else, unreadable paths included, goes to the safetensors reader, whose error
// names the problem.
static bool starts_as_gguf(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  char magic[4] = {};
  return f.read(magic, 4) && std::memcmp(magic, "GGUF", 4) == 0;
}

int cmd_plan(int argc, char** argv) {
  std::string checkpoint, model, budget_s, dense_dtype = "BF16";
  bool have_checkpoint = false, have_model = false, have_budget = false, as_json = false, have_dense_dtype = false;
  double link_gbps = 25.0, tflops = 100.0;
  const auto too_large = [](const std::string& flag, double v) {  // finite, but not once in bytes or FLOPs
    char b[96];
    std::snprintf(b, sizeof b, "%s %g is too large", flag.c_str(), v);
    return Usage{b};
  };
  // A rate so small that one byte or FLOP takes longer than a double holds (1e-320:
  // the plan said "inf s", its JSON "inf", which is not JSON): at least 1e-9.
  constexpr double kMinRate = 1e-9;  // 1 byte (1000 FLOPs) per second
  const auto check_rate = [](const std::string& flag, const std::string& text, double v, bool zero_ok) {
    if (v != 0 && v < kMinRate) {
      char b[96];
      std::snprintf(b, sizeof b, " is too small (at least %g%s)", kMinRate, zero_ok ? ", or 0: no time model" : "");
      throw Usage{flag + " " + text + b};
    }
    return v;
  };
  LayerOptions opt;
  int max_prefetch = 4;
  std::string host_budget_s;
  double disk_gbps = 2.0;
  std::set<std::string> given;  // the options seen
  try {
    for (int i = 1; i < argc; ++i) {
      std::string a = argv[i];
      std::string value;
      bool inline_value = false;
      if (a.rfind("--", 0) == 0) {
        size_t eq = a.find('=');
        if (eq != std::string::npos) {
          value = a.substr(eq + 1);
          a = a.substr(0, eq);
          inline_value = true;
        }
      }
      auto take = [&]() -> std::string {
        if (inline_value) return value;
        if (i + 1 >= argc) throw Usage{a + " needs a value"};
        // "--model --budget 1GiB" took --budget as the model's name.
        if (std::string(argv[i + 1]).rfind("--", 0) == 0)
          throw Usage{a + " needs a value, got the option " + json::quote(argv[i + 1])};
        return argv[++i];
      };
      // Given twice, the last one won silently.
      if (a.rfind("--", 0) == 0 && !given.insert(a).second) throw Usage{a + " is given twice: give it once"};
      auto no_value = [&]() {
        if (inline_value) throw Usage{a + " takes no value"};
      };
      if (a == "-h" || a == "--help") {
        std::fputs(kHelp, stdout);
        return 0;
      } else if (a == "--list-models") {
        no_value();
        for (const auto& n : builtin_model_names()) std::printf("%s\n", n.c_str());
        return 0;
      } else if (a == "--checkpoint") {
        checkpoint = take();
        have_checkpoint = true;
      } else if (a == "--model") {
        model = take();
        have_model = true;
      } else if (a == "--budget") {
        budget_s = take();
        cli::refuse_budget_share(a, budget_s, "layerstream plan",
                                 "it plans without a device, so there is no free memory to take a share of");
        have_budget = true;
      } else if (a == "--link-gbps") {
        const std::string v = take();
        link_gbps = check_rate(a, v, options::check_link_gbps(parse_number(a, v), "--link-gbps"), true);
        if (!std::isfinite(link_gbps * 1e9)) throw too_large(a, link_gbps);
      } else if (a == "--tflops") {
        const std::string v = take();
        tflops = check_rate(a, v, parse_number(a, v), true);
        if (!std::isfinite(tflops * 1e12)) throw too_large(a, tflops);
      } else if (a == "--tokens") {
        opt.tokens = parse_count(a, take(), 1, kMaxTokens);
      } else if (a == "--quantize") {
        opt.quantize = parse_quantization(take());
      } else if (a == "--train") {
        opt.training = true;
        if (inline_value && value.empty())
          throw Usage{"--train= needs a spec after '=' (grads, adamw, adamw-bf16, adamw-8bit, adafactor, "
                      "adafactor-beta1 or state bytes per parameter), or plain --train"};
        if (inline_value) {
          optim::parse_train_spec(value);  // an unknown spec: exit 2, naming the choices
          opt.train = value;
        }
      } else if (a == "--activations") {
        const std::string m = take();
        if (m != "host") throw Usage{"--activations expects host, got " + json::quote(m)};
        opt.activations = true;
      } else if (a == "--resident-dequantized") {
        no_value();
        opt.resident_dequantized = true;
      } else if (a == "--compute-dtype" || a == "--dense-dtype") {
        const std::string d = take();
        std::string& to = a == "--compute-dtype" ? opt.compute_dtype : dense_dtype;
        have_dense_dtype = have_dense_dtype || a == "--dense-dtype";
        if (d == "fp32" || d == "float32" || d == "F32") to = "F32";
        else if (d == "bf16" || d == "bfloat16" || d == "BF16") to = "BF16";
        else if (d == "fp16" || d == "float16" || d == "F16") to = "F16";
        else throw Usage{a + " expects fp32, bf16 or fp16, got " + json::quote(d)};
      } else if (a == "--experts") {
        const std::string m = take();
        if (m != "routed" && m != "all") throw Usage{"--experts expects routed or all, got " + json::quote(m)};
        opt.routed_experts = m == "routed";
      } else if (a == "--max-prefetch") {
        // offload(prefetch=)'s rule (options::check_prefetch), 0 included.
        const std::string v = take();
        char* end = nullptr;
        errno = 0;
        const long long n = std::strtoll(v.c_str(), &end, 10);
        if (v.empty() || *end != '\0' || errno == ERANGE)
          throw Usage{"--max-prefetch expects an integer in [0, " + std::to_string(options::kMaxPrefetch) +
                      "], got " + json::quote(v)};
        try {
          max_prefetch = options::check_prefetch(n);
        } catch (const Error& e) {
          throw Usage{"--max-prefetch: " + e.message()};
        }
      } else if (a == "--host-budget") {
        host_budget_s = take();
      } else if (a == "--disk-gbps") {
        const std::string v = take();
        disk_gbps = check_rate(a, v, parse_number(a, v, /*positive=*/true), false);
        if (!std::isfinite(disk_gbps * 1e9)) throw too_large(a, disk_gbps);
      } else if (a == "--json") {
        no_value();
        as_json = true;
      } else {
        if (i > 1 && std::string(argv[i - 1]) == "--train")  // "--train grads"
          throw Usage{"unknown option " + json::quote(a) + " (a --train spec goes after '=': --train=" + a + ")"};
        throw Usage{"unknown option " + json::quote(a)};
      }
    }
    if (have_checkpoint == have_model) throw Usage{"pass exactly one of --checkpoint PATH or --model NAME"};
    if (!have_budget) throw Usage{"--budget SIZE is required (e.g. --budget 12GiB)"};
    if (opt.activations && !opt.training)
      throw Usage{"--activations host needs --train: only a training step saves activations for a backward"};
    if (have_checkpoint && checkpoint.empty()) throw Usage{"--checkpoint needs a non-empty path"};
    if (opt.quantize == Quantization::Lossless &&
        (!have_checkpoint || starts_as_gguf(checkpoint)))
      throw Usage{"--quantize lossless needs a .safetensors --checkpoint: its size is measured from the weights"};
  } catch (const Usage& u) {
    return usage_error(u.message);
  } catch (const cli::UsageError& u) {
    return usage_error(u.message);
  } catch (const Error& e) {
    return usage_error(e.message());
  }

  PlannerInput in;
  ModelDescription desc;
  try {
    in.budget_bytes = layerstream::options::parse_budget(budget_s).bytes;  // shares refused above
    if (have_model) desc = builtin_model(model);
    if (have_model && have_dense_dtype) cast_to_dtype(desc, dense_dtype);
  } catch (const Error& e) {
    return usage_error(e.message());
  }
  std::string tied_table;
  double experts_active = 0.0;  // share of the experts a token runs (config.json), 0: unknown
  const bool gguf = have_checkpoint && starts_as_gguf(checkpoint);
  if (gguf) {
    const GgufFile g = read_gguf(checkpoint);  // errors -> exit 1
    LS_CHECK(!g.tensors.empty(), checkpoint, " holds no tensors: nothing to plan");
    desc = describe_gguf(g, dense_dtype);
  } else if (have_checkpoint) {
    const Checkpoint ck = read_checkpoint(checkpoint);  // errors -> exit 1
    LS_CHECK(!ck.tensors.empty(), checkpoint, " holds no tensors: nothing to plan");
    desc = describe_checkpoint(ck);
    if (have_dense_dtype) cast_to_dtype(desc, dense_dtype);  // as offload() reads them
    if (opt.quantize == Quantization::Lossless)  // from the weights' own values (cast as they will be)
      measure_lossless(desc, ck, have_dense_dtype ? dense_dtype : std::string());
    // A tied lm_head is not in the checkpoint: the model's config.json beside
    // it says whether offload() will stream one from the token table.
    const std::string config = config_json_beside(checkpoint);
    if (!config.empty()) {
      std::ifstream f(config, std::ios::binary);
      std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
      if (!f || f.bad()) LS_FAIL("cannot read ", config);
      tied_table = add_tied_head(desc, text, config);
      experts_active = set_expert_activity(desc, text, config);
    }
  }
  in.layers = layer_specs(desc, opt);
  in.fixed_resident_bytes = desc.small_bytes;
  in.fixed_train_bytes = small_train_bytes(desc, opt);
  in.link_bytes_per_s = link_gbps * 1e9;
  in.device_flops_per_s = tflops * 1e12;
  // The planner models at least one layer in flight (2 slots); prefetch 0
  // plans those 2 slots as offload(prefetch=0) does (plan_slots_first), and
  // the text says the prediction assumes the overlap prefetch 0 gives up.
  in.max_prefetch = std::max(1, max_prefetch);
  in.training = opt.training;
  in.cli = true;
  Plan plan = plan_placement(in);
  std::string host_text, host_json = "null";
  if (!host_budget_s.empty()) {
    int64_t host_budget = 0;
    try {
      const uint64_t b = parse_bytes(host_budget_s);
      // 2^63 and more read as a negative budget in the JSON.
      if (b > static_cast<uint64_t>(INT64_MAX)) return usage_error("--host-budget " + host_budget_s + " is too large");
      host_budget = static_cast<int64_t>(b);
    } catch (const Error& e) {
      return usage_error("--host-budget: " + e.message());
    }
    // What offload() may leave in the file (the rule: core/host_tier.h), a
    // Linear taken as a 2-D weight outside a group; quantized ones are planned
    // packed in offload(cache_dir=)'s cache file.
    std::vector<bool> disk_ok;
    for (const auto& l : desc.layers)
      disk_ok.push_back(have_checkpoint && !gguf &&
                        host_tier::may_stay_in_file(!l.group && l.weight_shape.size() == 2, !opt.training,
                                                    !l.cast, to_string(opt.quantize), true));
    host_disk_section(plan, in.layers, disk_ok, host_budget, disk_gbps, &host_text, &host_json);
  }

  // Pinned host memory cannot be swapped out: a plan that needs more than this
  // machine has available will not run here (core/host_memory.h).
  const HostMemory host = host_memory();
  if (host_budget_s.empty() && host.available_bytes > 0 && plan.host_pinned_bytes > host.available_bytes)
    std::fprintf(stderr,
                 "layerstream plan: warning: this plan needs %s of pinned host RAM, more than this machine "
                 "has available (%s of %s): offload() would fail here; run it on a machine with more RAM, "
                 "quantize (--quantize nf4), or raise the budget\n",
                 format_bytes(plan.host_pinned_bytes).c_str(), format_bytes(host.available_bytes).c_str(),
                 format_bytes(host.total_bytes).c_str());
  if (as_json) {
    std::string o = "{\"source\": {\"kind\": ";
    o += gguf ? "\"gguf\"" : have_checkpoint ? "\"checkpoint\"" : "\"model\"";
    o += ", \"name\": " + json::quote(have_checkpoint ? checkpoint : model) + ", \"files\": [";
    for (size_t i = 0; i < desc.files.size(); ++i) o += (i ? ", " : "") + json::quote(desc.files[i]);
    std::string tied_to;  // from config.json, or a built-in model's own tie
    for (const auto& l : desc.layers)
      if (!l.tied_to.empty()) tied_to = l.tied_to;
    o += "], \"tied_lm_head\": " + (tied_to.empty() ? std::string("null") : json::quote(tied_to));
    size_t cast = 0;  // layers with a tensor cast to --dense-dtype (cast_to_dtype)
    for (const auto& l : desc.layers) cast += l.cast ? 1 : 0;
    o += ", \"layers\": " + std::to_string(desc.layers.size()) +
         ", \"small_tensors\": " + std::to_string(desc.small_tensors) +
         ", \"cast_layers\": " + std::to_string(cast) + "}, ";
    o += "\"options\": {\"tokens\": " + std::to_string(opt.tokens) + ", \"quantize\": \"" +
         to_string(opt.quantize) + "\", \"training\": " + (opt.training ? "true" : "false") +
         ", \"train\": " + (opt.training ? json::quote(opt.train) : std::string("null")) +
         ", \"resident_dequantized\": " + (opt.resident_dequantized ? "true" : "false") +
         ", \"compute_dtype\": " + (opt.compute_dtype.empty() ? std::string("null") : json::quote(opt.compute_dtype)) +
         ", \"experts\": " + (opt.routed_experts ? "\"routed\"" : "\"all\"") +
         ", \"activations\": " + (opt.activations ? "\"host\"" : "null") +
         ", \"max_prefetch\": " + std::to_string(max_prefetch) + "}, ";
    o += "\"plan\": " + plan.to_json() + ", \"host\": " + host_json + "}";
    std::printf("%s\n", o.c_str());
  } else {
    if (gguf) {
      size_t packed = 0;
      for (const auto& l : desc.layers) packed += l.dense_dtype.empty() ? 0 : 1;
      std::printf("source: GGUF file %s: %zu weight(s) cross as the file's blocks, dequantized in the slot "
                  "to %s\n", checkpoint.c_str(), packed,
                  (opt.compute_dtype.empty() ? dense_dtype : opt.compute_dtype).c_str());
    } else if (have_checkpoint) {
      size_t cast = 0;
      for (const auto& l : desc.layers) cast += l.cast ? 1 : 0;
      std::printf("source: checkpoint %s (%zu file%s)", checkpoint.c_str(), desc.files.size(),
                  desc.files.size() == 1 ? "" : "s");
      if (have_dense_dtype) std::printf("; %zu layer(s) cast to %s as offload() reads them", cast, dense_dtype.c_str());
      std::printf("\n");
    }
    else
      std::printf("source: built-in model %s\n", model.c_str());
    std::printf("model:  %zu layers + %zu small tensors (%s, always resident)\n", desc.layers.size(),
                desc.small_tensors, format_bytes(desc.small_bytes).c_str());
    size_t groups = 0;
    for (const auto& l : desc.layers) {
      groups += l.group ? 1 : 0;
      if (l.group && l.active < 1.0 && experts_active <= 0) experts_active = l.active;  // a built-in's own
    }
    const char* active_from = gguf ? "the file's metadata" : have_checkpoint ? "config.json" : "built-in";
    if (groups && experts_active > 0) {
      const double reach = experts_reached(experts_active, opt.tokens);
      std::printf("        %zu mixture-of-experts group(s), one slot each; a token runs %.3g%% of the experts "
                  "(%s), %llu tokens reach ~%.3g%%%s\n", groups, experts_active * 100.0, active_from,
                  static_cast<unsigned long long>(opt.tokens), reach * 100.0,
                  !opt.routed_experts ? ": every expert crosses the bus (--experts all)"
                  : reach <= 0.5     ? ": only those cross the bus (routed), on demand"
                                     : ": more than half, so each group crosses whole");
    }
    else if (groups)
      std::printf("        %zu mixture-of-experts group(s), each streamed whole (one slot); FLOPs count "
                  "every expert (no config.json with num_experts_per_tok)\n", groups);
    if (!tied_table.empty())
      std::printf("        lm_head: not in the checkpoint, tied to %s (per %s); planned as offload() runs it\n",
                  tied_table.c_str(), config_json_beside(checkpoint).c_str());
    std::string quantize = to_string(opt.quantize);
    if (gguf && opt.quantize != Quantization::None) {  // the file's blocks cross as they are
      size_t dense = 0;
      for (const auto& l : desc.layers) dense += l.dense_dtype.empty() ? 1 : 0;
      quantize += dense ? " (the " + std::to_string(dense) + " dense weight(s) only; the file's blocks cross as they are)"
                        : std::string(" (none applies: every weight crosses as the file's blocks)");
    }
    std::printf("inputs: %llu tokens/step%s, quantize %s%s%s, link %g GB/s, device %g TFLOP/s\n\n",
                static_cast<unsigned long long>(opt.tokens), opt.training ? " (training)" : "",
                quantize.c_str(), opt.compute_dtype.empty() ? "" : ", compute dtype ",
                opt.compute_dtype.c_str(), link_gbps, tflops);
    std::fputs(plan.explain(!host_budget_s.empty()).c_str(), stdout);
    if (max_prefetch == 0)
      std::printf("note:   --max-prefetch 0: as offload(prefetch=0), no layer is copied ahead of its use (2 slots); "
                  "the predicted step above assumes one is, so the real step is slower by up to the copy time\n");
    std::fputs(host_text.c_str(), stdout);
  }
  return 0;
}

}  // namespace

LS_REGISTER_COMMAND("plan", cmd_plan, "placement plan: which layers stay resident, which stream");
