// Host optimizers over torch tensors: states, checks, the AdamW / Adafactor
// steps, the norm, the C++ AdamW (host_optim.h; the overlapped steps are in
// host_overlap.cpp). docs/design/optim.md.
#include "layerstream/host_optim.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>
#include <mutex>
#include <set>
#include <sstream>
#include <unordered_map>

#include "core/error.h"
#include "core/log.h"
#include "dtype_name.h"
#include "host_optim_internal.h"

namespace layerstream {
namespace optim {

namespace {

std::string device_str(const torch::Device& d) { return d.str(); }

// The kernels walk memory order: a parameter, its gradient and its states
// must be dense and share one layout.
void check_dense(const torch::Tensor& t, const std::string& what) {
  LS_CHECK(t.is_non_overlapping_and_dense(), "layerstream.optim: ", what,
           " is not a dense tensor (a view with gaps or overlaps); optimizers step dense parameters only");
}

bool same_layout(const torch::Tensor& a, const torch::Tensor& b) {
  return a.sizes() == b.sizes() && (a.numel() <= 1 || a.strides() == b.strides());
}

torch::ScalarType state_dtype(StateFormat f) {
  switch (f) {
    case StateFormat::F32: return torch::kFloat;
    case StateFormat::BF16: return torch::kBFloat16;
    case StateFormat::Q8: return torch::kByte;
  }
  return torch::kFloat;
}

Span span_of(const torch::Tensor& t) {
  return Span{t.data_ptr(), core_dtype(t, "gradient"), t.numel()};
}

}  // namespace

torch::Tensor in_layout_of(const torch::Tensor& g, const torch::Tensor& like) {
  if (same_layout(g, like)) return g;
  torch::Tensor out = torch::empty_like(like, g.options());
  out.copy_(g);
  return out;
}

void bump_versions(const std::vector<torch::Tensor>& params) {
  for (const torch::Tensor& p : params)
    if (p.device().is_cpu() && !p.is_inference()) torch::autograd::impl::bump_version(p);
}

AdamWTensor host_tensor(const torch::Tensor& p, const AdamWStates& s, StateFormat format, size_t i, int64_t step,
                        uint64_t key) {
  check_dense(p, "a parameter");
  LS_CHECK(same_layout(s.exp_avg, p) && same_layout(s.exp_avg_sq, p) && s.exp_avg.device().is_cpu() &&
               s.exp_avg_sq.device().is_cpu() && s.exp_avg.scalar_type() == state_dtype(format) &&
               s.exp_avg_sq.scalar_type() == state_dtype(format),
           "layerstream.optim: the states of parameter ", i, " do not match it (layout, device or dtype for "
           "state_precision='", state_format_name(format), "')");
  AdamWTensor t;
  t.param = p.data_ptr();
  t.param_dtype = core_dtype(p, "a parameter");
  t.exp_avg = s.exp_avg.data_ptr();
  t.exp_avg_sq = s.exp_avg_sq.data_ptr();
  if (format == StateFormat::Q8) {
    const int64_t blocks = state_absmax_count(format, p.numel());
    LS_CHECK(s.exp_avg_absmax.defined() && s.exp_avg_absmax.numel() == blocks &&
                 s.exp_avg_absmax.scalar_type() == torch::kFloat && s.exp_avg_absmax.is_contiguous() &&
                 s.exp_avg_sq_absmax.defined() && s.exp_avg_sq_absmax.numel() == blocks &&
                 s.exp_avg_sq_absmax.scalar_type() == torch::kFloat && s.exp_avg_sq_absmax.is_contiguous(),
             "layerstream.optim: the 8-bit states of parameter ", i, " lack their absmax values");
    t.exp_avg_absmax = s.exp_avg_absmax.data_ptr<float>();
    t.exp_avg_sq_absmax = s.exp_avg_sq_absmax.data_ptr<float>();
  }
  t.numel = p.numel();
  t.step = step;
  t.key = key;
  return t;
}

Dtype core_dtype(const torch::Tensor& t, const std::string& what) {
  if (t.scalar_type() == torch::kFloat) return Dtype::F32;
  if (t.scalar_type() == torch::kBFloat16) return Dtype::BF16;
  LS_FAIL("layerstream.optim: ", what, " has dtype ", layerstream::dtype_name(t.scalar_type()),
          "; the host optimizers step float32 and bfloat16 parameters (cast the model, e.g. model.float() or "
          "model.bfloat16(), or step those parameters with a torch optimizer of their own)");
}

void check_param_dtypes(const std::vector<torch::Tensor>& params, int group) {
  for (size_t i = 0; i < params.size(); ++i) {
    const torch::Tensor& p = params[i];
    if (!p.requires_grad()) continue;
    std::ostringstream what;
    what << "parameter " << i << " of param group " << group << " (shape " << p.sizes() << ")";
    core_dtype(p, what.str());
  }
}

AdamWStates adamw_init_states(const torch::Tensor& param, StateFormat format) {
  check_dense(param, "a parameter");
  AdamWStates s;
  const auto opts = param.options().dtype(state_dtype(format)).requires_grad(false);
  s.exp_avg = torch::zeros_like(param, opts, torch::MemoryFormat::Preserve);
  s.exp_avg_sq = torch::zeros_like(param, opts, torch::MemoryFormat::Preserve);
  if (format == StateFormat::Q8) {
    const int64_t blocks = state_absmax_count(format, param.numel());
    s.exp_avg_absmax = torch::zeros({blocks}, param.options().dtype(torch::kFloat).requires_grad(false));
    s.exp_avg_sq_absmax = torch::zeros({blocks}, param.options().dtype(torch::kFloat).requires_grad(false));
  }
  return s;
}

namespace {
// Whether a and b (same sizes) lay their elements out in the same order in
// memory: dense, with equal strides in every dimension of more than one element.
bool same_memory_order(const torch::Tensor& a, const torch::Tensor& b) {
  if (!a.is_non_overlapping_and_dense() || !b.is_non_overlapping_and_dense()) return false;
  for (int64_t d = 0; d < a.dim(); ++d)
    if (a.size(d) > 1 && a.stride(d) != b.stride(d)) return false;
  return true;
}

// The float values of 8-bit states `codes` (decoded in their own memory order, with
// their blocks' `absmax`), in the codes' layout, on the host.
torch::Tensor q8_decoded(const torch::Tensor& codes, const torch::Tensor& absmax, bool first_moment,
                         const std::string& what) {
  LS_CHECK(codes.is_non_overlapping_and_dense(), "layerstream.optim: the loaded 8-bit state ", what,
           " is not dense in memory (strides ", codes.strides(), "): its codes have no block order to decode in");
  const torch::Tensor c = codes.cpu();
  const torch::Tensor a = absmax.cpu().contiguous();
  torch::Tensor out = torch::empty_like(c, c.options().dtype(torch::kFloat), torch::MemoryFormat::Preserve);
  optim::q8_decode(c.data_ptr<uint8_t>(), a.data_ptr<float>(), c.numel(), first_moment, out.data_ptr<float>());
  return out;
}
}  // namespace

AdamWStates adamw_adopt_states(const torch::Tensor& param, StateFormat format, AdamWStates loaded,
                               const std::string& name) {
  torch::NoGradGuard ng;
  AdamWStates out;
  const int64_t blocks = optim::q8_blocks(param.numel());
  // One moment (exp_avg: first_moment) into `format`, in param's layout; `absmax_out`
  // receives its absmax values when `format` is 8-bit.
  auto adopt = [&](const torch::Tensor& t, const torch::Tensor& absmax, const char* key, bool first_moment,
                   torch::Tensor* absmax_out) {
    LS_CHECK(t.defined(), "layerstream.optim: the loaded state of ", name, " has no '", key, "'");
    LS_CHECK(t.sizes() == param.sizes(), "layerstream.optim: the loaded state '", key, "' of ", name, " has shape ",
             t.sizes(), ", the parameter ", param.sizes());
    const bool codes = t.scalar_type() == torch::kByte;
    LS_CHECK(codes || t.is_floating_point(), "layerstream.optim: the loaded state '", key, "' of ", name, " is ",
             layerstream::dtype_name(t.scalar_type()), "; AdamW states are floating-point moments or 8-bit codes "
             "(uint8, with their absmax values)");
    const std::string absmax_key = std::string(key) + "_absmax";
    LS_CHECK(!codes || (absmax.defined() && absmax.numel() == blocks && absmax.scalar_type() == torch::kFloat),
             "layerstream.optim: the loaded state of ", name, " needs '", absmax_key, "' (float32, ", blocks,
             " values) for its 8-bit states");
    torch::Tensor r = torch::empty_like(param, param.options().dtype(state_dtype(format)), torch::MemoryFormat::Preserve);
    // 8-bit codes share an absmax per block of consecutive elements in memory order:
    // copied as they are only into the same order; otherwise decoded in theirs and
    // encoded in the parameter's (docs/design/optim.md, "Converting states").
    if (format == StateFormat::Q8 && codes && same_memory_order(t, r)) {
      r.copy_(t);
      *absmax_out = absmax.to(param.device()).contiguous().clone();
      return r;
    }
    const torch::Tensor values = codes ? q8_decoded(t, absmax, first_moment, "'" + std::string(key) + "' of " + name) : t;
    if (format != StateFormat::Q8) {
      r.copy_(values);  // a float precision: rounded to nearest
      return r;
    }
    torch::Tensor f = torch::empty_like(r, r.options().dtype(torch::kFloat).device(torch::kCPU),
                                        torch::MemoryFormat::Preserve);
    f.copy_(values);
    torch::Tensor c = torch::empty_like(f, f.options().dtype(torch::kByte), torch::MemoryFormat::Preserve);
    torch::Tensor a = torch::empty({blocks}, f.options());
    LS_CHECK(optim::q8_encode(f.data_ptr<float>(), f.numel(), first_moment, c.data_ptr<uint8_t>(), a.data_ptr<float>()),
             "layerstream.optim: the loaded state '", key, "' of ", name, " has negative values; a second moment "
             "(exp_avg_sq) never is: was the state dict's exp_avg_sq another optimizer's state?");
    r.copy_(c);
    *absmax_out = a.to(param.device());
    return r;
  };
  out.exp_avg = adopt(loaded.exp_avg, loaded.exp_avg_absmax, "exp_avg", true, &out.exp_avg_absmax);
  out.exp_avg_sq = adopt(loaded.exp_avg_sq, loaded.exp_avg_sq_absmax, "exp_avg_sq", false, &out.exp_avg_sq_absmax);
  return out;
}

void check_group(const std::vector<torch::Tensor>& params, const std::vector<torch::Tensor>& grads, int group,
                 const std::vector<int64_t>& positions, bool cpp) {
  LS_CHECK(params.size() == grads.size(), "internal: one gradient per parameter");
  LS_CHECK(positions.empty() || positions.size() == params.size(), "internal: one position per parameter");
  const char* who = cpp ? "layerstream::optim::AdamW" : "layerstream.optim";
  std::vector<std::string> devices;
  for (size_t i = 0; i < params.size(); ++i) {
    const torch::Tensor& p = params[i];
    const torch::Tensor& g = grads[i];
    const int64_t at = positions.empty() ? static_cast<int64_t>(i) : positions[i];
    LS_CHECK(g.layout() == torch::kStrided, who, ": parameter ", at, " of param group ", group,
             " has a sparse gradient (", g.layout(), "); layerstream's optimizers need dense gradients (",
             cpp ? "torch::nn::EmbeddingOptions::sparse(false), or torch::optim::SparseAdam for that parameter"
                 : "use nn.Embedding(sparse=False), or torch.optim.SparseAdam for that parameter",
             ")");
    LS_CHECK(g.device() == p.device(), who, ": parameter ", at, " of param group ", group, " is on ",
             device_str(p.device()), " but its gradient on ", device_str(g.device()));
    LS_CHECK(g.scalar_type() == p.scalar_type(), who, ": parameter ", at, " of param group ", group, " is ",
             layerstream::dtype_name(p.scalar_type()), " but its gradient ", layerstream::dtype_name(g.scalar_type()));
    devices.push_back(device_str(p.device()));
  }
  optim::check_group_devices(devices, group);
}

void adamw_step(const AdamWConfig& config, StateFormat format, const std::vector<torch::Tensor>& params,
                const std::vector<torch::Tensor>& grads, const std::vector<AdamWStates>& states,
                const std::vector<int64_t>& steps, const std::vector<uint64_t>& keys, float grad_scale,
                uint64_t seed) {
  check_adamw(config);
  const size_t n = params.size();
  LS_CHECK(grads.size() == n && states.size() == n && steps.size() == n && keys.size() == n,
           "internal: adamw_step needs one gradient, state, step and key per parameter");
  torch::NoGradGuard ng;
  std::vector<AdamWTensor> host;
  std::vector<torch::Tensor> keep;  // gradients copied into their parameter's layout
  for (size_t i = 0; i < n; ++i) {
    const torch::Tensor& p = params[i];
    const AdamWStates& s = states[i];
    LS_CHECK(s.exp_avg.defined() && s.exp_avg_sq.defined(), "internal: AdamW states missing");
    if (!p.device().is_cpu()) {
      LS_CHECK(format != StateFormat::Q8, "layerstream.optim: parameters on ", device_str(p.device()),
               " are stepped by torch's AdamW arithmetic on that device, with fp32 or bf16 states; 8-bit "
               "states are the host kernels' only: put them in a param group of their own with "
               "state_precision='fp32' or 'bf16' (e.g. [p for p in model.parameters() if not p.is_cpu])");
      adamw_step_torch(config, p, grads[i], s, steps[i], grad_scale);
      continue;
    }
    torch::Tensor g = in_layout_of(grads[i], p);
    if (!g.is_same(grads[i])) keep.push_back(g);
    AdamWTensor t = host_tensor(p, s, format, i, steps[i], keys[i]);
    t.grad = g.data_ptr();
    t.grad_dtype = core_dtype(g, "a gradient");
    host.push_back(t);
  }
  if (!host.empty()) optim::adamw_step(config, format, host, grad_scale, seed);
  bump_versions(params);
}

void adamw_step_torch(const AdamWConfig& config, const torch::Tensor& p, const torch::Tensor& grad,
                      const AdamWStates& s, int64_t step, float grad_scale) {
  torch::NoGradGuard ng;
  // In fp32: a bf16 parameter or bf16 states through fp32 copies, rounded to nearest.
  const auto f32 = [](const torch::Tensor& t) { return t.scalar_type() == torch::kFloat ? t : t.to(torch::kFloat); };
  torch::Tensor g = f32(grad);
  if (grad_scale != 1.0f) g = g * grad_scale;
  torch::Tensor w = f32(p), m = f32(s.exp_avg), v = f32(s.exp_avg_sq);
  const double t = static_cast<double>(step);
  const double bc1 = 1.0 - std::pow(config.beta1, t), bc2 = 1.0 - std::pow(config.beta2, t);
  if (config.weight_decay != 0) w.mul_(1.0 - config.lr * config.weight_decay);
  m.lerp_(g, 1.0 - config.beta1);
  v.mul_(config.beta2).addcmul_(g, g, 1.0 - config.beta2);
  const torch::Tensor denom = (v.sqrt() / std::pow(bc2, 0.5)).add_(config.eps);
  w.addcdiv_(m, denom, -(config.lr / bc1));
  for (auto [dst, src] : {std::pair{p, w}, std::pair{s.exp_avg, m}, std::pair{s.exp_avg_sq, v}})
    if (!src.is_same(dst)) dst.copy_(src);
}

float adafactor_step_torch(const AdafactorConfig& c, const torch::Tensor& p, const torch::Tensor& grad,
                           const AdafactorStates& s, int64_t step, float grad_scale) {
  torch::NoGradGuard ng;
  check_adafactor(c);
  LS_CHECK(step >= 1, "layerstream.optim: Adafactor step must be >= 1, got ", step);
  if (p.numel() == 0) return 0.0f;
  torch::Tensor g = grad.scalar_type() == torch::kFloat ? grad : grad.to(torch::kFloat);
  if (grad_scale != 1.0f) g = g * grad_scale;
  const bool low = p.scalar_type() != torch::kFloat;
  torch::Tensor pf = low ? p.to(torch::kFloat) : p;
  const double root_n = std::pow(static_cast<double>(p.numel()), 0.5);
  // _rms(t) = t.norm(2) / numel ** 0.5, fp32; the learning rate needs it on the host.
  const float rms = (pf.norm(2) / root_n).item<float>();
  bool lr_fp32 = false;
  const double lr = optim::adafactor_lr(c, step, rms, &lr_fp32);
  const double beta2t = 1.0 - std::pow(static_cast<double>(step), c.decay_rate);
  torch::Tensor update = g.square().add_(c.eps1);
  if (p.dim() >= 2) {
    s.exp_avg_sq_row.mul_(beta2t).add_(update.mean(-1), 1.0 - beta2t);
    s.exp_avg_sq_col.mul_(beta2t).add_(update.mean(-2), 1.0 - beta2t);
    const torch::Tensor r = (s.exp_avg_sq_row / s.exp_avg_sq_row.mean(-1, true)).rsqrt_().unsqueeze(-1);
    const torch::Tensor col = s.exp_avg_sq_col.unsqueeze(-2).rsqrt();
    update = torch::mul(r, col).mul_(g);
  } else {
    s.exp_avg_sq.mul_(beta2t).add_(update, 1.0 - beta2t);
    update = s.exp_avg_sq.rsqrt().mul_(g);
  }
  update.div_((update.norm(2) / root_n / c.clip_threshold).clamp_(1.0));
  update.mul_(lr_fp32 ? static_cast<double>(static_cast<float>(lr)) : lr);
  if (c.beta1 >= 0.0) {
    s.exp_avg.mul_(c.beta1).add_(update, 1.0 - c.beta1);
    update = s.exp_avg;
  }
  if (c.weight_decay != 0.0) {
    const double alpha = lr_fp32 ? static_cast<double>(static_cast<float>(-c.weight_decay) * static_cast<float>(lr))
                                 : -c.weight_decay * lr;
    pf.add_(pf, alpha);
  }
  pf.sub_(update);
  if (low) p.copy_(pf);
  return rms;
}

AdafactorStates adafactor_init_states(const torch::Tensor& param, const AdafactorConfig& config) {
  AdafactorStates s;
  const auto f32 = param.options().dtype(torch::kFloat).requires_grad(false);
  if (param.dim() >= 2) {
    std::vector<int64_t> row(param.sizes().begin(), param.sizes().end() - 1);
    std::vector<int64_t> col(param.sizes().begin(), param.sizes().end() - 2);
    col.push_back(param.size(-1));
    s.exp_avg_sq_row = torch::zeros(row, f32);
    s.exp_avg_sq_col = torch::zeros(col, f32);
  } else {
    s.exp_avg_sq = torch::zeros(param.sizes(), f32);
  }
  if (config.beta1 >= 0.0) s.exp_avg = torch::zeros(param.sizes(), f32);
  return s;
}

std::vector<float> adafactor_step(const AdafactorConfig& config, const std::vector<torch::Tensor>& params,
                                  const std::vector<torch::Tensor>& grads,
                                  const std::vector<AdafactorStates>& states, const std::vector<int64_t>& steps,
                                  const std::vector<uint64_t>& keys, float grad_scale, uint64_t seed) {
  check_adafactor(config);
  const size_t n = params.size();
  LS_CHECK(grads.size() == n && states.size() == n && steps.size() == n && keys.size() == n,
           "internal: adafactor_step needs one gradient, state, step and key per parameter");
  torch::NoGradGuard ng;
  std::vector<AdafactorTensor> ts;  // the host parameters'
  std::vector<size_t> host;         // their indices
  std::vector<float> rms(n, 0.0f);
  std::vector<torch::Tensor> work_p(n), work_g(n);
  auto contiguous_f32 = [](const torch::Tensor& t, const char* what) {
    LS_CHECK(t.defined() && t.scalar_type() == torch::kFloat && t.is_contiguous() && t.device().is_cpu(),
             "layerstream.optim: Adafactor state '", what, "' must be a contiguous float32 host tensor");
    return t.data_ptr<float>();
  };
  std::vector<size_t> elsewhere;  // parameters on another device: torch's arithmetic there
  for (size_t i = 0; i < n; ++i) {
    const torch::Tensor& p = params[i];
    if (!p.device().is_cpu()) {
      const AdafactorStates& st = states[i];
      std::vector<const torch::Tensor*> need{&st.exp_avg_sq};
      if (p.dim() >= 2) need = {&st.exp_avg_sq_row, &st.exp_avg_sq_col};
      if (config.beta1 >= 0.0) need.push_back(&st.exp_avg);
      for (const torch::Tensor* t : need)
        LS_CHECK(t->defined() && t->scalar_type() == torch::kFloat && t->device() == p.device(),
                 "layerstream.optim: the Adafactor states of parameter ", i, " must be float32 tensors on its "
                 "device, ", device_str(p.device()));
      elsewhere.push_back(i);
      continue;
    }
    if (p.numel() == 0) continue;  // nothing to step (transformers' Adafactor leaves it as it is too)
    // Factored over the logical last two dimensions: row-major memory.
    work_p[i] = p.is_contiguous() ? p : p.contiguous();
    work_g[i] = grads[i].contiguous();
    host.push_back(i);
    AdafactorTensor& t = ts.emplace_back();
    t.param = work_p[i].data_ptr();
    t.param_dtype = core_dtype(p, "a parameter");
    t.grad = work_g[i].data_ptr();
    t.grad_dtype = core_dtype(work_g[i], "a gradient");
    t.factored = p.dim() >= 2;
    if (t.factored) {
      t.cols = p.size(-1);
      t.rows = p.size(-2);
      t.batch = t.rows * t.cols == 0 ? 0 : p.numel() / (t.rows * t.cols);
      t.exp_avg_sq_row = contiguous_f32(states[i].exp_avg_sq_row, "exp_avg_sq_row");
      t.exp_avg_sq_col = contiguous_f32(states[i].exp_avg_sq_col, "exp_avg_sq_col");
      LS_CHECK(states[i].exp_avg_sq_row.numel() == t.batch * t.rows &&
                   states[i].exp_avg_sq_col.numel() == t.batch * t.cols,
               "layerstream.optim: Adafactor factored states of parameter ", i, " do not match its shape");
    } else {
      t.batch = 1;
      t.rows = 1;
      t.cols = p.numel();
      t.exp_avg_sq = contiguous_f32(states[i].exp_avg_sq, "exp_avg_sq");
      LS_CHECK(states[i].exp_avg_sq.numel() == p.numel(), "layerstream.optim: Adafactor state of parameter ", i,
               " does not match its shape");
    }
    if (config.beta1 >= 0.0) {
      t.exp_avg = contiguous_f32(states[i].exp_avg, "exp_avg");
      LS_CHECK(states[i].exp_avg.numel() == p.numel(), "layerstream.optim: Adafactor exp_avg of parameter ", i,
               " does not match its shape");
    }
    t.step = steps[i];
    t.key = keys[i];
  }
  optim::adafactor_step(config, ts, grad_scale, seed);
  for (size_t k = 0; k < host.size(); ++k) {
    const size_t i = host[k];
    if (!work_p[i].is_same(params[i])) params[i].copy_(work_p[i]);
    rms[i] = ts[k].rms;
  }
  for (size_t i : elsewhere) rms[i] = adafactor_step_torch(config, params[i], grads[i], states[i], steps[i], grad_scale);
  bump_versions(params);
  return rms;
}

double grad_norm(const std::vector<torch::Tensor>& grads) {
  torch::NoGradGuard ng;
  std::vector<Span> host;
  std::vector<torch::Tensor> keep;
  std::vector<torch::Tensor> device_sums;  // one per device, in double: one sync each
  for (const torch::Tensor& g : grads) {
    LS_CHECK(g.layout() == torch::kStrided, "layerstream.optim: a sparse gradient cannot be clipped here");
    if (g.device().is_cpu() && (g.scalar_type() == torch::kFloat || g.scalar_type() == torch::kBFloat16)) {
      torch::Tensor d = g.is_non_overlapping_and_dense() ? g : g.contiguous();
      keep.push_back(d);
      host.push_back(span_of(d));
      continue;
    }
    const torch::Tensor sq = torch::linalg_vector_norm(g, 2, c10::nullopt, false, torch::kDouble).square();
    auto it = std::find_if(device_sums.begin(), device_sums.end(),
                           [&](const torch::Tensor& t) { return t.device() == g.device(); });
    if (it == device_sums.end())
      device_sums.push_back(sq);
    else
      it->add_(sq);
  }
  double device_sum = 0;
  for (const torch::Tensor& t : device_sums) device_sum += t.item<double>();
  return std::sqrt(sum_of_squares(host) + device_sum);
}

// ---------------------------------------------------------------- budget
namespace {
struct Noted {
  c10::weak_intrusive_ptr<c10::TensorImpl> param;
  std::shared_ptr<std::atomic<bool>> live;
};
std::mutex g_uncounted_mu;
std::unordered_map<const c10::TensorImpl*, Noted> g_uncounted;
}  // namespace

std::shared_ptr<std::atomic<bool>> note_uncounted_training(const std::vector<torch::Tensor>& params) {
  auto live = std::make_shared<std::atomic<bool>>(true);
  std::lock_guard<std::mutex> lock(g_uncounted_mu);
  for (auto it = g_uncounted.begin(); it != g_uncounted.end();)  // forget freed or detached ones
    it = it->second.param.expired() || !*it->second.live ? g_uncounted.erase(it) : std::next(it);
  for (const auto& p : params)
    g_uncounted.insert_or_assign(p.unsafeGetTensorImpl(),
                                 Noted{c10::weak_intrusive_ptr<c10::TensorImpl>(p.getIntrusivePtr()), live});
  return live;
}

bool uncounted_training(const torch::Tensor& param) {
  std::lock_guard<std::mutex> lock(g_uncounted_mu);
  auto it = g_uncounted.find(param.unsafeGetTensorImpl());
  // The same tensor, not a new one at a freed one's address.
  return it != g_uncounted.end() && *it->second.live && it->second.param.lock().get() == param.unsafeGetTensorImpl();
}

// ---------------------------------------------------------------- AdamW
void AdamW::warn_uncounted_training() const {
  size_t n = 0;
  uint64_t bytes = 0;
  std::string spec;
  for (const Group& g : groups_)
    for (const Param& p : g.params)
      if (uncounted_training(p.param)) {
        spec = "adamw-" + g.options.state_precision;
        ++n;
        bytes += train_bytes(parse_train_spec(spec), p.param.sizes().vec(),
                             static_cast<uint64_t>(p.param.element_size()));
      }
  if (n == 0) return;
  char mib[32];
  std::snprintf(mib, sizeof mib, "%.2f", static_cast<double>(bytes) / (1 << 20));
  warn("layerstream::optim::AdamW: " + std::to_string(n) + " parameter(s) that offload() kept on the device "
       "under OffloadOptions::budget_bytes train there: their gradients and optimizer states take " + mib +
       " MiB beyond the budget, which counted their weights only; OffloadOptions::train = \"" + spec +
       "\" makes the budget hold them (docs/design/planner.md, \"Training\")");
}

AdamW::AdamW(std::vector<torch::Tensor> params, AdamWOptions options) {
  // An empty list is a mistake (a model's parameters not yet made, a filter
  // that kept none): step() would do nothing, silently. torch.optim refuses it too.
  LS_CHECK(!params.empty(), "layerstream::optim::AdamW got an empty parameter list: pass the parameters it "
           "steps (e.g. model->parameters()); add_param_group() adds more groups later");
  add_param_group(std::move(params), std::move(options));
}

void AdamW::add_param_group(std::vector<torch::Tensor> params, AdamWOptions options) {
  check_adamw(AdamWConfig{options.lr, options.beta1, options.beta2, options.eps, options.weight_decay});
  if (options.max_grad_norm)
    LS_CHECK(*options.max_grad_norm > 0.0, "max_grad_norm must be > 0, got ", *options.max_grad_norm);
  // A later group's own max_grad_norm or seed was dropped silently: they are the optimizer's.
  if (!groups_.empty()) {
    const AdamWOptions& first = groups_[0].options;
    LS_CHECK(!options.max_grad_norm || options.max_grad_norm == first.max_grad_norm,
             "add_param_group(): max_grad_norm is the optimizer's (one clip over every parameter), set in the "
             "constructor's options; this group asks for ", *options.max_grad_norm, ", the optimizer has ",
             first.max_grad_norm ? std::to_string(*first.max_grad_norm) : std::string("none"),
             ". Leave it unset in add_param_group()'s options");
    LS_CHECK(options.seed == 0 || options.seed == first.seed, "add_param_group(): seed is the optimizer's, set in "
             "the constructor's options; leave it 0 in add_param_group()'s options");
  }
  Group g;
  g.format = parse_state_format(options.state_precision);
  g.options = std::move(options);
  for (auto& p : params) {
    for (const auto& other : groups_)
      for (const auto& q : other.params)
        LS_CHECK(!q.param.is_same(p), "some parameters appear in more than one parameter group");
    // Listed twice in one group: a tied weight, which Module::parameters() lists once
    // per module that registers it. Stepped once (twice, it took two steps and the
    // clip norm counted it twice).
    if (std::any_of(g.params.begin(), g.params.end(), [&](const Param& q) { return q.param.is_same(p); }))
      continue;
    core_dtype(p, "a parameter");
    g.params.push_back(Param{p, {}, 0, next_key_++});
  }
  groups_.push_back(std::move(g));
}

AdamW::Overlap AdamW::overlap(std::shared_ptr<Engine> engine, std::optional<int64_t> speculation_bytes,
                              bool keep_grads) {
  LS_CHECK(!pending_, "layerstream::optim::AdamW: overlap() while a previous overlapped backward has not been "
           "followed by step()");
  LS_CHECK(engine != nullptr, "layerstream::optim::AdamW: overlap() needs an offload() handle's engine");
  auto pending = std::make_unique<Pending>();
  for (const Group& g : groups_) pending->options.push_back(g.options);
  std::vector<AdamWOverlap::Group> groups;
  std::vector<AdamWOverlap::Param> params;
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    Group& g = groups_[gi];
    const AdamWOptions& o = g.options;
    groups.push_back({AdamWConfig{o.lr, o.beta1, o.beta2, o.eps, o.weight_decay}, g.format, groups_[0].options.seed});
    for (Param& prm : g.params) {
      if (!prm.param.device().is_cpu() || !prm.param.requires_grad()) continue;  // streamed weights are host tensors
      if (!prm.states.exp_avg.defined()) prm.states = adamw_init_states(prm.param, g.format);
      pending->params.push_back(&prm);
      pending->steps.push_back(torch::full({}, static_cast<float>(prm.step), torch::kFloat));
      params.push_back({prm.param, prm.states, pending->steps.back(), prm.key, gi});
    }
  }
  if (!groups_.empty() && groups_[0].options.max_grad_norm && !backups_)
    backups_ = std::make_shared<OverlapBackups>();
  // Speculate unless the last step clipped: a clip that triggers now would
  // restore and re-step every speculated layer in step().
  const int64_t speculation = speculation_bytes ? *speculation_bytes : (last_clipped_ ? 0 : -1);
  pending->plan = std::make_unique<AdamWOverlap>(std::move(engine), std::move(groups), std::move(params),
                                                 groups_.empty() ? std::nullopt : groups_[0].options.max_grad_norm,
                                                 speculation, backups_, keep_grads);
  return Overlap(this, std::move(pending));
}

AdamW::Overlap::Overlap(AdamW* opt, std::unique_ptr<Pending> pending)
    : opt_(opt), pending_(std::move(pending)), exceptions_(std::uncaught_exceptions()) {}

AdamW::Overlap::Overlap(Overlap&& o) noexcept
    : opt_(o.opt_), pending_(std::move(o.pending_)), exceptions_(o.exceptions_) {}

void AdamW::abort_pending(Pending& pending) {
  // The speculated layers are restored; the counters of layers stepped
  // without clipping stay counted.
  pending.plan->abort();
  for (size_t i = 0; i < pending.params.size(); ++i)
    pending.params[i]->step = static_cast<int64_t>(pending.steps[i].item<float>());
}

AdamW::Overlap::~Overlap() {
  if (!pending_) return;
  if (std::uncaught_exceptions() > exceptions_) {  // the backward failed
    abort_pending(*pending_);
    return;
  }
  // Every layer's gradient consumed (keep_grads: in .grad) when the scope
  // ends; what the plan's thread threw surfaces in step().
  try {
    pending_->plan->wait();
  } catch (...) {
    pending_->error = std::current_exception();
  }
  for (const Group& g : opt_->groups_)
    for (const Param& prm : g.params) {
      const torch::Tensor& grad = prm.param.grad();
      pending_->grads.push_back({&prm, grad, grad.defined() ? static_cast<int64_t>(grad._version()) : 0});
    }
  opt_->pending_ = std::move(pending_);
}

void AdamW::check_overlap_inputs(Pending& pending) {
  std::string changed;
  auto compare = [&](size_t gi, const char* name, double was, double now) {
    if (was == now) return;
    std::ostringstream o;
    o << (changed.empty() ? "" : "; ") << "group " << gi << "'s " << name << " from " << was << " to " << now;
    changed += o.str();
  };
  for (size_t gi = 0; gi < pending.options.size() && gi < groups_.size(); ++gi) {
    const AdamWOptions &was = pending.options[gi], &now = groups_[gi].options;
    compare(gi, "lr", was.lr, now.lr);
    compare(gi, "beta1", was.beta1, now.beta1);
    compare(gi, "beta2", was.beta2, now.beta2);
    compare(gi, "eps", was.eps, now.eps);
    compare(gi, "weight_decay", was.weight_decay, now.weight_decay);
  }
  if (!groups_.empty() && pending.options[0].max_grad_norm != groups_[0].options.max_grad_norm)
    changed += (changed.empty() ? "" : "; ") + std::string("max_grad_norm");
  size_t edited = 0;
  for (const auto& r : pending.grads) {
    const torch::Tensor& now = r.param->param.grad();
    if (now.defined() != r.grad.defined() || (now.defined() && (!now.is_same(r.grad) ||
                                                                static_cast<int64_t>(now._version()) != r.version)))
      ++edited;
  }
  if (changed.empty() && !edited) return;
  abort_pending(pending);
  const char* taken = " (layers stepped with clipping's speculation are taken back; the others keep the step the "
                      "backward gave them, and the rest of the model was not stepped)";
  LS_CHECK(changed.empty(), "layerstream::optim::AdamW: ", changed, " after overlap(): the streamed layers were "
           "stepped during the backward with the options of then, and the rest would be stepped with the new "
           "ones. Set options before overlap() (a scheduler's lr after step())", taken);
  LS_CHECK(false, "layerstream::optim::AdamW: the .grad of ", edited, " parameter(s) changed between the end of the "
           "overlap() scope and step() (written in place or replaced: a clip by hand, zero_grad(); or made by "
           "another backward): the streamed layers were already stepped with the gradients as they landed. Clip "
           "with AdamWOptions::max_grad_norm, read gradients without writing them, and run every backward of the "
           "step before the scope, wrapping only the last one", taken);
}

void AdamW::step() {
  torch::NoGradGuard ng;
  if (!budget_checked_) {
    budget_checked_ = true;
    warn_uncounted_training();
  }
  // An overlapped backward: what its plan covered (stepped, or its norm taken).
  std::unique_ptr<Pending> pending = std::move(pending_);
  if (pending && pending->error) {  // as a failed backward: nothing more is stepped
    abort_pending(*pending);
    std::rethrow_exception(pending->error);
  }
  if (pending) check_overlap_inputs(*pending);
  std::set<const Param*> covered;
  if (pending) {
    const std::vector<int> status = pending->plan->wait();
    for (size_t i = 0; i < status.size(); ++i)
      if (status[i] != AdamWOverlap::kUntouched) covered.insert(pending->params[i]);
  }
  struct Work {
    Group* group;
    std::vector<Param*> params;
    std::vector<torch::Tensor> p, g;
  };
  std::vector<Work> work;
  std::vector<torch::Tensor> all_grads;
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    Work w{&groups_[gi], {}, {}, {}};
    std::vector<int64_t> positions;  // in the group's list, for messages
    for (auto& prm : groups_[gi].params) {
      const torch::Tensor& grad = prm.param.grad();
      if (!grad.defined() || covered.count(&prm)) continue;
      w.params.push_back(&prm);
      w.p.push_back(prm.param);
      w.g.push_back(grad);
      positions.push_back(&prm - groups_[gi].params.data());
    }
    check_group(w.p, w.g, static_cast<int>(gi), positions, /*cpp=*/true);
    all_grads.insert(all_grads.end(), w.g.begin(), w.g.end());
    work.push_back(std::move(w));
  }
  float coef = 1.0f;
  const std::optional<double> max_norm = groups_.empty() ? std::nullopt : groups_[0].options.max_grad_norm;
  if (pending) {
    double other = 0.0;
    if (max_norm && !all_grads.empty()) other = std::pow(grad_norm(all_grads), 2);
    double total = std::nan("");
    coef = pending->plan->settle(other, &total);
    if (max_norm) last_norm_ = total;
    for (size_t i = 0; i < pending->params.size(); ++i)
      pending->params[i]->step = static_cast<int64_t>(pending->steps[i].item<float>());
    last_overlap_params_ = covered.size();
  } else if (max_norm) {
    last_norm_ = grad_norm(all_grads);
    coef = clip_coefficient(last_norm_, *max_norm);
  }
  last_clipped_ = coef < 1.0f;
  for (auto& w : work) {
    if (w.params.empty()) continue;
    const AdamWOptions& o = w.group->options;
    std::vector<AdamWStates> states;
    std::vector<int64_t> steps;
    std::vector<uint64_t> keys;
    for (Param* prm : w.params) {
      if (!prm->states.exp_avg.defined()) prm->states = adamw_init_states(prm->param, w.group->format);
      states.push_back(prm->states);
      steps.push_back(++prm->step);
      keys.push_back(prm->key);
    }
    adamw_step(AdamWConfig{o.lr, o.beta1, o.beta2, o.eps, o.weight_decay}, w.group->format, w.p, w.g, states,
               steps, keys, coef, groups_[0].options.seed);
  }
}

void AdamW::zero_grad(bool set_to_none) {
  for (auto& g : groups_)
    for (auto& prm : g.params) {
      torch::Tensor& grad = prm.param.mutable_grad();
      if (!grad.defined()) continue;
      if (set_to_none) {
        grad = torch::Tensor();
      } else {
        grad = grad.detach();
        grad.zero_();
      }
    }
}

int64_t AdamW::state_bytes() const {
  int64_t n = 0;
  for (const auto& g : groups_)
    for (const auto& prm : g.params)
      for (const torch::Tensor& t : {prm.states.exp_avg, prm.states.exp_avg_sq, prm.states.exp_avg_absmax,
                                     prm.states.exp_avg_sq_absmax})
        if (t.defined()) n += t.numel() * static_cast<int64_t>(t.element_size());
  return n;
}

// Checkpoint keys: "adamw_version", "adamw_groups", "group<g>_<option>",
// "group<g>_params", "group<g>_param<i>_<shape|step|exp_avg|...>". Version 1.
namespace {
constexpr int64_t kCheckpointVersion = 1;
const char* const kStateKeys[] = {"exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax"};
torch::Tensor* state_slot(AdamWStates& s, int k) {
  torch::Tensor* slots[] = {&s.exp_avg, &s.exp_avg_sq, &s.exp_avg_absmax, &s.exp_avg_sq_absmax};
  return slots[k];
}
c10::IValue read_value(torch::serialize::InputArchive& archive, const std::string& key) {
  c10::IValue v;
  LS_CHECK(archive.try_read(key, v), "layerstream::optim::AdamW::load: the archive has no '", key,
           "' (not saved by AdamW::save(), or by another version)");
  return v;
}
}  // namespace

void AdamW::save(torch::serialize::OutputArchive& archive) const {
  LS_CHECK(!pending_, "layerstream::optim::AdamW::save() between an overlapped backward and step(): step first");
  archive.write("adamw_version", c10::IValue(kCheckpointVersion));
  archive.write("adamw_groups", c10::IValue(static_cast<int64_t>(groups_.size())));
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    const Group& g = groups_[gi];
    const std::string k = "group" + std::to_string(gi) + "_";
    const AdamWOptions& o = g.options;
    for (const auto& [name, value] : {std::pair<const char*, double>{"lr", o.lr}, {"beta1", o.beta1},
                                      {"beta2", o.beta2}, {"eps", o.eps}, {"weight_decay", o.weight_decay}})
      archive.write(k + name, c10::IValue(value));
    archive.write(k + "state_precision", c10::IValue(o.state_precision));
    archive.write(k + "seed", c10::IValue(static_cast<int64_t>(o.seed)));
    archive.write(k + "max_grad_norm", o.max_grad_norm ? c10::IValue(*o.max_grad_norm) : c10::IValue());
    archive.write(k + "params", c10::IValue(static_cast<int64_t>(g.params.size())));
    for (size_t i = 0; i < g.params.size(); ++i) {
      const Param& prm = g.params[i];
      const std::string pk = k + "param" + std::to_string(i) + "_";
      archive.write(pk + "shape", c10::IValue(prm.param.sizes().vec()));
      archive.write(pk + "step", c10::IValue(prm.step));
      AdamWStates states = prm.states;
      for (int s = 0; s < 4; ++s)
        if (state_slot(states, s)->defined()) archive.write(pk + kStateKeys[s], *state_slot(states, s));
    }
  }
}

void AdamW::load(torch::serialize::InputArchive& archive) {
  LS_CHECK(!pending_, "layerstream::optim::AdamW::load() between an overlapped backward and step(): step first");
  const int64_t version = read_value(archive, "adamw_version").toInt();
  LS_CHECK(version == kCheckpointVersion, "layerstream::optim::AdamW::load: checkpoint version ", version,
           ", this build reads version ", kCheckpointVersion);
  const int64_t groups = read_value(archive, "adamw_groups").toInt();
  LS_CHECK(groups == static_cast<int64_t>(groups_.size()), "layerstream::optim::AdamW::load: the checkpoint has ",
           groups, " parameter group(s), this optimizer ", groups_.size(),
           "; build it over the same parameters in the same groups");
  // Everything is read and checked first: a mismatch changes nothing.
  struct Loaded {
    AdamWOptions options;
    std::vector<std::pair<int64_t, AdamWStates>> params;
  };
  std::vector<Loaded> loaded;
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    const Group& g = groups_[gi];
    const std::string k = "group" + std::to_string(gi) + "_";
    Loaded l{g.options, {}};
    l.options.lr = read_value(archive, k + "lr").toDouble();
    l.options.beta1 = read_value(archive, k + "beta1").toDouble();
    l.options.beta2 = read_value(archive, k + "beta2").toDouble();
    l.options.eps = read_value(archive, k + "eps").toDouble();
    l.options.weight_decay = read_value(archive, k + "weight_decay").toDouble();
    check_adamw(AdamWConfig{l.options.lr, l.options.beta1, l.options.beta2, l.options.eps, l.options.weight_decay});
    l.options.seed = static_cast<uint64_t>(read_value(archive, k + "seed").toInt());
    const c10::IValue max_norm = read_value(archive, k + "max_grad_norm");
    l.options.max_grad_norm = max_norm.isNone() ? std::nullopt : std::optional<double>(max_norm.toDouble());
    const std::string saved_precision = read_value(archive, k + "state_precision").toStringRef();
    const int64_t n = read_value(archive, k + "params").toInt();
    LS_CHECK(n == static_cast<int64_t>(g.params.size()), "layerstream::optim::AdamW::load: group ", gi,
             " of the checkpoint has ", n, " parameter(s), this optimizer's ", g.params.size());
    for (size_t i = 0; i < g.params.size(); ++i) {
      const Param& prm = g.params[i];
      const std::string pk = k + "param" + std::to_string(i) + "_";
      const std::string name = "parameter " + std::to_string(i) + " of group " + std::to_string(gi);
      const std::vector<int64_t> shape = read_value(archive, pk + "shape").toIntVector();
      LS_CHECK(c10::IntArrayRef(shape) == prm.param.sizes(), "layerstream::optim::AdamW::load: ", name,
               " was saved with shape ", c10::IntArrayRef(shape), ", this optimizer's is ", prm.param.sizes());
      const int64_t step = read_value(archive, pk + "step").toInt();
      AdamWStates states;
      for (int s = 0; s < 4; ++s) {
        torch::Tensor t;
        if (archive.try_read(pk + kStateKeys[s], t)) *state_slot(states, s) = t;
      }
      if (states.exp_avg.defined() || states.exp_avg_sq.defined()) {
        try {
          states = adamw_adopt_states(prm.param, g.format, states, name);
        } catch (const std::exception& e) {
          LS_CHECK(false, e.what(), " (saved with state_precision \"", saved_precision, "\", this group keeps \"",
                   g.options.state_precision, "\")");
        }
      }
      l.params.emplace_back(step, std::move(states));
    }
    loaded.push_back(std::move(l));
  }
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    groups_[gi].options = loaded[gi].options;  // this group's state_precision, the checkpoint's rest
    for (size_t i = 0; i < groups_[gi].params.size(); ++i) {
      Param& prm = groups_[gi].params[i];
      prm.step = loaded[gi].params[i].first;
      prm.states = std::move(loaded[gi].params[i].second);
    }
  }
}

torch::serialize::OutputArchive& operator<<(torch::serialize::OutputArchive& archive, const AdamW& opt) {
  opt.save(archive);
  return archive;
}

torch::serialize::InputArchive& operator>>(torch::serialize::InputArchive& archive, AdamW& opt) {
  opt.load(archive);
  return archive;
}

}  // namespace optim
}  // namespace layerstream
