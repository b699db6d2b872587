// Host optimizers over torch tensors: see host_optim.h and docs/design/optim.md.
#include "layerstream/host_optim.h"

#include <cmath>
#include <exception>
#include <set>
#include <sstream>

#include "core/error.h"

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

// `g` in the layout of `like` (a copy when it differs).
torch::Tensor in_layout_of(const torch::Tensor& g, const torch::Tensor& like) {
  if (same_layout(g, like)) return g;
  torch::Tensor out = torch::empty_like(like, g.options());
  out.copy_(g);
  return out;
}

torch::ScalarType state_dtype(StateFormat f) {
  switch (f) {
    case StateFormat::F32: return torch::kFloat;
    case StateFormat::BF16: return torch::kBFloat16;
    case StateFormat::Q8: return torch::kByte;
  }
  return torch::kFloat;
}

// The kernels write parameters through raw pointers: bump their version
// counters as an in-place torch op would, so that what watches them (the
// engine's cache_across_steps, a saved tensor's check) sees the update.
void bump_versions(const std::vector<torch::Tensor>& params) {
  for (const torch::Tensor& p : params)
    if (p.device().is_cpu() && !p.is_inference()) torch::autograd::impl::bump_version(p);
}

Span span_of(const torch::Tensor& t) {
  return Span{t.data_ptr(), core_dtype(t, "gradient"), t.numel()};
}

// The kernels' view of host parameter `p` (the i-th of a step) and its
// states, after checking they match; the gradient is the caller's to set.
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

}  // namespace

Dtype core_dtype(const torch::Tensor& t, const std::string& what) {
  if (t.scalar_type() == torch::kFloat) return Dtype::F32;
  if (t.scalar_type() == torch::kBFloat16) return Dtype::BF16;
  LS_FAIL("layerstream.optim: ", what, " has dtype ", t.scalar_type(),
          "; the host optimizers step float32 and bfloat16 parameters");
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

AdamWStates adamw_adopt_states(const torch::Tensor& param, StateFormat format, AdamWStates loaded,
                               const std::string& name) {
  torch::NoGradGuard ng;
  AdamWStates out;
  const torch::ScalarType want = state_dtype(format);
  auto adopt = [&](const torch::Tensor& t, const char* key) {
    LS_CHECK(t.defined(), "layerstream.optim: the loaded state of ", name, " has no '", key, "'");
    LS_CHECK(t.sizes() == param.sizes(), "layerstream.optim: the loaded state '", key, "' of ", name, " has shape ",
             t.sizes(), ", the parameter ", param.sizes());
    if (format == StateFormat::Q8) {
      LS_CHECK(t.scalar_type() == torch::kByte, "layerstream.optim: the loaded state '", key, "' of ", name,
               " is ", t.scalar_type(), ", but this optimizer keeps 8-bit states (uint8 codes); load a state dict "
               "saved with state_precision='8bit'");
    } else {
      LS_CHECK(t.is_floating_point(), "layerstream.optim: the loaded state '", key, "' of ", name, " is ",
               t.scalar_type(), "; state_precision='", state_format_name(format), "' needs floating-point states");
    }
    torch::Tensor r = torch::empty_like(param, param.options().dtype(want), torch::MemoryFormat::Preserve);
    r.copy_(t);
    return r;
  };
  out.exp_avg = adopt(loaded.exp_avg, "exp_avg");
  out.exp_avg_sq = adopt(loaded.exp_avg_sq, "exp_avg_sq");
  if (format == StateFormat::Q8) {
    const int64_t blocks = state_absmax_count(format, param.numel());
    auto absmax = [&](const torch::Tensor& t, const char* key) {
      LS_CHECK(t.defined() && t.numel() == blocks && t.scalar_type() == torch::kFloat, "layerstream.optim: the loaded ",
               "state of ", name, " needs '", key, "' (float32, ", blocks, " values) for its 8-bit states");
      return t.to(param.device()).contiguous().clone();
    };
    out.exp_avg_absmax = absmax(loaded.exp_avg_absmax, "exp_avg_absmax");
    out.exp_avg_sq_absmax = absmax(loaded.exp_avg_sq_absmax, "exp_avg_sq_absmax");
  }
  return out;
}

void check_group(const std::vector<torch::Tensor>& params, const std::vector<torch::Tensor>& grads, int group) {
  LS_CHECK(params.size() == grads.size(), "internal: one gradient per parameter");
  std::set<std::string> devices;
  for (size_t i = 0; i < params.size(); ++i) {
    const torch::Tensor& p = params[i];
    const torch::Tensor& g = grads[i];
    LS_CHECK(g.layout() == torch::kStrided, "layerstream.optim: parameter ", i, " of param group ", group,
             " has a sparse gradient (", g.layout(), "); layerstream's optimizers need dense gradients "
             "(use nn.Embedding(sparse=False), or torch.optim.SparseAdam for that parameter)");
    LS_CHECK(g.device() == p.device(), "layerstream.optim: parameter ", i, " of param group ", group, " is on ",
             device_str(p.device()), " but its gradient on ", device_str(g.device()));
    LS_CHECK(g.scalar_type() == p.scalar_type(), "layerstream.optim: parameter ", i, " of param group ", group,
             " is ", p.scalar_type(), " but its gradient ", g.scalar_type());
    devices.insert(device_str(p.device()));
  }
  if (devices.size() > 1) {
    std::ostringstream os;
    for (const auto& d : devices) os << (os.tellp() > 0 ? ", " : "") << d;
    LS_FAIL("layerstream.optim: the parameters of param group ", group, " are on several devices (", os.str(),
            "); one group's parameters must be on one device: put the others in a param group of their own");
  }
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
      // Torch's own single-tensor AdamW arithmetic on the parameter's device.
      LS_CHECK(format == StateFormat::F32, "layerstream.optim: parameters on ", device_str(p.device()),
               " are stepped by torch's AdamW arithmetic on that device, with fp32 states only; use "
               "state_precision='fp32' for their param group");
      torch::Tensor g = grads[i];
      if (grad_scale != 1.0f) g = g * grad_scale;
      const double t = static_cast<double>(steps[i]);
      const double bc1 = 1.0 - std::pow(config.beta1, t), bc2 = 1.0 - std::pow(config.beta2, t);
      if (config.weight_decay != 0) p.mul_(1.0 - config.lr * config.weight_decay);
      s.exp_avg.lerp_(g, 1.0 - config.beta1);
      s.exp_avg_sq.mul_(config.beta2).addcmul_(g, g, 1.0 - config.beta2);
      const torch::Tensor denom = (s.exp_avg_sq.sqrt() / std::pow(bc2, 0.5)).add_(config.eps);
      p.addcdiv_(s.exp_avg, denom, -(config.lr / bc1));
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
  std::vector<AdafactorTensor> ts(n);
  std::vector<torch::Tensor> work_p(n), work_g(n);
  auto contiguous_f32 = [](const torch::Tensor& t, const char* what) {
    LS_CHECK(t.defined() && t.scalar_type() == torch::kFloat && t.is_contiguous() && t.device().is_cpu(),
             "layerstream.optim: Adafactor state '", what, "' must be a contiguous float32 host tensor");
    return t.data_ptr<float>();
  };
  for (size_t i = 0; i < n; ++i) {
    const torch::Tensor& p = params[i];
    LS_CHECK(p.device().is_cpu(), "layerstream.optim.Adafactor steps host (CPU) parameters; parameter ", i,
             " is on ", device_str(p.device()));
    // Factored over the logical last two dimensions: row-major memory.
    work_p[i] = p.is_contiguous() ? p : p.contiguous();
    work_g[i] = grads[i].contiguous();
    AdafactorTensor& t = ts[i];
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
  std::vector<float> rms(n);
  for (size_t i = 0; i < n; ++i) {
    if (!work_p[i].is_same(params[i])) params[i].copy_(work_p[i]);
    rms[i] = ts[i].rms;
  }
  bump_versions(params);
  return rms;
}

double grad_norm(const std::vector<torch::Tensor>& grads) {
  torch::NoGradGuard ng;
  std::vector<Span> host;
  std::vector<torch::Tensor> keep;
  double device_sum = 0;
  for (const torch::Tensor& g : grads) {
    LS_CHECK(g.layout() == torch::kStrided, "layerstream.optim: a sparse gradient cannot be clipped here");
    if (g.device().is_cpu() && (g.scalar_type() == torch::kFloat || g.scalar_type() == torch::kBFloat16)) {
      torch::Tensor d = g.is_non_overlapping_and_dense() ? g : g.contiguous();
      keep.push_back(d);
      host.push_back(span_of(d));
    } else {
      const double nrm = torch::linalg_vector_norm(g, 2, c10::nullopt, false, torch::kDouble).item<double>();
      device_sum += nrm * nrm;
    }
  }
  return std::sqrt(sum_of_squares(host) + device_sum);
}

// ---------------------------------------------------------------- overlap
namespace {
bool same_shape(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.defined() != b.defined()) return false;
  return !a.defined() || (a.sizes() == b.sizes() && a.strides() == b.strides() && a.scalar_type() == b.scalar_type());
}
torch::Tensor empty_copy_of(const torch::Tensor& t) {
  return t.defined() ? torch::empty_like(t, torch::MemoryFormat::Preserve) : torch::Tensor();
}
}  // namespace

OverlapBackups::Copy& OverlapBackups::for_key(uint64_t key, const torch::Tensor& param, const AdamWStates& states) {
  std::lock_guard<std::mutex> lock(mu_);
  Copy& c = copies_[key];
  if (!same_shape(c.param, param) || !same_shape(c.states.exp_avg, states.exp_avg) ||
      !same_shape(c.states.exp_avg_sq, states.exp_avg_sq) ||
      !same_shape(c.states.exp_avg_absmax, states.exp_avg_absmax) ||
      !same_shape(c.states.exp_avg_sq_absmax, states.exp_avg_sq_absmax)) {
    torch::NoGradGuard ng;
    c.param = empty_copy_of(param.detach());
    c.states = AdamWStates{empty_copy_of(states.exp_avg), empty_copy_of(states.exp_avg_sq),
                           empty_copy_of(states.exp_avg_absmax), empty_copy_of(states.exp_avg_sq_absmax)};
  }
  return c;
}

torch::Tensor OverlapBackups::grad_for_key(uint64_t key, const torch::Tensor& param) {
  std::lock_guard<std::mutex> lock(mu_);
  torch::Tensor& g = grads_[key];
  if (!g.defined() || g.sizes() != param.sizes() || g.scalar_type() != param.scalar_type()) {
    torch::NoGradGuard ng;
    g = torch::empty(param.sizes(), param.options().requires_grad(false));
  }
  return g;
}

int64_t OverlapBackups::bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t n = 0;
  for (const auto& [key, g] : grads_) n += g.numel() * static_cast<int64_t>(g.element_size());
  for (const auto& [key, c] : copies_)
    for (const torch::Tensor& t : {c.param, c.states.exp_avg, c.states.exp_avg_sq, c.states.exp_avg_absmax,
                                   c.states.exp_avg_sq_absmax})
      if (t.defined()) n += t.numel() * static_cast<int64_t>(t.element_size());
  return n;
}

namespace {
// Per engine layer, the indices of `params` that are its weight or bias
// (*covered: how many in all).
template <class P>
std::vector<std::vector<AdamWOverlap::LayerParam>> params_by_layer(Engine& engine, const std::vector<P>& params,
                                                                   size_t* covered) {
  std::vector<std::vector<AdamWOverlap::LayerParam>> by_layer(static_cast<size_t>(engine.num_layers()));
  for (int layer = 0; layer < engine.num_layers(); ++layer) {
    const auto [w, b] = engine.layer_parameters(layer);
    for (const bool bias : {false, true}) {
      const torch::Tensor& t = bias ? b : w;
      if (!t.defined()) continue;
      for (size_t i = 0; i < params.size(); ++i)
        if (params[i].param.is_same(t)) {
          by_layer[static_cast<size_t>(layer)].push_back({i, bias});
          ++*covered;
        }
    }
  }
  return by_layer;
}

// A parameter's share of a layer's landed gradients (undefined: none landed).
torch::Tensor landed_of(const Engine::LandedGradients* landed, const AdamWOverlap::LayerParam& lp) {
  if (!landed) return {};
  return lp.bias ? landed->bias : landed->weight;
}

// Adds `landed` to param's .grad as the engine's end of backward does
// (allocating it on first use); returns the .grad.
torch::Tensor accumulate_into_grad(const torch::Tensor& param, const torch::Tensor& landed) {
  torch::NoGradGuard ng;
  torch::Tensor& grad = param.mutable_grad();
  if (grad.defined()) {
    grad.add_(landed);
  } else {
    grad = torch::empty_like(param, torch::MemoryFormat::Preserve);
    grad.copy_(landed);
  }
  return grad;
}

// Drops param's .grad (the gradient was consumed by the step).
void drop_grad(const torch::Tensor& param) { param.mutable_grad().reset(); }

// Removes the engine's gradient-ready hook and waits for the jobs already
// queued (they still run the old hook).
void unhook(Engine& engine) {
  engine.set_grad_ready_hook({});
  engine.wait_grad_ready();
}
}  // namespace

AdamWOverlap::AdamWOverlap(std::shared_ptr<Engine> engine, std::vector<Group> groups, std::vector<Param> params,
                           std::optional<double> max_grad_norm, int64_t speculation_bytes,
                           std::shared_ptr<OverlapBackups> backups, bool keep_grads)
    : engine_(std::move(engine)),
      groups_(std::move(groups)),
      params_(std::move(params)),
      max_norm_(max_grad_norm),
      speculation_left_(speculation_bytes < 0 ? INT64_MAX : speculation_bytes),
      keep_grads_(keep_grads),
      backups_(backups ? std::move(backups) : std::make_shared<OverlapBackups>()) {
  LS_CHECK(engine_ && !engine_->detached(), "layerstream.optim: overlap needs an attached offload() handle");
  for (const Group& g : groups_) check_adamw(g.config);
  const size_t n = params_.size();
  status_.assign(n, kUntouched);
  backup_.assign(n, nullptr);
  kept_.assign(n, torch::Tensor());
  speculated_.assign(n, 0);
  for (const Param& p : params_) {
    LS_CHECK(p.group < groups_.size(), "internal: overlap parameter without its group");
    LS_CHECK(p.step.defined() && p.step.numel() == 1 && p.step.scalar_type() == torch::kFloat,
             "internal: overlap parameter without a float32 step counter");
  }
  by_layer_ = params_by_layer(*engine_, params_, &covered_);
  engine_->set_grad_consume_hook([this](int layer, const Engine::LandedGradients* landed) { on_layer(layer, landed); });
  hooked_ = true;
}

AdamWOverlap::~AdamWOverlap() {
  if (!hooked_) return;
  try {
    unhook(*engine_);  // queued jobs still call on_layer: let them finish first
  } catch (...) {
  }
}

void AdamWOverlap::step_one(size_t i, const torch::Tensor& grad, float grad_scale) {
  Param& p = params_[i];
  const Group& g = groups_[p.group];
  torch::NoGradGuard ng;
  p.step.add_(1);
  const int64_t step = static_cast<int64_t>(p.step.item<float>());
  adamw_step(g.config, g.format, {p.param}, {grad}, {p.states}, {step}, {p.key}, grad_scale, g.seed);
}

torch::Tensor AdamWOverlap::grad_of(size_t i) const { return kept_[i].defined() ? kept_[i] : params_[i].param.grad(); }

bool AdamWOverlap::may_speculate(size_t i) {
  const Param& p = params_[i];
  int64_t bytes = p.param.numel() * static_cast<int64_t>(p.param.element_size());
  for (const torch::Tensor& t : {p.states.exp_avg, p.states.exp_avg_sq, p.states.exp_avg_absmax,
                                 p.states.exp_avg_sq_absmax})
    if (t.defined()) bytes += t.numel() * static_cast<int64_t>(t.element_size());
  std::lock_guard<std::mutex> lock(mu_);
  if (bytes > speculation_left_) return false;
  speculation_left_ -= bytes;
  return true;
}

void AdamWOverlap::fused_one(size_t i, const torch::Tensor& landed) {
  Param& p = params_[i];
  const Group& g = groups_[p.group];
  torch::NoGradGuard ng;
  const torch::Tensor prior = p.param.grad();
  const bool clip = max_norm_.has_value();
  const bool speculate = !clip || may_speculate(i);
  // Where the gradient goes: .grad when the user keeps it (in place when it
  // holds earlier micro-batches'); the optimizer's buffer when clipping may
  // need it in step() (a restore and re-step, or the clipped step); else
  // nowhere: the pass reads the landed buffer (plus .grad).
  torch::Tensor out;
  if (keep_grads_) {
    out = prior.defined() ? prior : torch::empty_like(p.param, torch::MemoryFormat::Contiguous);
    if (!prior.defined()) p.param.mutable_grad() = out;
  } else if (clip) {
    out = backups_->grad_for_key(p.key, p.param);
  }
  AdamWFused src;
  src.landed = landed.data_ptr();
  src.prior = prior.defined() ? prior.data_ptr() : nullptr;
  src.out = out.defined() ? out.data_ptr() : nullptr;
  OverlapBackups::Copy* copy = nullptr;
  if (clip && speculate) {  // the copy a triggered clip restores (docs/design/optim.md, "Clipping")
    copy = &backups_->for_key(p.key, p.param, p.states);
    src.copy_param = copy->param.data_ptr();
    src.copy_exp_avg = copy->states.exp_avg.data_ptr();
    src.copy_exp_avg_sq = copy->states.exp_avg_sq.data_ptr();
    if (copy->states.exp_avg_absmax.defined()) {
      src.copy_exp_avg_absmax = copy->states.exp_avg_absmax.data_ptr<float>();
      src.copy_exp_avg_sq_absmax = copy->states.exp_avg_sq_absmax.data_ptr<float>();
    }
  }
  if (speculate) p.step.add_(1);
  AdamWTensor t = host_tensor(p.param, p.states, g.format, i, static_cast<int64_t>(p.step.item<float>()), p.key);
  t.grad_dtype = core_dtype(landed, "a gradient");
  const double sq = adamw_fused(g.config, g.format, {t}, {src}, FusedWork{clip, speculate}, 1.0f, g.seed).at(0);
  if (speculate) bump_versions({p.param});
  if (!keep_grads_ && prior.defined()) drop_grad(p.param);  // consumed: not left half-summed
  std::lock_guard<std::mutex> lock(mu_);
  ++fused_;
  kept_[i] = clip ? out : torch::Tensor();
  if (clip) sum_sq_ += sq;
  if (copy) {
    backup_[i] = copy;
    speculated_[i] = 1;
  }
  status_[i] = speculate ? kStepped : kNormOnly;
}

void AdamWOverlap::on_layer(int layer, const Engine::LandedGradients* landed) {
  if (layer < 0 || static_cast<size_t>(layer) >= by_layer_.size()) return;
  torch::NoGradGuard ng;
  for (const LayerParam& lp : by_layer_[static_cast<size_t>(layer)]) {
    const size_t i = lp.index;
    Param& p = params_[i];
    const torch::Tensor mine = landed_of(landed, lp);
    const torch::Tensor& prior = p.param.grad();
    if (mine.defined() && (!prior.defined() || (prior.is_contiguous() && prior.scalar_type() == mine.scalar_type()))) {
      fused_one(i, mine);
      continue;
    }
    // Not consumed (a layer used twice: the engine summed its uses into
    // .grad), or an unusual .grad: separate passes over .grad.
    const torch::Tensor grad = mine.defined() ? accumulate_into_grad(p.param, mine) : prior;
    if (!grad.defined()) continue;
    bool speculate = true;
    if (max_norm_) {
      const double sq = grad_norm({grad});
      {
        std::lock_guard<std::mutex> lock(mu_);
        sum_sq_ += sq * sq;
        status_[i] = kNormOnly;
      }
      speculate = may_speculate(i);
    }
    if (!speculate) continue;
    if (max_norm_) {
      // The copy a triggered clip restores (docs/design/optim.md, "Clipping").
      OverlapBackups::Copy& c = backups_->for_key(p.key, p.param, p.states);
      c.param.copy_(p.param.detach());
      for (auto [dst, src] : {std::pair{c.states.exp_avg, p.states.exp_avg}, {c.states.exp_avg_sq, p.states.exp_avg_sq},
                              {c.states.exp_avg_absmax, p.states.exp_avg_absmax},
                              {c.states.exp_avg_sq_absmax, p.states.exp_avg_sq_absmax}})
        if (dst.defined()) dst.copy_(src);
      backup_[i] = &c;
      speculated_[i] = 1;
    }
    step_one(i, grad, 1.0f);
    std::lock_guard<std::mutex> lock(mu_);
    status_[i] = kStepped;
  }
}

std::vector<int> AdamWOverlap::wait() {
  if (hooked_) {
    hooked_ = false;
    unhook(*engine_);  // no new jobs; queued ones still run on_layer
  }
  std::lock_guard<std::mutex> lock(mu_);
  return status_;
}

// ---------------------------------------------------------------- AdafactorOverlap

AdafactorOverlap::AdafactorOverlap(std::shared_ptr<Engine> engine, std::vector<Group> groups,
                                   std::vector<Param> params, std::optional<double> max_grad_norm, bool keep_grads)
    : engine_(std::move(engine)),
      groups_(std::move(groups)),
      params_(std::move(params)),
      max_norm_(max_grad_norm),
      keep_grads_(keep_grads) {
  LS_CHECK(engine_ && !engine_->detached(), "layerstream.optim: overlap needs an attached offload() handle");
  for (const Group& g : groups_) check_adafactor(g.config);
  for (const Param& p : params_) {
    LS_CHECK(p.group < groups_.size(), "internal: overlap parameter without its group");
    LS_CHECK(p.rms.defined() && p.rms.numel() == 1, "internal: overlap parameter without its RMS tensor");
  }
  status_.assign(params_.size(), AdamWOverlap::kUntouched);
  size_t covered = 0;
  by_layer_ = params_by_layer(*engine_, params_, &covered);
  engine_->set_grad_consume_hook([this](int layer, const Engine::LandedGradients* landed) { on_layer(layer, landed); });
  hooked_ = true;
}

AdafactorOverlap::~AdafactorOverlap() {
  if (!hooked_) return;
  try {
    unhook(*engine_);
  } catch (...) {
  }
}

void AdafactorOverlap::step_one(size_t i, const torch::Tensor& grad, float grad_scale) {
  Param& p = params_[i];
  const Group& g = groups_[p.group];
  torch::NoGradGuard ng;
  const std::vector<float> rms =
      adafactor_step(g.config, {p.param}, {grad}, {p.states}, {p.step}, {p.key}, grad_scale, g.seed);
  p.rms.fill_(rms.at(0));
}

void AdafactorOverlap::on_layer(int layer, const Engine::LandedGradients* landed) {
  if (layer < 0 || static_cast<size_t>(layer) >= by_layer_.size()) return;
  torch::NoGradGuard ng;
  for (const AdamWOverlap::LayerParam& lp : by_layer_[static_cast<size_t>(layer)]) {
    const size_t i = lp.index;
    const torch::Tensor& param = params_[i].param;
    const torch::Tensor mine = landed_of(landed, lp);
    // The gradient to step with: the landed buffer itself when nothing else
    // needs it (no .grad to add to, none kept, no settle() to come), else
    // added to .grad as the engine would.
    const bool direct = mine.defined() && !param.grad().defined() && !keep_grads_ && !max_norm_;
    const torch::Tensor grad = direct ? mine : mine.defined() ? accumulate_into_grad(param, mine) : param.grad();
    if (!grad.defined()) continue;
    if (max_norm_) {  // the norm now; the step when settle() knows the clip coefficient
      const double sq = grad_norm({grad});
      std::lock_guard<std::mutex> lock(mu_);
      sum_sq_ += sq * sq;
      status_[i] = AdamWOverlap::kNormOnly;
      continue;
    }
    step_one(i, grad, 1.0f);
    if (!keep_grads_ && !direct) drop_grad(param);
    std::lock_guard<std::mutex> lock(mu_);
    status_[i] = AdamWOverlap::kStepped;
  }
}

std::vector<int> AdafactorOverlap::wait() {
  if (hooked_) {
    hooked_ = false;
    unhook(*engine_);
  }
  std::lock_guard<std::mutex> lock(mu_);
  return status_;
}

float AdafactorOverlap::settle(double other_sum_of_squares, double* total_norm) {
  LS_CHECK(!hooked_, "internal: AdafactorOverlap::settle before wait()");
  float coef = 1.0f;
  if (max_norm_) {
    const double norm = std::sqrt(sum_sq_ + other_sum_of_squares);
    if (total_norm) *total_norm = norm;
    coef = clip_coefficient(norm, *max_norm_);
    for (size_t i = 0; i < params_.size(); ++i)
      if (status_[i] == AdamWOverlap::kNormOnly) {
        step_one(i, params_[i].param.grad(), coef);
        status_[i] = AdamWOverlap::kStepped;
      }
  }
  if (!keep_grads_)  // as AdamWOverlap::settle
    for (size_t i = 0; i < params_.size(); ++i)
      if (status_[i] != AdamWOverlap::kUntouched) drop_grad(params_[i].param);
  return coef;
}

void AdafactorOverlap::abort() {
  try {
    wait();
  } catch (...) {
  }
}

namespace {
void restore(const torch::Tensor& dst, const torch::Tensor& src) {
  if (dst.defined() && src.defined()) dst.copy_(src);
}
}  // namespace

float AdamWOverlap::settle(double other_sum_of_squares, double* total_norm) {
  LS_CHECK(!hooked_, "internal: AdamWOverlap::settle before wait()");
  torch::NoGradGuard ng;
  float coef = 1.0f;
  if (max_norm_) {
    const double norm = std::sqrt(sum_sq_ + other_sum_of_squares);
    if (total_norm) *total_norm = norm;
    coef = clip_coefficient(norm, *max_norm_);
    for (size_t i = 0; i < params_.size(); ++i) {
      if (status_[i] == kNormOnly) {
        step_one(i, grad_of(i), coef);  // waited for the norm: stepped now, clipped
        status_[i] = kStepped;
      } else if (speculated_[i] && coef != 1.0f) {
        restore_one(i);
        step_one(i, grad_of(i), coef);
      }
      speculated_[i] = 0;
    }
  }
  // Without keep_grads, what this step covered leaves no .grad behind (the
  // fused pass wrote none; layers the engine applied first had one).
  for (size_t i = 0; i < params_.size(); ++i) {
    kept_[i] = torch::Tensor();
    if (!keep_grads_ && status_[i] != kUntouched) drop_grad(params_[i].param);
  }
  return coef;
}

void AdamWOverlap::abort() {
  try {
    wait();
  } catch (...) {
  }
  torch::NoGradGuard ng;
  for (size_t i = 0; i < params_.size(); ++i)
    if (speculated_[i]) {
      restore_one(i);
      speculated_[i] = 0;
    }
}

void AdamWOverlap::restore_one(size_t i) {
  Param& p = params_[i];
  const OverlapBackups::Copy& c = *backup_[i];
  torch::NoGradGuard ng;
  restore(p.param, c.param);
  restore(p.states.exp_avg, c.states.exp_avg);
  restore(p.states.exp_avg_sq, c.states.exp_avg_sq);
  restore(p.states.exp_avg_absmax, c.states.exp_avg_absmax);
  restore(p.states.exp_avg_sq_absmax, c.states.exp_avg_sq_absmax);
  p.step.sub_(1);
}

// ---------------------------------------------------------------- AdamW
AdamW::AdamW(std::vector<torch::Tensor> params, AdamWOptions options) {
  add_param_group(std::move(params), std::move(options));
}

void AdamW::add_param_group(std::vector<torch::Tensor> params, AdamWOptions options) {
  check_adamw(AdamWConfig{options.lr, options.beta1, options.beta2, options.eps, options.weight_decay});
  if (options.max_grad_norm)
    LS_CHECK(*options.max_grad_norm > 0.0, "max_grad_norm must be > 0, got ", *options.max_grad_norm);
  Group g;
  g.format = parse_state_format(options.state_precision);
  g.options = std::move(options);
  for (auto& p : params) {
    for (const auto& other : groups_)
      for (const auto& q : other.params)
        LS_CHECK(!q.param.is_same(p), "some parameters appear in more than one parameter group");
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
  opt_->pending_ = std::move(pending_);
}

void AdamW::step() {
  torch::NoGradGuard ng;
  // An overlapped backward: what its plan covered (stepped, or its norm taken).
  std::unique_ptr<Pending> pending = std::move(pending_);
  if (pending && pending->error) {  // as a failed backward: nothing more is stepped
    abort_pending(*pending);
    std::rethrow_exception(pending->error);
  }
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
    for (auto& prm : groups_[gi].params) {
      const torch::Tensor& grad = prm.param.grad();
      if (!grad.defined() || covered.count(&prm)) continue;
      w.params.push_back(&prm);
      w.p.push_back(prm.param);
      w.g.push_back(grad);
    }
    check_group(w.p, w.g, static_cast<int>(gi));
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

}  // namespace optim
}  // namespace layerstream
