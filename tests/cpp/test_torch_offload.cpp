// layerstream::offload() for LibTorch modules, on the sim device (tensors
// compute on the CPU, so results compare bit for bit with the resident model).
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "core/log.h"
#include "core/lossless.h"
#include "core/quant.h"
#include "layerstream/offload.h"

namespace {

// An embedding whose weight is also the output projection's (tied weights, as
// in GPT-2 or Gemma), with one ordinary streamed layer between them. With a
// torch::nn::Embedding (never swapped, so resident) the head stays resident;
// with a layerstream::nn::Embedding the table streams too.
template <typename EmbeddingHolder>
struct TiedLMImpl : torch::nn::Module {
  EmbeddingHolder emb{nullptr};
  layerstream::nn::Linear fc{nullptr}, head{nullptr};
  TiedLMImpl() {
    emb = register_module("emb", EmbeddingHolder(50, 16));
    fc = register_module("fc", layerstream::nn::Linear(16, 16));
    head = register_module(
        "head", layerstream::nn::Linear(torch::nn::LinearOptions(16, 50).bias(false), emb->weight,
                                        torch::Tensor()));
  }
  torch::Tensor forward(const torch::Tensor& ids) { return head(torch::relu(fc(emb(ids)))); }
};
using TiedImpl = TiedLMImpl<torch::nn::Embedding>;
TORCH_MODULE(Tied);
using StreamedTiedImpl = TiedLMImpl<layerstream::nn::Embedding>;
TORCH_MODULE(StreamedTied);

// Three SGD steps, the last two accumulating into the same gradients; returns
// each step's output and every parameter's gradient.
template <typename Model>
std::vector<torch::Tensor> train_steps(Model model) {
  torch::optim::SGD opt(model->parameters(), 0.1);
  std::vector<torch::Tensor> seen;
  torch::manual_seed(7);
  for (int step = 0; step < 3; ++step) {
    if (step < 2) opt.zero_grad();
    auto out = model(torch::randint(0, 50, {4, 7}));
    out.square().mean().backward();
    seen.push_back(out.detach().clone());
    for (auto& p : model->parameters()) seen.push_back(p.grad().clone());
    opt.step();
  }
  return seen;
}

layerstream::OffloadOptions sim_options() {
  layerstream::OffloadOptions o;
  o.device = "sim";
  return o;
}

TEST(TorchOffload, TiedWeightLayerStaysResidentAndLosesNoGradient) {
  torch::manual_seed(0);
  Tied ref;
  torch::manual_seed(0);
  Tied model;
  ASSERT_TRUE(model->head->weight.is_same(model->emb->weight));

  auto handle = layerstream::offload(*model, sim_options());
  EXPECT_EQ(handle->layers(), std::vector<std::string>{"fc"});
  EXPECT_FALSE(model->head->attached());
  EXPECT_TRUE(model->fc->attached());
  EXPECT_TRUE(model->head->weight.is_same(model->emb->weight));

  const auto want = train_steps(ref);
  const auto got = train_steps(model);
  ASSERT_EQ(want.size(), got.size());
  for (size_t i = 0; i < want.size(); ++i)
    EXPECT_TRUE(torch::equal(want[i], got[i])) << "output or gradient #" << i << " differs";
  handle->detach();
}

TEST(TorchOffload, TiedWeightStreamsFromOneHostCopyWhenEveryUserStreams) {
  // Table and head both stream: one host copy (pinned bytes), the gradient of
  // both uses summed by autograd (bit-identical to the resident model over
  // accumulating steps and SGD updates); detach() restores one tensor, tied.
  torch::manual_seed(0);
  StreamedTied ref;
  torch::manual_seed(0);
  StreamedTied model;
  auto handle = layerstream::offload(*model, sim_options());
  EXPECT_EQ(handle->layers(), (std::vector<std::string>{"emb", "fc", "head"}));
  EXPECT_TRUE(model->head->attached() && model->emb->attached());
  EXPECT_TRUE(model->head->weight.is_same(model->emb->weight));
  EXPECT_EQ(handle->stats().pinned_bytes, (50u * 16 + 16 * 16 + 16) * 4);

  const auto want = train_steps(ref);
  const auto got = train_steps(model);
  ASSERT_EQ(want.size(), got.size());
  for (size_t i = 0; i < want.size(); ++i)
    EXPECT_TRUE(torch::equal(want[i], got[i])) << "output or gradient #" << i << " differs";
  handle->detach();
  EXPECT_TRUE(model->head->weight.is_same(model->emb->weight));
  EXPECT_TRUE(torch::equal(model->emb->weight, ref->emb->weight));
}

TEST(TorchOffload, TiePartnerOfAResidentLayerStaysResident) {
  // The head shares its bias with another layer, so it stays resident; the
  // table it shares its weight with must then stay resident too.
  struct TwistedImpl : torch::nn::Module {
    layerstream::nn::Embedding emb{nullptr};
    layerstream::nn::Linear head{nullptr}, other{nullptr};
    TwistedImpl() {
      emb = register_module("emb", layerstream::nn::Embedding(50, 16));
      auto bias = torch::zeros({50}).requires_grad_();
      head = register_module("head", layerstream::nn::Linear(torch::nn::LinearOptions(16, 50), emb->weight, bias));
      other = register_module("other", layerstream::nn::Linear(torch::nn::LinearOptions(16, 50),
                                                               torch::randn({50, 16}), bias));
    }
  };
  auto model = std::make_shared<TwistedImpl>();
  EXPECT_THROW(layerstream::offload(*model, sim_options()), std::exception);  // nothing left to stream
  EXPECT_FALSE(model->emb->attached());
  EXPECT_TRUE(model->head->weight.is_same(model->emb->weight));
}

TEST(TorchOffload, QuantizeLeavesATiedWeightUnquantized) {
  // quantize= packs the other layers; the tied head reads the table's dense
  // host copy (a warning names it).
  torch::manual_seed(0);
  StreamedTied model;
  for (auto& p : model->parameters()) p.requires_grad_(false);
  auto opts = sim_options();
  opts.quantize = "int8";
  auto handle = layerstream::offload(*model, opts);
  EXPECT_EQ(handle->stats().quantized_layers, 1u);
  EXPECT_EQ(handle->engine()->layer_format(2), "");
  EXPECT_EQ(handle->engine()->layer_format(1), "int8");
  const auto ids = torch::randint(0, 50, {2, 5});
  torch::NoGradGuard ng;
  const auto h = torch::relu(model->fc(model->emb(ids)));
  EXPECT_TRUE(torch::equal(model->head(h), torch::linear(h, model->emb->weight)));
  handle->detach();
}

// Two equal Linear(256, 256) + Linear(256, 64) bf16 models, N(0, 0.02) weights.
std::pair<torch::nn::Sequential, torch::nn::Sequential> two_equal_bf16_mlps(bool trainable) {
  auto make = [trainable] {
    torch::nn::Sequential m(layerstream::nn::Linear(256, 256), layerstream::nn::Linear(256, 64));
    torch::NoGradGuard ng;
    for (auto& p : m->parameters()) {
      p.normal_(0, 0.02);
      p.requires_grad_(trainable);
    }
    m->to(torch::kBFloat16);
    return m;
  };
  auto a = make();
  auto b = make();
  torch::NoGradGuard ng;
  for (size_t i = 0; i < a->parameters().size(); ++i) b->parameters()[i].copy_(a->parameters()[i]);
  return {a, b};
}

TEST(TorchOffload, LosslessStreamsBitIdenticalAndDetachRestoresTheWeights) {
  // quantize = "lossless" (core/lossless.h) from C++: outputs bit for bit those
  // of the uncompressed stream, fewer bytes on the link, weights back exactly.
  torch::manual_seed(0);
  auto [plain, coded] = two_equal_bf16_mlps(/*trainable=*/false);
  std::vector<torch::Tensor> before;
  for (auto& p : coded->parameters()) before.push_back(p.detach().clone());
  auto o = sim_options();
  auto hp = layerstream::offload(*plain, o);
  o.quantize = "lossless";
  auto hc = layerstream::offload(*coded, o);
  EXPECT_EQ(hc->engine()->layer_format(0), "lossless");
  const auto x = torch::randn({3, 256}).to(torch::kBFloat16);
  torch::NoGradGuard ng;
  EXPECT_TRUE(torch::equal(coded->forward(x), plain->forward(x)));
  hc->synchronize();
  hp->synchronize();
  EXPECT_LT(hc->stats().h2d_bytes, hp->stats().h2d_bytes * 3 / 4);
  hc->detach();
  for (size_t i = 0; i < before.size(); ++i)
    EXPECT_TRUE(torch::equal(coded->parameters()[i].view(torch::kInt16), before[i].view(torch::kInt16))) << i;
  hp->detach();
}

TEST(TorchOffload, TrainableLosslessWeightsTrainLikePlainOnesAndAreRecodedAfterEachStep) {
  // Full fine-tuning with quantize = "lossless" from C++ (Note [Trainable
  // coded weights]): the parameters stay dense, the optimizer writes them,
  // the next copy re-codes them; every step bit for bit the plain stream's.
  torch::manual_seed(0);
  auto [plain, coded] = two_equal_bf16_mlps(/*trainable=*/true);
  auto o = sim_options();
  auto hp = layerstream::offload(*plain, o);
  o.quantize = "lossless";
  auto hc = layerstream::offload(*coded, o);
  EXPECT_EQ(hc->stats().coded_layers, 2u);
  EXPECT_EQ(hc->engine()->layer_format(0), "");  // a dense parameter; only the bus is coded
  torch::optim::SGD sp(plain->parameters(), 0.1), sc(coded->parameters(), 0.1);
  const uint64_t dense = (256 * 256 + 256 * 64) * 2;
  for (int step = 0; step < 3; ++step) {
    const auto x = torch::randn({3, 256}).to(torch::kBFloat16);
    const auto yp = plain->forward(x), yc = coded->forward(x);
    EXPECT_TRUE(torch::equal(yc, yp)) << "step " << step;
    yp.to(torch::kFloat).square().mean().backward();
    yc.to(torch::kFloat).square().mean().backward();
    sp.step();
    sc.step();
    sp.zero_grad();
    sc.zero_grad();
    for (size_t i = 0; i < plain->parameters().size(); ++i)
      EXPECT_TRUE(torch::equal(coded->parameters()[i], plain->parameters()[i])) << "step " << step << " #" << i;
    EXPECT_EQ(hc->stats().recoded_bytes, static_cast<uint64_t>(step) * dense) << "step " << step;
  }
  hc->synchronize();
  hp->synchronize();
  EXPECT_LT(hc->stats().h2d_bytes, hp->stats().h2d_bytes * 3 / 4);
  EXPECT_EQ(hc->stats().ordering_errors, 0u);
  hc->detach();
  hp->detach();
}

TEST(TorchOffload, WithCacheAcrossStepsAWriteThroughDataBeforeACallIsSeen) {
  // Note [Writes through .data between steps] (engine.cpp): the slots keep both
  // layers across calls; a write through .data() (a LoRA merge's) moves no version
  // counter, and the step that begins at the next call's first fetch sees it in the
  // sampled host bytes: that use copies the layer again.
  torch::manual_seed(0);
  auto o = sim_options();
  o.cache_across_steps = true;
  auto engine = layerstream::Engine::create(o);
  auto w0 = torch::randn({64, 64}), b0 = torch::randn({64});
  auto w1 = torch::randn({64, 64}), b1 = torch::randn({64});
  const int l0 = engine->add_linear("a", w0, b0, layerstream::quant::Format::None);
  const int l1 = engine->add_linear("b", w1, b1, layerstream::quant::Format::None);
  const auto x = torch::randn({3, 64});
  auto run = [&] {
    engine->begin_call();
    return engine->linear(l1, engine->linear(l0, x, false), false);
  };
  auto ref = [&] { return torch::linear(torch::linear(x, w0, b0), w1, b1); };
  for (int call = 0; call < 3; ++call) EXPECT_TRUE(torch::equal(run(), ref())) << "call " << call;
  const uint64_t copied = engine->stats().h2d_bytes;
  EXPECT_TRUE(torch::equal(run(), ref()));
  EXPECT_EQ(engine->stats().h2d_bytes, copied) << "both layers stay cached across calls";
  w1.data().mul_(2);  // no version counter moves
  b0.data().add_(1);
  EXPECT_TRUE(torch::equal(run(), ref())) << "the writes through .data() are seen";
  EXPECT_GT(engine->stats().h2d_bytes, copied);
  EXPECT_EQ(engine->ordering_errors(), std::vector<std::string>{});
}

TEST(TorchOffload, EngineRefusesToQuantizeOrShareABiasOfATiedWeight) {
  auto engine = layerstream::Engine::create(sim_options());
  auto table = torch::randn({10, 4});
  auto bias = torch::randn({10});
  engine->add_embedding("emb", table);
  try {
    engine->add_linear("head", table, torch::Tensor(), layerstream::quant::Format::Int8);
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("shared with streamed layer 'emb' (tied weights)"),
              std::string::npos) << e.what();
  }
  engine->add_linear("a", torch::randn({10, 4}), bias);
  try {
    engine->add_linear("b", torch::randn({10, 4}), bias);
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("shares its bias with already streamed layer 'a'"),
              std::string::npos) << e.what();
  }
  EXPECT_EQ(engine->num_layers(), 2);
}

TEST(TorchOffload, StreamedLayersAreDispatcherOperators) {
  // What torch.compile records (Note [Streamed layers as custom ops]): layerstream::linear
  // called through the dispatcher gives the eager call's output, and its autograd kernel the
  // input's gradient and, on the host, the trainable weight's and bias's.
  torch::manual_seed(0);
  auto engine = layerstream::Engine::create(sim_options());
  auto w = torch::randn({6, 4}).requires_grad_(true);
  auto b = torch::randn({6}).requires_grad_(true);
  auto w_ref = w.detach().clone().requires_grad_(true), b_ref = b.detach().clone().requires_grad_(true);
  const int layer = engine->add_linear("fc", w, b, layerstream::quant::Format::None);
  const auto op = c10::Dispatcher::singleton()
                      .findSchemaOrThrow("layerstream::linear", "")
                      .typed<torch::Tensor(const torch::Tensor&, const std::optional<torch::Tensor>&,
                                           const std::optional<torch::Tensor>&, int64_t, int64_t,
                                           c10::string_view)>();
  // Each call names its layer's layout (Note [An operator call names its layer's layout]).
  const std::string spec = engine->op_spec(layer);
  EXPECT_EQ(spec, "linear w=6x4 Float b=6 Float");
  auto x = torch::randn({3, 4}).requires_grad_(true);
  auto x_ref = x.detach().clone().requires_grad_(true);
  auto y = op.call(x, w, b, static_cast<int64_t>(engine->id()), layer, spec);
  auto y_ref = torch::linear(x_ref, w_ref, b_ref);
  EXPECT_TRUE(torch::allclose(y, y_ref, 1e-6, 1e-6));
  EXPECT_TRUE(torch::allclose(y, engine->linear(layer, x.detach(), false)));
  y.square().sum().backward();
  y_ref.square().sum().backward();
  EXPECT_TRUE(torch::allclose(x.grad(), x_ref.grad(), 1e-5, 1e-6));
  ASSERT_TRUE(w.grad().defined() && b.grad().defined());
  EXPECT_TRUE(w.grad().device().is_cpu());
  EXPECT_TRUE(torch::allclose(w.grad(), w_ref.grad(), 1e-5, 1e-6));
  EXPECT_TRUE(torch::allclose(b.grad(), b_ref.grad(), 1e-5, 1e-6));
  // Frozen parameters are not passed: only the input's gradient.
  auto x2 = torch::randn({2, 4}).requires_grad_(true);
  op.call(x2, std::nullopt, std::nullopt, static_cast<int64_t>(engine->id()), layer, spec).sum().backward();
  EXPECT_TRUE(x2.grad().defined());
  EXPECT_EQ(engine->ordering_errors(), std::vector<std::string>{});
  try {
    op.call(x, std::nullopt, std::nullopt, static_cast<int64_t>(engine->id()) + 1000, layer, spec);
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("does not exist in this process"), std::string::npos) << e.what();
  }
  try {
    op.call(x, std::nullopt, std::nullopt, static_cast<int64_t>(engine->id()), layer, "linear w=6x5 Float b=6 Float");
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("was traced for a layer of another layout (linear w=6x5"), std::string::npos)
        << e.what();
  }
  // A hooked weight's gradients go back to autograd, and the spec says so; a removed
  // hook (torch keeps its list, with a hole) is none.
  // An eager call fires it too, without being told (grads_via_autograd).
  int fired = 0;
  const unsigned hook = w.register_hook([&fired](const torch::Tensor& g) {
    ++fired;
    return g;
  });
  EXPECT_EQ(engine->op_spec(layer), spec + " grads=autograd");
  engine->linear(layer, torch::randn({2, 4}), false).sum().backward();
  EXPECT_EQ(fired, 1);
  w.remove_hook(hook);
  EXPECT_EQ(engine->op_spec(layer), spec);
}

// Saved-tensor hooks turn autograd's version check off: the engine and the C++
// scope's kept tensors check as autograd does; views whose conj/neg bit is not in
// their bytes are not taken.
TEST(TorchOffload, SavedActivationsKeepAutogradsVersionCheckAndConjugateViews) {
  auto engine = layerstream::Engine::create(sim_options());
  engine->begin_activations(0);
  auto t = torch::randn({256, 256});
  const int64_t token = engine->stash_activation(t);
  ASSERT_GE(token, 0);
  t.mul_(2);  // written in place after it was saved
  try {
    engine->restore_activation(token, true);
    FAIL() << "a saved tensor written in place was restored";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("modified by an inplace operation: a saved tensor of shape [256, 256] "
                                         "is at version 1; expected version 0"),
              std::string::npos)
        << e.what();
  }
  engine->drop_activation(token);
  const auto z = torch::complex(torch::randn({256, 256}), torch::randn({256, 256}));
  EXPECT_LT(engine->stash_activation(z.conj()), 0);
  EXPECT_LT(engine->stash_activation(torch::_neg_view(torch::randn({256, 256}))), 0);

  struct Net : torch::nn::Module {
    layerstream::nn::Linear a{nullptr}, b{nullptr};
    Net() {
      a = register_module("a", layerstream::nn::Linear(256, 256));
      b = register_module("b", layerstream::nn::Linear(256, 256));
    }
  };
  auto net = std::make_shared<Net>();
  auto o = sim_options();
  o.activations = 0;
  auto handle = layerstream::offload(*net, o);
  torch::Tensor loss;
  {
    auto saved = handle->saved_activations();
    loss = net->b(torch::gelu(net->a(torch::randn({256, 256})))).square().sum();
  }
  {
    torch::NoGradGuard ng;
    net->b->weight.mul_(2);  // e.g. an optimizer step before backward
  }
  EXPECT_THROW(loss.backward(), std::exception);
  handle->detach();
}

TEST(TorchOffload, SavedActivationsGoToTheHostAndBack) {
  // Activation offload through the C++ API (docs/design/activations.md): a dense tensor of 64 KiB
  // or more goes to the host and comes back bit-identical in its layout; a smaller one is kept.
  auto engine = layerstream::Engine::create(sim_options());
  engine->begin_activations(0);
  auto t = torch::randn({4, 32, 16, 16}).contiguous(torch::MemoryFormat::ChannelsLast);  // 128 KiB
  const auto want = t.clone(torch::MemoryFormat::Preserve);
  const int64_t token = engine->stash_activation(t);
  ASSERT_GE(token, 0);
  t = torch::Tensor();
  engine->synchronize();  // the copy to the host is done; the engine let the tensor go
  EXPECT_EQ(engine->stats().activation_device_bytes, 0u);
  const auto back = engine->restore_activation(token, true);
  EXPECT_TRUE(torch::equal(back, want));
  EXPECT_EQ(back.strides(), want.strides());
  const uint64_t bytes = 4 * 32 * 16 * 16 * 4;
  EXPECT_EQ(engine->stats().activation_d2h_bytes, bytes);
  EXPECT_EQ(engine->stats().activation_h2d_bytes, bytes);
  auto small = torch::randn({16});
  const int64_t kept = engine->stash_activation(small);
  ASSERT_GE(kept, 0);
  EXPECT_EQ(engine->restore_activation(kept, true).data_ptr(), small.data_ptr());  // never copied
  EXPECT_EQ(engine->stats().activation_d2h_bytes, bytes);
  engine->drop_activation(token);
  engine->drop_activation(kept);
  EXPECT_EQ(engine->stats().activation_device_bytes, 0u);
  EXPECT_EQ(engine->ordering_errors(), std::vector<std::string>{});
  try {
    engine->restore_activation(token, true);
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("was already released"), std::string::npos) << e.what();
  }
}

TEST(TorchOffload, LayerUsedUnderTwoNamesIsNotATie) {
  // One module registered twice shares its parameters with itself only.
  struct TwiceImpl : torch::nn::Module {
    layerstream::nn::Linear fc{nullptr};
    TwiceImpl() {
      fc = register_module("a", layerstream::nn::Linear(8, 8));
      register_module("b", fc);
    }
    torch::Tensor forward(const torch::Tensor& x) { return fc(fc(x)); }
  };
  auto model = std::make_shared<TwiceImpl>();
  auto x = torch::randn({3, 8});
  const auto want = model->forward(x);
  auto handle = layerstream::offload(*model, sim_options());
  EXPECT_TRUE(model->fc->attached());
  EXPECT_TRUE(torch::equal(model->forward(x), want));
  handle->detach();
}

struct OneImpl : torch::nn::Module {
  layerstream::nn::Linear fc{nullptr};
  OneImpl() { fc = register_module("fc", layerstream::nn::Linear(64, 32)); }
  torch::Tensor forward(const torch::Tensor& x) { return fc(x); }
};
TORCH_MODULE(One);

// `model` with its weight frozen, offloaded to the sim device quantized to int8.
std::shared_ptr<layerstream::OffloadHandle> offload_int8(One& model) {
  model->fc->weight.requires_grad_(false);
  auto opts = sim_options();
  opts.quantize = "int8";
  return layerstream::offload(*model, opts);
}

TEST(TorchOffload, WriteToQuantizedWeightIsRefusedUntilRequantized) {
  // The engine holds a quantized weight packed: a write to the module's dense
  // parameter would be silently ignored; it is refused at the next call
  // instead, and Engine::requantize() loads the written values.
  torch::manual_seed(0);
  One model, fresh;
  model->fc->weight.requires_grad_(false);
  {
    torch::NoGradGuard ng;
    fresh->fc->weight.copy_(model->fc->weight * 2);
    fresh->fc->bias.copy_(model->fc->bias);
  }
  fresh->fc->weight.requires_grad_(false);
  auto opts = sim_options();
  opts.quantize = "int8";
  auto handle = layerstream::offload(*model, opts);
  auto fresh_handle = layerstream::offload(*fresh, opts);
  const auto x = torch::randn({3, 64});
  const auto before = model->forward(x);
  {
    torch::NoGradGuard ng;
    model->fc->weight.mul_(2);
  }
  try {
    model->forward(x);
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("quantized layer 'fc' was written in place"),
              std::string::npos) << e.what();
  }
  handle->engine()->requantize(0, model->fc->weight);
  const auto after = model->forward(x);
  EXPECT_TRUE(torch::equal(after, fresh->forward(x)));
  EXPECT_FALSE(torch::equal(after, before));
  EXPECT_THROW(handle->engine()->requantize(0, torch::zeros({32, 63})), std::exception);
  handle->detach();
  fresh_handle->detach();
}

TEST(TorchOffload, RequantizedOrFreedDenseWeightIsNotLostBySaveOrDetach) {
  // Note [The dense parameter of a quantized layer]: values loaded with
  // Engine::requantize() reach the dense parameter (torch::save and detach gave
  // the old ones back), and a dense parameter freed to save host RAM is saved
  // and restored as the packed copy dequantized (it was saved and left empty).
  torch::manual_seed(0);
  One model;
  auto handle = offload_int8(model);
  const auto x = torch::randn({3, 64});
  const auto fresh = torch::randn({32, 64});
  handle->engine()->requantize(0, fresh);
  EXPECT_TRUE(torch::equal(model->fc->weight, fresh));
  std::stringstream saved;
  torch::save(model, saved);
  One loaded;
  torch::load(loaded, saved);
  EXPECT_TRUE(torch::equal(loaded->fc->weight, fresh));
  const auto out = model->forward(x);

  const auto packed = handle->engine()->dequantized_weight(0);
  model->fc->weight.set_data(torch::empty({0}));  // freed, as offload.h says a caller may
  EXPECT_TRUE(torch::equal(model->forward(x), out));
  std::stringstream saved_freed;
  torch::save(model, saved_freed);
  One loaded_freed;
  torch::load(loaded_freed, saved_freed);
  EXPECT_TRUE(torch::equal(loaded_freed->fc->weight, packed));
  handle->detach();
  EXPECT_TRUE(torch::equal(model->fc->weight, packed));
  EXPECT_TRUE(torch::allclose(model->forward(x), out, 1e-5, 1e-5));  // dense math on the dequantized values
}

// torch::load() into an offloaded model: LibTorch's archive replaced each tensor
// (set_), so the next call refused the model ("replaced or moved after
// offload()"). The streamed modules read the values and write them in place.
struct LoadNetImpl : torch::nn::Module {
  layerstream::nn::Embedding table{nullptr};
  layerstream::nn::Conv1d conv{nullptr};
  layerstream::nn::Linear fc{nullptr}, head{nullptr};
  LoadNetImpl() {
    table = register_module("table", layerstream::nn::Embedding(20, 16));
    conv = register_module("conv", layerstream::nn::Conv1d(torch::nn::Conv1dOptions(16, 16, 3).padding(1)));
    fc = register_module("fc", layerstream::nn::Linear(16, 64));
    head = register_module("head", layerstream::nn::Linear(64, 8));
  }
  torch::Tensor forward(const torch::Tensor& ids) {
    auto h = conv(table(ids).transpose(1, 2)).transpose(1, 2);
    return head(torch::relu(fc(torch::relu(h))));
  }
};
TORCH_MODULE(LoadNet);

std::string temp_path(const std::string& leaf) {
  return (std::filesystem::temp_directory_path() / (std::to_string(getpid()) + "-" + leaf)).string();
}

TEST(TorchOffload, TorchLoadIntoAnOffloadedModelWritesItsValuesInPlace) {
  torch::manual_seed(0);
  LoadNet saved, model;
  const std::string path = temp_path("loadnet.pt");
  torch::save(saved, path);
  const auto ids = torch::randint(0, 20, {2, 7});
  const auto want = saved->forward(ids);
  auto o = sim_options();
  o.budget_bytes = 9000;  // two slots of the largest layer (fc, 4.25 KiB) and no more: every layer streams
  auto handle = layerstream::offload(*model, o);
  ASSERT_EQ(handle->layers().size(), 4u) << handle->plan();
  EXPECT_FALSE(torch::equal(model->forward(ids), want));
  std::vector<const void*> where;
  for (const auto& p : model->parameters()) where.push_back(p.data_ptr());
  torch::load(model, path);
  for (size_t i = 0; i < where.size(); ++i) EXPECT_EQ(model->parameters()[i].data_ptr(), where[i]) << i;
  EXPECT_TRUE(torch::equal(model->forward(ids), want));
  model->forward(ids).sum().backward();  // trains on as before
  EXPECT_TRUE(model->fc->weight.grad().defined());

  // An archive of another shape: an error naming it, nothing written.
  struct Small : torch::nn::Module {
    layerstream::nn::Linear fc{nullptr};
    Small() { fc = register_module("fc", layerstream::nn::Linear(16, 16)); }
  };
  auto other = std::make_shared<Small>();
  const std::string small = temp_path("small.pt");
  torch::save(other, small);
  try {
    torch::load(model->fc, small);
    FAIL() << "torch::load() of another shape into a streamed layer did not throw";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("the archive has no 'weight'"), std::string::npos) << e.what();
  }
  torch::serialize::OutputArchive bad;
  bad.write("weight", torch::zeros({32, 15}));
  bad.write("bias", torch::zeros({64}));
  bad.save_to(small);
  try {
    torch::load(model->fc, small);
    FAIL() << "torch::load() of another shape into a streamed layer did not throw";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("'weight' has shape [32, 15] in the archive but [64, 16]"),
              std::string::npos) << e.what();
  }
  EXPECT_TRUE(torch::equal(model->forward(ids), want));
  handle->detach();
  std::remove(small.c_str());

  // Quantized: the packed host copy is packed again from the loaded values, and
  // the write to the dense parameter is not refused at the next call.
  LoadNet frozen, reference;
  torch::load(reference, path);
  for (auto* m : {&frozen, &reference})
    for (auto& p : (*m)->parameters()) p.requires_grad_(false);
  o.quantize = "int8";
  o.budget_bytes = -1;  // no plan: every layer streams
  auto qh = layerstream::offload(*frozen, o);
  auto rh = layerstream::offload(*reference, o);
  EXPECT_FALSE(torch::equal(frozen->forward(ids), reference->forward(ids)));
  torch::load(frozen, path);
  EXPECT_TRUE(torch::equal(frozen->forward(ids), reference->forward(ids)));
  qh->detach();
  rh->detach();

  // Lossless-coded frozen weights cannot take new values in place: an error
  // before anything is written.
  LoadNet coded;
  for (auto& p : coded->parameters()) p.requires_grad_(false);
  const auto coded_before = coded->forward(ids);
  o.quantize = "lossless";
  auto ch = layerstream::offload(*coded, o);
  torch::serialize::OutputArchive fc_values;
  fc_values.write("weight", saved->fc->weight.detach());
  fc_values.write("bias", saved->fc->bias.detach());
  fc_values.save_to(small);
  try {
    torch::load(coded->fc, small);
    FAIL() << "torch::load() into a lossless-coded frozen layer did not throw";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("lossless-coded"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(torch::equal(coded->forward(ids), coded_before));
  ch->detach();
  std::remove(small.c_str());
  std::remove(path.c_str());
}

// A padding_mode other than zeros: layerstream::nn::Conv*d threw before offload()
// and, attached, convolved with zero padding (other numbers, no error). It pads the
// input as torch::nn::ConvNdImpl does, then streams a convolution without padding.
template <typename TorchConv, typename Conv, typename Options>
void expect_conv_like_torch(const char* what, const Options& options, const torch::Tensor& x) {
  SCOPED_TRACE(what);
  torch::manual_seed(0);
  TorchConv ref(options);
  struct Holder : torch::nn::Module {
    Conv conv{nullptr};
    explicit Holder(const Options& o) { conv = register_module("conv", Conv(o)); }
  };
  auto net = std::make_shared<Holder>(options);
  {
    torch::NoGradGuard ng;
    net->conv->weight.copy_(ref->weight);
    net->conv->bias.copy_(ref->bias);
  }
  const auto want = ref->forward(x);
  EXPECT_TRUE(torch::equal(net->conv->forward(x), want));  // not attached: computes as torch's
  auto handle = layerstream::offload(*net, sim_options());
  auto xr = x.clone().requires_grad_(), xs = x.clone().requires_grad_();
  const auto yr = ref->forward(xr), ys = net->conv->forward(xs);
  EXPECT_TRUE(torch::equal(ys, yr));
  yr.square().sum().backward();
  ys.square().sum().backward();
  EXPECT_TRUE(torch::equal(xs.grad(), xr.grad()));
  EXPECT_TRUE(torch::equal(net->conv->weight.grad(), ref->weight.grad()));
  EXPECT_TRUE(torch::equal(net->conv->bias.grad(), ref->bias.grad()));
  EXPECT_GT(handle->stats().h2d_bytes, 0);
  handle->detach();
}

TEST(TorchOffload, ConvPaddingModesPadTheInputAsTheTorchModuleDoes) {
  using O1 = torch::nn::Conv1dOptions;
  using O2 = torch::nn::Conv2dOptions;
  using O3 = torch::nn::Conv3dOptions;
  const auto x2 = torch::randn({2, 8, 13, 11});
  expect_conv_like_torch<torch::nn::Conv2d, layerstream::nn::Conv2d>(
      "reflect", O2(8, 16, 3).padding(1).padding_mode(torch::kReflect), x2);
  expect_conv_like_torch<torch::nn::Conv2d, layerstream::nn::Conv2d>(
      "replicate, uneven padding, stride 2", O2(8, 16, 3).padding({2, 1}).stride(2).padding_mode(torch::kReplicate),
      x2);
  expect_conv_like_torch<torch::nn::Conv2d, layerstream::nn::Conv2d>(
      "circular", O2(8, 16, 3).padding(1).padding_mode(torch::kCircular), x2);
  expect_conv_like_torch<torch::nn::Conv2d, layerstream::nn::Conv2d>(
      "reflect, same, a 3x5 kernel", O2(8, 16, {3, 5}).padding(torch::kSame).padding_mode(torch::kReflect), x2);
  expect_conv_like_torch<torch::nn::Conv1d, layerstream::nn::Conv1d>(
      "1-D reflect", O1(8, 4, 3).padding(1).padding_mode(torch::kReflect), torch::randn({2, 8, 17}));
  expect_conv_like_torch<torch::nn::Conv3d, layerstream::nn::Conv3d>(
      "3-D replicate", O3(4, 6, 3).padding({0, 1, 1}).padding_mode(torch::kReplicate), torch::randn({1, 4, 5, 6, 7}));
}

// An unbatched input ((C, H, W) for a Conv2d), which torch::nn::Conv*d accepts:
// an attached layer took it, an unattached one threw (before offload(), after
// detach(), or kept resident by the plan), so a model worked or not by its budget.
TEST(TorchOffload, ConvTakesAnUnbatchedInputAttachedOrNot) {
  struct Net : torch::nn::Module {
    layerstream::nn::Conv2d a{nullptr}, b{nullptr};
    layerstream::nn::Conv1d c{nullptr};
    Net() {
      a = register_module("a", layerstream::nn::Conv2d(torch::nn::Conv2dOptions(3, 8, 3).padding(1)));
      b = register_module("b", layerstream::nn::Conv2d(
                                   torch::nn::Conv2dOptions(8, 64, 3).padding(1).padding_mode(torch::kReflect)));
      c = register_module("c", layerstream::nn::Conv1d(torch::nn::Conv1dOptions(64, 4, 3).padding(torch::kSame)));
    }
    torch::Tensor forward(const torch::Tensor& x) {
      const auto h = b(torch::relu(a(x)));
      return c(h.flatten(-2));
    }
  };
  torch::manual_seed(0);
  const auto x = torch::randn({3, 6, 7});
  auto net = std::make_shared<Net>();
  const auto want = net->forward(x.unsqueeze(0)).squeeze(0);  // the batched computation
  EXPECT_TRUE(torch::equal(net->forward(x), want));           // unattached
  for (const int64_t budget : {int64_t{-1}, int64_t{1} << 20}) {  // every layer streams; every layer resident
    auto o = sim_options();
    o.budget_bytes = budget;
    auto handle = layerstream::offload(*net, o);
    EXPECT_EQ(handle->layers().empty(), budget > 0);
    EXPECT_TRUE(torch::equal(net->forward(x), want)) << "budget " << budget;
    handle->detach();
    EXPECT_TRUE(torch::equal(net->forward(x), want)) << "after detach, budget " << budget;
  }
}

// A handle that outlives its model: detach() and saved_activations() must not
// touch the dead modules (the handle kept raw pointers: detach() swapped a
// torch::nn::Linear back into a freed parent, a heap corruption, and unbound a
// freed layerstream::nn::Linear: a write into freed memory that only
// tools/sanitize.sh's AddressSanitizer sees).
struct SwappedImpl : torch::nn::Module {
  layerstream::nn::Linear ours{nullptr};
  SwappedImpl() {
    register_module("fc", torch::nn::Linear(8, 8));  // held by the registry only: swapped
    ours = register_module("ours", layerstream::nn::Linear(8, 8));
  }
};
TORCH_MODULE(Swapped);

TEST(TorchOffload, HandleOutlivingItsModelDetachesWithoutTouchingIt) {
  auto o = sim_options();
  o.activations = 0;
  std::shared_ptr<layerstream::OffloadHandle> handle;
  std::weak_ptr<SwappedImpl> gone;
  {
    Swapped net;
    handle = layerstream::offload(*net, o);
    gone = net.ptr();
  }
  EXPECT_TRUE(gone.expired());  // the handle keeps nothing of the model alive
  try {
    handle->saved_activations();
    FAIL() << "saved_activations() of a dead model did not throw";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("no longer exists"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(handle->detach());
}

// clone() of an offloaded model: a streamed child's copy kept the engine binding, so
// the clone streamed (and trained: its own weights got no gradient) the original's
// weights. It throws, also for a swapped torch::nn::Linear (torch's own message said
// "a different type"); after detach() it clones like torch.
// Calls a torch::nn::Linear child through its parent's registry, whichever module
// is there now: the one way such a child streams (a ModuleHolder member would keep
// calling the module offload() swapped out).
torch::Tensor call_registered(torch::nn::Module& parent, const std::string& name, const torch::Tensor& x) {
  const auto m = parent.named_children()[name];
  if (const auto s = std::dynamic_pointer_cast<layerstream::nn::LinearImpl>(m)) return s->forward(x);
  return std::dynamic_pointer_cast<torch::nn::LinearImpl>(m)->forward(x);
}

struct CloneNetImpl : torch::nn::Cloneable<CloneNetImpl> {
  layerstream::nn::Linear ours{nullptr};
  layerstream::nn::Embedding table{nullptr};
  CloneNetImpl() { reset(); }
  void reset() override {
    table = register_module("table", layerstream::nn::Embedding(10, 8));
    register_module("fc", torch::nn::Linear(8, 8));  // no member: offload() swaps it
    ours = register_module("ours", layerstream::nn::Linear(8, 4));
  }
  torch::Tensor forward(const torch::Tensor& ids) {
    return ours(torch::relu(call_registered(*this, "fc", table(ids))));
  }
};
TORCH_MODULE(CloneNet);

TEST(TorchOffload, CloneOfAnOffloadedModelThrowsAndWorksAfterDetach) {
  torch::manual_seed(0);
  CloneNet net;
  const auto ids = torch::randint(0, 10, {3, 5});
  const auto expected = net->forward(ids);
  auto handle = layerstream::offload(*net, sim_options());
  ASSERT_EQ(handle->layers().size(), 3u);
  try {
    net->clone();
    FAIL() << "clone() of an offloaded model did not throw";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("cannot be cloned"), std::string::npos) << e.what();
  }
  try {
    net->ours->clone();
    FAIL() << "clone() of a streamed layer did not throw";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("streamed layer 'ours' cannot be cloned"), std::string::npos)
        << e.what();
  }
  EXPECT_TRUE(torch::equal(net->forward(ids), expected));  // the model is untouched
  // The swapped-in layer, kept by the caller past detach(): a plain layer again.
  const auto swapped = std::dynamic_pointer_cast<layerstream::nn::LinearImpl>(net->named_children()["fc"]);
  ASSERT_TRUE(swapped && swapped->attached());
  handle->detach();
  EXPECT_FALSE(swapped->attached());
  EXPECT_NO_THROW(swapped->clone());
  auto copy = std::dynamic_pointer_cast<CloneNetImpl>(net->clone());
  ASSERT_TRUE(copy);
  EXPECT_TRUE(torch::equal(copy->forward(ids), expected));
  copy->forward(ids).sum().backward();
  EXPECT_TRUE(copy->ours->weight.grad().defined());
  EXPECT_TRUE(copy->table->weight.grad().defined());
  EXPECT_FALSE(net->ours->weight.grad().defined());  // the copy's own parameters
  EXPECT_NE(copy->ours->weight.data_ptr(), net->ours->weight.data_ptr());
}

// A torch::nn::Linear held outside its parent's registry (a ModuleHolder member,
// the usual way a C++ module calls a child, or a variable of the caller's) went on
// being called after offload() swapped it: on the sim device it computed unstreamed
// and outside the budget with no error, on CUDA it met a device mismatch. offload()
// refuses it when the plan streams it, naming it and the fix, before anything changes.
struct HeldImpl : torch::nn::Module {
  torch::nn::Linear fc{nullptr};
  layerstream::nn::Linear ours{nullptr};
  HeldImpl() {
    fc = register_module("fc", torch::nn::Linear(16, 16));
    ours = register_module("ours", layerstream::nn::Linear(16, 16));
    register_module("free", torch::nn::Linear(16, 16));  // held by the registry only
  }
  torch::Tensor forward(const torch::Tensor& x) { return ours(torch::relu(fc(x))) + call_registered(*this, "free", x); }
};
TORCH_MODULE(Held);

TEST(TorchOffload, ATorchLinearHeldOutsideTheRegistryIsRefusedNamingTheFix) {
  torch::manual_seed(0);
  Held net;
  const auto x = torch::randn({4, 16});
  const auto expected = net->forward(x);
  const void* weight = net->fc->weight.data_ptr();
  try {
    layerstream::offload(*net, sim_options());
    FAIL() << "offload() swapped a torch::nn::Linear its parent calls through a member";
  } catch (const std::exception& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("cannot stream 'fc':"), std::string::npos) << msg;
    EXPECT_NE(msg.find("layerstream::nn::Linear"), std::string::npos) << msg;
    EXPECT_EQ(msg.find("'free'"), std::string::npos) << msg;  // the registry alone holds it
  }
  // Nothing changed: the same weights in place, nothing attached or swapped.
  EXPECT_EQ(net->fc->weight.data_ptr(), weight);
  EXPECT_FALSE(net->ours->attached());
  EXPECT_TRUE(std::dynamic_pointer_cast<torch::nn::LinearImpl>(net->named_children()["free"]));
  EXPECT_TRUE(torch::equal(net->forward(x), expected));

  // A budget that holds every layer keeps them resident: nothing is swapped.
  auto o = sim_options();
  o.budget_bytes = 1 << 20;
  {
    auto handle = layerstream::offload(*net, o);
    EXPECT_TRUE(handle->layers().empty());
    EXPECT_EQ(handle->resident_layers(), (std::vector<std::string>{"fc", "ours", "free"}));
    EXPECT_TRUE(torch::equal(net->forward(x), expected));
    handle->detach();
  }
  o.budget_bytes = -1;

  // A variable of the caller's holds a child as a member does.
  auto keep = net->named_children()["free"];
  o.exclude = {"fc"};
  try {
    layerstream::offload(*net, o);
    FAIL() << "offload() swapped a torch::nn::Linear the caller still holds";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("cannot stream 'free':"), std::string::npos) << e.what();
  }
  keep.reset();
  // Excluded, the held one stays resident; the others stream (the swapped one too).
  auto handle = layerstream::offload(*net, o);
  EXPECT_EQ(handle->layers(), (std::vector<std::string>{"ours", "free"}));
  const auto before = handle->stats().h2d_bytes;
  const auto got = net->forward(x);
  EXPECT_TRUE(torch::equal(got, expected)) << (got - expected).abs().max();
  const uint64_t streamed = 2 * (16 * 16 + 16) * sizeof(float);
  EXPECT_EQ(handle->stats().h2d_bytes - before, streamed);
  handle->detach();
}

// A root that is itself a layer: offload(*layerstream::nn::Linear(...)) found "no Linear ...
// to stream" (only children were candidates), where Python's offload(nn.Linear) streams
// it as ''. Ours is streamed where it is; a torch::nn root is refused naming the fix.
TEST(TorchOffload, ARootThatIsAStreamedLayerIsStreamed) {
  torch::manual_seed(0);
  torch::nn::Linear ref(8, 4);
  layerstream::nn::Linear root(torch::nn::LinearOptions(8, 4), ref->weight.detach().clone(),
                               ref->bias.detach().clone());
  const auto x = torch::randn({3, 8});
  {
    auto handle = layerstream::offload(*root, sim_options());
    EXPECT_EQ(handle->layers(), (std::vector<std::string>{""}));
    const auto y = root->forward(x);
    EXPECT_TRUE(torch::equal(y, ref->forward(x)));
    y.square().sum().backward();
    ref->forward(x).square().sum().backward();
    EXPECT_TRUE(torch::equal(root->weight.grad(), ref->weight.grad()));
    EXPECT_TRUE(torch::equal(root->bias.grad(), ref->bias.grad()));
    handle->detach();
  }
  layerstream::nn::Embedding table(50, 8);
  auto handle = layerstream::offload(*table, sim_options());
  EXPECT_EQ(handle->layers(), (std::vector<std::string>{""}));
  handle->detach();
  try {
    layerstream::offload(*ref, sim_options());
    FAIL() << "a torch::nn::Linear root cannot be swapped";
  } catch (const layerstream::Error& e) {
    EXPECT_NE(e.message().find("cannot stream the root module"), std::string::npos) << e.message();
    EXPECT_NE(e.message().find("layerstream::nn::Linear"), std::string::npos) << e.message();
  }
}

TEST(TorchOffload, SuspendFreesTheSlotsAndResumeContinuesExactly) {
  // suspend() frees the engine's device memory (the sim device computes on the
  // host, so no parameter moves here); a forward throws until resume(); after
  // it, training goes on as before (the same gradients as the model never
  // suspended, bit for bit); detach() of a suspended handle allocates nothing.
  torch::manual_seed(0);
  CloneNet net;
  auto twin = std::dynamic_pointer_cast<CloneNetImpl>(net->clone());
  const auto ids = torch::randint(0, 10, {3, 5});
  auto handle = layerstream::offload(*net, sim_options());
  net->forward(ids).sum().backward();
  twin->forward(ids).sum().backward();
  const uint64_t slots = handle->stats().device_bytes;
  ASSERT_GT(slots, 0u);
  handle->suspend();
  EXPECT_TRUE(handle->suspended());
  EXPECT_EQ(handle->stats().device_bytes, 0u);
  try {
    net->forward(ids);
    FAIL() << "a forward of a suspended model did not throw";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("suspended"), std::string::npos) << e.what();
  }
  handle->suspend();  // nothing to do
  handle->resume();
  EXPECT_FALSE(handle->suspended());
  EXPECT_EQ(handle->stats().device_bytes, slots);
  net->forward(ids).sum().backward();
  twin->forward(ids).sum().backward();
  handle->synchronize();
  for (const auto& p : net->named_parameters())
    EXPECT_TRUE(torch::equal(p.value().grad(), twin->named_parameters()[p.key()].grad())) << p.key();
  handle->suspend();
  const auto engine = handle->engine();
  handle->detach();
  EXPECT_EQ(engine->stats().device_bytes, 0u);
  EXPECT_TRUE(torch::equal(net->forward(ids), twin->forward(ids)));
}

TEST(TorchOffload, ToComputeDeviceKeepsStreamedWeightsOnTheHost) {
  // model->to(<compute device>) after offload() (the sim device computes on
  // the CPU) leaves the streamed weights where the engine reads them; a dtype
  // change throws; results are unchanged; after detach() to() converts.
  torch::manual_seed(0);
  Tied model;
  auto handle = layerstream::offload(*model, sim_options());
  const auto ids = torch::randint(0, 50, {2, 5});
  const auto before = model->forward(ids);
  const void* host = model->fc->weight.data_ptr();
  model->to(torch::kCPU);
  model->to(torch::kFloat);
  EXPECT_EQ(model->fc->weight.data_ptr(), host);
  EXPECT_TRUE(torch::equal(model->forward(ids), before));
  try {
    model->to(torch::kHalf);
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("streamed layer 'fc'"), std::string::npos) << e.what();
  }
  EXPECT_EQ(model->fc->weight.scalar_type(), torch::kFloat);
  handle->detach();
  model->to(torch::kHalf);
  EXPECT_EQ(model->fc->weight.scalar_type(), torch::kHalf);
}

TEST(TorchOffload, ContainerChildIsAClearError) {
  torch::nn::Sequential seq(torch::nn::Linear(4, 4), torch::nn::ReLU());
  try {
    layerstream::offload(*seq, sim_options());
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("cannot stream '0'"), std::string::npos) << e.what();
  }
}

}  // namespace

// Two streamed layers, a failure point, one more streamed layer: the layers
// after the failure point (first in backward) stage their gradients before it.
struct FailingImpl : torch::nn::Module {
  layerstream::nn::Linear a{nullptr}, b{nullptr}, c{nullptr};
  bool fail = false;
  FailingImpl() {
    a = register_module("a", layerstream::nn::Linear(8, 8));
    b = register_module("b", layerstream::nn::Linear(8, 8));
    c = register_module("c", layerstream::nn::Linear(8, 8));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::tanh(a(x)) * 1.0;
    if (fail) h.register_hook([](torch::Tensor g) -> torch::Tensor { throw std::runtime_error("boom"); });
    return c(torch::tanh(b(h)));
  }
};
TORCH_MODULE(Failing);

TEST(TorchOffload, BackwardThatThrowsLeavesNoGradientForTheNextStep) {
  // Before: b and c staged their gradients, the backward threw, and the
  // staged gradients were added at the end of the next backward, after the
  // caller's zero_grad(). Now they are dropped, and counted.
  torch::manual_seed(0);
  Failing ref;
  torch::manual_seed(0);
  Failing model;
  auto handle = layerstream::offload(*model, sim_options());
  const auto x = torch::randn({4, 8});
  for (Failing* m : {&model, &ref}) {
    (*m)->fail = true;
    EXPECT_THROW((*m)->forward(x).square().sum().backward(), std::exception);
    (*m)->fail = false;
    for (auto& p : (*m)->parameters()) p.mutable_grad() = torch::Tensor();
  }
  EXPECT_FALSE(model->c->weight.grad().defined());
  EXPECT_EQ(handle->stats().failed_backwards, 1u);
  for (int step = 0; step < 2; ++step) {
    const auto y = torch::randn({4, 8});
    model->forward(y).square().sum().backward();
    ref->forward(y).square().sum().backward();
    auto mp = model->named_parameters(), rp = ref->named_parameters();
    for (const auto& kv : mp)
      EXPECT_TRUE(torch::equal(kv.value().grad(), rp[kv.key()].grad())) << kv.key() << " step " << step;
  }
}

struct WithEmptyImpl : torch::nn::Module {
  layerstream::nn::Linear a{nullptr}, empty{nullptr};
  WithEmptyImpl() {
    a = register_module("a", layerstream::nn::Linear(4, 4));
    empty = register_module("empty", layerstream::nn::Linear(4, 0));
  }
};
TORCH_MODULE(WithEmpty);

TEST(TorchOffload, ZeroElementLayerIsLeftAsItIs) {
  WithEmpty model;
  auto handle = layerstream::offload(*model, sim_options());
  EXPECT_EQ(handle->layers(), std::vector<std::string>{"a"});
  const auto y = model->empty(torch::randn({2, 4}));
  EXPECT_EQ(y.sizes(), (std::vector<int64_t>{2, 0}));
}

TEST(TorchOffload, TrainingAQuantizedWeightIsRefused) {
  // The module keeps its dense parameter in C++, but the engine streams the
  // packed copy and computes no gradient for it: requires_grad set on it after
  // offload() used to train nothing without a word; the next call refuses it.
  torch::manual_seed(0);
  One model;
  auto handle = offload_int8(model);
  const auto x = torch::randn({3, 64});
  const auto before = model->forward(x);
  model->fc->weight.requires_grad_(true);
  try {
    model->forward(x);
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("quantized layer 'fc' was set to require grad"), std::string::npos)
        << e.what();
  }
  model->fc->weight.requires_grad_(false);
  EXPECT_TRUE(torch::equal(model->forward(x), before));
}

struct TwoImpl : torch::nn::Module {
  layerstream::nn::Linear a{nullptr}, b{nullptr};
  TwoImpl() {
    a = register_module("a", layerstream::nn::Linear(64, 64));
    b = register_module("b", layerstream::nn::Linear(64, 64));
  }
  torch::Tensor forward(const torch::Tensor& x) { return b(torch::tanh(a(x))); }
};
TORCH_MODULE(Two);

// A float64 Linear was streamed in C++ and then refused every float64 input
// (and computed a float32 one in float32, where the resident model refuses
// it); Python keeps such layers resident. Now C++ does too, with a warning
// naming them; nothing left to stream says why. A mistyped include pattern
// warns (it streamed nothing, silently), as in Python.
struct MixedImpl : torch::nn::Module {
  layerstream::nn::Linear a{nullptr}, b{nullptr};
  MixedImpl() {
    a = register_module("a", layerstream::nn::Linear(64, 64));
    b = register_module("b", layerstream::nn::Linear(64, 64));
    b->to(torch::kDouble);
  }
  torch::Tensor forward(const torch::Tensor& x) { return b(torch::tanh(a(x)).to(torch::kDouble)); }
};
TORCH_MODULE(Mixed);

TEST(TorchOffload, AFloat64LayerStaysResidentAndAnIncludeTypoIsWarned) {
  struct Collect : c10::WarningHandler {
    std::vector<std::string> got;
    void process(const c10::Warning& w) override { got.push_back(w.msg()); }
    bool has(const std::string& text) const {
      return std::any_of(got.begin(), got.end(), [&](const std::string& w) { return w.find(text) != std::string::npos; });
    }
  };
  torch::manual_seed(3);
  Mixed model, ref;
  {
    torch::NoGradGuard ng;
    for (auto& p : ref->named_parameters()) p.value().copy_(model->named_parameters()[p.key()]);
  }
  const auto x = torch::randn({4, 64});
  Collect warnings;
  std::shared_ptr<layerstream::OffloadHandle> handle;
  {
    c10::WarningUtils::WarningHandlerGuard guard(&warnings);
    handle = layerstream::offload(*model, sim_options());
  }
  EXPECT_TRUE(warnings.has("1 Linear/conv layer(s) whose weight dtype streamed layers do not compute in stay "
                           "resident on cpu")) << (warnings.got.empty() ? "" : warnings.got.front());
  EXPECT_TRUE(warnings.has("'b' (float64)"));
  EXPECT_EQ(handle->engine()->num_layers(), 1);
  EXPECT_TRUE(torch::equal(model->forward(x), ref->forward(x)));
  model->forward(x).sum().backward();
  ref->forward(x).sum().backward();
  EXPECT_TRUE(torch::equal(model->b->weight.grad(), ref->b->weight.grad()));
  EXPECT_TRUE(torch::equal(model->a->weight.grad(), ref->a->weight.grad()));
  handle->detach();

  auto only_b = sim_options();
  only_b.include = {"b"};
  try {
    layerstream::offload(*model, only_b);
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("stay resident (torch's Linear/conv takes its input in its weight's dtype"),
              std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("'b' (float64)"), std::string::npos) << e.what();
  }
  auto typo = sim_options();
  typo.include = {"a", "bb"};
  Collect typo_warnings;
  {
    c10::WarningUtils::WarningHandlerGuard guard(&typo_warnings);
    handle = layerstream::offload(*model, typo);
  }
  EXPECT_TRUE(typo_warnings.has("OffloadOptions::include: 'bb' matches no module name"));
  EXPECT_FALSE(typo_warnings.has("'a'"));
  handle->detach();
}

TEST(TorchOffload, FailureWhileAttachingUndoesWhatWasAttached) {
  // 'a' is frozen and quantizes; 'b' is trainable, which the engine refuses
  // for a quantized weight. Before, the exception left 'a' bound to an engine
  // no handle could detach. Now offload() undoes it and rethrows.
  torch::manual_seed(0);
  Two model;
  model->a->weight.requires_grad_(false);
  const auto x = torch::randn({3, 64});
  const auto want = model->forward(x).detach();
  auto opts = sim_options();
  opts.quantize = "int8";
  EXPECT_THROW(layerstream::offload(*model, opts), std::exception);
  EXPECT_FALSE(model->a->attached());
  EXPECT_FALSE(model->b->attached());
  EXPECT_TRUE(torch::equal(model->forward(x), want));
  model->b->weight.requires_grad_(false);
  model->b->bias.requires_grad_(false);
  auto handle = layerstream::offload(*model, opts);
  EXPECT_EQ(handle->stats().quantized_layers, 2u);
}

// A language model's input side: a token table, a plain torch table beside it
// and a Linear.
struct TokensImpl : torch::nn::Module {
  layerstream::nn::Embedding emb{nullptr};
  torch::nn::Embedding pos{nullptr};
  layerstream::nn::Linear fc{nullptr};
  TokensImpl() {
    emb = register_module("emb", layerstream::nn::Embedding(
                                     torch::nn::EmbeddingOptions(300, 16).padding_idx(0)));
    pos = register_module("pos", torch::nn::Embedding(8, 16));
    fc = register_module("fc", layerstream::nn::Linear(16, 4));
    emb->weight.requires_grad_(false);
    pos->weight.requires_grad_(false);
  }
  torch::Tensor forward(const torch::Tensor& ids) {
    return fc(emb(ids) + pos(torch::arange(ids.size(1))));
  }
};
TORCH_MODULE(Tokens);

TEST(TorchOffload, FrozenEmbeddingIsLookedUpInHostMemory) {
  torch::manual_seed(0);
  Tokens ref;
  torch::manual_seed(0);
  Tokens model;
  const auto table = model->emb->weight.detach().clone();
  auto handle = layerstream::offload(*model, sim_options());
  // torch::nn::Embedding is never swapped (its parent calls it through a member).
  EXPECT_EQ(handle->layers(), (std::vector<std::string>{"emb", "fc"}));
  EXPECT_TRUE(model->emb->attached());
  const auto ids = torch::tensor({{0, 299, 7, 7}, {3, 0, 1, 298}});
  for (int step = 0; step < 2; ++step) {
    auto out = model(ids), want = ref(ids);
    EXPECT_TRUE(torch::equal(out, want)) << "step " << step;
    out.square().sum().backward();
    want.square().sum().backward();
    EXPECT_FALSE(model->emb->weight.grad().defined());
    EXPECT_TRUE(torch::equal(model->fc->weight.grad(), ref->fc->weight.grad()));
  }
  const auto stats = handle->stats();
  EXPECT_EQ(stats.embedding_layers, 1u);
  EXPECT_EQ(stats.gathered_bytes, 2u * 8 * 16 * 4);
  auto engine = handle->engine();
  EXPECT_THROW(engine->linear(0, torch::randn({2, 16})), std::exception);  // 'emb' is a table
  try {
    engine->embedding(0, ids.to(torch::kFloat));
    ADD_FAILURE() << "float ids were accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("must be int64 or int32"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(engine->ordering_errors().empty());
  handle->detach();
  EXPECT_FALSE(model->emb->attached());
  EXPECT_TRUE(torch::equal(model->emb->weight, table));
  EXPECT_TRUE(torch::equal(model(ids), ref(ids)));
}

TEST(TorchOffload, TrainableEmbeddingTrainsFromTheHost) {
  // A trainable table streams too; its gradient (padding row excluded) is
  // computed on the host and matches the resident table's, over SGD steps.
  torch::manual_seed(0);
  Tokens ref;
  torch::manual_seed(0);
  Tokens model;
  ref->emb->weight.requires_grad_(true);
  model->emb->weight.requires_grad_(true);
  auto handle = layerstream::offload(*model, sim_options());
  EXPECT_EQ(handle->layers(), (std::vector<std::string>{"emb", "fc"}));
  torch::optim::SGD opt(model->parameters(), 0.5), opt_r(ref->parameters(), 0.5);
  const auto ids = torch::tensor({{0, 5, 5, 299}, {5, 0, 1, 2}});
  for (int step = 0; step < 3; ++step) {
    opt.zero_grad();
    opt_r.zero_grad();
    model(ids).square().sum().backward();
    ref(ids).square().sum().backward();
    ASSERT_TRUE(model->emb->weight.grad().defined());
    EXPECT_TRUE(torch::equal(model->emb->weight.grad(), ref->emb->weight.grad())) << "step " << step;
    EXPECT_EQ(model->emb->weight.grad()[0].abs().sum().item<float>(), 0.0f);  // the padding row
    opt.step();
    opt_r.step();
  }
  EXPECT_TRUE(torch::equal(model->emb->weight, ref->emb->weight));
  EXPECT_GT(handle->stats().d2h_bytes, 0u);
}

TEST(TorchOffload, TensorGroupIsFetchedWholeIntoOneSlot) {
  // add_group(): any-shaped tensors adopted into the host store (the
  // parameters alias it), fetched together as device views of one slot,
  // released by token; detach() restores them, bit-identical.
  auto engine = layerstream::Engine::create(sim_options());
  torch::manual_seed(0);
  auto a = torch::randn({4, 6, 8}), b = torch::randn({4, 8, 3}), c = torch::randn({4, 3});
  const auto a0 = a.clone(), b0 = b.clone(), c0 = c.clone();
  const int g = engine->add_group("experts", {a, b, c});
  EXPECT_EQ(engine->layer_bytes(g), (4 * 6 * 8 + 4 * 8 * 3 + 4 * 3) * 4);
  EXPECT_EQ(engine->stats().group_layers, 1u);
  EXPECT_EQ(engine->stats().pinned_bytes, static_cast<uint64_t>(engine->layer_bytes(g)));
  for (int step = 0; step < 2; ++step) {
    auto [token, views] = engine->fetch(g);
    ASSERT_EQ(views.size(), 3u);
    EXPECT_TRUE(torch::equal(views[0], a0) && torch::equal(views[1], b0) && torch::equal(views[2], c0));
    EXPECT_NE(views[0].data_ptr(), a.data_ptr());  // the slot, not the host copy
    engine->release(token);
    EXPECT_THROW(engine->release(token), std::exception);  // once
  }
  EXPECT_GT(engine->stats().h2d_bytes, 0u);
  try {
    engine->linear(g, torch::randn({2, 8}));
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("layer 'experts' is a tensor group, not a Linear"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(engine->add_group("again", {b}), std::exception);  // already streamed
  for (int which = 0; which < 2; ++which) {  // a group's tensor as a Linear's weight or bias
    try {
      if (which == 0) engine->add_linear("fc", c, torch::Tensor());
      else engine->add_linear("fc", torch::randn({4, 3}), c);
      FAIL() << "expected an error";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("uses a tensor of streamed tensor group 'experts'"), std::string::npos)
          << e.what();
    }
  }
  engine->detach({});
  EXPECT_TRUE(torch::equal(a, a0) && torch::equal(b, b0) && torch::equal(c, c0));
}

TEST(TorchOffload, AGroupsRawBytesCrossAsTheyAreEvenWithAFormat) {
  // A non-floating group tensor (diffusers' GGUF blocks, which the module's own
  // forward decodes): it crosses as it is, and a quantization format packs only
  // the floating-point tensors beside it (here none of 2+ dimensions).
  for (const auto format : {layerstream::quant::Format::None, layerstream::quant::Format::Int8}) {
    auto engine = layerstream::Engine::create(sim_options());
    torch::manual_seed(0);
    auto blocks = torch::randint(0, 256, {16, 34}, torch::kUInt8), bias = torch::randn({16});
    const auto blocks0 = blocks.clone(), bias0 = bias.clone();
    const int g = engine->add_group("gguf", {blocks, bias}, format);
    EXPECT_EQ(engine->layer_bytes(g), 16 * 34 + 16 * 4);
    auto [token, views] = engine->fetch(g);
    ASSERT_EQ(views.size(), 2u);
    EXPECT_EQ(views[0].scalar_type(), torch::kUInt8);
    EXPECT_TRUE(torch::equal(views[0], blocks0) && torch::equal(views[1], bias0));
    engine->release(token);
    engine->detach({});
    EXPECT_TRUE(torch::equal(blocks, blocks0) && torch::equal(bias, bias0));
  }
}

TEST(TorchOffload, RoutedFetchCopiesOnlyTheNamedExperts) {
  // add_group(..., experts): fetch(layer, experts) with at most half of the
  // experts copies only their slices of the expert-indexed tensors (dense
  // and packed: theirs dequantized), the other tensors whole; more than half
  // fetch the whole group. Lossless: each expert is a coded piece of its
  // own, copied and decoded alone, bit for bit. Bad ids and a group not
  // indexed by expert are clear errors.
  for (auto format : {layerstream::quant::Format::None, layerstream::quant::Format::NF4,
                      layerstream::quant::Format::Lossless}) {
    SCOPED_TRACE(layerstream::quant::to_string(format));
    auto engine = layerstream::Engine::create(sim_options());
    torch::manual_seed(0);
    auto a = torch::randn({8, 4, 32}), b = torch::randn({8, 64}), c = torch::randn({5});
    const auto a0 = a.clone(), b0 = b.clone();
    const int g = engine->add_group("experts", {a, b, c}, format, 8);
    const auto want_a = format == layerstream::quant::Format::None ? a0 : engine->dequantized_part(g, 0);
    const auto want_b = format == layerstream::quant::Format::None ? b0 : engine->dequantized_part(g, 1);
    double before = engine->stats().h2d_bytes;
    {
      auto [token, views] = engine->fetch(g, {6, 1, 2, 6});  // runs [1, 3) and [6, 7)
      for (int64_t x : {1, 2, 6}) {
        EXPECT_TRUE(torch::equal(views[0][x], want_a[x])) << "expert " << x;
        EXPECT_TRUE(torch::equal(views[1][x], want_b[x])) << "expert " << x;
      }
      EXPECT_TRUE(torch::equal(views[2], c));
      engine->release(token);
    }
    const double routed = engine->stats().h2d_bytes - before;
    EXPECT_EQ(engine->stats().routed_fetches, 1u);
    before = engine->stats().h2d_bytes;
    {
      auto [token, views] = engine->fetch(g, {0, 1, 2, 3, 4});  // more than half: whole
      EXPECT_TRUE(torch::equal(views[0], want_a) && torch::equal(views[1], want_b));
      engine->release(token);
    }
    const double whole = engine->stats().h2d_bytes - before;
    EXPECT_EQ(engine->stats().routed_fetches, 1u);
    if (format == layerstream::quant::Format::None) {
      EXPECT_EQ(routed, 3.0 / 8.0 * (8 * 4 * 32 + 8 * 64) * 4 + 5 * 4);
      EXPECT_EQ(whole, (8 * 4 * 32 + 8 * 64 + 5) * 4);
    } else if (format == layerstream::quant::Format::Lossless) {  // 3 experts' pieces of a and b
      EXPECT_TRUE(torch::equal(want_a, a0) && torch::equal(want_b, b0));
      namespace ll = layerstream::lossless;
      auto coded = [](const torch::Tensor& t) {
        return double(ll::analyze(ll::Dtype::F32, t.contiguous().data_ptr(), t.numel()).total_bytes());
      };
      double pieces = 0;
      for (int64_t x : {1, 2, 6}) pieces += coded(a0[x]) + coded(b0[x]);
      EXPECT_EQ(routed, pieces + 5 * 4);
      EXPECT_LT(routed, whole * 0.45);
    } else {  // 3 experts' codes (2 per byte) and block scales (one fp32 per 64)
      EXPECT_EQ(routed, 3 * (4 * 32 / 2 + 4 * 32 / 64 * 4 + 64 / 2 + 64 / 64 * 4) + 5 * 4);
      EXPECT_LT(routed, whole * 0.3);
    }
    try {
      engine->fetch(g, {8});
      FAIL() << "expected an error";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("expert 8 of tensor group 'experts' is outside [0, 8)"),
                std::string::npos) << e.what();
    }
    const int plain = engine->add_group("plain", {torch::randn({8, 4})});
    EXPECT_THROW(engine->fetch(plain, {1}), std::exception);
    engine->detach({});
  }
}

TEST(TorchOffload, TrainableLosslessGroupTensorsCrossCodedAndFollowWrites) {
  // A group tensor that requires grad with Format::Lossless stays the dense
  // parameter (written in place, as an optimizer does) and crosses coded, a
  // piece per expert (Note [Trainable coded weights]): routed and whole
  // fetches give its current values bit for bit after each write, the routed
  // copy moves the chosen experts' current pieces, and stats count the
  // re-codes. Two writes between fetches: the second one's values.
  namespace ll = layerstream::lossless;
  auto engine = layerstream::Engine::create(sim_options());
  torch::manual_seed(0);
  auto a = torch::randn({8, 4, 32}).to(torch::kBFloat16).requires_grad_(true);
  auto c = torch::randn({5}).requires_grad_(true);
  const int g = engine->add_group("experts", {a, c}, layerstream::quant::Format::Lossless, 8);
  EXPECT_EQ(engine->stats().coded_layers, 1u);
  auto coded = [](const torch::Tensor& t) {
    return double(ll::analyze(ll::Dtype::BF16, t.contiguous().data_ptr(), t.numel()).total_bytes());
  };
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE(step);
    if (step > 0) {
      torch::NoGradGuard ng;
      a.mul_(1.5).add_(0.25);  // in place, as an optimizer step
      if (step == 2) a.sub_(0.125);
    }
    const double before = engine->stats().h2d_bytes;
    {
      auto [token, views] = engine->fetch(g, {6, 1, 2});
      for (int64_t x : {1, 2, 6}) EXPECT_TRUE(torch::equal(views[0][x], a.detach()[x])) << "expert " << x;
      EXPECT_TRUE(torch::equal(views[1], c.detach()));
      engine->release(token);
    }
    double pieces = 0;
    for (int64_t x : {1, 2, 6}) pieces += coded(a.detach()[x]);
    EXPECT_EQ(engine->stats().h2d_bytes - before, pieces + 5 * 4);
    {
      auto [token, views] = engine->fetch(g, {});
      EXPECT_TRUE(torch::equal(views[0], a.detach()));
      engine->release(token);
    }
  }
  EXPECT_EQ(engine->stats().recoded_bytes, 2u * 8 * 4 * 32 * 2);
  EXPECT_EQ(engine->ordering_errors().size(), 0u);
}

TEST(TorchOffload, PrepackedGgufGroupPartsStreamAsTheirBytes) {
  // add_group(..., prepacked): a GGUF tensor's bytes (Q8_0 blocks here) are
  // stored as they are and dequantized into the slot (what quant::
  // dequantize_cpu gives, in the stand-in's dtype); each expert's rows are
  // fetched on their own, whatever the group's format; wrong byte counts,
  // non-GGUF formats and 1-D pre-packed tensors are refused.
  namespace q = layerstream::quant;
  // One expert: 3 rows of one Q8_0 block, 96 elements (not whole nf4 blocks:
  // only the GGUF rule, whole rows, lets an expert be fetched on its own).
  const int64_t experts = 8, rows = 3, cols = 32;
  const q::PackedLayout L = q::layout_for(q::Format::GgufQ8_0, experts * rows, cols);
  torch::manual_seed(0);
  // The file's bytes: whole blocks, no padding (the layout pads its section to 256 B).
  ASSERT_EQ(L.data_bytes, static_cast<size_t>(experts * rows * 34));
  ASSERT_GT(L.total_bytes(), L.data_bytes);
  auto bytes = torch::randint(0, 256, {static_cast<int64_t>(L.data_bytes)}, torch::kUInt8);
  auto* p = bytes.data_ptr<uint8_t>();
  for (size_t blk = 0; blk < L.data_bytes / 34; ++blk) {  // finite fp16 scales: 1/64 (0x2400)
    p[blk * 34] = 0x00;
    p[blk * 34 + 1] = 0x24;
  }
  auto want = torch::empty({experts, rows, cols}, torch::kBFloat16);
  auto padded = torch::zeros({static_cast<int64_t>(L.total_bytes())}, torch::kUInt8);
  std::memcpy(padded.data_ptr<uint8_t>() + L.data_offset(), p, L.data_bytes);
  q::dequantize_cpu(L, padded.data_ptr(), want.data_ptr(), q::OutDtype::BF16);
  for (auto format : {q::Format::None, q::Format::NF4}) {
    SCOPED_TRACE(q::to_string(format));
    auto engine = layerstream::Engine::create(sim_options());
    auto stand_in = torch::empty({experts, rows, cols}, torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kMeta));
    auto bias = torch::randn({5});
    const int g = engine->add_group("experts", {stand_in, bias}, format, experts,
                                    {{q::Format::GgufQ8_0, bytes}, {}});
    EXPECT_EQ(engine->dequantized_part(g, 0).view(torch::kInt16).equal(want.view(torch::kInt16)), true);
    {
      auto [token, views] = engine->fetch(g);
      EXPECT_TRUE(torch::equal(views[0], want));
      EXPECT_TRUE(torch::equal(views[1], bias));
      engine->release(token);
    }
    const double before = engine->stats().h2d_bytes;
    {
      auto [token, views] = engine->fetch(g, {5, 2});
      EXPECT_TRUE(torch::equal(views[0][5], want[5]) && torch::equal(views[0][2], want[2]));
      engine->release(token);
    }
    EXPECT_EQ(engine->stats().h2d_bytes - before, 2.0 * rows * cols / 32 * 34 + 5 * 4);
    EXPECT_EQ(engine->stats().routed_fetches, 1u);
    engine->detach({});
  }
  auto engine = layerstream::Engine::create(sim_options());
  auto meta = [](std::vector<int64_t> shape) {
    return torch::empty(shape, torch::TensorOptions().dtype(torch::kFloat).device(torch::kMeta));
  };
  const auto error_of = [&](auto&& fn) {
    try {
      fn();
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  std::string msg = error_of([&] {
    engine->add_group("short", {meta({experts, rows, cols})}, q::Format::None, 0,
                      {{q::Format::GgufQ8_0, bytes.narrow(0, 0, 100)}});
  });
  EXPECT_NE(msg.find("in q8_0 needs " + std::to_string(L.data_bytes) + " bytes, got 100"), std::string::npos) << msg;
  msg = error_of([&] {
    engine->add_group("nf4", {meta({experts, rows, cols})}, q::Format::None, 0, {{q::Format::NF4, bytes}});
  });
  EXPECT_NE(msg.find("pre-packed tensors are supported in the GGUF formats only"), std::string::npos) << msg;
  msg = error_of([&] { engine->add_group("flat", {meta({64})}, q::Format::None, 0, {{q::Format::GgufQ8_0, bytes}}); });
  EXPECT_NE(msg.find("must have 2 or more dimensions"), std::string::npos) << msg;
  msg = error_of([&] { engine->add_group("count", {meta({2, 64}), meta({3})}, q::Format::None, 0, {{}}); });
  EXPECT_NE(msg.find("1 pre-packed entries for 2 tensors"), std::string::npos) << msg;
}

TEST(TorchOffload, QuantizedTensorGroupDequantizesIntoTheSlot) {
  // With a format, 2+-D tensors cross packed and fetch() returns their
  // dequantized copies (what dequantized_part() computes on the host); 1-D
  // tensors stay as they are; requantize_part() loads new values; a tensor
  // that requires grad is refused.
  auto engine = layerstream::Engine::create(sim_options());
  torch::manual_seed(0);
  auto a = torch::randn({4, 6, 64}), b = torch::randn({64});
  const auto b0 = b.clone();
  const int g = engine->add_group("experts", {a, b}, layerstream::quant::Format::Int8);
  EXPECT_LT(engine->layer_bytes(g), (4 * 6 * 64 + 64) * 4 / 2);  // packed: ~1 byte per element
  const auto a_deq = engine->dequantized_part(g, 0);
  EXPECT_TRUE(torch::allclose(a_deq, a, 0, 0.05));
  EXPECT_THROW(engine->dequantized_part(g, 1), std::exception);  // not quantized
  {
    auto [token, views] = engine->fetch(g);
    EXPECT_TRUE(torch::equal(views[0], a_deq));
    EXPECT_TRUE(torch::equal(views[1], b0));
    engine->release(token);
  }
  engine->requantize_part(g, 0, a * 2);
  {
    auto [token, views] = engine->fetch(g);
    EXPECT_TRUE(torch::equal(views[0], engine->dequantized_part(g, 0)));
    EXPECT_TRUE(torch::allclose(views[0], a * 2, 0, 0.1));
    engine->release(token);
  }
  EXPECT_THROW(engine->requantize_part(g, 0, torch::randn({4, 6})), std::exception);  // shape
  auto t = torch::randn({2, 64}).requires_grad_();
  try {
    engine->add_group("trainable", {t}, layerstream::quant::Format::NF4);
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("a quantized tensor cannot be trained"), std::string::npos) << e.what();
  }
  engine->detach({});
}

// C++ offload() plans a budget as Python's does (plan_slots_first): a budget
// that holds the whole model keeps every layer resident (nothing streams), and
// a tighter one reserves prefetch + 1 slots, keeps what the rest holds
// resident and streams the others.
struct StackImpl : torch::nn::Module {
  std::vector<layerstream::nn::Linear> layers;
  StackImpl() {
    for (int i = 0; i < 8; ++i)
      layers.push_back(register_module("l" + std::to_string(i), layerstream::nn::Linear(64, 64)));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& l : layers) x = torch::tanh(l(x));
    return x;
  }
};
TORCH_MODULE(Stack);

TEST(TorchOffload, BudgetIsPlannedAsInPython) {
  constexpr int64_t kLayer = 64 * 64 * 4 + 64 * 4;  // 16640 bytes resident
  torch::manual_seed(3);
  Stack ref;
  const auto x = torch::randn({5, 64});
  const auto expected = ref(x);
  // 256 MiB holds everything: every layer resident, nothing crosses the bus.
  Stack roomy;
  {
    torch::NoGradGuard ng;
    for (size_t i = 0; i < ref->parameters().size(); ++i) roomy->parameters()[i].copy_(ref->parameters()[i]);
  }
  auto opts = sim_options();
  opts.budget_bytes = 256 << 20;
  auto h = layerstream::offload(*roomy, opts);
  EXPECT_EQ(h->resident_layers().size(), 8u);
  EXPECT_TRUE(h->layers().empty());
  EXPECT_TRUE(torch::equal(roomy(x), expected));
  EXPECT_EQ(h->stats().h2d_bytes, 0u);
  EXPECT_NE(h->plan().find("resident"), std::string::npos) << h->plan();
  h->detach();

  // 6 layers' worth: prefetch 2 -> 3 slots reserved first, residency with the
  // rest, the others stream.
  Stack tight;
  {
    torch::NoGradGuard ng;
    for (size_t i = 0; i < ref->parameters().size(); ++i) tight->parameters()[i].copy_(ref->parameters()[i]);
  }
  opts.budget_bytes = 6 * kLayer;
  opts.prefetch = 2;
  auto t = layerstream::offload(*tight, opts);
  EXPECT_TRUE(torch::equal(tight(x), expected));
  const auto s = t->stats();
  EXPECT_EQ(s.slots, 3u);
  const auto resident = static_cast<int64_t>(t->resident_layers().size());
  EXPECT_GE(resident, 1);
  EXPECT_GE(t->layers().size(), 1u);
  EXPECT_EQ(t->layers().size() + t->resident_layers().size(), 8u);
  EXPECT_GT(s.h2d_bytes, 0u);
  EXPECT_LE(static_cast<int64_t>(s.slots * s.slot_bytes) + resident * kLayer, opts.budget_bytes);
  // The handle's stats, as Python's: the budget given, and a peak that counts the
  // resident layers (the engine's own stats have what the slots got).
  EXPECT_EQ(s.budget_bytes, opts.budget_bytes);
  EXPECT_LT(t->engine()->stats().budget_bytes, opts.budget_bytes);
  EXPECT_GE(static_cast<int64_t>(s.peak_device_bytes), static_cast<int64_t>(s.slots * s.slot_bytes) + resident * kLayer);
  EXPECT_LE(static_cast<int64_t>(s.peak_device_bytes), opts.budget_bytes);
  // The sim's modelled link times the plan, as in Python (it said "no link bandwidth given").
  EXPECT_NE(t->plan().find("predicted copy time:      3.3 us per step over the 25 GB/s link"), std::string::npos)
      << t->plan();
  EXPECT_EQ(t->plan().find("no link bandwidth given"), std::string::npos) << t->plan();
  t->detach();
}

TEST(TorchOffload, LayersSharingAWeightArePlannedTogetherAndCountedOnce) {
  // l1 -> 3 blocks -> l2, l2's weight is l1's. Before, the planner saw them as
  // unrelated layers: the weight counted twice (a budget holding everything
  // streamed), and a plan keeping l1 resident was widened to l2 after it, so
  // plan() said what did not run.
  struct SharedImpl : torch::nn::Module {
    std::vector<layerstream::nn::Linear> layers;
    SharedImpl() {
      torch::manual_seed(0);
      layers.push_back(register_module("l1", layerstream::nn::Linear(64, 64)));
      for (int i = 0; i < 3; ++i)
        layers.push_back(register_module("m" + std::to_string(i), layerstream::nn::Linear(64, 64)));
      layers.push_back(register_module(
          "l2", layerstream::nn::Linear(torch::nn::LinearOptions(64, 64), layers[0]->weight, torch::randn({64}))));
    }
    torch::Tensor forward(torch::Tensor x) {
      for (auto& l : layers) x = torch::tanh(l(x));
      return x;
    }
  };
  constexpr int64_t W = 64 * 64 * 4, B = 64 * 4;
  const torch::Tensor x = torch::randn({3, 64});
  torch::NoGradGuard ng;
  const torch::Tensor expected = std::make_shared<SharedImpl>()->forward(x);
  for (const int64_t budget : {4 * W + 5 * B, 3 * (W + B) + 4 * B, 3 * (W + B) + B / 2}) {
    SCOPED_TRACE(budget);
    auto model = std::make_shared<SharedImpl>();
    auto opts = sim_options();
    opts.budget_bytes = budget;
    opts.prefetch = 1;
    auto h = layerstream::offload(*model, opts);
    EXPECT_TRUE(torch::equal(model->forward(x), expected));
    const auto& resident = h->resident_layers();
    const bool l1 = std::count(resident.begin(), resident.end(), "l1") > 0;
    EXPECT_EQ(l1, std::count(resident.begin(), resident.end(), "l2") > 0);
    EXPECT_EQ(l1, budget != 3 * (W + B) + B / 2) << h->plan();
    if (budget == 4 * W + 5 * B) {
      EXPECT_TRUE(h->layers().empty()) << h->plan();  // the weight counted once
    }
    EXPECT_NE(h->plan().find(std::to_string(resident.size()) + " resident"), std::string::npos) << h->plan();
    EXPECT_NE(h->plan().find(l1 ? "l2 is resident with l1" : "l2 streams with l1"), std::string::npos) << h->plan();
    EXPECT_LE(static_cast<int64_t>(h->stats().peak_device_bytes), budget);
    h->detach();
  }
}

// quantize with a budget: a layer the plan keeps resident holds the values it
// would stream with (layerstream::quantized_values), so the output is the
// all-streamed model's, whatever the budget.
TEST(TorchOffload, AQuantizedLayerKeptResidentComputesWithTheStreamedValues) {
  torch::manual_seed(5);
  Stack streamed, tight;
  {
    torch::NoGradGuard ng;
    for (size_t i = 0; i < streamed->parameters().size(); ++i) tight->parameters()[i].copy_(streamed->parameters()[i]);
  }
  for (auto* m : {&streamed, &tight})
    for (auto& p : (*m)->parameters()) p.requires_grad_(false);
  std::vector<torch::Tensor> original;
  for (auto& l : tight->layers) original.push_back(l->weight.detach().clone());
  auto opts = sim_options();
  opts.quantize = "int8";
  auto all = layerstream::offload(*streamed, opts);
  opts.budget_bytes = 8 * 64 * 64 * 4;  // prefetch + 1 slots, and some layers resident
  auto some = layerstream::offload(*tight, opts);
  ASSERT_FALSE(some->resident_layers().empty());
  ASSERT_FALSE(some->layers().empty());
  const auto x = torch::randn({5, 64});
  EXPECT_TRUE(torch::equal(tight(x), streamed(x)));
  for (const auto& name : some->resident_layers()) {
    const size_t i = std::stoul(name.substr(1));
    EXPECT_TRUE(torch::equal(tight->layers[i]->weight, layerstream::quantized_values(original[i], 64, 64, "int8")))
        << name;
    EXPECT_FALSE(torch::equal(tight->layers[i]->weight, original[i])) << name;
  }
  some->detach();
  all->detach();
}

// A quantized layer kept resident stays quantized after torch::load() and after
// a write into its weight, as a streamed one does (before, both wrote dense
// values: the budget changed the numbers); after detach() a write is as written.
TEST(TorchOffload, AQuantizedLayerKeptResidentIsQuantizedAgainAfterALoadOrAWrite) {
  torch::manual_seed(6);
  Stack streamed, tight, values;
  {
    torch::NoGradGuard ng;
    for (size_t i = 0; i < streamed->parameters().size(); ++i) tight->parameters()[i].copy_(streamed->parameters()[i]);
  }
  for (auto* m : {&streamed, &tight})
    for (auto& p : (*m)->parameters()) p.requires_grad_(false);
  const std::string path = temp_path("quantized_resident.pt");
  torch::save(values, path);
  auto opts = sim_options();
  opts.quantize = "int8";
  auto all = layerstream::offload(*streamed, opts);
  opts.budget_bytes = 8 * 64 * 64 * 4;
  auto some = layerstream::offload(*tight, opts);
  ASSERT_FALSE(some->resident_layers().empty());
  const auto x = torch::randn({5, 64});
  torch::load(tight, path);
  torch::load(streamed, path);
  const std::string& name = some->resident_layers().front();
  const size_t i = std::stoul(name.substr(1));
  // Quantized as it loads (its weight is read before any call too).
  EXPECT_TRUE(torch::equal(tight->layers[i]->weight,
                           layerstream::quantized_values(values->layers[i]->weight, 64, 64, "int8")))
      << name;
  EXPECT_TRUE(torch::equal(tight(x), streamed(x)));
  const auto written = torch::randn({64, 64});
  {
    torch::NoGradGuard ng;
    tight->layers[i]->weight.copy_(written);
  }
  tight(x);
  EXPECT_TRUE(torch::equal(tight->layers[i]->weight, layerstream::quantized_values(written, 64, 64, "int8"))) << name;
  some->detach();
  {
    torch::NoGradGuard ng;
    tight->layers[i]->weight.copy_(written);
  }
  tight(x);
  EXPECT_TRUE(torch::equal(tight->layers[i]->weight, written)) << name;
  all->detach();
  std::filesystem::remove(path);
  // A trainable layer is refused whether the budget streams it or keeps it (kept, it
  // trained dense after one quantization).
  Stack trainable;
  try {
    layerstream::offload(*trainable, opts);
    FAIL() << "a trainable layer kept resident under quantize= was not refused";
  } catch (const layerstream::Error& e) {
    EXPECT_NE(e.message().find("a quantized weight cannot be trained"), std::string::npos) << e.message();
  }
}

// torch::load() of a budget-kept quantized layer's own save leaves its values as
// they are: quantizing nf4 values (dequantized to bf16) again moves some
// (tensor_checksum tells a write of the same values from a new one).
TEST(TorchOffload, AQuantizedLayerKeptResidentLoadsItsOwnSaveUnchanged) {
  torch::manual_seed(7);
  Stack net;
  for (auto& p : net->parameters()) p.requires_grad_(false);
  auto opts = sim_options();
  opts.quantize = "nf4";
  opts.dequant_dtype = "bfloat16";
  opts.budget_bytes = 8 * 64 * 64 * 4;
  auto h = layerstream::offload(*net, opts);
  ASSERT_FALSE(h->resident_layers().empty());
  const size_t i = std::stoul(h->resident_layers().front().substr(1));
  const torch::Tensor before = net->layers[i]->weight.detach().clone();
  const auto twice = layerstream::quantized_values(before, 64, 64, "nf4", torch::kBFloat16);
  ASSERT_FALSE(torch::equal(twice, before)) << "idempotent here: this test shows nothing";
  const std::string path = temp_path("quantized_own_save.pt");
  torch::save(net, path);
  torch::load(net, path);
  net->forward(torch::randn({2, 64}));
  EXPECT_TRUE(torch::equal(net->layers[i]->weight, before));
  h->detach();
  std::filesystem::remove(path);
}

// A budget-kept quantized layer whose weight is unfrozen after offload() is
// refused at its next forward, as a streamed one is (a step's values would be
// quantized again). A dequant_dtype wider than the weights' dtype is warned of:
// the kept values are rounded to it, the streamed ones are not
// (resident_quantized_rounds, the rule Python's warning follows too).
TEST(TorchOffload, AQuantizedLayerKeptResidentRefusesUnfreezingAndWarnsOfRounding) {
  struct Collect : c10::WarningHandler {
    std::vector<std::string> got;
    void process(const c10::Warning& w) override { got.push_back(w.msg()); }
  };
  EXPECT_TRUE(layerstream::resident_quantized_rounds(torch::kBFloat16, torch::kFloat32));
  EXPECT_FALSE(layerstream::resident_quantized_rounds(torch::kBFloat16, torch::kBFloat16));
  EXPECT_FALSE(layerstream::resident_quantized_rounds(torch::kFloat32, torch::kBFloat16));
  EXPECT_FALSE(layerstream::resident_quantized_rounds(torch::kBFloat16, std::nullopt));
  for (const std::string dq : {"float32", "bfloat16"}) {
    torch::manual_seed(8);
    Stack net;
    net->to(torch::kBFloat16);
    for (auto& p : net->parameters()) p.requires_grad_(false);
    auto opts = sim_options();
    opts.quantize = "int8";
    opts.dequant_dtype = dq;
    opts.budget_bytes = 8 * 64 * 64 * 4;
    Collect warnings;
    std::shared_ptr<layerstream::OffloadHandle> handle;
    {
      c10::WarningUtils::WarningHandlerGuard guard(&warnings);
      handle = layerstream::offload(*net, opts);
    }
    ASSERT_FALSE(handle->resident_layers().empty()) << handle->plan();
    const std::string& name = handle->resident_layers().front();
    size_t rounding = 0;
    for (const auto& w : warnings.got)
      if (w.find("rounded from dequant_dtype=float32") != std::string::npos) {
        ++rounding;
        EXPECT_NE(w.find("'" + name + "'"), std::string::npos) << w;
        EXPECT_NE(w.find("(dequant_dtype=bfloat16)"), std::string::npos) << w;
      }
    EXPECT_EQ(rounding, dq == "float32" ? 1u : 0u) << dq;
    const auto x = torch::randn({5, 64}).to(torch::kBFloat16);
    const auto before = net(x);
    auto& weight = net->layers[std::stoul(name.substr(1))]->weight;
    weight.requires_grad_(true);
    try {
      net(x);
      ADD_FAILURE() << "a kept quantized weight unfrozen after offload() ran";
    } catch (const layerstream::Error& e) {
      EXPECT_NE(e.message().find("'" + name + "'"), std::string::npos) << e.message();
      EXPECT_NE(e.message().find("set to require grad after offload()"), std::string::npos) << e.message();
    }
    weight.requires_grad_(false);
    EXPECT_TRUE(torch::equal(net(x), before));
    handle->detach();
  }
}

// The handle's methods are thread-safe (offload.h): stats(), suspended() and
// synchronize() from other threads while one detaches each return or throw
// "detached", never read a handle half torn down (a race on engine_ before it
// had a lock: tools/sanitize.sh's stage 3 reports one; here it may crash).
TEST(TorchOffload, HandleMethodsFromSeveralThreadsWhileItDetaches) {
  for (int round = 0; round < 20; ++round) {
    Stack net;
    auto handle = layerstream::offload(*net, sim_options());
    net(torch::randn({2, 64}));
    std::atomic<bool> go{false};
    std::atomic<int> returned{0}, refused{0};
    std::vector<std::thread> readers;
    for (int t = 0; t < 3; ++t)
      readers.emplace_back([&, t] {
        while (!go.load()) std::this_thread::yield();
        for (int i = 0; i < 200; ++i) {
          try {
            if (t == 0) handle->stats();
            if (t == 1) handle->suspended();
            if (t == 2) handle->synchronize();
            ++returned;
          } catch (const layerstream::Error& e) {
            EXPECT_NE(e.message().find("detached"), std::string::npos) << e.message();
            ++refused;
          }
        }
      });
    go = true;
    handle->detach();
    for (auto& r : readers) r.join();
    EXPECT_EQ(returned + refused, 3 * 200);
    EXPECT_THROW(handle->stats(), layerstream::Error);
  }
}

// OffloadOptions::train: the budget covers the resident trainable weights'
// gradients and optimizer states too, with Python's rule (optim::train_bytes).
TEST(TorchOffload, TrainFootprintKeepsFewerTrainableLayersResident) {
  constexpr int64_t kLayer = 64 * 64 * 4 + 64 * 4;  // 16640 bytes resident, 3x that trained with AdamW
  auto opts = sim_options();
  opts.budget_bytes = 8 * kLayer;  // the whole stack as weights
  Stack weights_only, trained;
  auto a = layerstream::offload(*weights_only, opts);
  EXPECT_EQ(a->resident_layers().size(), 8u);
  opts.train = "adamw";
  auto b = layerstream::offload(*trained, opts);
  // 3 slots of 16640 + 1 resident layer at 4 x 16640 (weights, gradients, two
  // fp32 states) = 7 x 16640 <= 8 x 16640; 2 would not fit.
  EXPECT_EQ(b->resident_layers().size(), 1u) << b->plan();
  EXPECT_NE(b->plan().find("+ gradients and optimizer states 48.75 KiB"), std::string::npos) << b->plan();
  a->detach();
  b->detach();
  Stack other;
  auto bad = sim_options();
  bad.train = "adamw";  // no budget
  EXPECT_THROW(
      {
        try {
          layerstream::offload(*other, bad);
        } catch (const layerstream::Error& e) {
          EXPECT_NE(e.message().find("needs budget_bytes too"), std::string::npos) << e.message();
          throw;
        }
      },
      layerstream::Error);
  bad.budget_bytes = 8 * kLayer;
  bad.train = "sgd";
  EXPECT_THROW(layerstream::offload(*other, bad), layerstream::Error);
}

// device "auto" without a CUDA device falls back to the simulated device and
// says why, once per process (a broken driver would otherwise give a slow CPU
// simulation without a word); "sim" chosen explicitly says nothing.
TEST(TorchOffload, AutoDeviceFallingBackToSimWarnsOnceWhy) {
  if (torch::cuda::is_available()) GTEST_SKIP() << "a CUDA device is visible: \"auto\" picks it";
  std::vector<std::string> warnings;
  auto prev = layerstream::set_warning_handler([&](const std::string& w) { warnings.push_back(w); });
  layerstream::EngineOptions sim;
  sim.device = "sim";
  layerstream::Engine::create(sim);
  EXPECT_TRUE(warnings.empty());
  layerstream::EngineOptions autod;  // device "auto" by default
  auto engine = layerstream::Engine::create(autod);
  layerstream::Engine::create(autod);
  layerstream::set_warning_handler(prev);
  EXPECT_EQ(engine->device_name(), "sim");
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("no CUDA device"), std::string::npos) << warnings[0];
  EXPECT_NE(warnings[0].find("device \"sim\""), std::string::npos) << warnings[0];
}

// The host-tier and activation fields of EngineOptions are checked when the
// engine is made (core/options.h), each naming what it takes; their
// "unset" values (-1: no cap; staging_bytes 0: the least needed) work.
TEST(TorchOffload, EngineRefusesBadHostOptions) {
  auto error_of = [](void (*set)(layerstream::EngineOptions&)) {
    layerstream::EngineOptions o = sim_options();
    set(o);
    try {
      layerstream::Engine::create(o);
    } catch (const layerstream::Error& e) {
      return e.message();
    }
    ADD_FAILURE() << "no error";
    return std::string();
  };
  auto has = [](const std::string& text, const char* needle) {
    EXPECT_NE(text.find(needle), std::string::npos) << text;
  };
  has(error_of([](auto& o) { o.staging_bytes = -5; }), "staging_bytes must be a byte count >= 0");
  has(error_of([](auto& o) { o.reader_threads = 0; }), "reader_threads must be >= 1");
  has(error_of([](auto& o) { o.reader_threads = -1; }), "reader_threads must be >= 1");
  has(error_of([](auto& o) { o.activation_min_bytes = -1; }), "activation_min_bytes must be a byte count >= 0");
  has(error_of([](auto& o) { o.store_pinned_cap = -7; }), "store_pinned_cap must be -1 (no cap)");
  has(error_of([](auto& o) { o.activation_host_cap = -2; }), "activation_host_cap must be -1 (no cap)");
  has(error_of([](auto& o) { o.activation_pinned_cap = -2; }), "activation_pinned_cap must be -1 (no cap)");
  has(error_of([](auto& o) { o.grad_staging_pinned_cap = -2; }), "grad_staging_pinned_cap must be -1 (no cap)");
  layerstream::EngineOptions ok = sim_options();
  ok.store_pinned_cap = ok.activation_host_cap = ok.activation_pinned_cap = ok.grad_staging_pinned_cap = -1;
  ok.staging_bytes = 0;
  ok.activation_min_bytes = 0;
  ok.reader_threads = 1;
  EXPECT_NO_THROW(layerstream::Engine::create(ok));
  ok.store_pinned_cap = ok.activation_host_cap = ok.activation_pinned_cap = ok.grad_staging_pinned_cap = 0;
  ok.staging_bytes = 1 << 20;
  EXPECT_NO_THROW(layerstream::Engine::create(ok));
}

// "cuda" without a visible GPU: the advice names the caller's spelling of the
// simulated device (C++: OffloadOptions::device; Python: device='sim'; the
// command line: --device sim), from one rule (resolve_device).
TEST(TorchOffload, CudaWithoutAGpuAdvisesEachCallersSpelling) {
  if (torch::cuda::is_available()) GTEST_SKIP() << "a CUDA device is visible";
  auto message = [](const std::string& device, layerstream::DeviceSpelling spelling) {
    try {
      layerstream::resolve_device(device, spelling);
    } catch (const layerstream::Error& e) {
      return e.message();
    }
    ADD_FAILURE() << "no error for " << device;
    return std::string();
  };
  layerstream::EngineOptions o;
  o.device = "cuda";
  std::string cpp;
  try {
    layerstream::Engine::create(o);
    ADD_FAILURE() << "no error for device cuda";
  } catch (const layerstream::Error& e) {
    cpp = e.message();
  }
  EXPECT_NE(cpp.find("OffloadOptions::device = \"sim\""), std::string::npos) << cpp;
  EXPECT_NE(cpp.find("torch::cuda::is_available() is false"), std::string::npos) << cpp;
  EXPECT_EQ(cpp.find("device='sim'"), std::string::npos) << cpp;
  EXPECT_EQ(cpp.find("torch.cuda"), std::string::npos) << cpp;
  EXPECT_EQ(cpp, message("cuda", layerstream::DeviceSpelling::Cpp));
  const std::string py = message("cuda:0", layerstream::DeviceSpelling::Python);
  EXPECT_NE(py.find("use device='sim'"), std::string::npos) << py;
  EXPECT_NE(py.find("torch.cuda.is_available() is False"), std::string::npos) << py;
  const std::string cli = message("cuda", layerstream::DeviceSpelling::Cli);
  EXPECT_NE(cli.find("use --device sim"), std::string::npos) << cli;
  EXPECT_EQ(cli.find("device='sim'"), std::string::npos) << cli;
  EXPECT_EQ(cli.find("torch.cuda"), std::string::npos) << cli;
  const std::string cpu = message("cpu", layerstream::DeviceSpelling::Cpp);
  EXPECT_NE(cpu.find("OffloadOptions::device = \"sim\""), std::string::npos) << cpu;
}

TEST(TorchOffload, SavedActivationsOfAnOffloadedModelGoToTheHost) {
  // OffloadOptions::activations and OffloadHandle::saved_activations(): what the forward
  // saves while the scope lives goes through the engine; gradients equal the model's
  // without offload bit for bit (sim device: byte copies).
  struct NetImpl : torch::nn::Module {
    layerstream::nn::Linear a{nullptr}, b{nullptr}, c{nullptr};
    torch::nn::LayerNorm norm{nullptr};
    NetImpl() {
      a = register_module("a", layerstream::nn::Linear(256, 256));
      b = register_module("b", layerstream::nn::Linear(256, 256));
      c = register_module("c", layerstream::nn::Linear(256, 8));
      norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({256})));
    }
    torch::Tensor forward(const torch::Tensor& x) { return c(torch::gelu(b(norm(torch::gelu(a(x)))))); }
  };
  auto make = [] {
    torch::manual_seed(3);
    return std::make_shared<NetImpl>();
  };
  auto model = make(), ref = make();  // the same weights
  auto opts = sim_options();
  opts.activations = 0;  // every saved tensor that can goes to the host
  auto handle = layerstream::offload(*model, opts);
  const auto x = torch::randn({128, 256});
  for (int step = 0; step < 2; ++step) {
    torch::Tensor loss;
    {
      auto saved = handle->saved_activations();
      loss = model->forward(x).square().sum();
    }
    handle->synchronize();
    const auto s = handle->stats();
    EXPECT_GT(s.activation_d2h_bytes, 0u);
    // On the device: only the small ones (LayerNorm's statistics, the 128 x 8 output
    // square() saves: 5 KiB), every 128 KiB one is on the host until backward.
    EXPECT_EQ(s.activation_device_bytes, 128u * 4 * 2 + 128u * 8 * 4);
    // x (a's input), a's output, the first GELU's (norm's input), norm's, b's, the
    // second GELU's (c's input): six of 128 KiB per step.
    EXPECT_EQ(s.activation_d2h_bytes, (step + 1) * 6u * 128 * 256 * 4);
    loss.backward();
    ref->forward(x).square().sum().backward();
    const auto got = model->named_parameters(), want = ref->named_parameters();
    for (const auto& p : want) {
      ASSERT_TRUE(got[p.key()].grad().defined()) << p.key();
      EXPECT_TRUE(torch::equal(got[p.key()].grad().to(torch::kCPU), p.value().grad())) << p.key();
    }
    model->zero_grad();
    ref->zero_grad();
  }
  const auto s = handle->stats();
  EXPECT_EQ(s.activation_h2d_bytes, s.activation_d2h_bytes);
  EXPECT_EQ(handle->engine()->ordering_errors(), std::vector<std::string>{});
  // Scopes that end out of order leave this thread's chain intact; then a forward
  // outside any scope saves nothing through the engine.
  auto* outer = new layerstream::SavedActivations(handle->saved_activations());
  auto* inner = new layerstream::SavedActivations(handle->saved_activations());
  delete outer;
  delete inner;
  model->forward(x).sum().backward();
  EXPECT_EQ(handle->stats().activation_d2h_bytes, s.activation_d2h_bytes);
  // A scope destroyed on another thread (Note [A scope ended on another thread]) is
  // ended here too, with no dangling link: this thread's next forward crashed.
  auto* elsewhere = new layerstream::SavedActivations(handle->saved_activations());
  std::thread([elsewhere] { delete elsewhere; }).join();
  model->forward(x).sum().backward();
  EXPECT_EQ(handle->stats().activation_d2h_bytes, s.activation_d2h_bytes);
  // Without OffloadOptions::activations there is nothing to scope.
  auto other = std::make_shared<NetImpl>();
  auto plain = layerstream::offload(*other, sim_options());
  try {
    auto saved = plain->saved_activations();
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("set OffloadOptions::activations"), std::string::npos) << e.what();
  }
}

// A saved tensor the engine does not take (here: off the compute device) is
// kept by the scope's hook. An op that saves its own output (sigmoid) hands the
// hook the output with its grad_fn: kept as it was, the graph referred to
// itself and a forward whose backward never ran was never freed. The hook keeps
// it detached (as Python's _Kept does); the gradient stays the same.
TEST(TorchOffload, AForwardWithoutBackwardInASavedActivationsScopeIsFreed) {
  layerstream::nn::Linear net(8, 8);
  auto o = sim_options();
  o.activations = 0;
  auto handle = layerstream::offload(*net, o);
  auto freed = [&](bool scoped, const torch::TensorOptions& where) {
    auto x = torch::randn({1024}, where).requires_grad_();
    c10::weak_intrusive_ptr<torch::autograd::Node> node(c10::intrusive_ptr<torch::autograd::Node>{});
    {
      torch::Tensor y;
      if (scoped) {
        auto saved = handle->saved_activations();
        y = (x * 2).sigmoid();
      } else {
        y = (x * 2).sigmoid();
      }
      node = c10::weak_intrusive_ptr<torch::autograd::Node>(y.grad_fn());
    }
    return node.expired();
  };
  const auto meta = torch::TensorOptions().device(torch::kMeta);  // not the compute device: kept
  EXPECT_TRUE(freed(false, meta));
  EXPECT_TRUE(freed(true, meta));
  // A kept tensor still reaches its backward: mul saves the model's weight (a
  // parameter: kept) and the input (taken); the gradients are the same.
  auto x = torch::randn({8, 8}, torch::requires_grad());
  auto grads = [&](bool scoped) {
    x.mutable_grad().reset();
    torch::Tensor y;
    if (scoped) {
      auto saved = handle->saved_activations();
      y = (x * net->weight).tanh().sum();
    } else {
      y = (x * net->weight).tanh().sum();
    }
    y.backward();
    return x.grad().clone();
  };
  EXPECT_TRUE(torch::equal(grads(true), grads(false)));
  handle->detach();
}

TEST(TorchOffload, AChildForkedAfterOffloadIsRefusedAndDropsNothingOfTheParents) {
  // Note [An engine belongs to the process that made it] (csrc/torch/engine.cpp):
  // fork() leaves the engine's threads in the parent, so a child's call would wait
  // for copies nobody makes; it throws instead, and the child may drop the model.
  torch::manual_seed(0);
  auto model = torch::nn::Sequential(layerstream::nn::Linear(64, 64), layerstream::nn::Linear(64, 64));
  auto x = torch::randn({4, 64});
  const auto want = model->forward(x);
  auto handle = layerstream::offload(*model, sim_options());
  ASSERT_GT(handle->stats().layers, 0);
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    alarm(30);  // a hang ends the child by SIGALRM: the parent sees a signal, not an exit code
    int code = 3;
    try {
      model->forward(x);
      code = 1;
    } catch (const std::exception& e) {
      code = std::string(e.what()).find("forked") != std::string::npos ? 0 : 2;
    }
    if (code == 0) {
      handle.reset();
      model = torch::nn::Sequential();  // the last references: the engine is not destroyed here
    }
    _exit(code);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << "the child was ended by signal " << WTERMSIG(status);
  EXPECT_EQ(WEXITSTATUS(status), 0) << "1: the call ran, 2: another error, 3: not an std::exception";
  EXPECT_TRUE(torch::equal(model->forward(x), want));
}
