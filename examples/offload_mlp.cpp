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
  layerstream::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
  MLPImpl() {
    fc1 = register_module("fc1", layerstream::nn::Linear(64, 256));
    fc2 = register_module("fc2", layerstream::nn::Linear(256, 256));
    fc3 = register_module("fc3", layerstream::nn::Linear(256, 10));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(fc1(x));
    x = torch::relu(fc2(x));
    return fc3(x);
  }
};
TORCH_MODULE(MLP);

static std::vector<float> train(MLP model, bool stream, const std::string& device, torch::Device dev) {
  std::shared_ptr<layerstream::OffloadHandle> handle;
  if (stream) {
    layerstream::OffloadOptions opts;
    opts.device = device;
    opts.budget_bytes = 3 * 256 * 256 * 4;  // a few slots of the largest layer
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
    return worst <= 1e-5f ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "offload_mlp: %s\n", e.what());
    return 1;
  }
}
