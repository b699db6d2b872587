// An installed layerstream's C++ API from outside the repository: a small MLP
// trained one step resident and one step streamed on the sim device (budget
// smaller than its 3 x 257 KiB of weights); the gradients must be equal.
#include <layerstream/offload.h>

#include <cstdio>

struct Net : torch::nn::Module {
  layerstream::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};  // drop-in torch::nn::Linear
  Net() {
    fc1 = register_module("fc1", layerstream::nn::Linear(256, 256));
    fc2 = register_module("fc2", layerstream::nn::Linear(256, 256));
    fc3 = register_module("fc3", layerstream::nn::Linear(256, 256));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc3(torch::relu(fc2(torch::relu(fc1(x))))); }
};

int main() {
  torch::manual_seed(0);
  auto x = torch::randn({4, 256});
  auto resident = std::make_shared<Net>();
  auto streamed = std::make_shared<Net>();
  {
    torch::NoGradGuard ng;
    auto src = resident->parameters();
    auto dst = streamed->parameters();
    for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
  }
  resident->forward(x).square().sum().backward();

  layerstream::OffloadOptions opts;
  opts.device = "sim";
  opts.budget_bytes = 520 << 10;  // 2 slots of 257 KiB, not the 771 KiB of weights: they stream
  auto handle = layerstream::offload(*streamed, opts);
  streamed->forward(x).square().sum().backward();
  const auto stats = handle->stats();
  bool same = true;
  auto a = resident->named_parameters();
  auto b = streamed->named_parameters();
  for (const auto& p : a) same = same && torch::equal(p.value().grad(), b[p.key()].grad());
  std::printf("consumer: %lld bytes host->device, gradients %s\n",
              static_cast<long long>(stats.h2d_bytes), same ? "equal" : "DIFFER");
  handle->detach();
  return same && stats.h2d_bytes > 0 ? 0 : 1;
}
