// layerstream — host optimizers over torch tensors (LibTorch glue of
// core/optim/optim.h). Named host_optim.h, not optim.h: with csrc/ on the
// include path, "torch/optim.h" would shadow LibTorch's own <torch/optim.h>.
//
// Two layers:
//  * tensor functions: state allocation and checks, one AdamW / Adafactor
//    step over lists of tensors, the gradient norm. The Python optimizers
//    (python/layerstream/optim.py: torch.optim.Optimizer subclasses with
//    param groups, schedulers, state_dict) call these through _C, and so does
//  * layerstream::optim::AdamW, the C++ optimizer (LibTorch users, the CLI's
//    `demo --full`):
//
//      auto handle = layerstream::offload(*net, opts);
//      layerstream::optim::AdamWOptions o;  o.lr = 3e-3;  o.max_grad_norm = 1.0;
//      layerstream::optim::AdamW opt(net->parameters(), o);
//      loss.backward(); opt.step(); opt.zero_grad();
//
//    or, stepping each streamed layer while the backward still runs:
//
//      { auto overlap = opt.overlap(handle->engine()); loss.backward(); }
//      opt.step(); opt.zero_grad();
//
// Parameters must be float32 or bfloat16; the C++ kernels step those in host
// (CPU) memory — streamed weights of an offload() handle live there.
// Parameters on another device (resident on a GPU) are stepped by torch's own
// arithmetic on that device (adamw_step_torch, adafactor_step_torch; AdamW
// with fp32 or bf16 states), and count in the clipping norm like all others.
// One group's parameters may be on the host and one device
// (optim::check_group_devices); sparse gradients are refused.
// docs/design/optim.md.
//
// Ownership: state tensors are ordinary torch tensors (the caller's, or
// owned by the AdamW object). Thread safety: the functions may be called
// from any thread (they release nothing of Python's; the bindings release
// the GIL around them); an AdamW object is not thread-safe, like torch's
// optimizers.
#pragma once

#include <torch/torch.h>

#include <atomic>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "core/optim/optim.h"
#include "engine.h"

namespace layerstream {
namespace optim {

// The core dtype of a parameter or gradient (float32 / bfloat16; any other
// dtype throws, naming `what`).
Dtype core_dtype(const torch::Tensor& t, const std::string& what);
// core_dtype of each parameter of param group `group` that requires grad, named by its
// position and shape: what the Python optimizers check when a group is added and before
// an overlapped backward steps any layer, so that a dtype they cannot step is refused
// before anything moved (a frozen one is checked at the step, once it trains).
void check_param_dtypes(const std::vector<torch::Tensor>& params, int group);

// ---------------------------------------------------------------- AdamW
// The states of one parameter, as in its optimizer state dict: exp_avg and
// exp_avg_sq (float32 / bfloat16 like the parameter's layout, or uint8 codes)
// and, for 8-bit states, exp_avg_absmax / exp_avg_sq_absmax (float32 [blocks]).
struct AdamWStates {
  torch::Tensor exp_avg, exp_avg_sq, exp_avg_absmax, exp_avg_sq_absmax;
};
// Zero states for `param` (in its layout, on its device).
AdamWStates adamw_init_states(const torch::Tensor& param, StateFormat format);
// Checks states loaded from a state dict against `param` and `format` and
// returns them in the layout and dtype the kernels need, converted from
// whatever precision they were saved in (e.g. a torch.optim.AdamW fp32 state
// for bf16 or 8-bit states, 8-bit codes for fp32 ones; optim::q8_decode /
// q8_encode). 8-bit codes in the parameter's memory order are copied as they
// are. `name` names the parameter in errors. Thread safety: none needed (new
// tensors only).
AdamWStates adamw_adopt_states(const torch::Tensor& param, StateFormat format, AdamWStates loaded,
                               const std::string& name);

// One AdamW step over parallel lists (steps: each tensor's step number after
// its increment; keys: stochastic rounding streams, e.g. the positions of the
// parameters in the optimizer). Host tensors go to the C++ kernels (on
// ThreadPool::shared()); tensors on another device to torch's own AdamW
// arithmetic (adamw_step_torch; fp32 or bf16 states, not 8-bit). A gradient
// whose layout differs from its parameter's is copied into the parameter's
// layout first.
void adamw_step(const AdamWConfig& config, StateFormat format, const std::vector<torch::Tensor>& params,
                const std::vector<torch::Tensor>& grads, const std::vector<AdamWStates>& states,
                const std::vector<int64_t>& steps, const std::vector<uint64_t>& keys, float grad_scale,
                uint64_t seed);

// ---------------------------------------------------------------- Adafactor
struct AdafactorStates {
  torch::Tensor exp_avg_sq_row, exp_avg_sq_col, exp_avg_sq, exp_avg;  // undefined when unused
};
AdafactorStates adafactor_init_states(const torch::Tensor& param, const AdafactorConfig& config);
// One Adafactor step; returns each parameter's RMS before the step
// (transformers' state["RMS"]). Host tensors go to the C++ kernels, tensors on
// another device to adafactor_step_torch.
std::vector<float> adafactor_step(const AdafactorConfig& config, const std::vector<torch::Tensor>& params,
                                  const std::vector<torch::Tensor>& grads,
                                  const std::vector<AdafactorStates>& states, const std::vector<int64_t>& steps,
                                  const std::vector<uint64_t>& keys, float grad_scale, uint64_t seed);

// One parameter stepped by torch's own tensor arithmetic on its device: what
// adamw_step and adafactor_step do for parameters off the host (resident
// layers on a GPU). AdamW as torch.optim.AdamW's single-tensor path in fp32
// (fp32 or bf16 states); Adafactor as transformers' Adafactor (returns the RMS
// before the step). A bf16/fp16 parameter or bf16 state goes through an fp32
// copy, rounded to nearest. The gradient is scaled by grad_scale (clipping).
// Any device, the host included (where the tests compare them with torch's
// and transformers' classes). Runs on the caller's thread and, on a GPU, its
// current stream.
void adamw_step_torch(const AdamWConfig& config, const torch::Tensor& param, const torch::Tensor& grad,
                      const AdamWStates& states, int64_t step, float grad_scale);
float adafactor_step_torch(const AdafactorConfig& config, const torch::Tensor& param, const torch::Tensor& grad,
                           const AdafactorStates& states, int64_t step, float grad_scale);

// ---------------------------------------------------------------- budget
// Trainable parameters that an offload() budget kept on the compute device
// while OffloadOptions::train was empty (Python: offload(budget=...) without
// train=): the budget counted their weights, not the gradients and optimizer
// states they take there while training (docs/design/planner.md,
// "Training"). offload() notes them for as long as its handle is attached
// (the flag returned here: the handle sets it false when it detaches); the
// optimizers (C++ AdamW; Python's AdamW and Adafactor) warn once, at their
// first step, when some of their parameters are noted. One registry for
// both languages. Thread safety: process-wide, guarded by a mutex.
// Ownership: parameters are held weakly (a freed one is forgotten).
std::shared_ptr<std::atomic<bool>> note_uncounted_training(const std::vector<torch::Tensor>& params);
bool uncounted_training(const torch::Tensor& param);

// ---------------------------------------------------------------- clipping
// The total 2-norm of `grads` (host ones by the C++ kernels, others by
// torch on their device, all summed in double).
double grad_norm(const std::vector<torch::Tensor>& grads);
// Checks what every optimizer refuses in a group: sparse gradients, a
// gradient on another device or of another dtype than its parameter, and
// parameters on two devices besides the host (optim::check_group_devices;
// `group` numbers the group in messages, `positions` each parameter's place in
// the group's list (empty: its index in `params`); `cpp`: messages in the C++
// API's spelling, else Python's).
void check_group(const std::vector<torch::Tensor>& params, const std::vector<torch::Tensor>& grads, int group,
                 const std::vector<int64_t>& positions = {}, bool cpp = false);

// ---------------------------------------------------------------- overlap
// One AdamW step whose streamed layers are stepped during the backward that
// completes their gradients (docs/design/optim.md, "Overlap"): installed as
// the engine's gradient-ready hook for one backward; each layer whose
// gradient has landed is stepped on the engine's hook thread (with the
// kernels' thread pool) while the backward goes on. finish() waits for those
// steps; the caller steps the parameters it did not (resident ones, tables,
// layers used twice).
//
// Clipping (max_grad_norm): the global norm is known only when the backward
// ends. Each layer's gradient sum of squares is taken when it lands; its step
// is taken speculatively with no clipping, after saving the layer's
// parameters and states, as long as the saved bytes stay within
// `speculation_bytes` (later layers wait for finish()). finish() computes the
// norm; if the clip triggers, every speculated layer is restored from its
// copy and stepped again with the clip coefficient -- the result is the
// reference's either way. The copies live in an OverlapBackups the caller
// keeps across steps (allocated once).
//
// Fusion (docs/design/optim.md, "Fusion"): the hook consumes a layer's
// landed gradient (Engine::set_grad_consume_hook) and one pass over each
// parameter's host memory assembles its gradient (what .grad held plus the
// landed one), takes the norm, saves the copy and steps it. With
// keep_grads, .grad is materialized as the plain step would leave it; else
// a stepped parameter's .grad is left undefined (with clipping, the
// gradient step() may still need is kept in the OverlapBackups instead).
// Layers the engine applies to .grad first (a layer called twice) are read
// from .grad, as without fusion.
//
// Ownership: holds the tensors it was given (the caller's state tensors;
// `step` tensors are the state dict's 0-dim float32 counters, incremented
// here). Thread safety: on_layer() runs on the engine's hook thread;
// finish()/abort() from the caller's thread after the backward returned.
// The copies a speculative step keeps (AdamWOverlap), by parameter key,
// and the gradients a clipped overlapped step keeps for step() when .grad
// is not kept: allocated at the first step and reused by the next ones
// (allocating and freeing them every step costs page faults on the critical
// path). Held by the optimizer across steps. Thread safety: internally locked.
class OverlapBackups {
 public:
  struct Copy {
    torch::Tensor param;
    AdamWStates states;
  };
  // The copy of `key`, shaped like `param` and `states` (made on first use
  // or when they changed).
  Copy& for_key(uint64_t key, const torch::Tensor& param, const AdamWStates& states);
  // The gradient buffer of `key`, contiguous, shaped like `param`.
  torch::Tensor grad_for_key(uint64_t key, const torch::Tensor& param);
  int64_t bytes() const;

 private:
  mutable std::mutex mu_;
  std::map<uint64_t, Copy> copies_;
  std::map<uint64_t, torch::Tensor> grads_;
};

class AdamWOverlap {
 public:
  struct Group {
    AdamWConfig config;
    StateFormat format = StateFormat::F32;
    uint64_t seed = 0;
  };
  struct Param {
    torch::Tensor param;
    AdamWStates states;
    torch::Tensor step;  // 0-dim float32: the state's step counter
    uint64_t key = 0;
    size_t group = 0;
    // Only elements [lo, hi) of a contiguous `param` (in memory order) are
    // stepped, and `states` cover those (a shard of a tensor that a node's
    // ranks share: offload(share_host_store="all"), each rank stepping its
    // own; docs/design/distributed.md, "Sharded step"). hi < 0: all of it.
    // The gradient norm for clipping then covers the shard only:
    // sum_of_squares() is this rank's part, the caller sums the ranks'.
    int64_t lo = 0, hi = -1;
  };
  // Entry status after wait().
  // kOtherRank (AdafactorOverlap only): a tensor another rank steps (sharded
  // by whole tensors): its gradient was consumed, nothing stepped or counted.
  enum Status : int { kUntouched = 0, kNormOnly = 1, kStepped = 2, kOtherRank = 3 };

  // loss_scale: the backward's gradients are the loss's times this (a
  // torch.amp.GradScaler's scale; docs/design/optim.md, "Loss scaling"):
  // each step multiplies them by its reciprocal as it reads them, and the
  // layers are stepped speculatively as with clipping, so that settle() can
  // take the whole step back when a gradient is not finite.
  AdamWOverlap(std::shared_ptr<Engine> engine, std::vector<Group> groups, std::vector<Param> params,
               std::optional<double> max_grad_norm, int64_t speculation_bytes,
               std::shared_ptr<OverlapBackups> backups = nullptr, bool keep_grads = false,
               std::optional<double> loss_scale = std::nullopt);
  ~AdamWOverlap();
  AdamWOverlap(const AdamWOverlap&) = delete;
  AdamWOverlap& operator=(const AdamWOverlap&) = delete;

  // Waits for the hook's work and removes the hook; per parameter: whether
  // its gradient norm was taken (kNormOnly) or it was also stepped (kStepped).
  std::vector<int> wait();
  // With clipping: the total norm from the layers' partial sums and
  // `other_sum_of_squares` (the gradients not counted here, unscaled), and
  // the clip coefficient; speculated layers are re-stepped when it is not 1.
  // Without clipping: returns 1. With a loss scale, the step is skipped
  // (speculated layers restored, nothing else stepped) when `skip` (the
  // caller found a non-finite gradient among the others) or when a gradient
  // counted here is not finite; skipped() tells. After wait().
  float settle(double other_sum_of_squares, double* total_norm = nullptr, bool skip = false);
  bool skipped() const { return skipped_; }
  // With clipping or a loss scale, after wait(): the sum of squares of the
  // gradients this plan counted, as they landed (scaled; sharded parameters:
  // of their shards), and its replacement (by the sum over the ranks that
  // share the shards) before settle().
  double sum_of_squares() const { return sum_sq_; }
  void set_sum_of_squares(double s) { sum_sq_ = s; }
  // After a failed backward: waits, removes the hook and restores the
  // speculated layers (layers stepped without clipping stay stepped).
  void abort();
  // Parameters of the engine's layers that this step covers (for tests).
  size_t layer_params() const { return covered_; }
  // Parameters whose landed gradient the fused pass consumed (for tests).
  size_t fused_params() const { return fused_; }

  // Per engine layer: the indices of a plan's parameters that are its weight
  // (bias false) or bias.
  struct LayerParam {
    size_t index;
    bool bias;
  };

 private:
  void on_layer(int layer, const Engine::LandedGradients* landed);
  // One fused pass over `index`: its gradient is `landed` (+ `prior`, the
  // .grad of earlier micro-batches); in_grad: `landed` is .grad itself.
  void fused_one(size_t index, const torch::Tensor& landed, const torch::Tensor& prior, bool in_grad);
  // Speculates on `index` (clipping): within the bound, reserves its copy's bytes.
  bool may_speculate(size_t index);
  void step_one(size_t index, const torch::Tensor& grad, float grad_scale);
  void restore_one(size_t index);  // from its copy, step counter back by one
  // The gradient step() steps `index` with: the one the fused pass kept, else .grad.
  torch::Tensor grad_of(size_t index) const;

  std::shared_ptr<Engine> engine_;
  std::vector<Group> groups_;
  std::vector<Param> params_;
  // Whether settle() has work: clipping, or a loss scale to check.
  bool settles() const { return max_norm_.has_value() || scaled_; }

  std::optional<double> max_norm_;
  int64_t speculation_left_;
  bool keep_grads_;
  bool scaled_ = false;    // a loss scale was given
  float loss_mult_ = 1.f;  // its reciprocal, rounded as GradScaler rounds it
  bool skipped_ = false;
  std::vector<std::vector<LayerParam>> by_layer_;
  size_t covered_ = 0, fused_ = 0;
  std::mutex mu_;
  std::vector<int> status_;
  std::shared_ptr<OverlapBackups> backups_;
  std::vector<OverlapBackups::Copy*> backup_;  // per parameter, when speculated
  std::vector<torch::Tensor> kept_;            // per parameter: the gradient kept for settle()
  std::vector<char> speculated_;
  double sum_sq_ = 0;
  bool hooked_ = false;
  bool unsettled_ = false;  // it set Engine::set_unsettled_step (wait() with a layer stepped)
};

// One Adafactor step overlapped with a backward, as AdamWOverlap: each
// streamed layer whose gradient has landed is stepped on the engine's hook
// thread. With max_grad_norm, only the layer's gradient norm is taken then
// (no speculation: its roll-back would need a copy of each parameter, and
// Adafactor is chosen to save memory) and settle() steps those layers with
// the clip coefficient. The caller
// steps the parameters it did not, and counts the stepped ones' steps
// (`step` is the number this step uses). Fusion: without clipping, a layer
// called once is stepped from its landed gradient (the engine's staging
// buffer) with no .grad written; with keep_grads, or with clipping (settle()
// needs the gradient), it is added to .grad as the engine would, and
// without keep_grads that .grad is dropped once stepped. Ownership and
// threads as AdamWOverlap.
class AdafactorOverlap {
 public:
  struct Group {
    AdafactorConfig config;
    uint64_t seed = 0;
  };
  struct Param {
    torch::Tensor param;
    AdafactorStates states;
    int64_t step = 0;   // this step's number (the state's count + 1)
    torch::Tensor rms;  // 0-dim float32: the parameter's RMS before the step, written here
    uint64_t key = 0;
    size_t group = 0;
    // false: a tensor another rank of the node steps (offload(share_host_store=
    // "all") shards Adafactor by whole tensors): this rank drops its gradient
    // (keeps it in .grad with keep_grads) and leaves its norm to the owner;
    // states may be undefined.
    bool owned = true;
  };
  // loss_scale: as AdamWOverlap's; the layers' norms are taken and settle()
  // steps them (no speculation), or skips the step.
  AdafactorOverlap(std::shared_ptr<Engine> engine, std::vector<Group> groups, std::vector<Param> params,
                   std::optional<double> max_grad_norm, bool keep_grads = false,
                   std::optional<double> loss_scale = std::nullopt);
  ~AdafactorOverlap();
  AdafactorOverlap(const AdafactorOverlap&) = delete;
  AdafactorOverlap& operator=(const AdafactorOverlap&) = delete;
  // As AdamWOverlap's (kNormOnly, kStepped, kOtherRank); settle() steps the kNormOnly ones.
  std::vector<int> wait();
  float settle(double other_sum_of_squares, double* total_norm = nullptr, bool skip = false);
  bool skipped() const { return skipped_; }
  // As AdamWOverlap's: the norms' sum so far (sharded: of the tensors this rank owns).
  double sum_of_squares() const { return sum_sq_; }
  void set_sum_of_squares(double s) { sum_sq_ = s; }
  // After a failed backward: waits and removes the hook (stepped layers stay stepped).
  void abort();

 private:
  void on_layer(int layer, const Engine::LandedGradients* landed);
  void step_one(size_t index, const torch::Tensor& grad, float grad_scale);

  std::shared_ptr<Engine> engine_;
  std::vector<Group> groups_;
  std::vector<Param> params_;
  bool settles() const { return max_norm_.has_value() || scaled_; }

  std::optional<double> max_norm_;
  bool keep_grads_;
  bool scaled_ = false;
  float loss_mult_ = 1.f;
  bool skipped_ = false;
  std::vector<std::vector<AdamWOverlap::LayerParam>> by_layer_;
  std::mutex mu_;
  std::vector<int> status_;
  double sum_sq_ = 0;
  bool hooked_ = false;
  bool unsettled_ = false;  // it set Engine::set_unsettled_step (wait() with a layer stepped)
};

// ---------------------------------------------------------------- C++ AdamW
struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9, beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
  // clip_grad_norm_(all parameters, max_grad_norm) before each step.
  std::optional<double> max_grad_norm;
  std::string state_precision = "fp32";  // "fp32", "bf16" or "8bit"
  uint64_t seed = 0;                      // stochastic rounding
};

class AdamW {
 public:
  class Overlap;
  // One group; add_param_group() adds more (lr, betas, eps, weight_decay,
  // state_precision of its own; max_grad_norm and seed are the optimizer's:
  // a later group that sets another throws).
  // `params` must not be empty (throws, as torch.optim does). A tensor listed
  // twice (a tied weight: Module::parameters() lists it once per module that
  // registers it) is stepped once; in two groups, it throws.
  AdamW(std::vector<torch::Tensor> params, AdamWOptions options = {});
  void add_param_group(std::vector<torch::Tensor> params, AdamWOptions options);
  // Steps every parameter that has a gradient (clipping first if set).
  void step();
  void zero_grad(bool set_to_none = true);
  // The overlapped step (docs/design/optim.md, "Overlap"), as Python's
  // opt.overlap(handle): while the returned scope lives, `engine`'s streamed
  // layers are stepped on host threads as soon as their gradient lands; the
  // backward run inside must be the last one of this optimizer step (wrap
  // only the last micro-batch's). step() must come next: it waits for those
  // steps and steps the other parameters, with the result of the plain
  // step. With max_grad_norm, layers are stepped speculatively (unclipped)
  // within `speculation_bytes` of copies of their parameters and states
  // (nullopt: no limit unless the previous step clipped, then none) and
  // re-stepped in step() when the clip triggers. A scope left by an
  // exception restores the speculated layers (layers stepped without
  // clipping stay stepped, their kept .grad dropped: it was applied; zero
  // the gradients after a failed backward), and step() is then the plain step. Parameters must not be
  // written while the scope lives. The scope's end waits until every
  // layer's gradient has been consumed; the layers' gradients are consumed
  // in one pass with their update (AdamWOverlap, "Fusion"): their .grad is
  // left undefined unless `keep_grads` (then it holds the gradient as
  // after a plain backward, at the cost of writing it). Between the scope's
  // end and step(), the options and the parameters' .grad must stay as they
  // are: the streamed layers were stepped with them as they were, so step()
  // throws (after restoring the speculated layers) when a group's options
  // changed (a scheduler's lr: set it before the scope) or a .grad was
  // written in place, replaced or made by another backward (a hand clip: use
  // max_grad_norm), as Python's step() does. A write through .data() (LibTorch's
  // torch::nn::utils::clip_grad_norm_ writes so) escapes the version counters
  // this reads: clip with max_grad_norm.
  Overlap overlap(std::shared_ptr<Engine> engine, std::optional<int64_t> speculation_bytes = std::nullopt,
                  bool keep_grads = false);
  // Parameters the last overlapped step stepped (or, clipping, took the norm
  // of) during the backward.
  size_t last_overlap_params() const { return last_overlap_params_; }
  // The total gradient norm of the last step (NaN before, or when not clipping).
  double last_grad_norm() const { return last_norm_; }
  size_t num_groups() const { return groups_.size(); }
  AdamWOptions& group_options(size_t group) { return groups_.at(group).options; }
  // Bytes of optimizer state held (for reports).
  int64_t state_bytes() const;
  // Checkpoints, as torch::optim's save()/load() (torch::save(opt, path) and
  // torch::load(opt, path) call them): each group's lr, betas, eps,
  // weight_decay, seed and max_grad_norm, and each parameter's step count and
  // states, by position.
  // load() needs an optimizer built over parameters of the same shapes in the
  // same groups; it restores those options (as torch does) and keeps each
  // group's state_precision: states saved in another one are converted (as
  // adamw_adopt_states). A mismatch throws before anything changes. Neither
  // between overlap()'s scope and step().
  void save(torch::serialize::OutputArchive& archive) const;
  void load(torch::serialize::InputArchive& archive);

 private:
  struct Param {
    torch::Tensor param;
    AdamWStates states;
    int64_t step = 0;
    uint64_t key = 0;
  };
  struct Group {
    AdamWOptions options;
    StateFormat format;
    std::vector<Param> params;
  };
  std::vector<Group> groups_;
  uint64_t next_key_ = 0;
  double last_norm_ = std::nan("");
  // An overlapped backward's plan, from the scope's end to step(): the
  // parameters it covers and their step counters (0-dim float32, as
  // AdamWOverlap counts them).
  struct Pending {
    std::unique_ptr<AdamWOverlap> plan;
    std::vector<Param*> params;
    std::vector<torch::Tensor> steps;
    std::exception_ptr error;  // what the plan's thread threw (step() rethrows it)
    std::vector<AdamWOptions> options;  // each group's, when overlap() was called
    struct Grad {
      const Param* param;
      torch::Tensor grad;  // its .grad at the scope's end (undefined: none)
      int64_t version;
    };
    std::vector<Grad> grads;  // every parameter's, at the scope's end
  };
  std::unique_ptr<Pending> pending_;
  std::shared_ptr<OverlapBackups> backups_;  // the speculation's copies, kept across steps
  bool last_clipped_ = false;
  bool budget_checked_ = false;  // warn_uncounted_training() ran (at the first step)
  void warn_uncounted_training() const;
  size_t last_overlap_params_ = 0;
  // After a failed overlapped backward: restores the speculated layers and
  // copies the step counters of those that stay stepped.
  static void abort_pending(Pending& pending);
  // step() after an overlapped backward: throws (the plan aborted) when an
  // option or a .grad changed since (overlap()'s comment).
  void check_overlap_inputs(Pending& pending);
  // Copies the overlapped layers' step counters back; returns per parameter
  // of pending_ whether the plan counted it.
  std::vector<int> finish_pending(const std::vector<torch::Tensor>& other_grads, float* coef);
};

// torch::save(opt, path) / torch::load(opt, path) (found by argument-dependent lookup).
torch::serialize::OutputArchive& operator<<(torch::serialize::OutputArchive& archive, const AdamW& opt);
torch::serialize::InputArchive& operator>>(torch::serialize::InputArchive& archive, AdamW& opt);

// The scope AdamW::overlap() returns. Not copyable; movable.
class AdamW::Overlap {
 public:
  Overlap(Overlap&& o) noexcept;
  Overlap& operator=(Overlap&&) = delete;
  Overlap(const Overlap&) = delete;
  ~Overlap();

 private:
  friend class AdamW;
  Overlap(AdamW* opt, std::unique_ptr<Pending> pending);
  AdamW* opt_;
  std::unique_ptr<Pending> pending_;
  int exceptions_;  // std::uncaught_exceptions() when it began
};

}  // namespace optim
}  // namespace layerstream
