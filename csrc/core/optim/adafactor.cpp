// Adafactor with transformers' semantics (docs/design/optim.md, "Adafactor").
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "core/optim/internal.h"
#include "core/optim/kernels.h"
#include "core/optim/optim.h"

namespace layerstream {
namespace optim {

void check_adafactor(const AdafactorConfig& c) {
  const bool has_lr = c.lr >= 0.0;
  LS_CHECK(c.lr == c.lr, "Adafactor: lr must be a number or None, got NaN");
  LS_CHECK(!(has_lr && c.relative_step), "Adafactor: cannot combine a manual lr and relative_step=True "
           "(pass relative_step=False to use lr, or lr=None)");
  LS_CHECK(has_lr || c.relative_step, "Adafactor: lr=None needs relative_step=True (or give an lr)");
  LS_CHECK(!(c.warmup_init && !c.relative_step), "Adafactor: warmup_init=True requires relative_step=True");
  LS_CHECK(c.eps1 == c.eps1 && c.eps2 == c.eps2 && c.eps1 >= 0.0 && c.eps2 >= 0.0,
           "Adafactor: eps values must be >= 0");
  LS_CHECK(c.clip_threshold == c.clip_threshold && c.clip_threshold > 0.0,
           "Adafactor: clip_threshold must be > 0, got ", c.clip_threshold);
  LS_CHECK(c.decay_rate == c.decay_rate && c.decay_rate <= 0.0,
           "Adafactor: decay_rate must be <= 0 (beta2 = 1 - step^decay_rate), got ", c.decay_rate);
  LS_CHECK(c.beta1 == c.beta1 && c.beta1 < 1.0, "Adafactor: beta1 must be in [0, 1) or None, got ", c.beta1);
  LS_CHECK(c.weight_decay == c.weight_decay && c.weight_decay >= 0.0,
           "Adafactor: weight_decay must be >= 0, got ", c.weight_decay);
}

namespace {

// transformers' _get_lr. When the parameter scale is the RMS (a 0-dim fp32
// tensor there), the product is an fp32 tensor: `fp32` says so (the weight
// decay factor is then formed in fp32 too).
double lr_for(const AdafactorConfig& c, int64_t step, float rms, bool* fp32) {
  double rel = c.lr;
  if (c.relative_step) {
    const double min_step = c.warmup_init ? 1e-6 * static_cast<double>(step) : 1e-2;
    rel = std::min(min_step, 1.0 / std::sqrt(static_cast<double>(step)));
  }
  *fp32 = false;
  if (!c.scale_parameter) return 1.0 * rel;
  // max(eps2, RMS) returns eps2 (a Python float) unless RMS > eps2 (compared
  // in fp32).
  if (rms > static_cast<float>(c.eps2)) {
    *fp32 = true;
    return static_cast<double>(rms * static_cast<float>(rel));
  }
  return c.eps2 * rel;
}

// _rms(t) = t.norm(2) / (t.numel() ** 0.5): an fp32 norm over a Python float.
float rms_of(double sumsq, int64_t n) {
  const float norm = static_cast<float>(std::sqrt(sumsq));
  return norm / static_cast<float>(std::pow(static_cast<double>(n), 0.5));
}

}  // namespace

double adafactor_lr(const AdafactorConfig& c, int64_t step, float param_rms, bool* fp32) {
  bool f = false;
  const double lr = lr_for(c, step, param_rms, &f);
  if (fp32) *fp32 = f;
  return lr;
}

void adafactor_step(const AdafactorConfig& c, std::vector<AdafactorTensor>& tensors, float grad_scale,
                    uint64_t seed, ThreadPool* pool) {
  check_adafactor(c);
  const detail::Kernels& k = detail::kernels();
  const size_t nt = tensors.size();
  for (size_t i = 0; i < nt; ++i) {
    const AdafactorTensor& t = tensors[i];
    LS_CHECK(t.batch >= 0 && t.rows >= 0 && t.cols >= 0, "Adafactor tensor ", i, ": negative shape");
    if (t.numel() == 0) continue;
    LS_CHECK(t.param && t.grad, "Adafactor tensor ", i, ": parameter and gradient must be given");
    LS_CHECK(t.factored ? (t.exp_avg_sq_row && t.exp_avg_sq_col) : (t.exp_avg_sq != nullptr), "Adafactor tensor ",
             i, ": its second-moment state is missing");
    LS_CHECK(c.beta1 < 0.0 || t.exp_avg, "Adafactor tensor ", i, ": beta1 is set but exp_avg is missing");
    LS_CHECK(t.step >= 1, "Adafactor tensor ", i, ": step must be >= 1, got ", t.step);
  }

  // Phase 1: sums of squares of the parameters (their RMS) and, for
  // factored tensors, the row and column sums of grad^2 + eps1.
  std::vector<detail::AdafactorScalars> sc(nt);
  for (size_t i = 0; i < nt; ++i) {
    sc[i].grad_scale = grad_scale;
    sc[i].eps1 = static_cast<float>(c.eps1);
  }
  struct Chunk {
    size_t tensor;
    int64_t begin, end;
  };
  struct StatTask {
    size_t tensor;
    int64_t b, r0, r1;
    size_t col_part;  // index of its column partial sums
  };
  std::vector<Chunk> chunks;
  std::vector<StatTask> stats;
  std::vector<std::vector<double>> row_sums(nt);
  std::vector<std::vector<double>> col_parts;
  for (size_t i = 0; i < nt; ++i) {
    const AdafactorTensor& t = tensors[i];
    const int64_t n = t.numel();
    for (int64_t b = 0; b < n; b += detail::kChunk) chunks.push_back({i, b, std::min(n, b + detail::kChunk)});
    if (!t.factored || n == 0) continue;
    row_sums[i].assign(static_cast<size_t>(t.batch * t.rows), 0.0);
    // Row ranges of at least kChunk elements and at most 64 per matrix: fixed
    // by the shape, so the column sums are combined in the same order always.
    const int64_t per = std::max((detail::kChunk + t.cols - 1) / std::max<int64_t>(t.cols, 1), (t.rows + 63) / 64);
    for (int64_t b = 0; b < t.batch; ++b)
      for (int64_t r0 = 0; r0 < t.rows; r0 += per) {
        stats.push_back({i, b, r0, std::min(t.rows, r0 + per), col_parts.size()});
        col_parts.emplace_back(static_cast<size_t>(t.cols), 0.0);
      }
  }
  std::vector<double> p_part(chunks.size(), 0.0);
  const int64_t n_chunks = static_cast<int64_t>(chunks.size());
  detail::run_tasks(pool, n_chunks + static_cast<int64_t>(stats.size()), [&](int64_t n) {
    if (n < n_chunks) {
      const Chunk& ch = chunks[static_cast<size_t>(n)];
      const AdafactorTensor& t = tensors[ch.tensor];
      p_part[static_cast<size_t>(n)] = k.sumsq(Span{t.param, t.param_dtype, t.numel()}, ch.begin, ch.end);
      return;
    }
    const StatTask& st = stats[static_cast<size_t>(n - n_chunks)];
    const AdafactorTensor& t = tensors[st.tensor];
    k.af_stats(t, sc[st.tensor], st.b, st.r0, st.r1, row_sums[st.tensor].data() + st.b * t.rows + st.r0,
               col_parts[st.col_part].data());
  });

  // Serial: RMS, learning rate, beta2t; the factored second moments and
  // their factors (rows + cols values per matrix).
  std::vector<double> p_sum(nt, 0.0);
  for (size_t n = 0; n < chunks.size(); ++n) p_sum[chunks[n].tensor] += p_part[n];
  std::vector<std::vector<float>> rf(nt), cf(nt);
  std::vector<bool> lr_fp32(nt, false);
  std::vector<double> lr(nt, 0.0);
  size_t stat_index = 0;
  for (size_t i = 0; i < nt; ++i) {
    AdafactorTensor& t = tensors[i];
    detail::AdafactorScalars& s = sc[i];
    const int64_t n = t.numel();
    if (n == 0) continue;
    t.rms = rms_of(p_sum[i], n);
    bool fp32 = false;
    lr[i] = lr_for(c, t.step, t.rms, &fp32);
    lr_fp32[i] = fp32;
    const double beta2t = 1.0 - std::pow(static_cast<double>(t.step), c.decay_rate);
    s.b2t = static_cast<float>(beta2t);
    s.om_b2t = static_cast<float>(1.0 - beta2t);
    if (!t.factored) continue;
    std::vector<double> col(static_cast<size_t>(t.batch * t.cols), 0.0);
    for (; stat_index < stats.size() && stats[stat_index].tensor == i; ++stat_index) {
      const StatTask& st = stats[stat_index];
      const std::vector<double>& part = col_parts[st.col_part];
      double* dst = col.data() + st.b * t.cols;
      for (int64_t cc = 0; cc < t.cols; ++cc) dst[cc] += part[static_cast<size_t>(cc)];
    }
    rf[i].resize(static_cast<size_t>(t.batch * t.rows));
    cf[i].resize(static_cast<size_t>(t.batch * t.cols));
    for (int64_t b = 0; b < t.batch; ++b) {
      // exp_avg_sq_row.mul_(beta2t).add_(update.mean(dim=-1), alpha=1 - beta2t)
      float* row = t.exp_avg_sq_row + b * t.rows;
      double row_total = 0;
      for (int64_t r = 0; r < t.rows; ++r) {
        const float mean = static_cast<float>(row_sums[i][static_cast<size_t>(b * t.rows + r)]) /
                           static_cast<float>(t.cols);
        row[r] = row[r] * s.b2t + s.om_b2t * mean;
        row_total += row[r];
      }
      float* colv = t.exp_avg_sq_col + b * t.cols;
      for (int64_t cc = 0; cc < t.cols; ++cc) {
        const float mean = static_cast<float>(col[static_cast<size_t>(b * t.cols + cc)]) / static_cast<float>(t.rows);
        colv[cc] = colv[cc] * s.b2t + s.om_b2t * mean;
        cf[i][static_cast<size_t>(b * t.cols + cc)] = 1.0f / std::sqrt(colv[cc]);
      }
      // r_factor = (row / row.mean(dim=-1, keepdim=True)).rsqrt_()
      const float row_mean = static_cast<float>(row_total) / static_cast<float>(t.rows);
      for (int64_t r = 0; r < t.rows; ++r)
        rf[i][static_cast<size_t>(b * t.rows + r)] = 1.0f / std::sqrt(row[r] / row_mean);
    }
  }

  // Phase 2: the sum of squares of each tensor's update (not factored: the
  // second moment is updated here).
  std::vector<double> u_part(chunks.size(), 0.0);
  detail::run_tasks(pool, n_chunks, [&](int64_t n) {
    const Chunk& ch = chunks[static_cast<size_t>(n)];
    const AdafactorTensor& t = tensors[ch.tensor];
    u_part[static_cast<size_t>(n)] =
        k.af_update_sumsq(t, sc[ch.tensor], rf[ch.tensor].data(), cf[ch.tensor].data(), ch.begin, ch.end);
  });
  std::vector<double> u_sum(nt, 0.0);
  for (size_t n = 0; n < chunks.size(); ++n) u_sum[chunks[n].tensor] += u_part[n];
  for (size_t i = 0; i < nt; ++i) {
    const AdafactorTensor& t = tensors[i];
    detail::AdafactorScalars& s = sc[i];
    if (t.numel() == 0) continue;
    // update.div_((self._rms(update) / clip_threshold).clamp_(min=1.0)); update.mul_(lr)
    const float x = rms_of(u_sum[i], t.numel()) / static_cast<float>(c.clip_threshold);
    s.clip_div = x < 1.0f ? 1.0f : x;  // clamp(min=1): NaN stays NaN
    s.lr = static_cast<float>(lr[i]);
    s.first_moment = c.beta1 >= 0.0;
    s.beta1 = static_cast<float>(c.beta1);
    s.om_beta1 = static_cast<float>(1.0 - c.beta1);
    s.weight_decay = c.weight_decay != 0.0;
    s.neg_wd_lr = lr_fp32[i] ? static_cast<float>(-c.weight_decay) * s.lr
                             : static_cast<float>(-c.weight_decay * lr[i]);
  }

  // Phase 3: the parameter update.
  detail::run_tasks(pool, n_chunks, [&](int64_t n) {
    const Chunk& ch = chunks[static_cast<size_t>(n)];
    const AdafactorTensor& t = tensors[ch.tensor];
    k.af_apply(t, sc[ch.tensor], rf[ch.tensor].data(), cf[ch.tensor].data(),
               detail::chunk_keys(seed, t.key, t.step, ch.begin), ch.begin, ch.end);
  });
}

}  // namespace optim
}  // namespace layerstream
