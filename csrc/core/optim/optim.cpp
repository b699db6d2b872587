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

namespace detail {

const Kernels& kernels() {
  static const Kernels* k = [] {
    const char* force = std::getenv("LS_OPTIM_ISA");
    if (force && std::string(force) == "generic") return &generic::kKernels;
#if defined(__x86_64__)
    __builtin_cpu_init();
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
  k.m = derive_key(seed, tensor_key, step, 2, begin);
  k.v = derive_key(seed, tensor_key, step, 3, begin);
  return k;
}

void run_tasks(ThreadPool* pool, int64_t n, const std::function<void(int64_t)>& fn) {
  (pool ? *pool : ThreadPool::shared()).run(n, fn);
}

}  // namespace detail

const Q8Tables& q8_tables() {
  static const Q8Tables t = [] {
    Q8Tables q{};
    for (int c = 0; c < 256; ++c) {
      // signed e4m3 (bias 15): s eeee mmm
      const int e4 = (c >> 3) & 15, m4 = c & 7;
      const double mag4 = e4 == 0 ? (m4 / 8.0) * std::ldexp(1.0, -14) : (1.0 + m4 / 8.0) * std::ldexp(1.0, e4 - 15);
      const double v4 = mag4 / static_cast<double>(kQ8Top);
      q.signed_e4m3[c] = static_cast<float>((c & 128) ? -v4 : v4);
      // unsigned e5m3 (bias 31): eeeee mmm
      const int e5 = c >> 3, m5 = c & 7;
      const double mag5 = e5 == 0 ? (m5 / 8.0) * std::ldexp(1.0, -30) : (1.0 + m5 / 8.0) * std::ldexp(1.0, e5 - 31);
      q.unsigned_e5m3[c] = static_cast<float>(mag5 / static_cast<double>(kQ8Top));
    }
    return q;
  }();
  return t;
}

const char* kernel_isa() { return detail::kernels().isa; }

namespace {

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
  struct Task {
    size_t tensor;
    int64_t begin, end;
  };
  std::vector<Task> tasks;
  std::vector<detail::AdamWScalars> scalars(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const AdamWTensor& t = tensors[i];
    check_tensor(t, states, i);
    if (t.numel == 0) continue;
    scalars[i] = adamw_scalars(config, t.step, grad_scale);
    for (int64_t b = 0; b < t.numel; b += detail::kChunk)
      tasks.push_back({i, b, std::min<int64_t>(t.numel, b + detail::kChunk)});
  }
  const detail::Kernels& k = detail::kernels();
  detail::run_tasks(pool, static_cast<int64_t>(tasks.size()), [&](int64_t n) {
    const Task& task = tasks[static_cast<size_t>(n)];
    const AdamWTensor& t = tensors[task.tensor];
    k.adamw(t, states, scalars[task.tensor], detail::chunk_keys(seed, t.key, t.step, task.begin), task.begin,
            task.end);
  });
}

double sum_of_squares(const std::vector<Span>& spans, ThreadPool* pool) {
  struct Task {
    size_t span;
    int64_t begin, end;
  };
  std::vector<Task> tasks;
  for (size_t i = 0; i < spans.size(); ++i) {
    LS_CHECK(spans[i].numel >= 0 && (spans[i].numel == 0 || spans[i].data), "sum_of_squares: span ", i,
             " has no data");
    for (int64_t b = 0; b < spans[i].numel; b += detail::kChunk)
      tasks.push_back({i, b, std::min<int64_t>(spans[i].numel, b + detail::kChunk)});
  }
  std::vector<double> part(tasks.size(), 0.0);
  const detail::Kernels& k = detail::kernels();
  detail::run_tasks(pool, static_cast<int64_t>(tasks.size()), [&](int64_t n) {
    const Task& t = tasks[static_cast<size_t>(n)];
    part[static_cast<size_t>(n)] = k.sumsq(spans[t.span], t.begin, t.end);
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
