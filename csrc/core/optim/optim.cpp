// Host optimizers: names, argument rules, the kernel dispatch, AdamW and the
// gradient norm (Adafactor is in adafactor.cpp). docs/design/optim.md.
#include "core/optim/optim.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>

#include "core/error.h"
#include "core/optim/internal.h"
#include "core/optim/kernels.h"

namespace layerstream {
namespace optim {

const char* dtype_name(Dtype d) { return d == Dtype::BF16 ? "bfloat16" : "float32"; }

StateFormat parse_state_format(const std::string& name) {
  if (name == "fp32" || name == "float32") return StateFormat::F32;
  if (name == "bf16" || name == "bfloat16") return StateFormat::BF16;
  if (name == "8bit" || name == "int8" || name == "q8") return StateFormat::Q8;
  LS_FAIL("unknown optimizer state precision '", name, "': use 'fp32', 'bf16' or '8bit'");
}

const char* state_format_name(StateFormat f) {
  switch (f) {
    case StateFormat::F32: return "fp32";
    case StateFormat::BF16: return "bf16";
    case StateFormat::Q8: return "8bit";
  }
  return "?";
}

int64_t state_bytes(StateFormat f, int64_t numel) {
  switch (f) {
    case StateFormat::F32: return 4 * numel;
    case StateFormat::BF16: return 2 * numel;
    case StateFormat::Q8: return numel;
  }
  return 0;
}

int64_t state_absmax_count(StateFormat f, int64_t numel) { return f == StateFormat::Q8 ? q8_blocks(numel) : 0; }

void q8_decode(const uint8_t* codes, const float* absmax, int64_t n, bool first_moment, float* out) {
  for (int64_t i = 0; i < n; ++i)
    out[i] = (first_moment ? q8_value_e4m3(codes[i]) : q8_value_e5m3(codes[i])) * absmax[i / kQ8Block];
}

bool q8_encode(const float* x, int64_t n, bool first_moment, uint8_t* codes, float* absmax) {
  constexpr uint32_t kNearest = 0x80000u;  // half the 20 dropped bits: round to nearest
  for (int64_t b0 = 0; b0 < n; b0 += kQ8Block) {
    const int64_t e = std::min(n, b0 + kQ8Block);
    uint32_t top = 0;  // |x| as bits (as the step: NaN and Inf show as >= 0x7F800000)
    for (int64_t i = b0; i < e; ++i) {
      if (!first_moment && x[i] < 0.0f) return false;
      top = std::max(top, bits_from_f32(x[i]) & 0x7FFFFFFFu);
    }
    const float am = top >= 0x7F800000u ? std::numeric_limits<float>::quiet_NaN() : f32_from_bits(top);
    const float scale = am > 0.0f ? kQ8Top / am : 0.0f;
    for (int64_t i = b0; i < e; ++i) {
      const float y = f32_from_bits(bits_from_f32(x[i]) & 0x7FFFFFFFu) * scale;
      codes[i] = static_cast<uint8_t>(first_moment ? q8_code_e4m3(y, kNearest) | ((bits_from_f32(x[i]) >> 31) << 7)
                                                   : q8_code_e5m3(y, kNearest));
    }
    absmax[b0 / kQ8Block] = am;
  }
  return true;
}

double adamw_bytes_per_element(Dtype param, Dtype grad, StateFormat states) {
  const double p = param == Dtype::BF16 ? 2 : 4, g = grad == Dtype::BF16 ? 2 : 4;
  double s = 0;
  switch (states) {
    case StateFormat::F32: s = 4; break;
    case StateFormat::BF16: s = 2; break;
    case StateFormat::Q8: s = 1 + 4.0 / static_cast<double>(kQ8Block); break;
  }
  return 2 * p + g + 2 * 2 * s;
}

TrainSpec parse_train_spec(const std::string& s) {
  TrainSpec t;
  if (s.empty() || s == "none") return t;
  t.enabled = true;
  if (s == "grads") return t;
  if (s == "adamw" || s == "adamw-fp32" || s == "adamw-bf16" || s == "adamw-8bit") {
    t.states = TrainSpec::States::AdamW;
    t.adamw = s == "adamw" ? StateFormat::F32 : parse_state_format(s.substr(6));
    return t;
  }
  if (s == "adafactor" || s == "adafactor-beta1") {
    t.states = TrainSpec::States::Adafactor;
    t.adafactor_beta1 = s == "adafactor-beta1";
    return t;
  }
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  LS_CHECK(end && *end == '\0' && end != s.c_str() && v >= 0 && v <= 1e6,
           "train='", s, "' is not a training footprint: use 'grads' (gradients only), 'adamw', "
           "'adamw-bf16', 'adamw-8bit', 'adafactor', 'adafactor-beta1' (layerstream.optim's states), or the optimizer's state bytes "
           "per parameter as a number (e.g. 8 for torch.optim.AdamW on float32 weights, 4 on bfloat16)");
  t.states = TrainSpec::States::PerParam;
  t.bytes_per_param = v;
  return t;
}

uint64_t train_bytes(const TrainSpec& spec, const std::vector<int64_t>& shape, uint64_t elem_bytes) {
  if (!spec.enabled) return 0;
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  const auto n = static_cast<uint64_t>(numel);
  uint64_t states = 0;
  switch (spec.states) {
    case TrainSpec::States::None: break;
    case TrainSpec::States::AdamW:
      states = 2 * static_cast<uint64_t>(state_bytes(spec.adamw, numel) + 4 * state_absmax_count(spec.adamw, numel));
      break;
    case TrainSpec::States::Adafactor:  // factored second moment (rows + columns) for 2-D and up, fp32
      if (shape.size() >= 2) {
        uint64_t lead = 1;  // the dimensions before the last two
        for (size_t i = 0; i + 2 < shape.size(); ++i) lead *= static_cast<uint64_t>(shape[i]);
        const auto r = static_cast<uint64_t>(shape[shape.size() - 2]), c = static_cast<uint64_t>(shape.back());
        states = 4 * (lead * r + lead * c);  // exp_avg_sq_row [..., r], exp_avg_sq_col [..., c]
      } else {
        states = 4 * n;
      }
      if (spec.adafactor_beta1) states += 4 * n;  // exp_avg
      break;
    case TrainSpec::States::PerParam:
      states = static_cast<uint64_t>(std::ceil(spec.bytes_per_param * static_cast<double>(n)));
      break;
  }
  return n * elem_bytes + states;
}

namespace {
bool is_nan(double x) { return x != x; }
}  // namespace

void check_adamw(const AdamWConfig& c) {
  LS_CHECK(!is_nan(c.lr) && c.lr >= 0.0, "Invalid learning rate: ", c.lr, " (AdamW needs lr >= 0)");
  LS_CHECK(!is_nan(c.eps) && c.eps >= 0.0, "Invalid epsilon value: ", c.eps, " (AdamW needs eps >= 0)");
  LS_CHECK(!is_nan(c.beta1) && c.beta1 >= 0.0 && c.beta1 < 1.0, "Invalid beta parameter at index 0: ", c.beta1,
           " (betas must be in [0, 1))");
  LS_CHECK(!is_nan(c.beta2) && c.beta2 >= 0.0 && c.beta2 < 1.0, "Invalid beta parameter at index 1: ", c.beta2,
           " (betas must be in [0, 1))");
  LS_CHECK(!is_nan(c.weight_decay) && c.weight_decay >= 0.0, "Invalid weight_decay value: ", c.weight_decay,
           " (AdamW needs weight_decay >= 0)");
}

void check_group_devices(const std::vector<std::string>& devices, int group) {
  std::vector<std::string> others;
  for (const std::string& d : devices)
    if (d != "cpu" && std::find(others.begin(), others.end(), d) == others.end()) others.push_back(d);
  if (others.size() <= 1) return;
  std::sort(others.begin(), others.end());
  std::string list;
  for (const std::string& d : others) list += (list.empty() ? "" : ", ") + d;
  LS_FAIL("layerstream.optim: the parameters of param group ", group, " are on several devices besides the host (",
          list, "); one group's parameters must be on the host and one device at most: put the others in a "
          "param group of their own");
}

namespace detail {

bool avx512_usable() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#else
  return false;
#endif
}

const Kernels& kernels() {
  static const Kernels* k = [] {
    const char* force = std::getenv("LS_OPTIM_ISA");
    // Another spelling was ignored (AVX-512 kernels ran where a benchmark meant AVX2's).
    LS_CHECK(!force || !*force || std::string(force) == "generic" || std::string(force) == "avx2",
             "LS_OPTIM_ISA=", force, " is not one of generic, avx2 (unset: the widest the CPU runs)");
    if (force && std::string(force) == "generic") return &generic::kKernels;
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (avx512_usable() && !(force && std::string(force) == "avx2")) return &avx512::kKernels;
    if (__builtin_cpu_supports("avx2")) return &avx2::kKernels;
#endif
    return &generic::kKernels;
  }();
  return *k;
}

uint32_t derive_key(uint64_t seed, uint64_t tensor_key, int64_t step, uint32_t purpose, int64_t begin) {
  uint64_t x = mix64(seed);
  x = mix64(x ^ tensor_key);
  x = mix64(x ^ static_cast<uint64_t>(step));
  x = mix64(x ^ (static_cast<uint64_t>(purpose) << 56));
  x = mix64(x ^ static_cast<uint64_t>(begin));
  return static_cast<uint32_t>(x ^ (x >> 32));
}

Keys chunk_keys(uint64_t seed, uint64_t tensor_key, int64_t step, int64_t begin) {
  Keys k;
  k.param = derive_key(seed, tensor_key, step, 1, begin);
  k.q8 = derive_key(seed, tensor_key, step, 2, begin);
  return k;
}

void run_tasks(ThreadPool* pool, int64_t n, const std::function<void(int64_t)>& fn) {
  (pool ? *pool : ThreadPool::shared()).run(n, fn);
}

}  // namespace detail

const char* kernel_isa() { return detail::kernels().isa; }

namespace {

// A task of the kernels: elements [begin, end) of tensor (or span) `tensor`.
struct ChunkTask {
  size_t tensor;
  int64_t begin, end;
};
// Tensor i's elements in tasks of kChunk (fixed: results do not depend on threads).
void add_chunks(std::vector<ChunkTask>& tasks, size_t i, int64_t numel) {
  for (int64_t b = 0; b < numel; b += detail::kChunk) tasks.push_back({i, b, std::min<int64_t>(numel, b + detail::kChunk)});
}

void check_tensor(const AdamWTensor& t, StateFormat f, size_t index) {
  LS_CHECK(t.numel >= 0, "AdamW tensor ", index, ": negative element count");
  if (t.numel == 0) return;
  LS_CHECK(t.param && t.grad && t.exp_avg && t.exp_avg_sq, "AdamW tensor ", index,
           ": parameter, gradient and both states must be given");
  LS_CHECK(f != StateFormat::Q8 || (t.exp_avg_absmax && t.exp_avg_sq_absmax), "AdamW tensor ", index,
           ": 8-bit states need their absmax arrays");
  LS_CHECK(t.step >= 1, "AdamW tensor ", index, ": step must be >= 1 (the step being taken), got ", t.step);
}

detail::AdamWScalars adamw_scalars(const AdamWConfig& c, int64_t step, float grad_scale) {
  detail::AdamWScalars s;
  s.grad_scale = grad_scale;
  // As torch/optim/adam.py computes them (Python floats, i.e. double), then
  // rounded to fp32 where the tensor op takes them.
  const double t = static_cast<double>(step);
  const double bc1 = 1.0 - std::pow(c.beta1, t);
  const double bc2 = 1.0 - std::pow(c.beta2, t);
  const double step_size = c.lr / bc1;
  const double bc2_sqrt = std::pow(bc2, 0.5);
  s.decay = c.weight_decay != 0.0 ? static_cast<float>(1.0 - c.lr * c.weight_decay) : 1.0f;
  s.w1 = static_cast<float>(1.0 - c.beta1);
  s.one_minus_w1 = 1.0f - s.w1;
  s.small_w1 = std::fabs(s.w1) < 0.5f;
  s.beta2 = static_cast<float>(c.beta2);
  s.omb2 = static_cast<float>(1.0 - c.beta2);
  s.bc2_sqrt = static_cast<float>(bc2_sqrt);
  s.eps = static_cast<float>(c.eps);
  s.neg_step = static_cast<float>(-step_size);
  s.neg_step_bc2 = static_cast<float>(-step_size * bc2_sqrt);
  s.eps_bc2 = static_cast<float>(c.eps * bc2_sqrt);
  return s;
}

}  // namespace

void adamw_step(const AdamWConfig& config, StateFormat states, const std::vector<AdamWTensor>& tensors,
                float grad_scale, uint64_t seed, ThreadPool* pool) {
  check_adamw(config);
  std::vector<ChunkTask> tasks;
  std::vector<detail::AdamWScalars> scalars(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const AdamWTensor& t = tensors[i];
    check_tensor(t, states, i);
    if (t.numel == 0) continue;
    scalars[i] = adamw_scalars(config, t.step, grad_scale);
    add_chunks(tasks, i, t.numel);
  }
  const detail::Kernels& k = detail::kernels();
  detail::run_tasks(pool, static_cast<int64_t>(tasks.size()), [&](int64_t n) {
    const ChunkTask& task = tasks[static_cast<size_t>(n)];
    const AdamWTensor& t = tensors[task.tensor];
    k.adamw(t, nullptr, states, scalars[task.tensor], detail::chunk_keys(seed, t.key, t.step, task.begin),
            task.begin, task.end);
  });
}

namespace {
int64_t dtype_size(Dtype d) { return d == Dtype::BF16 ? 2 : 4; }

// Copies elements [b, e) of `src` to `dst` (`size` bytes each); nothing when dst is null.
void copy_range(void* dst, const void* src, int64_t size, int64_t b, int64_t e) {
  if (dst && e > b)
    std::memcpy(static_cast<char*>(dst) + b * size, static_cast<const char*>(src) + b * size,
                static_cast<size_t>((e - b) * size));
}
}  // namespace

std::vector<double> adamw_fused(const AdamWConfig& config, StateFormat states, const std::vector<AdamWTensor>& tensors,
                                const std::vector<AdamWFused>& sources, FusedWork work, float grad_scale, uint64_t seed,
                                ThreadPool* pool) {
  check_adamw(config);
  LS_CHECK(sources.size() == tensors.size(), "adamw_fused: one gradient source per tensor");
  std::vector<ChunkTask> tasks;
  std::vector<detail::AdamWScalars> scalars(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const AdamWTensor& t = tensors[i];
    const AdamWFused& src = sources[i];
    if (t.numel == 0) continue;
    LS_CHECK(src.landed, "AdamW tensor ", i, ": a fused pass needs the landed gradient");
    if (work.update) {
      AdamWTensor checked = t;
      checked.grad = src.landed;
      check_tensor(checked, states, i);
      scalars[i] = adamw_scalars(config, t.step, grad_scale);
    }
    add_chunks(tasks, i, t.numel);
  }
  std::vector<double> part(tasks.size(), 0.0);
  const detail::Kernels& k = detail::kernels();
  detail::run_tasks(pool, static_cast<int64_t>(tasks.size()), [&](int64_t n) {
    const ChunkTask& task = tasks[static_cast<size_t>(n)];
    const AdamWTensor& t = tensors[task.tensor];
    const AdamWFused& src = sources[task.tensor];
    const int64_t b = task.begin, e = task.end, gs = dtype_size(t.grad_dtype);
    // 1. The gradient of this chunk: landed, or prior + landed.
    const char* g = static_cast<const char*>(src.landed) + b * gs;
    if (src.prior) {
      // The chunk's sum when it is not kept: a per-thread scratch that stays in cache.
      thread_local std::vector<float> scratch;
      if (!src.out) scratch.resize(static_cast<size_t>(detail::kChunk));
      char* dst = src.out ? static_cast<char*>(src.out) + b * gs : reinterpret_cast<char*>(scratch.data());
      k.grad_add(dst, static_cast<const char*>(src.prior) + b * gs, g, t.grad_dtype, e - b);
      g = dst;
    } else if (src.out) {
      copy_range(src.out, src.landed, gs, b, e);
    }
    // 2. Its sum of squares (sum_of_squares()'s chunks: the same partial sums).
    if (work.sum_squares) part[static_cast<size_t>(n)] = k.sumsq(Span{g, t.grad_dtype, e - b}, 0, e - b);
    if (!work.update) return;
    // 3. The copy a speculative step keeps, then 4. the update.
    copy_range(src.copy_param, t.param, dtype_size(t.param_dtype), b, e);
    const int64_t ss = state_bytes(states, 1);
    copy_range(src.copy_exp_avg, t.exp_avg, ss, b, e);
    copy_range(src.copy_exp_avg_sq, t.exp_avg_sq, ss, b, e);
    if (states == StateFormat::Q8) {
      const int64_t b0 = b / kQ8Block, b1 = q8_blocks(e);
      copy_range(src.copy_exp_avg_absmax, t.exp_avg_absmax, sizeof(float), b0, b1);
      copy_range(src.copy_exp_avg_sq_absmax, t.exp_avg_sq_absmax, sizeof(float), b0, b1);
    }
    k.adamw(t, g, states, scalars[task.tensor], detail::chunk_keys(seed, t.key, t.step, b), b, e);
  });
  std::vector<double> sums(tensors.size(), 0.0);
  for (size_t n = 0; n < tasks.size(); ++n) sums[tasks[n].tensor] += part[n];
  return sums;
}

double sum_of_squares(const std::vector<Span>& spans, ThreadPool* pool) {
  std::vector<ChunkTask> tasks;
  for (size_t i = 0; i < spans.size(); ++i) {
    LS_CHECK(spans[i].numel >= 0 && (spans[i].numel == 0 || spans[i].data), "sum_of_squares: span ", i,
             " has no data");
    add_chunks(tasks, i, spans[i].numel);
  }
  std::vector<double> part(tasks.size(), 0.0);
  const detail::Kernels& k = detail::kernels();
  detail::run_tasks(pool, static_cast<int64_t>(tasks.size()), [&](int64_t n) {
    const ChunkTask& t = tasks[static_cast<size_t>(n)];
    part[static_cast<size_t>(n)] = k.sumsq(spans[t.tensor], t.begin, t.end);
  });
  double total = 0;
  for (double p : part) total += p;
  return total;
}

float clip_coefficient(double total_norm, double max_norm) {
  // torch.nn.utils.clip_grad_norm_: clip_coef = max_norm / (total_norm + 1e-6)
  // on an fp32 tensor, where `float / tensor` is tensor.reciprocal() * float;
  // then clamp(max=1.0), which keeps NaN.
  const float total = static_cast<float>(total_norm);
  const float denom = total + 1e-6f;
  const float coef = (1.0f / denom) * static_cast<float>(max_norm);
  return coef > 1.0f ? 1.0f : coef;
}

}  // namespace optim
}  // namespace layerstream
