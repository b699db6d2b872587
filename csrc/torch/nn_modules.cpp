// layerstream — LibTorch glue: the streamed layerstream::nn modules (Linear, Conv1d/2d/3d, Embedding):
// through the engine while attached, torch's own computation when not (layerstream/offload.h,
// docs/design/torch-glue.md). offload(), which attaches them: offload.cpp.
#include "layerstream/offload.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "dtype_name.h"

namespace layerstream {

namespace {

// A padding_mode other than zeros pads the input (F::pad) and convolves without
// padding, as torch::nn::ConvNdImpl does: the pads, last dimension first as F::pad
// takes them (its _reversed_padding_repeated_twice). Empty for zero padding.
template <size_t D>
std::vector<int64_t> mode_pads(const torch::nn::ConvOptions<D>& o) {
  if (std::holds_alternative<torch::enumtype::kZeros>(o.padding_mode())) return {};
  std::vector<int64_t> pads(2 * D, 0);
  const auto& pad = o.padding();
  if (std::holds_alternative<torch::enumtype::kSame>(pad)) {
    // LibTorch's ConvNdImpl::reset() fills these in dimension order, unlike torch.nn's
    // Python module (which reverses them): the same here, so that the layer computes
    // what the torch::nn module computes.
    for (size_t i = 0; i < D; ++i) {
      const int64_t total = (*o.dilation())[i] * ((*o.kernel_size())[i] - 1);
      pads[2 * i] = total / 2;
      pads[2 * i + 1] = total - total / 2;
    }
  } else if (!std::holds_alternative<torch::enumtype::kValid>(pad)) {
    const auto& arr = std::get<torch::ExpandingArray<D>>(pad);
    for (size_t i = 0; i < D; ++i) pads[2 * i] = pads[2 * i + 1] = (*arr)[D - 1 - i];
  }
  return pads;
}

template <size_t D>
torch::Tensor pad_for_mode(const torch::nn::ConvOptions<D>& o, const torch::Tensor& x) {
  const std::vector<int64_t> pads = mode_pads<D>(o);
  if (pads.empty()) return x;
  namespace F = torch::nn::functional;
  const auto& m = o.padding_mode();
  F::PadFuncOptions::mode_t mode = torch::kCircular;
  if (std::holds_alternative<torch::enumtype::kReflect>(m)) mode = torch::kReflect;
  else if (std::holds_alternative<torch::enumtype::kReplicate>(m)) mode = torch::kReplicate;
  return F::pad(x, F::PadFuncOptions(pads).mode(mode));
}

template <size_t D, typename Opt>
ConvSpec spec_from(const Opt& o) {
  ConvSpec s;
  s.dims = static_cast<int>(D);
  s.stride = std::vector<int64_t>(o.stride()->begin(), o.stride()->end());
  s.dilation = std::vector<int64_t>(o.dilation()->begin(), o.dilation()->end());
  s.groups = o.groups();
  const auto& pad = o.padding();
  if (!std::holds_alternative<torch::enumtype::kZeros>(o.padding_mode())) {
    s.padding.assign(D, 0);  // the input comes padded (pad_for_mode)
  } else if (std::holds_alternative<torch::enumtype::kSame>(pad)) {
    s.same = true;
  } else if (std::holds_alternative<torch::enumtype::kValid>(pad)) {
    s.padding.assign(D, 0);
  } else {
    const auto& arr = std::get<torch::ExpandingArray<D>>(pad);
    s.padding = std::vector<int64_t>(arr->begin(), arr->end());
  }
  return s;
}

}  // namespace

namespace nn {

bool StreamedBase::keep_streamed(const torch::Tensor& weight, std::optional<torch::Device> device,
                                 std::optional<torch::Dtype> dtype) const {
  if (!engine_) return false;
  const torch::Device compute = engine_->compute_device();
  const bool same_device = !device || *device == compute ||
                           (device->is_cuda() && compute.is_cuda() && !device->has_index() &&
                            compute.index() == 0);
  LS_CHECK(same_device && (!dtype || *dtype == weight.scalar_type()), "streamed layer '",
           engine_->layer_name(index_), "' keeps its weights in host memory and computes on ",
           compute.str(), ": to() that device is fine (the streamed weights stay as they are), but "
           "this conversion would move them elsewhere or change their dtype (weight is ",
           dtype_name(weight.scalar_type()), "). Convert the model before offload(), or call detach() first (to free "
           "the device memory for a while: suspend(), then resume()).");
  return true;
}

void StreamedBase::refuse_clone() const {
  LS_CHECK(!engine_, "streamed layer '", engine_ ? engine_->layer_name(index_) : std::string(),
           "' cannot be cloned: its weights live in layerstream's host store, and a copy would "
           "still stream (and train) the original's. Clone the model before offload(), or call "
           "detach() first.");
}

bool StreamedBase::load_in_place(torch::nn::Module& self, torch::serialize::InputArchive& archive) {
  if (!engine_) return false;
  const std::string name = engine_->layer_name(index_);
  const std::string format = engine_->layer_format(index_);
  // Read everything first: an archive without a tensor, or with another shape,
  // leaves the layer as it was.
  struct Write {
    torch::Tensor param, value;
    bool packed;  // a weight offload() quantized: its host copy is packed again
  };
  std::vector<Write> writes;
  for (const auto& p : self.named_parameters(/*recurse=*/false)) {
    torch::Tensor value;
    LS_CHECK(archive.try_read(p.key(), value), "torch::load() into streamed layer '", name, "': the archive has "
             "no '", p.key(), "'");
    const bool packed = p.key() == "weight" && !format.empty();  // "": dense, or coded from dense
    // A packed weight's dense parameter may have been freed (offload.h): its shape
    // is checked by requantize().
    LS_CHECK(packed || value.sizes() == p.value().sizes(), "torch::load() into streamed layer '", name, "': '",
             p.key(), "' has shape ", value.sizes(), " in the archive but ", p.value().sizes(), " in the model");
    writes.push_back({p.value(), value, packed});
  }
  torch::NoGradGuard ng;
  for (const auto& w : writes)  // first: it refuses (lossless-coded, pre-packed) before anything changes
    if (w.packed) engine_->requantize(index_, w.value);  // and writes the dense parameter unless freed
  for (const auto& w : writes)
    if (!w.packed) w.param.copy_(w.value);
  return true;
}

bool StreamedBase::save_streamed(const torch::nn::Module& self, torch::serialize::OutputArchive& archive) const {
  // Note [No call between an overlapped backward and its step] (engine_grad_ready.cpp).
  LS_CHECK(!engine_ || !engine_->unsettled_step(), "torch::save() of streamed layer '",
           engine_ ? engine_->layer_name(index_) : std::string(), "' between an overlapped backward "
           "(opt.overlap(engine)) and step(): the layers stepped during the backward are a step ahead of the others "
           "(and not yet clipped), a checkpoint no run holds. Call step() first.");
  if (!engine_ || engine_->layer_format(index_).empty()) return false;
  for (const auto& p : self.named_parameters(/*recurse=*/false)) {
    torch::Tensor value = p.value();
    // Freed (another shape than the registered one): the packed copy is the weight.
    if (p.key() == "weight" && value.sizes() != engine_->layer_parameters(index_).first.sizes())
      value = engine_->dequantized_weight(index_);
    archive.write(p.key(), value);
  }
  for (const auto& b : self.named_buffers(/*recurse=*/false)) archive.write(b.key(), b.value(), /*is_buffer=*/true);
  return true;
}

void StreamedBase::keep_quantized(const torch::Tensor& weight, std::string format,
                                  std::optional<torch::Dtype> dequant, std::string name) {
  quantized_ = Quantized{std::move(format), dequant, std::move(name), weight.unsafeGetTensorImpl(),
                         weight._version(), tensor_checksum(weight)};
}

void StreamedBase::refresh_quantized(const torch::Tensor& weight, bool force) {
  if (!quantized_ || !weight.defined()) return;
  // As offload() refuses it and the engine refuses a streamed one unfrozen later (engine.cpp).
  LS_CHECK(force || !weight.requires_grad(), "the weight of quantized layer '", quantized_->name,
           "' (kept resident by the budget) was set to require grad after offload(); it holds its quantized "
           "values, quantized again after each write, which would undo a training step. Train an adapter "
           "beside it (LoRA) or do not quantize this layer; freeze it again (requires_grad_(false)) to run "
           "the model.");
  if (!force && quantized_->weight == weight.unsafeGetTensorImpl() && quantized_->version == weight._version())
    return;
  torch::NoGradGuard ng;
  if (tensor_checksum(weight) != quantized_->checksum) {  // new values: its own (a load of its save) stay
    const int64_t rows = weight.dim() ? weight.size(0) : 1;
    weight.copy_(quantized_values(weight.detach(), rows, weight.numel() / std::max<int64_t>(rows, 1),
                                  quantized_->format, quantized_->dequant));
    quantized_->checksum = tensor_checksum(weight);
  }
  quantized_->weight = weight.unsafeGetTensorImpl();
  quantized_->version = weight._version();
}

void LinearImpl::save(torch::serialize::OutputArchive& archive) const {
  if (!save_streamed(*this, archive)) torch::nn::Module::save(archive);
}
template <size_t D>
void ConvImpl<D>::save(torch::serialize::OutputArchive& archive) const {
  if (!this->save_streamed(*this, archive)) torch::nn::Module::save(archive);
}

void LinearImpl::load(torch::serialize::InputArchive& archive) {
  if (load_in_place(*this, archive)) return;
  torch::nn::Module::load(archive);
  refresh_quantized(weight, /*force=*/true);
}
template <size_t D>
void ConvImpl<D>::load(torch::serialize::InputArchive& archive) {
  if (this->load_in_place(*this, archive)) return;
  torch::nn::Module::load(archive);
  this->refresh_quantized(weight, /*force=*/true);
}
void EmbeddingImpl::load(torch::serialize::InputArchive& archive) {
  if (!load_in_place(*this, archive)) torch::nn::Module::load(archive);
}

std::shared_ptr<torch::nn::Module> LinearImpl::clone(const std::optional<torch::Device>& device) const {
  refuse_clone();
  return torch::nn::Cloneable<LinearImpl>::clone(device);
}
template <size_t D>
std::shared_ptr<torch::nn::Module> ConvImpl<D>::clone(const std::optional<torch::Device>& device) const {
  this->refuse_clone();
  return torch::nn::Cloneable<ConvImpl<D>>::clone(device);
}
std::shared_ptr<torch::nn::Module> EmbeddingImpl::clone(const std::optional<torch::Device>& device) const {
  refuse_clone();
  return torch::nn::Cloneable<EmbeddingImpl>::clone(device);
}

void LinearImpl::to(torch::Device device, torch::Dtype dtype, bool non_blocking) {
  if (!keep_streamed(weight, device, dtype)) torch::nn::Module::to(device, dtype, non_blocking);
}
void LinearImpl::to(torch::Dtype dtype, bool non_blocking) {
  if (!keep_streamed(weight, std::nullopt, dtype)) torch::nn::Module::to(dtype, non_blocking);
}
void LinearImpl::to(torch::Device device, bool non_blocking) {
  if (!keep_streamed(weight, device, std::nullopt)) torch::nn::Module::to(device, non_blocking);
}

template <size_t D>
void ConvImpl<D>::to(torch::Device device, torch::Dtype dtype, bool non_blocking) {
  if (!this->keep_streamed(weight, device, dtype)) torch::nn::Module::to(device, dtype, non_blocking);
}
template <size_t D>
void ConvImpl<D>::to(torch::Dtype dtype, bool non_blocking) {
  if (!this->keep_streamed(weight, std::nullopt, dtype)) torch::nn::Module::to(dtype, non_blocking);
}
template <size_t D>
void ConvImpl<D>::to(torch::Device device, bool non_blocking) {
  if (!this->keep_streamed(weight, device, std::nullopt)) torch::nn::Module::to(device, non_blocking);
}

LinearImpl::LinearImpl(const torch::nn::LinearOptions& options_) : options(options_) { reset(); }

LinearImpl::LinearImpl(const torch::nn::LinearOptions& options_, torch::Tensor w, torch::Tensor b)
    : options(options_) {
  weight = register_parameter("weight", w);
  if (b.defined()) bias = register_parameter("bias", b);
  else bias = register_parameter("bias", {}, /*requires_grad=*/false);
}

void LinearImpl::reset() {
  // Same initialisation as torch::nn::Linear.
  weight = register_parameter("weight", torch::empty({options.out_features(), options.in_features()}));
  torch::nn::init::kaiming_uniform_(weight, std::sqrt(5));
  if (options.bias()) {
    bias = register_parameter("bias", torch::empty(options.out_features()));
    const double bound = 1.0 / std::sqrt(static_cast<double>(options.in_features()));
    torch::nn::init::uniform_(bias, -bound, bound);
  } else {
    bias = register_parameter("bias", {}, false);
  }
}

torch::Tensor LinearImpl::forward(const torch::Tensor& x) {
  if (engine_) return engine_->linear(index_, x);
  refresh_quantized(weight);
  return torch::linear(x, weight, bias);
}

void LinearImpl::pretty_print(std::ostream& stream) const {
  stream << "layerstream::nn::Linear(in_features=" << options.in_features()
         << ", out_features=" << options.out_features() << ", bias=" << options.bias()
         << (engine_ ? ", streamed" : "") << ")";
}

template <size_t D>
ConvImpl<D>::ConvImpl(const torch::nn::ConvOptions<D>& options_) : options(options_) {
  reset();
}

template <size_t D>
ConvImpl<D>::ConvImpl(const torch::nn::ConvOptions<D>& options_, torch::Tensor w, torch::Tensor b)
    : options(options_) {
  weight = this->register_parameter("weight", w);
  if (b.defined()) bias = this->register_parameter("bias", b);
  else bias = this->register_parameter("bias", {}, false);
}

template <size_t D>
void ConvImpl<D>::reset() {
  std::vector<int64_t> shape = {options.out_channels(), options.in_channels() / options.groups()};
  for (auto k : *options.kernel_size()) shape.push_back(k);
  weight = this->register_parameter("weight", torch::empty(shape));
  torch::nn::init::kaiming_uniform_(weight, std::sqrt(5));
  if (options.bias()) {
    bias = this->register_parameter("bias", torch::empty(options.out_channels()));
    int64_t fan_in = shape[1];
    for (size_t i = 2; i < shape.size(); ++i) fan_in *= shape[i];
    const double bound = 1.0 / std::sqrt(static_cast<double>(fan_in));
    torch::nn::init::uniform_(bias, -bound, bound);
  } else {
    bias = this->register_parameter("bias", {}, false);
  }
}

template <size_t D>
ConvSpec ConvImpl<D>::spec() const {
  return spec_from<D>(options);
}

template <size_t D>
torch::Tensor ConvImpl<D>::forward(const torch::Tensor& x) {
  const torch::Tensor in = pad_for_mode<D>(options, x);
  if (engine_) return engine_->conv(index_, in);
  // Unattached (before offload(), after detach(), or kept resident by the plan):
  // as torch::nn::Conv*d, an unbatched input (no batch dimension) too.
  this->refresh_quantized(weight);
  const bool unbatched = in.dim() == static_cast<int64_t>(D) + 1;
  const torch::Tensor batched = unbatched ? in.unsqueeze(0) : in;
  const ConvSpec s = spec();
  const torch::Tensor out =
      s.same ? torch::_convolution_mode(batched, weight, bias, s.stride, "same", s.dilation, s.groups)
             : torch::convolution(batched, weight, bias, s.stride, s.padding, s.dilation, false,
                                  std::vector<int64_t>(D, 0), s.groups);
  return unbatched ? out.squeeze(0) : out;
}

EmbeddingImpl::EmbeddingImpl(const torch::nn::EmbeddingOptions& options_) : options(options_) { reset(); }

EmbeddingImpl::EmbeddingImpl(const torch::nn::EmbeddingOptions& options_, torch::Tensor w)
    : options(options_) {
  normalize_padding_idx();
  weight = register_parameter("weight", w, w.requires_grad());
}

void EmbeddingImpl::reset() {
  normalize_padding_idx();
  // Same initialisation as torch::nn::Embedding: N(0, 1), the padding row zero.
  weight = register_parameter("weight", torch::empty({options.num_embeddings(), options.embedding_dim()}));
  torch::nn::init::normal_(weight);
  if (options.padding_idx()) {
    torch::NoGradGuard ng;
    weight[*options.padding_idx()].fill_(0);
  }
}

void EmbeddingImpl::normalize_padding_idx() {
  // As torch::nn::Embedding: a negative padding_idx counts from the end.
  if (options.padding_idx() && *options.padding_idx() < 0)
    options.padding_idx(*options.padding_idx() + options.num_embeddings());
  LS_CHECK(!options.padding_idx() || (*options.padding_idx() >= 0 &&
                                      *options.padding_idx() < options.num_embeddings()),
           "Embedding: padding_idx must be within num_embeddings");
}

torch::Tensor EmbeddingImpl::forward(const torch::Tensor& ids) {
  if (engine_) return engine_->embedding(index_, ids);
  namespace F = torch::nn::functional;
  auto o = F::EmbeddingFuncOptions().padding_idx(options.padding_idx()).max_norm(options.max_norm());
  o.norm_type(options.norm_type()).scale_grad_by_freq(options.scale_grad_by_freq()).sparse(options.sparse());
  return F::embedding(ids, weight, o);
}

void EmbeddingImpl::pretty_print(std::ostream& stream) const {
  stream << "layerstream::nn::Embedding(num_embeddings=" << options.num_embeddings()
         << ", embedding_dim=" << options.embedding_dim() << (engine_ ? ", streamed" : "") << ")";
}

void EmbeddingImpl::to(torch::Device device, torch::Dtype dtype, bool non_blocking) {
  if (!keep_streamed(weight, device, dtype)) torch::nn::Module::to(device, dtype, non_blocking);
}
void EmbeddingImpl::to(torch::Dtype dtype, bool non_blocking) {
  if (!keep_streamed(weight, std::nullopt, dtype)) torch::nn::Module::to(dtype, non_blocking);
}
void EmbeddingImpl::to(torch::Device device, bool non_blocking) {
  if (!keep_streamed(weight, device, std::nullopt)) torch::nn::Module::to(device, non_blocking);
}

template class ConvImpl<1>;
template class ConvImpl<2>;
template class ConvImpl<3>;

}  // namespace nn
}  // namespace layerstream
