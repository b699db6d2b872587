// The host optimizers' steps overlapped with a backward (host_optim.h:
// OverlapBackups, AdamWOverlap, AdafactorOverlap): each streamed layer stepped
// on the engine's gradient-ready hook as its gradient lands, in one fused pass
// (docs/design/optim.md, "Overlap", "Clipping", "Fusion").
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "core/error.h"
#include "host_optim_internal.h"
#include "layerstream/host_optim.h"

namespace layerstream {
namespace optim {

namespace {
bool same_shape(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.defined() != b.defined()) return false;
  return !a.defined() || (a.sizes() == b.sizes() && a.strides() == b.strides() && a.scalar_type() == b.scalar_type());
}
torch::Tensor empty_copy_of(const torch::Tensor& t) {
  return t.defined() ? torch::empty_like(t, torch::MemoryFormat::Preserve) : torch::Tensor();
}
// What a plan steps of `t` (the parameter, or a contiguous tensor of its
// shape: a gradient): elements [lo, hi), or all of it.
torch::Tensor part(const AdamWOverlap::Param& p, const torch::Tensor& t) {
  if (p.hi < 0 || !t.defined()) return t;
  return t.view(-1).slice(0, p.lo, p.hi);
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

// The landed gradients of a layer's parameters that this plan does not step
// (another optimizer's, or none's) go to .grad, as the engine would have put
// them: the consuming hook takes every landed gradient of the layers it is
// handed, and a gradient it dropped would be lost (before, a second optimizer's
// streamed layers lost their gradient in an overlapped backward).
void keep_uncovered(Engine& engine, int layer, const Engine::LandedGradients* landed,
                    const std::vector<AdamWOverlap::LayerParam>& covered) {
  if (!landed) return;  // not consumed: the engine applied it to .grad
  bool weight = landed->weight.defined(), bias = landed->bias.defined();  // landed and not stepped here
  for (const AdamWOverlap::LayerParam& lp : covered) (lp.bias ? bias : weight) = false;
  if (!weight && !bias) return;
  const auto [w, b] = engine.layer_parameters(layer);
  if (weight) accumulate_into_grad(w, landed->weight);
  if (bias) accumulate_into_grad(b, landed->bias);
}

// Drops param's .grad (the gradient was consumed by the step).
void drop_grad(const torch::Tensor& param) { param.mutable_grad().reset(); }

// What a step multiplies a gradient by to unscale it: the reciprocal of the
// loss scale in double, rounded to float, as GradScaler.unscale_() computes
// it (1 without a scale). A GradScaler's scales are powers of two, so the
// product is exact and equals the gradient GradScaler would have unscaled.
float loss_multiplier(std::optional<double> scale) {
  if (!scale) return 1.f;
  LS_CHECK(std::isfinite(*scale) && *scale > 0, "layerstream.optim: a loss scale must be finite and > 0, got ",
           *scale);
  return static_cast<float>(1.0 / *scale);
}

// Removes the engine's gradient-ready hook and waits for the jobs already
// queued (they still run the old hook).
void unhook(Engine& engine) {
  engine.set_grad_ready_hook({});
  engine.wait_grad_ready();
}

// Note [No call between an overlapped backward and its step]
// (engine_grad_ready.cpp): from the end of the block (wait()) while a layer
// was stepped, until settle() or abort(), the engine refuses calls.
void mark_unsettled(Engine& engine, bool& flag, bool now) {
  if (flag == now) return;
  engine.set_unsettled_step(now);
  flag = now;
}

bool any_stepped(const std::vector<int>& status) {
  return std::find(status.begin(), status.end(), AdamWOverlap::kStepped) != status.end();
}
}  // namespace

AdamWOverlap::AdamWOverlap(std::shared_ptr<Engine> engine, std::vector<Group> groups, std::vector<Param> params,
                           std::optional<double> max_grad_norm, int64_t speculation_bytes,
                           std::shared_ptr<OverlapBackups> backups, bool keep_grads,
                           std::optional<double> loss_scale)
    : engine_(std::move(engine)),
      groups_(std::move(groups)),
      params_(std::move(params)),
      max_norm_(max_grad_norm),
      speculation_left_(speculation_bytes < 0 ? INT64_MAX : speculation_bytes),
      keep_grads_(keep_grads),
      scaled_(loss_scale.has_value()),
      loss_mult_(loss_multiplier(loss_scale)),
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
    if (p.hi >= 0) {
      LS_CHECK(p.param.is_contiguous(), "layerstream.optim: overlap() steps a shard of a shared parameter only "
               "when it is contiguous (shape ", p.param.sizes(), ", strides ", p.param.strides(), ")");
      LS_CHECK(0 <= p.lo && p.lo <= p.hi && p.hi <= p.param.numel(), "internal: overlap shard [", p.lo, ", ",
               p.hi, ") outside a parameter of ", p.param.numel(), " elements");
      LS_CHECK(!keep_grads_, "layerstream.optim: overlap(keep_grads=True) is not available for sharded "
               "parameters (offload(share_host_store=\"all\")): each rank's pass reads only its shard of the "
               "gradient; call step() after the backward to keep .grad");
    }
  }
  by_layer_ = params_by_layer(*engine_, params_, &covered_);
  engine_->set_grad_consume_hook([this](int layer, const Engine::LandedGradients* landed) { on_layer(layer, landed); });
  hooked_ = true;
}

AdamWOverlap::~AdamWOverlap() {
  mark_unsettled(*engine_, unsettled_, false);
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
  adamw_step(g.config, g.format, {part(p, p.param)}, {grad}, {p.states}, {step}, {p.key}, grad_scale, g.seed);
}

torch::Tensor AdamWOverlap::grad_of(size_t i) const {
  return kept_[i].defined() ? kept_[i] : part(params_[i], params_[i].param.grad());
}

bool AdamWOverlap::may_speculate(size_t i) {
  const Param& p = params_[i];
  int64_t bytes = part(p, p.param).numel() * static_cast<int64_t>(p.param.element_size());
  for (const torch::Tensor& t : {p.states.exp_avg, p.states.exp_avg_sq, p.states.exp_avg_absmax,
                                 p.states.exp_avg_sq_absmax})
    if (t.defined()) bytes += t.numel() * static_cast<int64_t>(t.element_size());
  std::lock_guard<std::mutex> lock(mu_);
  if (bytes > speculation_left_) return false;
  speculation_left_ -= bytes;
  return true;
}

void AdamWOverlap::fused_one(size_t i, const torch::Tensor& landed, const torch::Tensor& prior, bool in_grad) {
  Param& p = params_[i];
  const Group& g = groups_[p.group];
  torch::NoGradGuard ng;
  // settle: clipping or a loss scale, whose step() may take this step back.
  const bool settle = settles();
  const bool speculate = !settle || may_speculate(i);
  // Where the gradient goes: nowhere when it is .grad already; .grad when
  // the user keeps it (in place when it holds earlier micro-batches'); the
  // optimizer's buffer when step() may need it (a restore and re-step, or
  // the clipped step); else nowhere: the pass reads the landed buffer (plus
  // .grad).
  // A shard (Param::lo/hi): the pass reads and writes its elements only.
  const torch::Tensor target = part(p, p.param);
  torch::Tensor out;
  if (!in_grad && keep_grads_) {
    out = prior.defined() ? prior : torch::empty_like(p.param, torch::MemoryFormat::Contiguous);
    if (!prior.defined()) p.param.mutable_grad() = out;
  } else if (!in_grad && settle) {
    out = backups_->grad_for_key(p.key, target);
  }
  LS_CHECK(p.hi < 0 || landed.is_contiguous(), "internal: a sharded parameter's landed gradient is not contiguous");
  AdamWFused src;
  src.landed = part(p, landed).data_ptr();
  src.prior = prior.defined() ? part(p, prior).data_ptr() : nullptr;
  src.out = out.defined() ? out.data_ptr() : nullptr;
  OverlapBackups::Copy* copy = nullptr;
  if (settle && speculate) {  // the copy a triggered clip or a skip restores (docs/design/optim.md, "Clipping")
    copy = &backups_->for_key(p.key, target, p.states);
    src.copy_param = copy->param.data_ptr();
    src.copy_exp_avg = copy->states.exp_avg.data_ptr();
    src.copy_exp_avg_sq = copy->states.exp_avg_sq.data_ptr();
    if (copy->states.exp_avg_absmax.defined()) {
      src.copy_exp_avg_absmax = copy->states.exp_avg_absmax.data_ptr<float>();
      src.copy_exp_avg_sq_absmax = copy->states.exp_avg_sq_absmax.data_ptr<float>();
    }
  }
  if (speculate) p.step.add_(1);
  AdamWTensor t = host_tensor(target, p.states, g.format, i, static_cast<int64_t>(p.step.item<float>()), p.key);
  t.grad_dtype = core_dtype(landed, "a gradient");
  const double sq =
      adamw_fused(g.config, g.format, {t}, {src}, FusedWork{settle, speculate}, loss_mult_, g.seed).at(0);
  if (speculate) bump_versions({p.param});
  if (!keep_grads_ && prior.defined()) drop_grad(p.param);  // consumed: not left half-summed
  std::lock_guard<std::mutex> lock(mu_);
  fused_ += !in_grad;
  kept_[i] = settle ? out : torch::Tensor();  // undefined: step() reads .grad
  if (settle) sum_sq_ += sq;
  if (copy) {
    backup_[i] = copy;
    speculated_[i] = 1;
  }
  status_[i] = speculate ? kStepped : kNormOnly;
}

// A layer whose gradient lands a second time inside one overlap() block (two
// backwards in it, or a retained graph's backward again) was stepped with the
// first already: stepping again counted a second step on part of the gradient,
// silently. An error instead, raised when the block ends (the engine's
// gradient-ready thread hands it to the backward's end). Defensive: the
// engine now refuses the second forward such a backward needs (Note [No call
// between an overlapped backward and its step], engine_grad_ready.cpp), and a
// retained graph's second backward fails autograd's version check.
static void refuse_second_landing(const Engine& engine, int layer, int status) {
  LS_CHECK(status == AdamWOverlap::kUntouched, "streamed layer '", engine.layer_name(layer), "' got a second "
           "gradient inside one opt.overlap(handle) block (two backwards in it, or backward(retain_graph=True) "
           "again); it was stepped with the first one already. Wrap only the last backward of an optimizer step "
           "in overlap() (run the other micro-batches' backwards before the block), then call step()");
}

void AdamWOverlap::on_layer(int layer, const Engine::LandedGradients* landed) {
  torch::NoGradGuard ng;
  if (layer < 0 || static_cast<size_t>(layer) >= by_layer_.size()) return keep_uncovered(*engine_, layer, landed, {});
  keep_uncovered(*engine_, layer, landed, by_layer_[static_cast<size_t>(layer)]);
  for (const LayerParam& lp : by_layer_[static_cast<size_t>(layer)]) {
    const size_t i = lp.index;
    {
      std::lock_guard<std::mutex> lock(mu_);
      refuse_second_landing(*engine_, layer, status_[i]);
    }
    Param& p = params_[i];
    const torch::Tensor mine = landed_of(landed, lp);
    const torch::Tensor prior = p.param.grad();  // a handle: fused_one may set a new .grad
    if (mine.defined() && (!prior.defined() || (prior.is_contiguous() && prior.scalar_type() == mine.scalar_type()))) {
      fused_one(i, mine, prior, false);
      continue;
    }
    // Not consumed (a layer used twice: the engine summed its uses into
    // .grad), or an unusual .grad: the same pass reads .grad (in the
    // parameter's layout).
    const torch::Tensor grad = mine.defined() ? accumulate_into_grad(p.param, mine) : prior;
    if (grad.defined()) fused_one(i, in_layout_of(grad, p.param), torch::Tensor(), true);
  }
}

std::vector<int> AdamWOverlap::wait() {
  const bool stepped_now = hooked_;  // the block ends here
  if (hooked_) {
    hooked_ = false;
    unhook(*engine_);  // no new jobs; queued ones still run on_layer
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (stepped_now && any_stepped(status_)) mark_unsettled(*engine_, unsettled_, true);
  return status_;
}

// ---------------------------------------------------------------- AdafactorOverlap

AdafactorOverlap::AdafactorOverlap(std::shared_ptr<Engine> engine, std::vector<Group> groups,
                                   std::vector<Param> params, std::optional<double> max_grad_norm, bool keep_grads,
                                   std::optional<double> loss_scale)
    : engine_(std::move(engine)),
      groups_(std::move(groups)),
      params_(std::move(params)),
      max_norm_(max_grad_norm),
      keep_grads_(keep_grads),
      scaled_(loss_scale.has_value()),
      loss_mult_(loss_multiplier(loss_scale)) {
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
  mark_unsettled(*engine_, unsettled_, false);
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
  torch::NoGradGuard ng;
  if (layer < 0 || static_cast<size_t>(layer) >= by_layer_.size()) return keep_uncovered(*engine_, layer, landed, {});
  keep_uncovered(*engine_, layer, landed, by_layer_[static_cast<size_t>(layer)]);
  for (const AdamWOverlap::LayerParam& lp : by_layer_[static_cast<size_t>(layer)]) {
    const size_t i = lp.index;
    {
      std::lock_guard<std::mutex> lock(mu_);
      refuse_second_landing(*engine_, layer, status_[i]);
    }
    const torch::Tensor& param = params_[i].param;
    const torch::Tensor mine = landed_of(landed, lp);
    if (!params_[i].owned) {  // another rank steps it and counts its norm
      if (keep_grads_ && mine.defined())
        accumulate_into_grad(param, mine);
      else if (!keep_grads_)
        drop_grad(param);  // earlier micro-batches' share too: this rank never steps it
      std::lock_guard<std::mutex> lock(mu_);
      status_[i] = AdamWOverlap::kOtherRank;
      continue;
    }
    // The gradient to step with: the landed buffer itself when nothing else
    // needs it (no .grad to add to, none kept, no settle() to come), else
    // added to .grad as the engine would.
    const bool direct = mine.defined() && !param.grad().defined() && !keep_grads_ && !settles();
    const torch::Tensor grad = direct ? mine : mine.defined() ? accumulate_into_grad(param, mine) : param.grad();
    if (!grad.defined()) continue;
    if (settles()) {  // the norm now; the step when settle() knows the clip coefficient (or skips)
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
  const bool stepped_now = hooked_;  // the block ends here
  if (hooked_) {
    hooked_ = false;
    unhook(*engine_);
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (stepped_now && any_stepped(status_)) mark_unsettled(*engine_, unsettled_, true);
  return status_;
}

float AdafactorOverlap::settle(double other_sum_of_squares, double* total_norm, bool skip) {
  mark_unsettled(*engine_, unsettled_, false);
  LS_CHECK(!hooked_, "internal: AdafactorOverlap::settle before wait()");
  float coef = 1.0f;
  if (settles()) {
    const double mult = loss_mult_;
    const double total_sq = sum_sq_ * mult * mult + other_sum_of_squares;
    const double norm = std::sqrt(total_sq);
    if (total_norm) *total_norm = norm;
    skipped_ = scaled_ && (skip || !std::isfinite(total_sq));
    if (max_norm_) coef = clip_coefficient(norm, *max_norm_);
    if (!skipped_)
      for (size_t i = 0; i < params_.size(); ++i)
        if (status_[i] == AdamWOverlap::kNormOnly) {
          step_one(i, params_[i].param.grad(), coef * loss_mult_);
          status_[i] = AdamWOverlap::kStepped;
        }
  }
  if (!keep_grads_)  // as AdamWOverlap::settle
    for (size_t i = 0; i < params_.size(); ++i)
      if (status_[i] != AdamWOverlap::kUntouched) drop_grad(params_[i].param);
  return coef;
}

// Note [A stepped layer's kept gradient goes at an abort]: a block left by an
// exception leaves the layers stepped without clipping stepped; with
// keep_grads their gradient was still in .grad, and the step() that follows
// (the plain step, after an abort) stepped them a second time. Their .grad is
// dropped: it was applied.
void AdafactorOverlap::abort() {
  try {
    wait();
  } catch (...) {
  }
  mark_unsettled(*engine_, unsettled_, false);  // after wait(), which may set it
  torch::NoGradGuard ng;
  for (size_t i = 0; i < params_.size(); ++i)
    if (status_[i] == AdamWOverlap::kStepped) drop_grad(params_[i].param);
}

namespace {
void restore(const torch::Tensor& dst, const torch::Tensor& src) {
  if (dst.defined() && src.defined()) dst.copy_(src);
}
}  // namespace

float AdamWOverlap::settle(double other_sum_of_squares, double* total_norm, bool skip) {
  mark_unsettled(*engine_, unsettled_, false);
  LS_CHECK(!hooked_, "internal: AdamWOverlap::settle before wait()");
  torch::NoGradGuard ng;
  float coef = 1.0f;
  if (settles()) {
    // The landed gradients carry the loss scale: their sum of squares by its
    // reciprocal squared (exact for a power of two).
    const double mult = loss_mult_;
    const double total_sq = sum_sq_ * mult * mult + other_sum_of_squares;
    const double norm = std::sqrt(total_sq);
    if (total_norm) *total_norm = norm;
    // A loss-scaled step with a non-finite gradient is skipped, as
    // GradScaler.step() skips it: every speculated layer goes back.
    skipped_ = scaled_ && (skip || !std::isfinite(total_sq));
    if (max_norm_) coef = clip_coefficient(norm, *max_norm_);
    for (size_t i = 0; i < params_.size(); ++i) {
      if (skipped_) {
        if (speculated_[i]) restore_one(i);
      } else if (status_[i] == kNormOnly) {
        step_one(i, grad_of(i), coef * loss_mult_);  // waited for the norm: stepped now, clipped
        status_[i] = kStepped;
      } else if (speculated_[i] && coef != 1.0f) {
        restore_one(i);
        step_one(i, grad_of(i), coef * loss_mult_);
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
  mark_unsettled(*engine_, unsettled_, false);  // after wait(), which may set it
  torch::NoGradGuard ng;
  for (size_t i = 0; i < params_.size(); ++i)
    if (speculated_[i]) {
      restore_one(i);
      speculated_[i] = 0;
      status_[i] = kUntouched;  // as before the backward: step() steps it
    } else if (status_[i] == kStepped) {
      drop_grad(params_[i].param);  // Note [A stepped layer's kept gradient goes at an abort]
    }
}

void AdamWOverlap::restore_one(size_t i) {
  Param& p = params_[i];
  const OverlapBackups::Copy& c = *backup_[i];
  torch::NoGradGuard ng;
  restore(part(p, p.param), c.param);
  restore(p.states.exp_avg, c.states.exp_avg);
  restore(p.states.exp_avg_sq, c.states.exp_avg_sq);
  restore(p.states.exp_avg_absmax, c.states.exp_avg_absmax);
  restore(p.states.exp_avg_sq_absmax, c.states.exp_avg_sq_absmax);
  p.step.sub_(1);
}

}  // namespace optim
}  // namespace layerstream
