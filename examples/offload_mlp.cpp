// Example: stream a LibTorch model's Linear layers with layerstream.
//
//   build/examples/offload_mlp [--device sim|cuda]
//
// Trains the same MLP twice from the same initial weights, once resident and
// once with its Linear layers streamed under a budget, and prints both
// losses per step (they match: streaming does not change the numbers).
#include <torch/torch.h>

#include <cstdio>
#include <cstring>
#include <string>

#include "layerstream/offload.h"

struct MLPImpl : torch::nn::Module {
  // layerstream::nn::Linear is a drop-in torch::nn::Linear that streams once offloaded.
  layerstream::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr}, fc4{nullptr}, fc5{nullptr};
  MLPImpl() {
    fc1 = register_module("fc1", layerstream::nn::Linear(64, 128));
    fc2 = register_module("fc2", layerstream::nn::Linear(128, 128));
    fc3 = register_module("fc3", layerstream::nn::Linear(128, 128));
    fc4 = register_module("fc4", layerstream::nn::Linear(128, 128));
    fc5 = register_module("fc5", layerstream::nn::Linear(128, 10));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(fc1(x));
    x = torch::relu(fc2(x));
    x = torch::relu(fc3(x));
    x = torch::relu(fc4(x));
    return fc5(x);
  }
};
TORCH_MODULE(MLP);

static bool streamed_within_budget = true;  // set by the streamed run

static std::vector<float> train(MLP model, bool stream, const std::string& device, torch::Device dev) {
  std::shared_ptr<layerstream::OffloadHandle> handle;
  if (stream) {
    layerstream::OffloadOptions opts;
    opts.device = device;
    // Three slots of the largest layer (128 x 128 fp32 and its bias; prefetch 2
    // keeps two in flight beside the one in use), about half the model's weights
    // (~237 KB): the planner streams the layers that do not fit beside the slots.
    opts.budget_bytes = 3 * (128 * 128 + 128) * 4 + 8192;
    handle = layerstream::offload(*model, opts);
  } else {
    model->to(dev);
  }
  torch::optim::SGD opt(model->parameters(), 0.05);
  torch::manual_seed(1);
  std::vector<float> losses;
  for (int step = 0; step < 5; ++step) {
    auto x = torch::randn({32, 64}).to(dev);
    auto y = torch::randint(0, 10, {32}).to(dev);
    opt.zero_grad();
    if (handle) handle->engine()->begin_call();  // a new call of the model (README, C++ usage)
    auto loss = torch::nn::functional::cross_entropy(model(x), y);
    loss.backward();  // streamed weight gradients are on the host and complete here
    opt.step();
    losses.push_back(loss.item<float>());
  }
  if (handle) {
    auto s = handle->stats();
    std::printf("streamed: %llu layers, peak device bytes %llu (budget %lld), %llu bytes host->device\n",
                static_cast<unsigned long long>(s.layers), static_cast<unsigned long long>(s.peak_device_bytes),
                static_cast<long long>(s.budget_bytes), static_cast<unsigned long long>(s.h2d_bytes));
    // The check must be able to fail: something streamed, inside the budget.
    streamed_within_budget = s.layers > 0 && s.h2d_bytes > 0 &&
                             s.peak_device_bytes <= static_cast<uint64_t>(s.budget_bytes);
    handle->detach();
  }
  return losses;
}

int main(int argc, char** argv) {
  std::string device = "auto";
  for (int i = 1; i < argc; ++i)
    if (!std::strcmp(argv[i], "--device") && i + 1 < argc) device = argv[++i];
  try {
    const std::string resolved = layerstream::resolve_device(device);
    const torch::Device dev = resolved == "sim" ? torch::Device(torch::kCPU) : torch::Device(resolved);
    torch::manual_seed(0);
    MLP a;
    torch::manual_seed(0);
    MLP b;  // same initial weights
    auto ref = train(a, false, device, dev);
    auto got = train(b, true, device, dev);
    std::printf("device %s\nstep  resident    streamed\n", resolved.c_str());
    float worst = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
      std::printf("%-5zu %-11.6f %-11.6f\n", i, ref[i], got[i]);
      worst = std::max(worst, std::abs(ref[i] - got[i]));
    }
    std::printf("max |difference| = %g\n", worst);
    if (!streamed_within_budget) {
      std::fprintf(stderr, "offload_mlp: nothing streamed, or the peak exceeded the budget\n");
      return 1;
    }
    return worst == 0.0f ? 0 : 1;  // identical: streaming does not change the numbers
  } catch (const std::exception& e) {
    std::fprintf(stderr, "offload_mlp: %s\n", e.what());
    return 1;
  }
}
