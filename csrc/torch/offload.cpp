#include "layerstream/offload.h"

#include <fnmatch.h>

#include <cmath>
#include <map>
#include <set>

#include "core/offload_policy.h"
#include "core/optim/optim.h"
#include "core/options.h"
#include "core/planner.h"
#include "core/slot_layout.h"
#include "engine_impl.h"  // src_dtype_of
#include "layerstream/host_optim.h"

namespace layerstream {

namespace {

bool glob_any(const std::vector<std::string>& patterns, const std::string& name) {
  for (const auto& p : patterns)
    if (fnmatch(p.c_str(), name.c_str(), 0) == 0) return true;
  return false;
}

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

template <size_t D, typename Opt>
torch::nn::ConvOptions<D> conv_options_from(const Opt& o) {
  torch::nn::ConvOptions<D> c(o.in_channels(), o.out_channels(), o.kernel_size());
  c.stride(o.stride()).padding(o.padding()).dilation(o.dilation()).groups(o.groups()).bias(o.bias());
  c.padding_mode(o.padding_mode());
  return c;
}

}  // namespace

// ---------------------------------------------------------------------------
// Streamed modules
// ---------------------------------------------------------------------------
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
           weight.scalar_type(), "). Convert the model before offload(), or call detach() first (to free the "
           "device memory for a while: suspend(), then resume()).");
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
    if (w.packed) engine_->requantize(index_, w.value);
  for (const auto& w : writes) {
    if (w.packed && w.param.sizes() != w.value.sizes()) continue;  // freed: the packed copy is the weight
    w.param.copy_(w.value);
    if (w.packed) engine_->watch_weight(index_, w.param);  // this write is the one just packed
  }
  return true;
}

void LinearImpl::load(torch::serialize::InputArchive& archive) {
  if (!load_in_place(*this, archive)) torch::nn::Module::load(archive);
}
template <size_t D>
void ConvImpl<D>::load(torch::serialize::InputArchive& archive) {
  if (!this->load_in_place(*this, archive)) torch::nn::Module::load(archive);
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

// ---------------------------------------------------------------------------
// offload()
// ---------------------------------------------------------------------------
std::shared_ptr<Engine> OffloadHandle::engine() const {
  LS_CHECK(engine_ != nullptr, "this layerstream handle was detached; call offload() again");
  return engine_;
}

EngineStats OffloadHandle::stats() const { return engine()->stats(); }

void OffloadHandle::synchronize() { engine()->synchronize(); }

// Note [Suspend] (engine.cpp): the engine frees its slots; the model's tensors on
// the compute device are the handle's to move (as the Python Handle does).
void OffloadHandle::suspend() {
  auto e = engine();
  if (e->suspended()) return;
  e->suspend();  // first: it refuses while a layer computes
  const torch::Device dev = e->compute_device();
  auto root = root_.lock();
  if (!root || dev.is_cpu()) return;  // the sim device computes on the host: nothing to move
  torch::NoGradGuard ng;
  std::set<torch::TensorImpl*> seen;
  auto off = [&](torch::Tensor t) {
    if (!t.defined() || t.device() != dev || !seen.insert(t.unsafeGetTensorImpl()).second) return;
    t.set_data(t.data().to(torch::kCPU));
    if (t.grad().defined() && t.grad().device() == dev) t.mutable_grad() = t.grad().to(torch::kCPU);
    moved_.emplace_back(t, dev);
  };
  for (auto& p : root->parameters(/*recurse=*/true)) off(p);
  for (auto& b : root->buffers(/*recurse=*/true)) off(b);
}

void OffloadHandle::move_back() {
  torch::NoGradGuard ng;
  for (auto& [t, dev] : moved_) {
    if (t.device() != dev) t.set_data(t.data().to(dev));
    if (t.grad().defined() && t.grad().device() != dev) t.mutable_grad() = t.grad().to(dev);
  }
}

void OffloadHandle::resume() {
  auto e = engine();
  if (!e->suspended()) return;
  move_back();  // before the slots: a retry after an error redoes both
  e->resume();
  moved_.clear();
}

void OffloadHandle::detach() {
  auto e = engine();
  move_back();  // a suspended model's tensors; no slots for detach
  moved_.clear();
  e->detach(devices_);
  for (auto& u : unbind_) u();
  for (auto& s : swaps_)
    if (auto parent = s.parent.lock()) parent->replace_module(s.child, s.original);
  unbind_.clear();
  swaps_.clear();
  engine_.reset();
  root_.reset();
  if (uncounted_) *uncounted_ = false;
}

std::shared_ptr<OffloadHandle> offload(torch::nn::Module& root, const OffloadOptions& options) {
  auto handle = std::shared_ptr<OffloadHandle>(new OffloadHandle());
  LS_CHECK(options.activations >= -1, "OffloadOptions::activations is ", options.activations,
           ": use -1 (off), 0 (every saved tensor that can goes to the host) or a device budget in bytes");
  optim::parse_train_spec(options.train);  // an unknown spec throws before anything changes
  LS_CHECK(options.train.empty() || options.train == "none" || options.budget_bytes >= 0, "OffloadOptions::train '",
           options.train, "' sizes what the budget covers; it needs budget_bytes too (without a budget nothing is "
           "kept resident for it)");
  handle->activations_ = options.activations;
  const quant::Format qformat =
      options.quantize.empty() || options.quantize == "none" ? quant::Format::None
                                                             : quant::parse_format(options.quantize);
  std::set<torch::TensorImpl*> streamed;

  auto selected = [&](const std::string& name) {
    if (!options.include.empty() && !glob_any(options.include, name)) return false;
    return !glob_any(options.exclude, name);
  };
  // Called right after the engine took the layer, with the device its
  // weight was on before (the engine moved it to the host store).
  auto record = [&](const std::string& name, const torch::Tensor& w, const torch::Tensor& b,
                    torch::Device before) {
    handle->names_.push_back(name);
    handle->devices_.push_back(before);
    streamed.insert(w.unsafeGetTensorImpl());
    if (b.defined()) streamed.insert(b.unsafeGetTensorImpl());
  };

  // Collect first: swapping while iterating the tree would invalidate it.
  struct Item {
    std::string name;
    torch::nn::Module* parent;
    std::weak_ptr<torch::nn::Module> parent_ref;  // what the handle keeps (Swap)
    std::string child;
    std::shared_ptr<torch::nn::Module> module;
    bool shared = false;  // its weight is tied to another streamed layer's
  };
  std::vector<Item> items;
  std::set<torch::nn::Module*> collected;
  // Tied weights (the rule: core/offload_policy.h analyse_ties).
  std::map<uint64_t, std::vector<policy::TieOwner>> owners;
  {
    std::set<torch::nn::Module*> seen;
    for (const auto& named : root.named_modules("", /*include_self=*/true)) {
      if (!seen.insert(named.value().get()).second) continue;
      for (const auto& p : named.value()->named_parameters(/*recurse=*/false)) {
        if (!p.value().defined()) continue;
        owners[reinterpret_cast<uint64_t>(p.value().unsafeGetTensorImpl())].push_back(
            {reinterpret_cast<uint64_t>(named.value().get()), p.key(),
             named.key().empty() ? p.key() : named.key() + "." + p.key()});
      }
    }
  }
  // Pass 1: the modules offload() would stream, ties aside.
  for (const auto& named : root.named_modules("", /*include_self=*/true)) {
    if (named.key().empty()) handle->root_ = named.value();  // named_modules needs it in a shared_ptr
    torch::nn::Module* parent = named.value().get();
    const bool is_container = dynamic_cast<torch::nn::SequentialImpl*>(parent) ||
                              dynamic_cast<torch::nn::ModuleListImpl*>(parent) ||
                              dynamic_cast<torch::nn::ModuleDictImpl*>(parent);
    for (const auto& child : parent->named_children()) {
      const std::string name = named.key().empty() ? child.key() : named.key() + "." + child.key();
      auto m = child.value();
      // layerstream::nn::Embedding: a float table without max_norm (which
      // renormalizes the rows it reads, in place); others compute as the torch
      // module, resident. torch::nn::Embedding is not swapped: parents
      // usually call it through their own holder member, which would keep
      // calling the torch module on a weight moved to the host.
      if (const auto* e = dynamic_cast<nn::EmbeddingImpl*>(m.get())) {
        if (!e->weight.is_floating_point() || e->options.max_norm()) continue;
      }
      const bool plain = dynamic_cast<torch::nn::LinearImpl*>(m.get()) ||
                         dynamic_cast<torch::nn::Conv1dImpl*>(m.get()) ||
                         dynamic_cast<torch::nn::Conv2dImpl*>(m.get()) ||
                         dynamic_cast<torch::nn::Conv3dImpl*>(m.get());
      const bool ours = dynamic_cast<nn::StreamedBase*>(m.get()) != nullptr;
      if ((!plain && !ours) || !selected(name)) continue;
      const auto own = m->named_parameters(/*recurse=*/false);  // kept: find() points into it
      if (const torch::Tensor* w = own.find("weight"); w && w->numel() == 0)
        continue;  // zero elements (e.g. Linear(0, n)): nothing to stream
      if (!collected.insert(m.get()).second) continue;  // one module under two names
      LS_CHECK(!(plain && is_container), "cannot stream '", name, "': it is a torch::nn module "
               "inside a Sequential/ModuleList/ModuleDict, whose element list offload() cannot "
               "swap. Declare it as layerstream::nn::Linear/Conv*d, or exclude it.");
      if (ours) {
        LS_CHECK(!dynamic_cast<nn::StreamedBase*>(m.get())->attached(), "module '", name,
                 "' is already offloaded by another layerstream handle; detach it first");
      }
      items.push_back(Item{name, parent, named.value(), child.key(), m});
    }
  }
  // Pass 2: ties.
  std::vector<policy::TieCandidate> described;
  for (const auto& it : items) {
    policy::TieCandidate c{it.name, reinterpret_cast<uint64_t>(it.module.get()), {}};
    for (const auto& p : it.module->named_parameters(/*recurse=*/false))
      if (p.value().defined())
        c.params.push_back({p.key(), reinterpret_cast<uint64_t>(p.value().unsafeGetTensorImpl()),
                            p.key() == "weight"});
    described.push_back(std::move(c));
  }
  const policy::TieResult ties = policy::analyse_ties(described, owners);
  std::vector<std::string> unquantized;
  std::vector<Item> kept;
  for (size_t k = 0; k < ties.kept.size(); ++k) {
    Item it = items[ties.kept[k]];
    it.shared = ties.shares[k];
    if (it.shared && qformat != quant::Format::None && !dynamic_cast<nn::EmbeddingImpl*>(it.module.get()))
      unquantized.push_back("'" + it.name + "'");
    kept.push_back(std::move(it));
  }
  const std::vector<std::string>& tied = ties.resident;
  items = std::move(kept);
  LS_CHECK(!items.empty(), "offload() found no Linear, Conv1d/2d/3d or Embedding module to stream: it streams "
           "layerstream::nn::Linear / Conv*d / Embedding (a table without max_norm) and registered "
           "torch::nn::Linear / Conv*d children outside Sequential/ModuleList/ModuleDict, never "
           "torch::nn::Embedding, and keeps layers whose weights are tied to a resident module resident (a "
           "warning names them); a layer of zero elements has nothing to stream; include/exclude select "
           "among them");

  // With a budget, the planner's rule, as Python's offload(): slots first,
  // residency with what is left (core/planner.h plan_slots_first); the budget
  // covers every weight on the device. Layers it keeps resident are not
  // attached; the engine's slots get what is left.
  EngineOptions engine_options = options;
  std::set<std::string> resident;
  if (options.budget_bytes >= 0) {
    const options::Dtypes dtypes = options::check_dtypes(options.dequant_dtype, options.compute_dtype);
    const std::optional<quant::OutDtype> dequant = dtypes.dequant, compute = dtypes.compute;
    const auto out_bytes = [](quant::OutDtype d) { return static_cast<uint64_t>(quant::out_dtype_bytes(d)); };
    const auto cast_to_compute = [&](const torch::Tensor& t) {
      return compute && t.element_size() != static_cast<int64_t>(out_bytes(*compute)) ? t.numel() * out_bytes(*compute)
                                                                                     : uint64_t{0};
    };
    const optim::TrainSpec train = optim::parse_train_spec(options.train);
    const auto train_bytes = [&](const torch::Tensor& t) {
      return t.defined() && t.requires_grad()
                 ? optim::train_bytes(train, t.sizes().vec(), static_cast<uint64_t>(t.element_size()))
                 : uint64_t{0};
    };
    PlannerInput in;
    in.budget_bytes = static_cast<uint64_t>(options.budget_bytes);
    std::set<torch::nn::Module*> planned;
    for (const auto& it : items) {
      if (dynamic_cast<nn::EmbeddingImpl*>(it.module.get())) continue;  // looked up in host memory
      planned.insert(it.module.get());
      const auto params = it.module->named_parameters(/*recurse=*/false);
      const torch::Tensor& w = params["weight"];
      const torch::Tensor* b = params.find("bias");
      const bool has_bias = b && b->defined();
      const quant::Format fmt = it.shared ? quant::Format::None : qformat;
      const int64_t rows = w.size(0), cols = w.numel() / std::max<int64_t>(rows, 1);
      const uint64_t dense = static_cast<uint64_t>(w.numel() * w.element_size());
      std::vector<slot_layout::Part> parts;
      // A trainable lossless weight (Note [Trainable coded weights]): the slot
      // holds its largest coded size, the bus its coded size.
      const bool coded = fmt == quant::Format::Lossless && w.requires_grad();
      uint64_t coded_gap = 0;
      if (coded) {
        const quant::SrcDtype d = src_dtype_of(w.scalar_type(), it.name);
        const uint64_t cap = lossless::max_encoded_bytes(d, w.numel());
        coded_gap = slot_layout::align(cap) -
                    slot_layout::align(quant::packed_bytes(fmt, d, w.detach().cpu().contiguous().data_ptr(), rows, cols));
        parts.push_back({cap, dense});
      } else if (fmt != quant::Format::None) {  // packed on the bus; dequantized after it in the slot
        const torch::Tensor src = fmt == quant::Format::Lossless ? w.detach().cpu().contiguous() : torch::Tensor();
        parts.push_back({quant::packed_bytes(fmt, src_dtype_of(w.scalar_type(), it.name),
                                             src.defined() ? src.data_ptr() : nullptr, rows, cols),
                         dequant && fmt != quant::Format::Lossless ? w.numel() * out_bytes(*dequant) : dense});
      } else {
        parts.push_back({dense, cast_to_compute(w)});
      }
      if (has_bias) parts.push_back({static_cast<uint64_t>(b->numel() * b->element_size()), cast_to_compute(*b)});
      const auto layout = slot_layout::of(parts);
      PlannerLayer l;
      l.name = it.name;
      l.bytes = layout.bus_bytes - coded_gap;
      l.slot_bytes = layout.slot_bytes();
      l.resident_bytes = dense + (has_bias ? static_cast<uint64_t>(b->numel() * b->element_size()) : 0);
      l.trainable = w.requires_grad();
      l.train_bytes = train_bytes(w) + (has_bias ? train_bytes(*b) : 0);
      in.layers.push_back(l);
    }
    std::set<torch::TensorImpl*> counted;  // a tensor shared by two modules is on the device once
    for (const auto& named : root.named_modules("", /*include_self=*/true)) {
      if (planned.count(named.value().get()) || collected.count(named.value().get())) continue;
      for (const auto& t : named.value()->parameters(/*recurse=*/false))
        if (t.defined() && counted.insert(t.unsafeGetTensorImpl()).second) {
          in.fixed_resident_bytes += t.nbytes();
          in.fixed_train_bytes += train_bytes(t);
        }
      for (const auto& t : named.value()->buffers(/*recurse=*/false))
        if (t.defined() && counted.insert(t.unsafeGetTensorImpl()).second) in.fixed_resident_bytes += t.nbytes();
    }
    const Plan plan = plan_slots_first(in, options.prefetch, options.slots);
    for (const auto& l : plan.layers)
      if (l.resident) resident.insert(l.name);
    // Tied weights: a layer kept resident keeps the tensor on the device, so
    // the layers that share it stay resident too.
    for (const auto& group : ties.groups)
      for (const auto& n : group)
        if (resident.count(n)) { resident.insert(group.begin(), group.end()); break; }
    engine_options.budget_bytes = static_cast<int64_t>(
        plan.budget_bytes -
        std::min(plan.budget_bytes, plan.resident_bytes + plan.fixed_resident_bytes + plan.train_bytes));
    handle->plan_ = plan.explain();
    std::vector<Item> streaming;
    for (auto& it : items) {
      if (resident.count(it.name)) handle->resident_.push_back(it.name);
      else streaming.push_back(std::move(it));
    }
    items = std::move(streaming);
  }
  // A torch::nn::Linear / Conv*d is swapped in its parent's registry only. Anyone
  // else who holds it would go on calling the old module on weights moved to the
  // host: unstreamed and outside the budget on the sim device (no error at all), a
  // device mismatch on CUDA. C++ modules call their children through ModuleHolder
  // members (`torch::nn::Linear fc{nullptr}`), which hold them, so this is the usual
  // case. Layers the plan keeps resident are not swapped: they may be held. Owners
  // now: the registry, `items`, and whoever else (use_count()). docs/design/torch-glue.md.
  {
    std::string held;
    for (const auto& it : items)
      if (!dynamic_cast<nn::StreamedBase*>(it.module.get()) && it.module.use_count() > 2)
        held += (held.empty() ? "'" : ", '") + it.name + "'";
    LS_CHECK(held.empty(), "cannot stream ", held, ": torch::nn modules that are held outside their parent's "
             "registry (a member `torch::nn::Linear fc{nullptr}` through which the parent calls it, or a "
             "variable of yours). offload() can swap a torch::nn::Linear/Conv*d child only in the registry, "
             "so such a holder would go on calling the old module on weights moved to host memory. Declare "
             "the members as layerstream::nn::Linear / Conv1d / Conv2d / Conv3d (drop-in replacements: same "
             "options and parameter names), or exclude them (OffloadOptions::exclude: they stay resident, "
             "as a budget that holds them keeps them); nothing was changed");
  }
  auto engine = Engine::create(engine_options);
  handle->engine_ = engine;
  const torch::Device dev = engine->compute_device();
  if (!tied.empty()) {
    std::string list;
    for (const auto& t : tied) list += (list.empty() ? "" : "; ") + t;
    TORCH_WARN("layerstream: ", tied.size(), " layer(s) with tied weights stay resident on ",
               engine->compute_device(), " (another module that stays resident, or a bias, shares "
               "the tensor; a streamed copy would move it under that module): ", list);
  }
  if (!unquantized.empty()) {
    std::string list;
    for (const auto& t : unquantized) list += (list.empty() ? "" : ", ") + t;
    TORCH_WARN("layerstream: quantize=", options.quantize, " does not apply to ", unquantized.size(),
               " layer(s) with tied weights (a shared weight streams unquantized): ", list);
  }


  // A failure part way (a trainable layer to quantize, host or device
  // memory) undoes the layers attached so far, as detach() does, before it
  // propagates.
  struct UndoOnThrow {
    OffloadHandle* handle;
    bool armed = true;
    ~UndoOnThrow() {
      if (!armed) return;
      try {
        handle->detach();
      } catch (...) {
      }
    }
  } undo{handle.get()};
  // The model may die before the handle: detach() then has nothing to unbind (a
  // raw pointer here was a write into freed memory; HandleOutlivingItsModel...).
  auto unbind_later = [&handle](const std::shared_ptr<torch::nn::Module>& module) {
    handle->unbind_.push_back([weak = std::weak_ptr<torch::nn::Module>(module)] {
      if (auto alive = weak.lock()) dynamic_cast<nn::StreamedBase&>(*alive).unbind();
    });
  };
  for (auto& it : items) {
    torch::nn::Module* m = it.module.get();
    const quant::Format fmt = it.shared ? quant::Format::None : qformat;
    const auto own = m->named_parameters(/*recurse=*/false);  // kept: find() points into it
    const torch::Tensor* w0 = own.find("weight");
    const torch::Device before = w0 ? w0->device() : torch::Device(torch::kCPU);
    if (auto* l = dynamic_cast<nn::LinearImpl*>(m)) {
      const int idx = engine->add_linear(it.name, l->weight, l->bias, fmt);
      l->bind(engine, idx);
      unbind_later(it.module);
      record(it.name, l->weight, l->bias, before);
    } else if (auto* e = dynamic_cast<nn::EmbeddingImpl*>(m)) {
      const int idx = engine->add_embedding(it.name, e->weight, e->options.padding_idx().value_or(-1),
                                            e->options.scale_grad_by_freq(), e->options.sparse());
      e->bind(engine, idx);
      unbind_later(it.module);
      record(it.name, e->weight, torch::Tensor(), before);
    } else if (auto* tl = dynamic_cast<torch::nn::LinearImpl*>(m)) {
      auto s = std::make_shared<nn::LinearImpl>(tl->options, tl->weight, tl->bias);
      const int idx = engine->add_linear(it.name, s->weight, s->bias, fmt);
      s->bind(engine, idx);
      unbind_later(s);  // a reference the caller kept computes as a plain layer after detach()
      it.parent->replace_module(it.child, s);
      handle->swaps_.push_back({it.parent_ref, it.child, it.module});
      record(it.name, s->weight, s->bias, before);
    } else {
      auto swap_conv = [&](auto* conv, auto dim_tag) -> bool {
        if (!conv) return false;
        constexpr size_t D = decltype(dim_tag)::value;
        auto opts = conv_options_from<D>(conv->options);
        auto s = std::make_shared<nn::ConvImpl<D>>(opts, conv->weight, conv->bias);
        const int idx = engine->add_conv(it.name, s->weight, s->bias, s->spec(), fmt);
        s->bind(engine, idx);
        unbind_later(s);
        it.parent->replace_module(it.child, s);
        handle->swaps_.push_back({it.parent_ref, it.child, it.module});
        record(it.name, s->weight, s->bias, before);
        return true;
      };
      auto bind_ours = [&](auto* conv) -> bool {
        if (!conv) return false;
        const int idx = engine->add_conv(it.name, conv->weight, conv->bias, conv->spec(), fmt);
        conv->bind(engine, idx);
        unbind_later(it.module);
        record(it.name, conv->weight, conv->bias, before);
        return true;
      };
      if (bind_ours(dynamic_cast<nn::Conv1dImpl*>(m)) || bind_ours(dynamic_cast<nn::Conv2dImpl*>(m)) ||
          bind_ours(dynamic_cast<nn::Conv3dImpl*>(m)))
        continue;
      if (swap_conv(dynamic_cast<torch::nn::Conv1dImpl*>(m), std::integral_constant<size_t, 1>{}) ||
          swap_conv(dynamic_cast<torch::nn::Conv2dImpl*>(m), std::integral_constant<size_t, 2>{}) ||
          swap_conv(dynamic_cast<torch::nn::Conv3dImpl*>(m), std::integral_constant<size_t, 3>{}))
        continue;
    }
  }

  // Everything not streamed goes to the compute device (device memory can run
  // out here too: still undone).
  torch::NoGradGuard ng;
  for (auto& p : root.parameters(/*recurse=*/true)) {
    if (streamed.count(p.unsafeGetTensorImpl()) || p.device() == dev) continue;
    p.set_data(p.data().to(dev));
  }
  for (auto& b : root.buffers(/*recurse=*/true)) {
    if (b.device() != dev) b.set_data(b.data().to(dev));
  }
  if (options.budget_bytes >= 0 && (options.train.empty() || options.train == "none")) {
    std::vector<torch::Tensor> kept;  // trainable, on the device, beyond what the budget counted
    for (auto& p : root.parameters(/*recurse=*/true))
      if (p.requires_grad() && !streamed.count(p.unsafeGetTensorImpl())) kept.push_back(p);
    handle->uncounted_ = optim::note_uncounted_training(kept);
  }
  undo.armed = false;
  return handle;
}

}  // namespace layerstream
