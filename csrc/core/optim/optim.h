// layerstream — host optimizer kernels (torch-free, CUDA-free C++17).
//
// The arithmetic of one optimizer step over parameters that live in host
// memory, on raw spans: AdamW (torch.optim.AdamW's semantics and order of
// operations) with fp32, bf16 or 8-bit block-quantized states, Adafactor
// (transformers' Adafactor semantics), the global gradient norm and the
// clip coefficient of torch.nn.utils.clip_grad_norm_. The torch glue
// (layerstream/host_optim.h) and the Python optimizers (python/layerstream/optim.py)
// drive these; docs/design/optim.md has the design.
//
// Numbers: fp32 parameters are updated with torch's single-tensor AdamW
// operations in the same order, each rounded to fp32 (no fused multiply-add,
// a correctly rounded sqrt: results do not depend on the CPU; torch's own CPU
// kernels fuse lerp and round sqrt otherwise, so the two agree to ~1 ulp per
// step: docs/design/optim.md, "Agreement with torch"), bf16 parameters
// are updated in fp32 and written back by stochastic rounding (numerics.h).
// Results never depend on the number of threads: work is cut into chunks of
// a fixed size, sums are combined in chunk order.
//
// Memory: every span is caller-owned, contiguous in memory order (any dense
// layout works as long as a parameter, its gradient and its states share
// it), and must not overlap another span of the same call.
// Thread safety: the functions may be called from any thread; each call
// uses the given pool (ThreadPool::shared() by default), so calls on one
// pool run one after another.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "numerics.h"
#include "thread_pool.h"

namespace layerstream {
namespace optim {

// Element types of parameters and gradients.
enum class Dtype : uint8_t { F32 = 0, BF16 = 1 };
const char* dtype_name(Dtype d);

// Precision of AdamW's two moment states.
//   F32   4 + 4 bytes per element
//   BF16  2 + 2 bytes per element, written by stochastic rounding
//   Q8    1 + 1 bytes per element + 2 fp32 absmax per block of kQ8Block
enum class StateFormat : uint8_t { F32 = 0, BF16 = 1, Q8 = 2 };
// "fp32", "bf16" or "8bit" (the names users pass as state_precision=).
StateFormat parse_state_format(const std::string& name);
const char* state_format_name(StateFormat f);
// Bytes of one moment state of `numel` elements (codes only for Q8) and the
// number of fp32 absmax values it needs (0 unless Q8).
int64_t state_bytes(StateFormat f, int64_t numel);
int64_t state_absmax_count(StateFormat f, int64_t numel);

// Bytes of host memory one AdamW step reads and writes per element
// (parameter read + write, gradient read, both states read + write; the Q8
// absmax values are amortised over their block). The benchmark's GB/s.
double adamw_bytes_per_element(Dtype param, Dtype grad, StateFormat states);

// ---------------------------------------------------------------- training footprint
// offload(train=...) (docs/design/planner.md, "Training"): what a weight kept
// resident takes on its device beside itself while it trains: its gradient
// (in the weight's dtype) and the states an optimizer keeps for it there.
// For layerstream.optim the states are exactly what adamw_init_states /
// adafactor_init_states allocate (layerstream/host_optim.h).
struct TrainSpec {
  enum class States : uint8_t { None, AdamW, Adafactor, PerParam };
  bool enabled = false;  // false: the budget covers the weights only
  States states = States::None;
  StateFormat adamw = StateFormat::F32;  // States::AdamW
  bool adafactor_beta1 = false;          // States::Adafactor with a first moment (fp32, full size)
  double bytes_per_param = 0.0;          // States::PerParam (e.g. 8 for torch's AdamW on fp32 weights)
};
// "" or "none": off; "grads": gradients only; "adamw" (fp32 states), "adamw-bf16",
// "adamw-8bit", "adafactor" (beta1=None), "adafactor-beta1"; a number >= 0:
// gradients plus that many bytes of state per parameter. Anything else throws,
// naming the choices.
TrainSpec parse_train_spec(const std::string& s);
// Gradient and state bytes of one trainable tensor of `shape`, `elem_bytes` per element.
uint64_t train_bytes(const TrainSpec& spec, const std::vector<int64_t>& shape, uint64_t elem_bytes);

// ---------------------------------------------------------------- AdamW
struct AdamWConfig {
  double lr = 1e-3;
  double beta1 = 0.9, beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
};
// torch.optim.AdamW's argument rules (lr >= 0, eps >= 0, betas in [0, 1),
// weight_decay >= 0; NaN refused): throws layerstream::Error saying which.
void check_adamw(const AdamWConfig& c);

// One parameter tensor of an AdamW step.
struct AdamWTensor {
  void* param = nullptr;
  Dtype param_dtype = Dtype::F32;
  const void* grad = nullptr;
  Dtype grad_dtype = Dtype::F32;
  // The states, per StateFormat: float[numel], uint16_t[numel] (bf16 bits)
  // or uint8_t[numel] codes with float[state_absmax_count()] absmax values.
  // Zero-filled before the first step (that is the initial state).
  void* exp_avg = nullptr;
  void* exp_avg_sq = nullptr;
  float* exp_avg_absmax = nullptr;
  float* exp_avg_sq_absmax = nullptr;
  int64_t numel = 0;
  // The number of this step for this tensor (1 on its first), as torch's
  // state["step"] after its increment: the bias corrections use it.
  int64_t step = 1;
  // Identifies the tensor in the stochastic-rounding streams (e.g. its
  // position in the optimizer): two tensors of one step need distinct keys.
  uint64_t key = 0;
};

// One AdamW step over `tensors` (all with the same config and state format):
//   g = grad * grad_scale     (the clip coefficient; 1 multiplies exactly)
//   p = p * (1 - lr * wd)
//   m = lerp(m, g, 1 - beta1)
//   v = v * beta2 + (1 - beta2) * g * g
//   p = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
// with torch's scalar arithmetic (scalars in double, rounded to fp32 where
// torch rounds them). NaN and Inf propagate as in torch. `seed` is the
// stochastic rounding seed (any value; fp32 parameters and states use none).
void adamw_step(const AdamWConfig& config, StateFormat states, const std::vector<AdamWTensor>& tensors,
                float grad_scale = 1.0f, uint64_t seed = 0, ThreadPool* pool = nullptr);

// 8-bit states to and from fp32, for states loaded with another state_precision or
// another memory layout (docs/design/optim.md, "Converting states"). `n` elements in
// memory order, q8_blocks(n) absmax values; `first_moment`: exp_avg (signed codes), else
// exp_avg_sq. Decoding reads each element as the step does (its code's value times its
// block's absmax). Encoding takes each block's absmax as the step does and rounds each
// element to the nearest code (the step rounds stochastically; a one-off conversion
// wants the smallest error), so encoding decoded codes gives them back whenever their
// block holds its top code (every block a step wrote, unless all zero). A nonzero second
// moment keeps a nonzero code; a block with a NaN or Inf reads back as NaN. A negative
// second moment is not one: q8_encode returns false (nothing else is checked).
void q8_decode(const uint8_t* codes, const float* absmax, int64_t n, bool first_moment, float* out);
bool q8_encode(const float* x, int64_t n, bool first_moment, uint8_t* codes, float* absmax);

// ---------------------------------------------------------------- fused AdamW
// The overlapped step's fusion (docs/design/optim.md, "Fusion"): one pass
// over a tensor's host memory that assembles its gradient, takes its sum of
// squares, saves a copy of the parameter and states, and steps it. Where
// the gradient comes from, per tensor:
struct AdamWFused {
  // This backward's gradient (the engine's staging buffer), in grad_dtype.
  const void* landed = nullptr;
  // What earlier backward passes accumulated (.grad), or null: the gradient
  // is prior + landed, rounded to grad_dtype as torch's `grad += landed` is.
  const void* prior = nullptr;
  // Where the gradient is written (may be `prior`: accumulation in place), or
  // null: not kept (the pass reads it from `landed`, or from a per-thread
  // scratch chunk when there is a prior).
  void* out = nullptr;
  // A copy of the parameter, states and absmax values (same layout) taken
  // before the update (the speculation's backup), or all null.
  void* copy_param = nullptr;
  void* copy_exp_avg = nullptr;
  void* copy_exp_avg_sq = nullptr;
  float* copy_exp_avg_absmax = nullptr;
  float* copy_exp_avg_sq_absmax = nullptr;
};
// What a fused pass does besides assembling the gradient.
struct FusedWork {
  bool sum_squares = false;  // return each gradient's sum of squares
  bool update = true;        // copy (if asked) and step; false: only assemble and sum
};
// A fused pass over `tensors` (their `grad` is ignored: `sources` gives it;
// `grad_dtype` is its dtype), chunk by chunk: each chunk of gradient,
// parameter and states comes from memory once and the later phases (sum,
// copy, update) find it in cache. The results are bit for bit those of the
// separate passes: the add, sum_of_squares() of the gradient, the copy, and
// adamw_step() with the same config, grad_scale and seed. Returns each
// tensor's gradient sum of squares (0 unless work.sum_squares).
std::vector<double> adamw_fused(const AdamWConfig& config, StateFormat states, const std::vector<AdamWTensor>& tensors,
                                const std::vector<AdamWFused>& sources, FusedWork work, float grad_scale = 1.0f,
                                uint64_t seed = 0, ThreadPool* pool = nullptr);

// ---------------------------------------------------------------- norms
struct Span {
  const void* data = nullptr;
  Dtype dtype = Dtype::F32;
  int64_t numel = 0;
};
// The sum of squares of all elements, accumulated in double (NaN or Inf
// anywhere gives NaN or Inf, as torch's norm does).
double sum_of_squares(const std::vector<Span>& spans, ThreadPool* pool = nullptr);
// torch.nn.utils.clip_grad_norm_'s coefficient for a total 2-norm:
// min(max_norm / (total_norm + 1e-6), 1) computed as torch does, in fp32
// (1 / (float(total) + 1e-6f) * max_norm, then clamped to 1; NaN stays NaN).
float clip_coefficient(double total_norm, double max_norm);

// ---------------------------------------------------------------- Adafactor
// transformers.optimization.Adafactor (v4/v5) semantics; lr < 0 = none.
struct AdafactorConfig {
  double lr = -1;  // none: only with relative_step
  double eps1 = 1e-30, eps2 = 1e-3;
  double clip_threshold = 1.0;
  double decay_rate = -0.8;
  double beta1 = -1;  // < 0: no first moment
  double weight_decay = 0.0;
  bool scale_parameter = true;
  bool relative_step = true;
  bool warmup_init = false;
};
// transformers' rules (a manual lr and relative_step exclude each other,
// warmup_init needs relative_step, ...): throws layerstream::Error.
void check_adafactor(const AdafactorConfig& c);

// The devices of one param group's parameters ("cpu", "cuda:0", ...): the host
// and at most one other device, as an offloaded model has them (streamed
// weights on the host, resident layers on its GPU); two devices besides the
// host are refused (`group` numbers the group in the message).
void check_group_devices(const std::vector<std::string>& devices, int group);

// One parameter tensor of an Adafactor step. A parameter with two or more
// dimensions is factored: viewed as `batch` matrices of rows x cols (its
// last two dimensions), its second moment is kept as exp_avg_sq_row
// [batch * rows] and exp_avg_sq_col [batch * cols]; otherwise
// (factored = false, rows = 1, cols = numel) as exp_avg_sq [numel].
struct AdafactorTensor {
  void* param = nullptr;
  Dtype param_dtype = Dtype::F32;
  const void* grad = nullptr;
  Dtype grad_dtype = Dtype::F32;
  bool factored = false;
  int64_t batch = 1, rows = 1, cols = 0;
  float* exp_avg_sq_row = nullptr;
  float* exp_avg_sq_col = nullptr;
  float* exp_avg_sq = nullptr;
  float* exp_avg = nullptr;  // [numel] when beta1 is set
  int64_t step = 1;          // this step's number (1 on the first)
  uint64_t key = 0;          // as AdamWTensor::key
  // Out: the parameter's RMS before the step (transformers' state["RMS"]).
  float rms = 0.0f;
  int64_t numel() const { return batch * rows * cols; }
};
// The learning rate transformers' Adafactor uses for a step (its _get_lr):
// relative step min(1e-2 or 1e-6 * step with warmup_init, 1/sqrt(step)) or
// the manual lr, times max(eps2, param_rms) with scale_parameter. `fp32`
// (optional) tells whether transformers holds it as an fp32 tensor (scaled by
// the RMS): the weight decay factor is then formed in fp32 too.
double adafactor_lr(const AdafactorConfig& c, int64_t step, float param_rms, bool* fp32 = nullptr);
// One Adafactor step over `tensors` (updates rms of each).
void adafactor_step(const AdafactorConfig& config, std::vector<AdafactorTensor>& tensors,
                    float grad_scale = 1.0f, uint64_t seed = 0, ThreadPool* pool = nullptr);

// Which kernels run: "avx2" or "generic" (the CPU decides at first use;
// the results are identical).
const char* kernel_isa();

}  // namespace optim
}  // namespace layerstream
