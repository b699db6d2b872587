// layerstream::optim::AdamW (layerstream/host_optim.h), the C++ optimizer, on a model
// streamed by the C++ offload() (sim device), against clip_grad_norm_ and
// AdamW written out with torch ops in torch.optim.AdamW's order (Python's
// single-tensor path: lerp for the first moment).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <unistd.h>
#include <mutex>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/log.h"
#include "layerstream/offload.h"
#include "layerstream/host_optim.h"

namespace {

struct NetImpl : torch::nn::Module {
  layerstream::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::LayerNorm norm{nullptr};
  NetImpl() {
    fc1 = register_module("fc1", layerstream::nn::Linear(8, 32));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({32})));
    fc2 = register_module("fc2", layerstream::nn::Linear(32, 4));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::tanh(norm(fc1(x)))); }
};
TORCH_MODULE(Net);

// A resident Net with `model`'s parameter values (the reference).
Net twin_of(Net& model) {
  Net ref;
  torch::NoGradGuard ng;
  auto src = model->named_parameters();
  for (auto& p : ref->named_parameters()) p.value().copy_(src[p.key()]);
  return ref;
}

// `model` streamed by the C++ offload() on the sim device.
auto offload_sim(Net& model) {
  layerstream::OffloadOptions o;
  o.device = "sim";
  return layerstream::offload(*model, o);
}

// torch.optim.AdamW's single-tensor step with clip_grad_norm_ first.
struct Reference {
  std::vector<torch::Tensor> params, m, v;
  double lr = 1e-2, b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 1e-2, max_norm;
  int64_t step = 0;
  Reference(std::vector<torch::Tensor> p, double max_norm) : params(std::move(p)), max_norm(max_norm) {
    for (auto& t : params) {
      m.push_back(torch::zeros_like(t));
      v.push_back(torch::zeros_like(t));
    }
  }
  double update() {
    torch::NoGradGuard ng;
    const double norm = torch::nn::utils::clip_grad_norm_(params, max_norm);
    ++step;
    const double bc1 = 1 - std::pow(b1, static_cast<double>(step)), bc2 = 1 - std::pow(b2, static_cast<double>(step));
    for (size_t i = 0; i < params.size(); ++i) {
      const torch::Tensor& g = params[i].grad();
      params[i].mul_(1 - lr * wd);
      m[i].lerp_(g, 1 - b1);
      v[i].mul_(b2).addcmul_(g, g, 1 - b2);
      params[i].addcdiv_(m[i], (v[i].sqrt() / std::pow(bc2, 0.5)).add_(eps), -(lr / bc1));
    }
    return norm;
  }
};

TEST(TorchOptim, AdamWOnStreamedParametersMatchesTorch) {
  torch::manual_seed(0);
  Net model;
  Net ref = twin_of(model);
  auto handle = offload_sim(model);
  ASSERT_EQ(handle->layers().size(), 2u);

  layerstream::optim::AdamWOptions opts;
  opts.lr = 1e-2;
  opts.max_grad_norm = 0.3;
  layerstream::optim::AdamW opt(model->parameters(), opts);
  Reference want(ref->parameters(), 0.3);
  int clipped = 0;
  for (int s = 0; s < 12; ++s) {
    const torch::Tensor x = torch::randn({16, 8}) * (s % 2 ? 0.2 : 3.0);
    model->forward(x).square().mean().backward();
    ref->forward(x).square().mean().backward();
    const double norm = want.update();
    clipped += norm > 0.3;
    opt.step();
    EXPECT_NEAR(opt.last_grad_norm(), norm, 1e-6 * norm);
    opt.zero_grad();
    ref->zero_grad();
    for (const auto& p : model->parameters()) EXPECT_FALSE(p.grad().defined());
  }
  EXPECT_GT(clipped, 0);
  EXPECT_LT(clipped, 12);
  auto got = model->named_parameters();
  for (const auto& p : ref->named_parameters()) {
    const torch::Tensor a = got[p.key()], b = p.value();
    const double scale = b.abs().max().item<double>();
    EXPECT_TRUE(torch::allclose(a, b, 1e-6, 1e-6 * scale)) << p.key() << " max diff "
                                                           << (a - b).abs().max().item<double>();
  }
  // fp32 states of 8 + 4 bytes of every parameter element.
  int64_t numel = 0;
  for (const auto& p : model->parameters()) numel += p.numel();
  EXPECT_EQ(opt.state_bytes(), 8 * numel);
  handle->detach();
}

// Engine::set_grad_ready_hook (issue 21): each streamed layer's hook call
// comes after its .grad holds this backward's gradient (equal to the
// resident model's), during the backward (before it returns); a second
// backward accumulates before its calls; without a hook nothing is queued.
TEST(TorchOptim, GradReadyHookSeesCompleteGradients) {
  torch::manual_seed(3);
  Net model;
  Net ref = twin_of(model);
  auto handle = offload_sim(model);
  auto engine = handle->engine();
  std::mutex mu;
  std::vector<int> calls;
  std::vector<torch::Tensor> seen;  // the weight gradients at hook time
  engine->set_grad_ready_hook([&](int layer) {
    const auto [w, b] = engine->layer_parameters(layer);
    std::lock_guard<std::mutex> lock(mu);
    calls.push_back(layer);
    seen.push_back(w.grad().defined() ? w.grad().clone() : torch::Tensor());
  });
  for (int round = 0; round < 2; ++round) {  // the second accumulates into .grad
    const torch::Tensor x = torch::randn({8, 8});
    model->forward(x).square().mean().backward();
    ref->forward(x).square().mean().backward();
    engine->wait_grad_ready();
    std::lock_guard<std::mutex> lock(mu);
    ASSERT_EQ(calls.size(), 2u * static_cast<size_t>(round + 1));
    std::vector<int> last(calls.end() - 2, calls.end());
    std::sort(last.begin(), last.end());
    EXPECT_EQ(last, (std::vector<int>{0, 1}));
    for (size_t k = calls.size() - 2; k < calls.size(); ++k) {
      const torch::Tensor& want = calls[k] == 0 ? ref->fc1->weight.grad() : ref->fc2->weight.grad();
      ASSERT_TRUE(seen[k].defined());
      EXPECT_TRUE(torch::equal(seen[k], want)) << "layer " << calls[k] << " round " << round;
    }
  }
  engine->set_grad_ready_hook({});
  model->forward(torch::randn({8, 8})).sum().backward();
  engine->wait_grad_ready();
  EXPECT_EQ(calls.size(), 4u);
  auto [w, b] = engine->layer_parameters(0);
  EXPECT_TRUE(w.is_same(model->fc1->weight));
  EXPECT_TRUE(b.is_same(model->fc1->bias));
  handle->detach();
}

// Engine::set_grad_consume_hook (issue 21, fusion): a layer called once is
// handed over with its landed gradients (equal to the resident model's) and
// the engine never adds them to .grad, in this backward or at its end.
TEST(TorchOptim, GradConsumeHookTakesTheLandedGradients) {
  torch::manual_seed(4);
  Net model;
  Net ref = twin_of(model);
  auto handle = offload_sim(model);
  auto engine = handle->engine();
  std::mutex mu;
  std::vector<int> calls;
  std::vector<torch::Tensor> weights, biases;  // copies of the landed gradients
  engine->set_grad_consume_hook([&](int layer, const layerstream::Engine::LandedGradients* landed) {
    std::lock_guard<std::mutex> lock(mu);
    calls.push_back(layer);
    ASSERT_NE(landed, nullptr);
    weights.push_back(landed->weight.clone());
    biases.push_back(landed->bias.clone());
  });
  const torch::Tensor x = torch::randn({8, 8});
  model->forward(x).square().mean().backward();
  ref->forward(x).square().mean().backward();
  engine->wait_grad_ready();
  engine->set_grad_consume_hook({});
  ASSERT_EQ(calls.size(), 2u);
  for (size_t k = 0; k < 2; ++k) {
    const auto& lin = calls[k] == 0 ? ref->fc1 : ref->fc2;
    EXPECT_TRUE(torch::equal(weights[k], lin->weight.grad())) << "layer " << calls[k];
    EXPECT_TRUE(torch::equal(biases[k], lin->bias.grad())) << "layer " << calls[k];
  }
  handle->synchronize();
  EXPECT_FALSE(model->fc1->weight.grad().defined());
  EXPECT_FALSE(model->fc2->bias.grad().defined());
  EXPECT_TRUE(model->norm->weight.grad().defined());  // resident: autograd's own
  // Without a hook, the next backward applies them to .grad again.
  model->forward(x).square().mean().backward();
  EXPECT_TRUE(torch::equal(model->fc1->weight.grad(), ref->fc1->weight.grad()));
  handle->detach();
}

TEST(TorchOptim, GroupsPrecisionsAndErrors) {
  torch::manual_seed(1);
  auto a = torch::randn({300}, torch::requires_grad());
  auto b = torch::randn({40, 7}, torch::TensorOptions().dtype(torch::kBFloat16).requires_grad(true));
  layerstream::optim::AdamWOptions o1, o2;
  o2.state_precision = "8bit";
  o2.lr = 0.0;  // a group that must not move
  layerstream::optim::AdamW opt({a}, o1);
  opt.add_param_group({b}, o2);
  const auto b0 = b.detach().clone();
  a.mutable_grad() = torch::ones_like(a);
  b.mutable_grad() = torch::ones_like(b);
  opt.step();
  EXPECT_TRUE(torch::equal(b, b0));  // lr 0 (weight decay x lr = 0 too)
  EXPECT_FALSE(torch::equal(a, torch::zeros_like(a)));
  EXPECT_EQ(opt.state_bytes(), 300 * 8 + 280 * 2 + 2 * 4 * 2 /* two 8-bit blocks' absmax */);
  opt.group_options(1).lr = 1e-2;  // a scheduler's change
  opt.step();
  EXPECT_FALSE(torch::equal(b, b0));

  // Named by its place in the group (behind one without a gradient), in the C++ spelling.
  auto sparse = torch::randn({4, 3}, torch::requires_grad());
  auto no_grad = torch::randn({2}, torch::requires_grad());
  layerstream::optim::AdamW s({no_grad, sparse});
  sparse.mutable_grad() = torch::randn({4, 3}).to_sparse();
  try {
    s.step();
    FAIL() << "no error for a sparse gradient";
  } catch (const layerstream::Error& e) {
    EXPECT_NE(e.message().find("layerstream::optim::AdamW: parameter 1 of param group 0 has a sparse gradient"),
              std::string::npos) << e.message();
    EXPECT_NE(e.message().find("torch::optim::SparseAdam"), std::string::npos) << e.message();
    EXPECT_EQ(e.message().find("nn.Embedding("), std::string::npos) << e.message();
  }
  EXPECT_THROW(layerstream::optim::AdamW({a}, [] {
                 layerstream::optim::AdamWOptions o;
                 o.beta1 = 1.0;
                 return o;
               }()),
               layerstream::Error);
  EXPECT_THROW(opt.add_param_group({a}, o1), layerstream::Error);  // already in a group
}

// An empty parameter list is refused, as torch.optim refuses it: step() would
// otherwise do nothing, silently (a model's parameters not made yet, a filter
// that kept none).
TEST(TorchOptim, AdamWRefusesAnEmptyParameterList) {
  try {
    layerstream::optim::AdamW opt(std::vector<torch::Tensor>{});
    FAIL() << "no error for an empty parameter list";
  } catch (const layerstream::Error& e) {
    EXPECT_NE(e.message().find("empty parameter list"), std::string::npos) << e.message();
  }
  torch::nn::Linear net(3, 2);
  layerstream::optim::AdamW opt(net->parameters());  // a model's parameters: fine
  opt.add_param_group({}, {});  // an empty extra group is harmless, as in torch
  // A group's own max_grad_norm was dropped silently: the optimizer's.
  layerstream::optim::AdamWOptions clip;
  clip.max_grad_norm = 1.0;
  try {
    opt.add_param_group({torch::zeros({2}, torch::requires_grad())}, clip);
    FAIL() << "no error for a group's own max_grad_norm";
  } catch (const layerstream::Error& e) {
    EXPECT_NE(e.message().find("max_grad_norm is the optimizer's"), std::string::npos) << e.message();
  }
  EXPECT_EQ(opt.num_groups(), 2u);
}

}  // namespace

namespace {

// Two identical offloaded models and their optimizers: `a` to step plainly, `b` with
// AdamW::overlap() around a backward.
struct TwinRuns {
  Net plain;
  Net overlapped;
  decltype(offload_sim(std::declval<Net&>())) ha, hb;
  layerstream::optim::AdamW a, b;
  explicit TwinRuns(const layerstream::optim::AdamWOptions& opts)
      : overlapped(twin_of(plain)),
        ha(offload_sim(plain)),
        hb(offload_sim(overlapped)),
        a(plain->parameters(), opts),
        b(overlapped->parameters(), opts) {}
};

// One stepped plainly, one with AdamW::overlap() around the last micro-batch's backward;
// `speculation` as AdamW::overlap() takes it.
void expect_overlap_equals_plain_step(std::optional<int64_t> speculation) {
  layerstream::optim::AdamWOptions opts;
  opts.lr = 1e-2;
  opts.max_grad_norm = 0.3;
  TwinRuns runs(opts);
  Net &plain = runs.plain, &overlapped = runs.overlapped;
  auto& hb = runs.hb;
  layerstream::optim::AdamW &a = runs.a, &b = runs.b;
  int clipped = 0;
  for (int s = 0; s < 8; ++s) {
    for (int micro = 0; micro < 2; ++micro) {  // accumulation: only the last backward steps layers early
      const torch::Tensor x = torch::randn({16, 8});
      const double weight = s % 3 ? 0.01 : 10.0;  // the gradients' scale: the clip triggers on some steps
      (plain->forward(x).square().mean() * weight).backward();
      torch::Tensor loss = overlapped->forward(x).square().mean() * weight;
      if (micro == 0) {
        loss.backward();
      } else {
        auto scope = b.overlap(hb->engine(), speculation);
        loss.backward();
      }
    }
    a.step();
    b.step();
    EXPECT_EQ(b.last_overlap_params(), 4u) << "fc1 and fc2, weight and bias, during the backward";
    EXPECT_NEAR(b.last_grad_norm(), a.last_grad_norm(), 1e-6 * a.last_grad_norm());
    clipped += a.last_grad_norm() > 0.3;
    a.zero_grad();
    b.zero_grad();
  }
  EXPECT_GT(clipped, 0);
  EXPECT_LT(clipped, 8);
  auto got = overlapped->named_parameters();
  for (const auto& p : plain->named_parameters()) {
    const torch::Tensor x = got[p.key()], y = p.value();
    EXPECT_TRUE(torch::allclose(x, y, 1e-6, 1e-6 * y.abs().max().item<double>()))
        << p.key() << " max diff " << (x - y).abs().max().item<double>();
  }
}

}  // namespace

// AdamW::overlap() (issue 21, point 6: the overlap in C++ too): streamed layers stepped
// during the last backward, with clipping active on some steps, speculating without a
// bound, with none (norms only), and by the default rule; equal to the plain step.
TEST(TorchOptim, OverlappedStepEqualsThePlainStep) {
  torch::manual_seed(1);
  expect_overlap_equals_plain_step(std::nullopt);
  expect_overlap_equals_plain_step(-1);
  expect_overlap_equals_plain_step(0);
}

// A tensor listed twice in one group (Module::parameters() lists a tied weight once per
// module that registers it) was stepped twice per step, with two states.
TEST(TorchOptim, AParameterListedTwiceIsSteppedOnce) {
  auto w = torch::ones({2, 2}, torch::requires_grad());
  auto v = torch::ones({2, 2}, torch::requires_grad());
  layerstream::optim::AdamWOptions o;
  o.lr = 0.1;
  o.weight_decay = 0.0;
  layerstream::optim::AdamW twice({w, w}, o), once({v}, o);
  w.mutable_grad() = torch::full({2, 2}, 0.5);
  v.mutable_grad() = torch::full({2, 2}, 0.5);
  twice.step();
  once.step();
  EXPECT_TRUE(torch::equal(w, v)) << w;
  EXPECT_NEAR(w[0][0].item<float>(), 0.9f, 1e-6);
}

// A scope left by an exception after a complete backward: the layers stepped during it
// stay stepped; with keep_grads their gradient was still in .grad and step() (the plain
// step after an abort) stepped them again.
TEST(TorchOptim, AScopeLeftByAnExceptionKeepingGradsStepsEachLayerOnce) {
  torch::manual_seed(3);
  layerstream::optim::AdamWOptions opts;
  opts.lr = 1e-2;
  TwinRuns runs(opts);
  Net &plain = runs.plain, &overlapped = runs.overlapped;
  layerstream::optim::AdamW &a = runs.a, &b = runs.b;
  const torch::Tensor x = torch::randn({16, 8});
  plain->forward(x).square().mean().backward();
  try {
    auto scope = b.overlap(runs.hb->engine(), std::nullopt, /*keep_grads=*/true);
    overlapped->forward(x).square().mean().backward();
    throw std::runtime_error("the user's own error");
  } catch (const std::runtime_error&) {
  }
  a.step();
  b.step();
  auto got = overlapped->named_parameters();
  for (const auto& p : plain->named_parameters())
    EXPECT_TRUE(torch::equal(got[p.key()], p.value())) << p.key();
}

// Between the overlap() scope and step(): an option set (a scheduler's lr), a .grad
// written in place (a hand clip: of the LayerNorm's two without keep_grads, of all six
// with it), or another backward. Each reached only what step() steps, silently; now step()
// throws, as Python's does, and the next step is the plain one.
TEST(TorchOptim, ChangesBetweenTheOverlapScopeAndStepAreRefused) {
  using Change = std::function<void(Net&, layerstream::optim::AdamW&, const torch::Tensor&)>;
  auto expect_refused = [](const Change& change, bool keep_grads, const std::string& says) {
    torch::manual_seed(4);
    layerstream::optim::AdamWOptions opts;
    opts.lr = 1e-2;
    TwinRuns runs(opts);
    const torch::Tensor x = torch::randn({16, 8});
    {
      auto scope = runs.b.overlap(runs.hb->engine(), std::nullopt, keep_grads);
      runs.overlapped->forward(x).square().mean().backward();
    }
    change(runs.overlapped, runs.b, x);
    try {
      runs.b.step();
      ADD_FAILURE() << "no error; expected: " << says;
    } catch (const layerstream::Error& e) {
      EXPECT_NE(e.message().find(says), std::string::npos) << e.message();
    }
    runs.b.zero_grad();
    runs.overlapped->forward(x).square().mean().backward();
    runs.b.step();  // plain: nothing pending
  };
  expect_refused([](Net&, layerstream::optim::AdamW& opt, const torch::Tensor&) { opt.group_options(0).lr = 1e-3; },
                 false, "group 0's lr from 0.01 to 0.001 after overlap()");
  for (bool keep : {false, true})
    expect_refused([](Net& m, layerstream::optim::AdamW&, const torch::Tensor&) {
      // A clip by hand (LibTorch's clip_grad_norm_ writes through .data(), which the
      // version counters do not see: host_optim.h says so).
      for (auto& p : m->parameters())
        if (p.grad().defined()) p.mutable_grad().mul_(0.5);
    }, keep, keep ? "the .grad of 6 parameter(s) changed" : "the .grad of 2 parameter(s) changed");
  // A forward there is refused before it computes, as are torch::save() of the model
  // (Note [No call between an overlapped backward and its step]); step() then steps as
  // the plain run does, and both work again after it.
  torch::manual_seed(4);
  layerstream::optim::AdamWOptions opts;
  opts.lr = 1e-2;
  TwinRuns runs(opts);
  const torch::Tensor x = torch::randn({16, 8});
  {
    auto scope = runs.b.overlap(runs.hb->engine());
    runs.overlapped->forward(x).square().mean().backward();
  }
  for (const auto& [what, call] : std::vector<std::pair<std::string, std::function<void()>>>{
           {"was called between an overlapped backward", [&] { runs.overlapped->forward(x); }},
           {"torch::save() of streamed layer", [&] {
              std::stringstream out;
              torch::save(runs.overlapped, out);
            }}}) {
    try {
      call();
      ADD_FAILURE() << "no error; expected: " << what;
    } catch (const layerstream::Error& e) {
      EXPECT_NE(e.message().find(what), std::string::npos) << e.message();
    }
  }
  runs.b.step();
  runs.plain->forward(x).square().mean().backward();
  runs.a.step();
  for (size_t i = 0; i < runs.plain->parameters().size(); ++i)
    EXPECT_TRUE(torch::equal(runs.plain->parameters()[i], runs.overlapped->parameters()[i])) << i;
  std::stringstream out;
  torch::save(runs.overlapped, out);
  runs.overlapped->forward(x);
}

TEST(TorchOptim, OverlapTwiceWithoutStepIsAnError) {
  Net model;
  auto handle = offload_sim(model);
  layerstream::optim::AdamW opt(model->parameters());
  { auto scope = opt.overlap(handle->engine()); }
  try {
    auto again = opt.overlap(handle->engine());
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("has not been followed by step()"), std::string::npos) << e.what();
  }
  opt.step();
}

// A budget without OffloadOptions::train kept trainable layers on the device:
// the first step says once what their gradients and states take beyond it
// (optim::note_uncounted_training, the registry Python's optimizers read too);
// with train set, after detach(), or for frozen layers, nothing.
TEST(TorchOptim, ABudgetThatDidNotCountTrainingIsNamedOnce) {
  auto said = [](auto& model, const torch::Tensor& x) {
    std::vector<std::string> warnings;
    auto prev = layerstream::set_warning_handler([&](const std::string& w) { warnings.push_back(w); });
    layerstream::optim::AdamWOptions o;
    o.state_precision = "bf16";
    layerstream::optim::AdamW opt(model->parameters(), o);
    for (int i = 0; i < 2; ++i) {
      model->forward(x).square().mean().backward();
      opt.step();
      opt.zero_grad();
    }
    layerstream::set_warning_handler(prev);
    return warnings;
  };
  auto budgeted = [](torch::nn::Module& model, const std::string& train) {
    layerstream::OffloadOptions o;
    o.device = "sim";
    o.budget_bytes = 4 << 20;  // every layer resident
    o.train = train;
    return layerstream::offload(model, o);
  };
  auto stack = [] {
    return torch::nn::Sequential(layerstream::nn::Linear(256, 256), torch::nn::Tanh(), layerstream::nn::Linear(256, 256));
  };
  const torch::Tensor x = torch::randn({4, 256});
  auto model = stack();
  auto handle = budgeted(*model, "");
  EXPECT_EQ(handle->resident_layers().size(), 2u) << handle->plan();
  const auto w = said(model, x);
  ASSERT_EQ(w.size(), 1u);
  // 4 fp32 parameters of 2 x (256 x 256 + 256) elements: an fp32 gradient and two bf16 states each.
  char mib[32];
  std::snprintf(mib, sizeof mib, "%.2f", 2.0 * (256 * 256 + 256) * (4 + 2 + 2) / (1 << 20));
  EXPECT_NE(w[0].find("4 parameter(s)"), std::string::npos) << w[0];
  EXPECT_NE(w[0].find(std::string("take ") + mib + " MiB beyond the budget"), std::string::npos) << w[0];
  EXPECT_NE(w[0].find("OffloadOptions::train = \"adamw-bf16\""), std::string::npos) << w[0];
  handle->detach();
  EXPECT_TRUE(said(model, x).empty());  // detached: no budget any more
  auto counted = stack();
  auto h2 = budgeted(*counted, "adamw-bf16");
  EXPECT_TRUE(said(counted, x).empty());
  Net frozen;  // its Linear layers frozen: only the norm trains on the device
  for (auto& p : frozen->fc1->parameters()) p.requires_grad_(false);
  for (auto& p : frozen->fc2->parameters()) p.requires_grad_(false);
  auto h3 = budgeted(*frozen, "");
  for (auto& p : frozen->fc1->parameters()) EXPECT_FALSE(layerstream::optim::uncounted_training(p));
  const auto w3 = said(frozen, torch::randn({4, 8}));
  ASSERT_EQ(w3.size(), 1u);
  EXPECT_NE(w3[0].find("2 parameter(s)"), std::string::npos) << w3[0];
}

namespace {

// The optimizer of `model` in the checkpoint test: fc1 with fp32 states, fc2 with 8-bit
// ones, the resident LayerNorm with bf16 ones (`precision` overrides the first group's).
layerstream::optim::AdamW checkpoint_optimizer(Net& model, double lr, const std::string& precision = "fp32") {
  layerstream::optim::AdamWOptions o;
  o.lr = lr;
  o.max_grad_norm = 1.0;
  o.state_precision = precision;
  layerstream::optim::AdamW opt(model->fc1->parameters(), o);
  o.state_precision = "8bit";
  opt.add_param_group(model->fc2->parameters(), o);
  o.state_precision = "bf16";
  opt.add_param_group(model->norm->parameters(), o);
  return opt;
}

std::string temp_path(const char* name) {
  return (std::filesystem::temp_directory_path() / (std::string(name) + "-" + std::to_string(::getpid()))).string();
}

}  // namespace

// A C++ training run checkpoints its optimizer and resumes it (torch::save(opt, path),
// torch::load(opt, path)): the resumed run's weights equal the uninterrupted run's, bit for
// bit, with the learning rate restored; a checkpoint that does not fit the optimizer is
// refused before anything changes; states of another state_precision are converted.
TEST(TorchOptim, CheckpointResumesBitIdentically) {
  torch::manual_seed(3);
  std::vector<torch::Tensor> xs;
  for (int s = 0; s < 6; ++s) xs.push_back(torch::randn({16, 8}) * (s % 2 ? 0.3 : 3.0));
  auto train = [&](Net& model, layerstream::optim::AdamW& opt, int from, int to) {
    for (int s = from; s < to; ++s) {
      model->forward(xs[s]).square().mean().backward();
      opt.step();
      opt.zero_grad();
    }
  };
  Net run;
  Net resumed = twin_of(run);  // re-filled from the checkpoint below
  auto h_run = offload_sim(run);
  auto opt = checkpoint_optimizer(run, 1e-2);
  train(run, opt, 0, 3);
  const std::string path = temp_path("ls-adamw-checkpoint");
  torch::save(opt, path);
  {
    torch::NoGradGuard ng;
    auto src = run->named_parameters();
    for (auto& p : resumed->named_parameters()) p.value().copy_(src[p.key()]);
  }
  opt.group_options(0).lr = 5e-3;  // a scheduler's change after the checkpoint: not in it
  train(run, opt, 3, 6);

  auto h_resumed = offload_sim(resumed);
  auto opt2 = checkpoint_optimizer(resumed, 0.5);  // lr comes from the checkpoint
  opt2.group_options(0).max_grad_norm = std::nullopt;  // and so does the clipping
  torch::load(opt2, path);
  EXPECT_EQ(opt2.group_options(1).lr, 1e-2);
  EXPECT_EQ(opt2.group_options(0).max_grad_norm, std::optional<double>(1.0));
  EXPECT_EQ(opt2.state_bytes(), opt.state_bytes());
  opt2.group_options(0).lr = 5e-3;
  train(resumed, opt2, 3, 6);
  auto got = resumed->named_parameters();
  for (const auto& p : run->named_parameters())
    EXPECT_TRUE(torch::equal(got[p.key()], p.value())) << p.key();

  // Refusals: another group structure, another shape.
  auto expect_refused = [&](layerstream::optim::AdamW& o, const std::string& words) {
    const int64_t before = o.state_bytes();
    try {
      torch::load(o, path);
      FAIL() << "loaded a checkpoint that does not fit (" << words << ")";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
    EXPECT_EQ(o.state_bytes(), before);  // nothing changed
  };
  Net other;
  layerstream::optim::AdamW one_group(other->parameters());
  expect_refused(one_group, "parameter group(s)");
  auto transposed = checkpoint_optimizer(other, 1e-2);
  {
    torch::NoGradGuard ng;
    other->fc1->weight.set_(torch::zeros({8, 32}));  // (in, out) instead of (out, in)
  }
  expect_refused(transposed, "shape");
  Net swapped;
  layerstream::optim::AdamWOptions o;
  o.state_precision = "fp32";
  layerstream::optim::AdamW fp32_fc2(swapped->fc1->parameters(), o);
  fp32_fc2.add_param_group(swapped->fc2->parameters(), o);  // the checkpoint's fc2 states are 8-bit
  fp32_fc2.add_param_group(swapped->norm->parameters(), o);
  torch::load(fp32_fc2, path);  // decoded into fp32 (docs/design/optim.md, "Converting states")
  EXPECT_GT(fp32_fc2.state_bytes(), opt.state_bytes());
  // fp32 states load into a bf16 group (rounded to nearest).
  Net narrow;
  auto bf16_fc1 = checkpoint_optimizer(narrow, 1e-2, "bf16");
  torch::load(bf16_fc1, path);
  EXPECT_GT(bf16_fc1.state_bytes(), 0);
  EXPECT_LT(bf16_fc1.state_bytes(), opt.state_bytes());

  // Not between an overlapped backward and its step.
  resumed->forward(xs[0]).square().mean().backward();
  {
    auto scope = opt2.overlap(h_resumed->engine());
  }
  EXPECT_THROW(torch::save(opt2, path), layerstream::Error);
  opt2.step();
  std::remove(path.c_str());
  h_run->detach();
  h_resumed->detach();
}
