// bench_fusion — the overlapped AdamW step's fused pass against the separate
// passes it replaces (issue 21, point 5; docs/design/optim.md, "Fusion").
//
//   bench_fusion [--mparams 64] [--tensors 16] [--reps 5] [--threads N]
//
// Per optimizer step, over --mparams million fp32 parameters in --tensors
// tensors (layers), each with fp32 AdamW states and a landed gradient (the
// engine's staging buffer):
//
//   separate  what the hook did before fusion, per tensor: the landed
//             gradient added to .grad (a fresh tensor: allocate + copy, as the
//             engine's first accumulation does; with earlier micro-batches,
//             added in place), its sum of squares (clipping), the
//             speculation's copy of parameter and states (clipping), the step
//   fused     adamw_fused(): one pass doing all of it, no .grad written
//
// for k = 1 micro-batch (no earlier .grad) and k > 1 (an earlier .grad to add
// to), without and with clipping. Times are the best of --reps steps; the
// results of the two are bit for bit the same (tests/cpp/test_optim.cpp,
// FusedPassEqualsTheSeparatePasses).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "core/optim/optim.h"

namespace o = layerstream::optim;

namespace {

struct Tensor {
  std::vector<float> p, m, v, landed, prior, copy_p, copy_m, copy_v;
};

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

o::AdamWTensor view(Tensor& t, int64_t step, uint64_t key) {
  o::AdamWTensor a;
  a.param = t.p.data();
  a.exp_avg = t.m.data();
  a.exp_avg_sq = t.v.data();
  a.numel = static_cast<int64_t>(t.p.size());
  a.step = step;
  a.key = key;
  return a;
}

// dst[j] = src[j] (add: dst[j] += src[j]) on the pool, in chunks, as torch's
// copy_ / add_ run on their threads.
void parallel(float* dst, const float* src, size_t n, bool add, o::ThreadPool& pool) {
  const int64_t chunk = 65536, tasks = static_cast<int64_t>((n + chunk - 1) / chunk);
  pool.run(tasks, [&](int64_t t) {
    const size_t b = static_cast<size_t>(t * chunk), e = std::min(n, b + chunk);
    if (add) {
      for (size_t j = b; j < e; ++j) dst[j] += src[j];
    } else {
      std::memcpy(dst + b, src + b, (e - b) * sizeof(float));
    }
  });
}

// One step the way the hook did it before fusion.
void separate(std::vector<Tensor>& ts, bool prior, bool clip, int64_t step, o::ThreadPool& pool) {
  o::AdamWConfig c;
  for (size_t i = 0; i < ts.size(); ++i) {
    Tensor& t = ts[i];
    const size_t n = t.p.size();
    std::unique_ptr<float[]> fresh;
    float* grad;
    if (prior) {  // .grad holds earlier micro-batches: grad += landed
      grad = t.prior.data();
      parallel(grad, t.landed.data(), n, true, pool);
    } else {  // a new .grad: allocated (page faults) and copied
      fresh.reset(new float[n]);
      grad = fresh.get();
      parallel(grad, t.landed.data(), n, false, pool);
    }
    if (clip) {
      volatile double sum = o::sum_of_squares({o::Span{grad, o::Dtype::F32, static_cast<int64_t>(n)}}, &pool);
      (void)sum;
      parallel(t.copy_p.data(), t.p.data(), n, false, pool);
      parallel(t.copy_m.data(), t.m.data(), n, false, pool);
      parallel(t.copy_v.data(), t.v.data(), n, false, pool);
    }
    o::AdamWTensor a = view(t, step, i);
    a.grad = grad;
    o::adamw_step(c, o::StateFormat::F32, {a}, 1.0f, 0, &pool);
  }
}

void fused(std::vector<Tensor>& ts, bool prior, bool clip, int64_t step, o::ThreadPool& pool) {
  o::AdamWConfig c;
  for (size_t i = 0; i < ts.size(); ++i) {
    Tensor& t = ts[i];
    o::AdamWFused src;
    src.landed = t.landed.data();
    src.prior = prior ? t.prior.data() : nullptr;
    if (clip) {
      src.copy_param = t.copy_p.data();
      src.copy_exp_avg = t.copy_m.data();
      src.copy_exp_avg_sq = t.copy_v.data();
    }
    o::adamw_fused(c, o::StateFormat::F32, {view(t, step, i)}, {src}, o::FusedWork{clip, true}, 1.0f, 0, &pool);
  }
}

}  // namespace

int main(int argc, char** argv) {
  double mparams = 64;
  int tensors = 16, reps = 5, threads = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--mparams") mparams = std::atof(next());
    else if (a == "--tensors") tensors = std::atoi(next());
    else if (a == "--reps") reps = std::atoi(next());
    else if (a == "--threads") threads = std::atoi(next());
    else {
      std::fprintf(stderr, "usage: bench_fusion [--mparams 64] [--tensors 16] [--reps 5] [--threads N]\n");
      return 2;
    }
  }
  const size_t per = static_cast<size_t>(mparams * 1e6 / tensors);
  o::ThreadPool pool(threads > 0 ? threads : o::ThreadPool::shared().threads());
  std::vector<Tensor> ts(static_cast<size_t>(tensors));
  for (size_t i = 0; i < ts.size(); ++i) {
    Tensor& t = ts[i];
    for (auto* x : {&t.p, &t.m, &t.v, &t.landed, &t.prior, &t.copy_p, &t.copy_m, &t.copy_v}) x->assign(per, 0.0f);
    for (size_t j = 0; j < per; ++j) {
      t.p[j] = static_cast<float>((j * 2654435761u + i) % 1000) * 1e-3f;
      t.landed[j] = static_cast<float>((j * 40503u + 7 * i) % 997) * 1e-4f - 0.05f;
      t.prior[j] = t.landed[j] * 0.5f;
    }
  }
  const double total = static_cast<double>(per) * tensors;
  std::printf("bench_fusion: %.1fM fp32 parameters in %d tensors, fp32 states, %d threads, best of %d (kernels: %s)\n",
              total / 1e6, tensors, pool.threads(), reps, o::kernel_isa());
  std::printf("| micro-batches | clipping | separate passes ms | fused ms | ns/param separate | ns/param fused | speed-up |\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  int64_t step = 1;
  for (bool prior : {false, true}) {
    for (bool clip : {false, true}) {
      double best[2] = {1e30, 1e30};
      for (int r = 0; r < reps + 1; ++r) {  // the first round warms up
        for (int which = 0; which < 2; ++which) {
          const double t0 = now();
          if (which == 0) separate(ts, prior, clip, step, pool);
          else fused(ts, prior, clip, step, pool);
          const double dt = now() - t0;
          if (r > 0) best[which] = std::min(best[which], dt);
          ++step;
          if (prior)  // the next step's earlier micro-batches
            for (auto& t : ts) std::memcpy(t.prior.data(), t.landed.data(), per * sizeof(float));
        }
      }
      std::printf("| %s | %s | %.1f | %.1f | %.2f | %.2f | %.2fx |\n", prior ? "k > 1" : "1", clip ? "yes" : "no",
                  best[0] * 1e3, best[1] * 1e3, best[0] / total * 1e9, best[1] / total * 1e9, best[0] / best[1]);
    }
  }
  return 0;
}
