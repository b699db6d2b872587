// layerstream — internal: the per-chunk loops of the host optimizers, compiled
// once per instruction set (kernels_generic.cpp: the compiler's baseline;
// kernels_avx2.cpp: AVX2; kernels_avx512.cpp: AVX-512 F/BW/VL/DQ with 512-bit
// vectors) from kernels_impl.h, and the table the dispatcher picks at first
// use (the widest the CPU runs; LS_OPTIM_ISA=generic or avx2 forces one).
// All variants compute the same IEEE operations in the same order (no fused
// multiply-add: -ffp-contract=off; reductions into fixed accumulators), so
// they give bit-identical results; only the vector width differs.
#pragma once

#include <cstdint>

#include "optim.h"

namespace layerstream {
namespace optim {
namespace detail {

// AdamW's per-tensor scalars, each rounded to fp32 where torch rounds it.
struct AdamWScalars {
  float grad_scale = 1.0f;
  float decay = 1.0f;         // 1 - lr * wd
  float w1 = 0.1f;            // lerp weight 1 - beta1
  float one_minus_w1 = 0.9f;  // 1 - w1 (lerp with a weight >= 0.5)
  bool small_w1 = true;       // |w1| < 0.5: torch's lerp formula choice
  float beta2 = 0.999f, omb2 = 0.001f;
  float bc2_sqrt = 1.0f;      // sqrt(1 - beta2^t)
  float eps = 1e-8f;
  float neg_step = -1e-3f;    // -lr / (1 - beta1^t)
  // bf16 parameters: the update with one division (kernels_impl.h).
  float neg_step_bc2 = -1e-3f;  // -lr / (1 - beta1^t) * sqrt(1 - beta2^t)
  float eps_bc2 = 1e-8f;        // eps * sqrt(1 - beta2^t)
};

// Random-stream keys of one chunk (32-bit element counters): the
// parameter's (and the bf16 states') rounding bits, and the 8-bit states'.
struct Keys {
  uint32_t param = 0, q8 = 0;
};

// Adafactor's per-tensor scalars.
struct AdafactorScalars {
  float grad_scale = 1.0f;
  float eps1 = 1e-30f;
  float b2t = 0.0f, om_b2t = 1.0f;  // beta2t, 1 - beta2t
  float clip_div = 1.0f;            // max(rms(update) / clip_threshold, 1)
  float lr = 0.0f;
  bool first_moment = false;
  float beta1 = 0.0f, om_beta1 = 1.0f;
  bool weight_decay = false;
  float neg_wd_lr = 0.0f;  // -weight_decay * lr
};

struct Kernels {
  const char* isa;
  // AdamW over elements [begin, end) of `t` (begin a multiple of kQ8Block);
  // the gradient is read from `grad_chunk` (its element `begin`) when given,
  // else from t.grad.
  void (*adamw)(const AdamWTensor& t, const void* grad_chunk, StateFormat f, const AdamWScalars& s, const Keys& k,
                int64_t begin, int64_t end);
  // out[i] = a[i] + b[i] for i < n, rounded to `dt` as torch's add is (bf16:
  // the fp32 sum rounded to nearest even); `out` may be `a`.
  void (*grad_add)(void* out, const void* a, const void* b, Dtype dt, int64_t n);
  // Sum of squares of elements [begin, end), in double.
  double (*sumsq)(const Span& s, int64_t begin, int64_t end);
  // Adafactor, factored: rows [r0, r1) of matrix `b` of `t`: row sums of
  // g*g + eps1 into row_sums[r - r0] and column sums added into col_sums
  // [cols] (both double; g scaled by grad_scale).
  void (*af_stats)(const AdafactorTensor& t, const AdafactorScalars& s, int64_t b, int64_t r0, int64_t r1,
                   double* row_sums, double* col_sums);
  // Adafactor: sum of squares of the update before clipping over flat
  // elements [begin, end); factored: r_factor [batch * rows], c_factor
  // [batch * cols]; not factored: also updates exp_avg_sq there.
  double (*af_update_sumsq)(const AdafactorTensor& t, const AdafactorScalars& s, const float* r_factor,
                            const float* c_factor, int64_t begin, int64_t end);
  // Adafactor: the parameter update over flat elements [begin, end).
  void (*af_apply)(const AdafactorTensor& t, const AdafactorScalars& s, const float* r_factor,
                   const float* c_factor, const Keys& k, int64_t begin, int64_t end);
};

namespace generic {
extern const Kernels kKernels;
}
namespace avx2 {
extern const Kernels kKernels;
}
namespace avx512 {
extern const Kernels kKernels;
}
// Whether this CPU (and OS) runs the AVX-512 loops (F, BW, VL, DQ).
bool avx512_usable();

}  // namespace detail
}  // namespace optim
}  // namespace layerstream
