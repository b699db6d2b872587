#include "engine.h"

#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/jit/frontend/tracer.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <limits>
#include <queue>
#include <unordered_map>

#include "backends/sim/sim_backend.h"
#include "core/log.h"
#include "core/options.h"
#include "cuda_glue.h"

namespace layerstream {

namespace {

std::mutex g_registry_mu;
std::map<uint64_t, std::weak_ptr<Engine>>& registry() {
  static std::map<uint64_t, std::weak_ptr<Engine>> r;
  return r;
}
std::atomic<uint64_t> g_next_id{1};

size_t align256(size_t v) { return (v + 255) / 256 * 256; }

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// What a parameter's data needs alive after the Engine is gone: the host
// store and the backend that frees its buffers, released in that order.
struct HostKeepAlive {
  std::shared_ptr<Backend> backend;
  std::shared_ptr<HostStore> store;
  ~HostKeepAlive() { store.reset(); }  // buffers go back to a live backend
};


bool is_float_activation(torch::ScalarType t) {
  return t == torch::kFloat || t == torch::kBFloat16 || t == torch::kHalf;
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

}  // namespace

std::string resolve_device(const std::string& device) {
  if (device == "sim") return "sim";
  if (device == "auto") return cuda_glue::available() ? "cuda:0" : "sim";
  if (device == "cpu")
    LS_FAIL("device 'cpu' cannot be a streaming target: weights already live on the CPU. Use "
            "device='sim' for the simulated GPU, or 'cuda'.");
  if (device.rfind("cuda", 0) == 0) {
    int index = 0;
    if (device.size() > 4) {
      LS_CHECK(device[4] == ':' && device.size() > 5, "bad device '", device,
               "': use 'cuda' or 'cuda:N'");
      try {
        index = std::stoi(device.substr(5));
      } catch (...) {
        LS_FAIL("bad device '", device, "': use 'cuda' or 'cuda:N'");
      }
    }
    LS_CHECK(cuda_glue::available(), "device '", device,
             "' was requested but no CUDA GPU is visible to PyTorch (torch.cuda.is_available() "
             "is False, or this layerstream build has no CUDA support); use device='sim' to run "
             "on the simulated device.");
    LS_CHECK(index >= 0 && index < cuda_glue::device_count(), "device '", device,
             "' does not exist: PyTorch sees ", cuda_glue::device_count(), " CUDA device(s)");
    return "cuda:" + std::to_string(index);
  }
  LS_FAIL("unknown device '", device, "': use 'auto', 'sim', 'cuda' or 'cuda:N'");
}

std::shared_ptr<Engine> Engine::create(const EngineOptions& options) {
  std::shared_ptr<Engine> e(new Engine(options));
  std::lock_guard<std::mutex> lock(g_registry_mu);
  registry()[e->id_] = e;
  return e;
}

std::shared_ptr<Engine> Engine::lookup(uint64_t id) {
  std::lock_guard<std::mutex> lock(g_registry_mu);
  auto it = registry().find(id);
  return it == registry().end() ? nullptr : it->second.lock();
}

Engine::Engine(const EngineOptions& options) : opts_(options), id_(g_next_id++) {
  options::check_prefetch(opts_.prefetch);
  options::check_slots(opts_.slots);
  options::check_budget_bytes(opts_.budget_bytes);
  options::check_link_gbps(opts_.sim_h2d_gbps, "sim_h2d_gbps");
  options::check_link_gbps(opts_.sim_d2h_gbps, "sim_d2h_gbps");
  options::check_latency_us(opts_.sim_latency_us);
  auto parse_dtype = [](const std::string& text, const char* what) -> std::optional<torch::ScalarType> {
    if (text.empty()) return std::nullopt;
    try {
      switch (quant::parse_out_dtype(text)) {
        case quant::OutDtype::F32: return torch::kFloat;
        case quant::OutDtype::BF16: return torch::kBFloat16;
        case quant::OutDtype::F16: return torch::kHalf;
      }
    } catch (const Error& e) {
      LS_FAIL(what, " (empty = each weight's own dtype): ", e.message());
    }
    return std::nullopt;
  };
  dequant_dtype_ = parse_dtype(opts_.dequant_dtype, "dequant_dtype");
  compute_dtype_ = parse_dtype(opts_.compute_dtype, "compute_dtype");
  if (compute_dtype_) {
    LS_CHECK(!dequant_dtype_ || *dequant_dtype_ == *compute_dtype_, "dequant_dtype '",
             opts_.dequant_dtype, "' and compute_dtype '", opts_.compute_dtype, "' disagree; "
             "compute_dtype alone is enough (quantized weights are then dequantized to it)");
    dequant_dtype_ = compute_dtype_;
  }
  device_name_ = resolve_device(opts_.device);
  if (device_name_ == "sim") {
    SimOptions so;
    so.h2d_gbps = opts_.sim_h2d_gbps;
    so.d2h_gbps = opts_.sim_d2h_gbps;
    so.latency_us = opts_.sim_latency_us;
    so.checker = opts_.checker;
    so.abort_on_ordering_error = opts_.abort_on_ordering_error;
    backend_ = make_sim_backend(so);
    compute_device_ = torch::Device(torch::kCPU);
    inline_compute_ = backend_->create_inline_stream("compute");
  } else {
    cuda_index_ = std::stoi(device_name_.substr(5));
    compute_device_ = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(cuda_index_));
  }
  auto scope = device_scope();
  if (!backend_) backend_ = cuda_glue::make_backend(cuda_index_);
  store_ = std::make_shared<HostStore>(*backend_, opts_.pin_memory);
  {
    auto keep = std::make_shared<HostKeepAlive>();
    keep->backend = backend_;
    keep->store = store_;
    keepalive_ = keep;
  }
  if (opts_.trace) tracer_ = std::make_shared<TraceRecorder>();
  transfer_ = backend_->create_stream("transfer");
  grad_stream_ = backend_->create_stream("grad");
  dequant_stream_ = backend_->create_stream("dequant");
}

Engine::~Engine() {
  std::optional<cuda_glue::DeviceScope> scope;
  try {
    scope.emplace(cuda_index_);
  } catch (...) {
  }
  try {
    drain_grads(kAnyTask);  // no callback can reach this engine any more
  } catch (...) {
  }
  sched_.reset();
  try {
    wait_lookups_locked();  // no lookup may still read the host store
  } catch (...) {
  }
  for (auto& l : layers_) {
    l->grad_done = Event();
    l->last_read = Event();
    for (auto& b : l->grad_staging) b.reset();
  }
  try {
    backend_->synchronize(grad_stream_);
    backend_->destroy_stream(transfer_);
    backend_->destroy_stream(dequant_stream_);
    backend_->destroy_stream(grad_stream_);
    if (inline_compute_) backend_->destroy_stream(inline_compute_);
  } catch (...) {
  }
  std::lock_guard<std::mutex> lock(g_registry_mu);
  registry().erase(id_);
}

int Engine::num_layers() const {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  return static_cast<int>(layers_.size());
}

std::string Engine::layer_name(int i) const {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  return layers_.at(static_cast<size_t>(i))->name;
}

int64_t Engine::layer_bytes(int i) const {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  const auto& l = *layers_.at(static_cast<size_t>(i));
  size_t bytes = l.w_bytes + l.b_bytes;
  for (const auto& e : l.parts) bytes += e.bytes;
  return static_cast<int64_t>(bytes);
}

Engine::LayerInfo& Engine::layer(int i) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  LS_CHECK(i >= 0 && i < static_cast<int>(layers_.size()), "no streamed layer #", i);
  return *layers_[static_cast<size_t>(i)];
}

namespace {
// Moves a parameter's data into the host store; the parameter's data becomes
// a CPU tensor over the store's memory (kept alive by the tensor's deleter).
// A dense, non-overlapping layout other than the contiguous one (a
// channels_last conv weight, a transposed Linear weight) is kept: the store
// holds the bytes in that memory order and `strides` receives them (empty:
// contiguous), so the device copy computes exactly as the original did.
void* adopt(HostStore& store, const std::shared_ptr<void>& keep, torch::Tensor& param,
            const std::string& name, size_t* index, size_t* bytes, std::vector<int64_t>* strides = nullptr) {
  torch::NoGradGuard ng;
  torch::Tensor src = param.detach().to(torch::kCPU);
  const bool keep_layout = strides && !src.is_contiguous() && src.is_non_overlapping_and_dense();
  if (!keep_layout) src = src.contiguous();
  *bytes = static_cast<size_t>(src.numel()) * src.element_size();
  *index = store.add(*bytes, src.data_ptr(), name);
  void* ptr = store.buffer(*index).ptr;
  auto keepalive = keep;
  const auto opts = torch::TensorOptions().dtype(src.scalar_type());
  torch::Tensor alias = keep_layout ? torch::from_blob(ptr, src.sizes(), src.strides(), [keepalive](void*) {}, opts)
                                    : torch::from_blob(ptr, src.sizes(), [keepalive](void*) {}, opts);
  if (strides) *strides = keep_layout ? src.strides().vec() : std::vector<int64_t>{};
  param.set_data(alias);
  return ptr;
}
}  // namespace

namespace {
quant::SrcDtype src_dtype_of(torch::ScalarType t, const std::string& name) {
  switch (t) {
    case torch::kFloat: return quant::SrcDtype::F32;
    case torch::kBFloat16: return quant::SrcDtype::BF16;
    case torch::kHalf: return quant::SrcDtype::F16;
    default:
      LS_FAIL("layer '", name, "': only float32/bfloat16/float16 weights can be quantized, got ", t);
  }
}

quant::OutDtype out_dtype_of(torch::ScalarType t) {
  switch (t) {
    case torch::kFloat: return quant::OutDtype::F32;
    case torch::kBFloat16: return quant::OutDtype::BF16;
    case torch::kHalf: return quant::OutDtype::F16;
    default: LS_FAIL("cannot dequantize to ", t);
  }
}

// Casts `numel` elements on the CPU, as torch's Tensor::to(dtype) does
// (the sim device's compute_dtype cast, run on a stream worker).
void cast_cpu(const void* src, torch::ScalarType from, void* dst, torch::ScalarType to, int64_t numel) {
  torch::Tensor out = torch::from_blob(dst, {numel}, torch::TensorOptions().dtype(to));
  out.copy_(torch::from_blob(const_cast<void*>(src), {numel}, torch::TensorOptions().dtype(from)));
}

// A data-less stand-in (meta tensor) with the weight's shape and dtype: the
// engine must not keep the dense weight alive once it is packed.
torch::Tensor meta_like(const std::vector<int64_t>& shape, torch::ScalarType dtype) {
  return torch::empty(shape, torch::TensorOptions().dtype(dtype).device(torch::kMeta));
}
}  // namespace

namespace {
void watch(Engine::LayerInfo& l, const torch::Tensor& param) {
  const c10::VariableVersion& v = param.unsafeGetTensorImpl()->version_counter();
  if (!v.enabled()) return;  // an inference tensor cannot be written in place later
  l.watched = v;
  l.watched_version = v.current_version();
  l.watched_param = c10::weak_intrusive_ptr<c10::TensorImpl>(param.getIntrusivePtr());
}
}  // namespace

void Engine::watch_weight(int index, const torch::Tensor& param) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  LayerInfo& l = *layers_.at(static_cast<size_t>(index));
  LS_CHECK(param.defined(), "watch_weight: layer '", l.name, "': undefined tensor");
  watch(l, param);
}

void Engine::requantize(int index, const torch::Tensor& dense) {
  auto scope = device_scope();
  std::lock_guard<std::recursive_mutex> lock(mu_);
  LS_CHECK(!detached_, "this layerstream handle was detached; write the module's weight directly");
  LayerInfo& l = *layers_.at(static_cast<size_t>(index));
  LS_CHECK(l.packed_here, "layer '", l.name, "' was not quantized by offload() (",
           l.qformat == quant::Format::None ? "it is not quantized: write its parameter in place"
                                            : "its weight came pre-packed: detach(), load, and offload() again",
           ")");
  LS_CHECK(dense.defined() && dense.sizes().vec() == l.w_shape, "layer '", l.name,
           "': new weight of shape ", dense.defined() ? shape_str(dense.sizes().vec()) : "(undefined)",
           " does not match the layer's ", shape_str(l.w_shape));
  LS_CHECK(dense.is_floating_point(), "layer '", l.name, "': a new weight must be floating point, got ",
           dense.scalar_type());
  LS_CHECK(!dense.is_meta(), "layer '", l.name, "': the new weight is data-less (meta), e.g. "
           "taken from the state_dict() of an offloaded quantized model; it has no values to load");
  torch::NoGradGuard ng;
  torch::Tensor src = dense.detach().to(torch::kCPU).to(l.w_dtype).contiguous();
  const int64_t rows = l.w_shape[0];
  const int64_t cols = rows ? src.numel() / rows : 0;
  std::vector<char> packed(l.w_bytes);
  try {
    quant::pack(l.qformat, src.data_ptr(), src_dtype_of(src.scalar_type(), l.name), rows, cols,
                packed.data(), 0);
  } catch (const Error& e) {
    LS_FAIL("cannot quantize the new weight of layer '", l.name, "' to ", quant::to_string(l.qformat),
            ": ", e.message(), " (the old weight is kept)");
  }
  synchronize();  // no copy may read the host buffer while it changes; forgets cached slots
  std::memcpy(l.w_host, packed.data(), l.w_bytes);
  // A write, as far as autograd's version checks go: a backward whose forward
  // used the old values raises (see saved_variables_of()).
  if (l.weight.unsafeGetTensorImpl()->version_counter().enabled())
    l.weight.unsafeGetTensorImpl()->bump_version();
  // The packed weight now holds these values: an earlier stray write to the
  // watched parameter no longer matters.
  if (l.watched) l.watched_version = l.watched->current_version();
}

int Engine::add_layer(LayerInfo info, quant::Format format) {
  auto scope = device_scope();
  std::lock_guard<std::recursive_mutex> lock(mu_);
  LS_CHECK(!detached_, "this layerstream handle was detached; create a new one with offload()");
  LS_CHECK(info.weight.defined(), "layer '", info.name, "' has no weight");
  LS_CHECK(info.weight.is_floating_point(), "layer '", info.name, "' has a ",
           info.weight.scalar_type(), " weight; only floating-point weights can be streamed");
  info.w_shape = info.weight.sizes().vec();
  info.w_dtype = info.weight.scalar_type();
  if (share_weight_locked(info, format)) {
    // Tied: the other layer's host copy is this layer's too.
  } else if (format == quant::Format::None) {
    info.w_host = adopt(*store_, keepalive_, info.weight, info.name + ".weight", &info.w_index, &info.w_bytes,
                        &info.w_strides);
  } else {
    LS_CHECK(!info.weight.requires_grad(), "layer '", info.name, "': a quantized weight cannot be "
             "trained; freeze it first (weight.requires_grad_(False), as QLoRA does with the base "
             "model) or do not quantize this layer");
    torch::NoGradGuard ng;
    torch::Tensor src = info.weight.detach().to(torch::kCPU).contiguous();
    const int64_t rows = info.w_shape[0];
    const int64_t cols = rows ? src.numel() / rows : 0;
    try {
      info.qlayout = quant::layout_for(format, rows, cols);
      info.w_bytes = info.qlayout.total_bytes();
      info.w_index = store_->add(info.w_bytes, nullptr, info.name + ".weight[" + quant::to_string(format) + "]");
      info.w_host = store_->buffer(info.w_index).ptr;
      quant::pack(format, src.data_ptr(), src_dtype_of(src.scalar_type(), info.name), rows, cols,
                  info.w_host, 0);
    } catch (const Error& e) {
      LS_FAIL("cannot quantize layer '", info.name, "' (weight ", shape_str(info.w_shape), ") to ",
              quant::to_string(format), ": ", e.message());
    }
    info.qformat = format;
    info.packed_here = true;
    watch(info, info.weight);
    info.weight = meta_like(info.w_shape, info.w_dtype);
  }
  if (info.bias.defined()) {
    LS_CHECK(info.bias.is_floating_point(), "layer '", info.name, "' has a non-float bias");
    info.b_shape = info.bias.sizes().vec();
    info.b_dtype = info.bias.scalar_type();
    info.b_host = adopt(*store_, keepalive_, info.bias, info.name + ".bias", &info.b_index, &info.b_bytes);
  }
  return register_layer_locked(std::move(info));
}

bool Engine::share_weight_locked(LayerInfo& info, quant::Format format) {
  const auto same = [](const torch::Tensor& a, const torch::Tensor& b) { return a.defined() && a.is_same(b); };
  for (const auto& l : layers_) {
    LS_CHECK(!info.bias.defined() || (!same(l->bias, info.bias) && !same(l->weight, info.bias)),
             "layer '", info.name, "' shares its bias with already streamed layer '", l->name,
             "'; only weights can be shared between streamed layers (tied weights): keep one of "
             "them resident");
    LS_CHECK(!same(l->bias, info.weight), "layer '", info.name, "' uses the bias of already streamed "
             "layer '", l->name, "' as its weight; keep one of them resident");
    for (const auto& e : l->parts)
      LS_CHECK(!same(e.param, info.weight) && !same(e.param, info.bias), "layer '", info.name,
               "' uses a tensor of streamed tensor group '", l->name, "'; keep one of them resident");
    const auto watched = l->watched_param.lock();
    LS_CHECK(!(watched && watched.get() == info.weight.unsafeGetTensorImpl()), "layer '", info.name,
             "' shares its weight with layer '", l->name, "', which streams it quantized; a shared "
             "(tied) weight streams unquantized: quantize neither layer");
  }
  for (auto& lp : layers_) {
    LayerInfo& l = *lp;
    if (!same(l.weight, info.weight)) continue;
    LS_CHECK(format == quant::Format::None, "cannot quantize layer '", info.name, "' to ",
             quant::to_string(format), ": its weight is shared with streamed layer '", l.name,
             "' (tied weights), and a shared weight streams unquantized; do not quantize it");
    LS_CHECK(l.qformat == quant::Format::None, "layer '", info.name, "' shares its weight with layer '",
             l.name, "', which streams it quantized; a shared (tied) weight streams unquantized");
    check_host_alias(l);  // the shared tensor still is the host copy
    info.w_index = l.w_index;
    info.w_host = l.w_host;
    info.w_bytes = l.w_bytes;
    info.w_strides = l.w_strides;
    info.shared_weight = l.shared_weight = true;
    return true;
  }
  return false;
}

int Engine::register_layer_locked(LayerInfo info) {
  if (info.qformat != quant::Format::None) info.q_dtype = dequant_dtype_.value_or(info.w_dtype);
  // An embedding's output is in its weight's dtype, as torch's lookup: never cast.
  if (compute_dtype_ && !info.is_embedding && !info.is_group) {
    info.cast_dtype = *compute_dtype_;
    info.cast_w = info.qformat == quant::Format::None && info.w_dtype != *compute_dtype_;
    info.cast_b = info.bias.defined() && info.b_dtype != *compute_dtype_;
  }
  if (info.cast_b) {
    // The bias copy goes after the device weight in the workspace (if any).
    const bool weight_in_ws = info.qformat != quant::Format::None || info.cast_w;
    info.ws_b_offset = weight_in_ws ? align256(dense_weight_bytes(info)) : 0;
  }
  info.grad_done = backend_->create_event();
  layers_.push_back(std::make_unique<LayerInfo>(std::move(info)));
  // A new layer invalidates the scheduler (its slot size and trace).
  if (sched_) {
    sched_->quiesce();
    const SchedulerStats st = sched_->stats();
    carried_.steps += st.steps;
    carried_.acquires += st.acquires;
    carried_.hits += st.hits;
    carried_.misses += st.misses;
    carried_.deviations += st.deviations;
    carried_.retraces += st.retraces;
    carried_.h2d_bytes += st.h2d_bytes;
    carried_.host_wait_seconds += st.host_wait_seconds;
    sched_.reset();
  }
  return static_cast<int>(layers_.size()) - 1;
}

int Engine::add_linear(const std::string& name, torch::Tensor weight, torch::Tensor bias,
                       quant::Format format) {
  LS_CHECK(weight.dim() == 2, "Linear layer '", name, "' needs a 2-D weight, got ",
           shape_str(weight.sizes().vec()));
  LayerInfo info;
  info.name = name;
  info.weight = weight;
  info.bias = bias;
  return add_layer(std::move(info), format);
}

int Engine::add_embedding(const std::string& name, torch::Tensor weight, int64_t padding_idx,
                          bool scale_grad_by_freq, bool sparse) {
  auto scope = device_scope();
  std::lock_guard<std::recursive_mutex> lock(mu_);
  LS_CHECK(!detached_, "this layerstream handle was detached; create a new one with offload()");
  LS_CHECK(weight.defined() && weight.dim() == 2, "embedding layer '", name, "' needs a 2-D weight, got ",
           weight.defined() ? shape_str(weight.sizes().vec()) : std::string("none"));
  LS_CHECK(weight.is_floating_point(), "embedding layer '", name, "' has a ", weight.scalar_type(),
           " weight; only floating-point weights can be streamed");
  LayerInfo info;
  info.name = name;
  info.is_embedding = true;
  info.weight = weight;
  const int64_t rows = weight.size(0);
  LS_CHECK(padding_idx == -1 || (padding_idx >= 0 && padding_idx < rows), "embedding layer '", name,
           "': padding_idx ", padding_idx, " must be -1 (none) or a row index below ", rows);
  info.padding_idx = padding_idx;
  info.scale_grad_by_freq = scale_grad_by_freq;
  info.sparse = sparse;
  info.w_shape = weight.sizes().vec();
  info.w_dtype = weight.scalar_type();
  if (!share_weight_locked(info, quant::Format::None))
    info.w_host = adopt(*store_, keepalive_, info.weight, name + ".weight", &info.w_index, &info.w_bytes,
                        &info.w_strides);
  info.last_read = backend_->create_event();
  info.w_host_mapped = backend_->device_address_of_host(store_->buffer(info.w_index));
  return register_layer_locked(std::move(info));
}

int Engine::add_group(const std::string& name, const std::vector<torch::Tensor>& tensors, quant::Format format,
                      int64_t experts, const std::vector<PrepackedPart>& prepacked) {
  auto scope = device_scope();
  std::lock_guard<std::recursive_mutex> lock(mu_);
  LS_CHECK(!detached_, "this layerstream handle was detached; create a new one with offload()");
  LS_CHECK(!tensors.empty(), "tensor group '", name, "' has no tensors");
  LS_CHECK(experts >= 0, "tensor group '", name, "': experts must be >= 0 (0: not indexed by expert), got ",
           experts);
  for (size_t k = 0; k < tensors.size(); ++k) {
    const torch::Tensor& t = tensors[k];
    LS_CHECK(t.defined() && t.is_floating_point(), "tensor group '", name, "': tensor #", k,
             " is not a floating-point tensor; only those can be streamed");
    for (const auto& l : layers_) {
      bool taken = l->weight.is_same(t) || (l->bias.defined() && l->bias.is_same(t));
      for (const auto& e : l->parts) taken = taken || e.param.is_same(t);
      LS_CHECK(!taken, "tensor group '", name, "': tensor #", k, " is already streamed by layer '", l->name,
               "'; a tensor can be in one streamed layer only");
    }
    for (size_t j = 0; j < k; ++j)
      LS_CHECK(!tensors[j].is_same(t), "tensor group '", name, "' lists one tensor twice");
    const bool pre = k < prepacked.size() && prepacked[k].format != quant::Format::None;
    if ((format != quant::Format::None && t.dim() >= 2) || pre)
      LS_CHECK(!t.requires_grad(), "tensor group '", name, "': tensor #", k, " requires grad, but a quantized "
               "tensor cannot be trained; freeze it (requires_grad_(False)) or do not quantize this group");
    if (pre) {
      LS_CHECK(quant::is_gguf(prepacked[k].format), "tensor group '", name, "': tensor #", k,
               ": pre-packed tensors are supported in the GGUF formats only, got ",
               quant::to_string(prepacked[k].format));
      LS_CHECK(t.dim() >= 2 && t.numel() > 0, "tensor group '", name, "': pre-packed tensor #", k,
               " must have 2 or more dimensions and elements, got ", shape_str(t.sizes().vec()));
    }
  }
  LS_CHECK(prepacked.empty() || prepacked.size() == tensors.size(), "tensor group '", name, "': ",
           prepacked.size(), " pre-packed entries for ", tensors.size(), " tensors (give one per tensor, or none)");
  LayerInfo info;
  info.name = name;
  info.is_group = true;
  size_t ws = 0;
  for (size_t k = 0; k < tensors.size(); ++k) {
    LayerInfo::Part e;
    e.param = tensors[k];
    e.shape = e.param.sizes().vec();
    e.dtype = e.param.scalar_type();
    const std::string label = name + "#" + std::to_string(k);
    const bool pre = !prepacked.empty() && prepacked[k].format != quant::Format::None;
    if (pre || (format != quant::Format::None && e.param.dim() >= 2)) {
      // Packed as a matrix of the last dimension's columns (an expert's rows
      // follow each other), dequantized into the workspace after the copy.
      const quant::Format f = pre ? prepacked[k].format : format;
      const int64_t cols = e.shape.back();
      const int64_t rows = cols ? e.param.numel() / cols : 0;
      if (pre) {
        LS_CHECK(e.dtype == torch::kFloat || e.dtype == torch::kBFloat16 || e.dtype == torch::kHalf,
                 "tensor group '", name, "': pre-packed tensor #", k, " must be float32, bfloat16 or float16 "
                 "(its dense dtype), got ", e.dtype);
        const torch::Tensor b = prepacked[k].bytes.detach().to(torch::kCPU).contiguous();
        LS_CHECK(b.element_size() == 1 && !b.is_floating_point(), "tensor group '", name, "': the bytes of "
                 "pre-packed tensor #", k, " must be an int8/uint8 tensor, got ", b.scalar_type());
        try {
          e.qlayout = quant::layout_for(f, rows, cols);
        } catch (const Error& err) {
          LS_FAIL("tensor group '", name, "': pre-packed tensor #", k, " (", shape_str(e.shape), ") cannot be ",
                  quant::to_string(f), ": ", err.message());
        }
        LS_CHECK(static_cast<size_t>(b.numel()) == e.qlayout.data_bytes, "tensor group '", name,
                 "': pre-packed tensor #", k, " ", shape_str(e.shape), " in ", quant::to_string(f), " needs ",
                 e.qlayout.data_bytes, " bytes, got ", b.numel());
        // The layout pads its section to 256 bytes: zeros, as pack() leaves them.
        e.bytes = e.qlayout.total_bytes();
        e.index = store_->add(e.bytes, nullptr, label + "[" + quant::to_string(f) + "]");
        e.host = store_->buffer(e.index).ptr;
        std::memset(e.host, 0, e.bytes);
        std::memcpy(static_cast<char*>(e.host) + e.qlayout.data_offset(), b.data_ptr(), e.qlayout.data_bytes);
      } else {
        torch::NoGradGuard ng;
        const torch::Tensor src = e.param.detach().to(torch::kCPU).contiguous();
        try {
          e.qlayout = quant::layout_for(f, rows, cols);
          e.bytes = e.qlayout.total_bytes();
          e.index = store_->add(e.bytes, nullptr, label + "[" + quant::to_string(f) + "]");
          e.host = store_->buffer(e.index).ptr;
          quant::pack(f, src.data_ptr(), src_dtype_of(src.scalar_type(), name), rows, cols, e.host, 0);
        } catch (const Error& err) {
          LS_FAIL("cannot quantize tensor #", k, " of group '", name, "' (", shape_str(e.shape), ") to ",
                  quant::to_string(f), ": ", err.message());
        }
      }
      e.qformat = f;
      e.q_dtype = dequant_dtype_.value_or(e.dtype);
      e.ws_offset = ws;
      ws += align256(static_cast<size_t>(e.param.numel()) * c10::elementSize(e.q_dtype));
      e.param = meta_like(e.shape, e.dtype);  // the engine keeps no dense copy
      // An expert's rows start on whole blocks: GGUF rows always do; for our
      // formats, an expert's element count must be a multiple of 64 (whole nf4
      // blocks and 16 bytes of codes, what the device kernel loads at once).
      if (experts > 0 && e.shape[0] == experts && rows % experts == 0 &&
          (quant::is_gguf(f) || (rows / experts * cols) % 64 == 0)) {
        e.by_expert = true;
        e.expert_rows = rows / experts;
      }
    } else {
      e.host = adopt(*store_, keepalive_, e.param, label, &e.index, &e.bytes, &e.strides);
      // Dim-0 slices are contiguous when dim 0 is the outermost (densely
      // laid out: adopt() keeps only dense, non-overlapping layouts).
      const int64_t n = e.param.numel();
      if (experts > 0 && e.shape[0] == experts && n > 0 &&
          (e.strides.empty() || e.strides[0] * experts == n)) {
        e.by_expert = true;
        e.expert_bytes = e.bytes / static_cast<size_t>(experts);
      }
    }
    info.parts.push_back(std::move(e));
  }
  info.experts = experts;
  info.group_ws_bytes = ws;
  return register_layer_locked(std::move(info));
}

static Engine::LayerInfo::Part& group_part(Engine::LayerInfo& l, int part) {
  LS_CHECK(l.is_group && part >= 0 && static_cast<size_t>(part) < l.parts.size(), "layer '", l.name,
           "' has no tensor #", part, l.is_group ? "" : " (it is not a tensor group)");
  return l.parts[static_cast<size_t>(part)];
}

torch::Tensor Engine::dequantized_part(int index, int part) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  LayerInfo::Part& e = group_part(*layers_.at(static_cast<size_t>(index)), part);
  LS_CHECK(e.qformat != quant::Format::None, "tensor #", part, " of group '", layers_[static_cast<size_t>(index)]->name,
           "' is not quantized");
  torch::Tensor dense = torch::empty(e.shape, torch::TensorOptions().dtype(torch::kFloat));
  quant::dequantize_cpu(e.qlayout, e.host, dense.data_ptr(), quant::OutDtype::F32, 0);
  return dense.to(e.dtype);
}

void Engine::requantize_part(int index, int part, const torch::Tensor& dense) {
  auto scope = device_scope();
  std::lock_guard<std::recursive_mutex> lock(mu_);
  LS_CHECK(!detached_, "this layerstream handle was detached; write the module's tensor directly");
  LayerInfo& l = *layers_.at(static_cast<size_t>(index));
  LayerInfo::Part& e = group_part(l, part);
  LS_CHECK(e.qformat != quant::Format::None, "tensor #", part, " of group '", l.name,
           "' is not quantized: write its parameter in place");
  LS_CHECK(dense.defined() && dense.sizes().vec() == e.shape, "group '", l.name, "': new tensor #", part,
           " of shape ", dense.defined() ? shape_str(dense.sizes().vec()) : "(undefined)", " does not match ",
           shape_str(e.shape));
  LS_CHECK(dense.is_floating_point() && !dense.is_meta(), "group '", l.name, "': new tensor #", part,
           " must be a floating-point tensor with values (not meta)");
  torch::NoGradGuard ng;
  const torch::Tensor src = dense.detach().to(torch::kCPU).to(e.dtype).contiguous();
  const int64_t cols = e.shape.back();
  const int64_t rows = cols ? src.numel() / cols : 0;
  std::vector<char> packed(e.bytes);
  try {
    quant::pack(e.qformat, src.data_ptr(), src_dtype_of(src.scalar_type(), l.name), rows, cols, packed.data(), 0);
  } catch (const Error& err) {
    LS_FAIL("cannot quantize the new tensor #", part, " of group '", l.name, "' to ", quant::to_string(e.qformat),
            ": ", err.message(), " (the old values are kept)");
  }
  synchronize();  // no copy may read the host buffer while it changes; forgets cached slots
  std::memcpy(e.host, packed.data(), e.bytes);
}

std::pair<int64_t, std::vector<torch::Tensor>> Engine::fetch(int layer_index, const std::vector<int64_t>& experts) {
  auto scope = device_scope();
  LayerInfo& l = call_layer(layer_index, "a tensor group");
  LS_CHECK(l.is_group, "fetch(): layer '", l.name, "' is not a tensor group");
  LS_CHECK(experts.empty() || l.experts > 0, "fetch(): tensor group '", l.name, "' was not added as indexed by "
           "expert (add_group(..., experts)); fetch it whole");
  std::vector<int64_t> ids(experts);
  for (int64_t x : ids)
    LS_CHECK(x >= 0 && x < l.experts, "fetch(): expert ", x, " of tensor group '", l.name, "' is outside [0, ",
             l.experts, ")");
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  check_host_alias(l);
  ensure_scheduler();
  Stream cs = compute_stream();
  // Some experts only: copy their slices (unless the group is in a slot
  // already); more than half: the whole group, which may be prefetched.
  const bool routed = !ids.empty() && 2 * static_cast<int64_t>(ids.size()) <= l.experts;
  if (l.experts > 0) scheduler().set_prefetch(layer_index, !routed);
  Lease lease;
  if (routed) {
    std::vector<std::pair<int64_t, int64_t>> runs;  // consecutive experts, [begin, end)
    for (int64_t x : ids) {
      if (!runs.empty() && runs.back().second == x)
        runs.back().second = x + 1;
      else
        runs.push_back({x, x + 1});
    }
    PartialCopy copy;
    copy.ranges.resize(l.parts.size());
    for (size_t k = 0; k < l.parts.size(); ++k) {
      const LayerInfo::Part& e = l.parts[k];
      auto& r = copy.ranges[k];
      if (!e.by_expert) {
        r.push_back({0, e.bytes});
      } else if (e.qformat == quant::Format::None) {
        for (const auto& run : runs)
          r.push_back({static_cast<size_t>(run.first) * e.expert_bytes,
                       static_cast<size_t>(run.second - run.first) * e.expert_bytes});
      } else {
        for (const auto& run : runs) {
          const quant::RowRange q = quant::row_range(e.qlayout, run.first * e.expert_rows, run.second * e.expert_rows);
          r.push_back({q.data_begin, q.data_bytes});
          r.push_back({q.scale_begin, q.scale_bytes});
          if (q.zero_bytes) r.push_back({q.zero_begin, q.zero_bytes});
        }
      }
    }
    if (l.group_ws_bytes) copy.post_copy = make_group_post_copy(l, l.parts.size(), &runs);
    lease = scheduler().acquire_partial(layer_index, cs, current_phase(), copy);
    if (!lease.hit) routed_fetches_++;
  } else {
    lease = scheduler().acquire(layer_index, cs, current_phase());
  }
  // Views with their parameters' requires_grad: the module's forward then
  // takes the resident module's paths (Note [Same calls as the resident module]).
  std::vector<torch::Tensor> views;
  auto view = [&](void* ptr, const std::vector<int64_t>& shape, const std::vector<int64_t>& strides,
                  torch::ScalarType dtype) {
    const auto opts = torch::TensorOptions().dtype(dtype).device(compute_device_);
    views.push_back(strides.empty() ? torch::from_blob(ptr, shape, opts) : torch::from_blob(ptr, shape, strides, opts));
    if (l.parts[views.size() - 1].param.requires_grad()) views.back().set_requires_grad(true);
  };
  for (size_t k = 0; k < l.parts.size(); ++k) {
    const LayerInfo::Part& e = l.parts[k];
    if (e.qformat != quant::Format::None)  // its dequantized copy in the workspace
      view(static_cast<char*>(lease.part_ptr(l.parts.size())) + e.ws_offset, e.shape, {}, e.q_dtype);
    else
      view(lease.part_ptr(k), e.shape, e.strides, e.dtype);
  }
  std::lock_guard<std::recursive_mutex> lock(mu_);
  const int64_t token = next_token_++;
  fetched_.emplace(token, std::move(lease));
  return {token, std::move(views)};
}

void Engine::release(int64_t token) {
  auto scope = device_scope();
  Lease lease;
  {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    auto it = fetched_.find(token);
    LS_CHECK(it != fetched_.end(), "release(): token ", token, " is not a fetched tensor group (released twice?)");
    lease = std::move(it->second);
    fetched_.erase(it);
  }
  scheduler().release(lease, compute_stream());
}

int Engine::add_linear_int8(const std::string& name, torch::Tensor data,
                            torch::Tensor scales, torch::Tensor bias, torch::ScalarType dense_dtype) {
  LS_CHECK(data.dim() == 2 && data.scalar_type() == torch::kChar, "layer '", name,
           "': pre-quantized weight must be a 2-D int8 tensor, got ", data.scalar_type(), " ",
           shape_str(data.sizes().vec()));
  const int64_t rows = data.size(0), cols = data.size(1);
  torch::Tensor sc = scales.detach().to(torch::kCPU).to(torch::kFloat).contiguous().reshape({-1});
  LS_CHECK(sc.numel() == rows || sc.numel() == 1, "layer '", name, "': int8 weight has ", rows,
           " rows but ", sc.numel(), " scales (need one per row or one per tensor)");
  if (sc.numel() == 1) sc = sc.expand({rows}).contiguous();
  return add_linear_packed(name, quant::Format::Int8, data, sc, bias, rows, cols, dense_dtype);
}

int Engine::add_linear_packed(const std::string& name, quant::Format format, torch::Tensor codes,
                              torch::Tensor scales, torch::Tensor bias, int64_t rows, int64_t cols,
                              torch::ScalarType dense_dtype) {
  auto scope = device_scope();
  std::lock_guard<std::recursive_mutex> lock(mu_);
  LS_CHECK(!detached_, "this layerstream handle was detached; create a new one with offload()");
  LS_CHECK(format == quant::Format::Int8 || format == quant::Format::NF4 || quant::is_gguf(format), "layer '",
           name, "': pre-packed weights are supported in the int8, nf4 and GGUF formats, got ",
           quant::to_string(format));
  LS_CHECK(dense_dtype == torch::kFloat || dense_dtype == torch::kBFloat16 || dense_dtype == torch::kHalf,
           "layer '", name, "': the dense dtype of a pre-packed weight must be float32, bfloat16 or "
           "float16, got ", dense_dtype);
  LS_CHECK(rows > 0 && cols > 0, "layer '", name, "': pre-packed weight shape [", rows, ", ", cols,
           "] is empty");
  const quant::PackedLayout layout = quant::layout_for(format, rows, cols);
  torch::Tensor d = codes.detach().to(torch::kCPU).contiguous();
  LS_CHECK(d.element_size() == 1 && !d.is_floating_point(), "layer '", name,
           "': pre-packed codes must be an int8/uint8 tensor, got ", d.scalar_type());
  LS_CHECK(static_cast<size_t>(d.numel()) == layout.data_bytes, "layer '", name, "': ",
           quant::to_string(format), " weight [", rows, ", ", cols, "] needs ", layout.data_bytes,
           " bytes of codes, got ", d.numel());
  torch::Tensor sc = scales.detach().to(torch::kCPU).to(torch::kFloat).contiguous().reshape({-1});
  LS_CHECK(sc.numel() == layout.num_scales(), "layer '", name, "': ", quant::to_string(format),
           " weight [", rows, ", ", cols, "] needs ", layout.num_scales(), " scales, got ", sc.numel());
  LS_CHECK(torch::isfinite(sc).all().item<bool>(), "layer '", name, "': scales contain NaN/Inf");
  LayerInfo info;
  info.name = name;
  info.bias = bias;
  info.w_shape = {rows, cols};
  info.w_dtype = dense_dtype;
  info.qformat = format;
  info.qlayout = layout;
  info.w_bytes = layout.total_bytes();
  info.w_index = store_->add(info.w_bytes, nullptr, name + ".weight[" + quant::to_string(format) + "]");
  info.w_host = store_->buffer(info.w_index).ptr;
  char* dst = static_cast<char*>(info.w_host);
  std::memset(dst, 0, info.w_bytes);
  std::memcpy(dst + layout.data_offset(), d.data_ptr(), layout.data_bytes);
  std::memcpy(dst + layout.scale_offset(), sc.data_ptr(), layout.scale_bytes);
  if (format == quant::Format::NF4 && layout.numel() % 2 == 1) {
    // The last byte's low nibble is padding: zero, as pack() writes it.
    auto* last = reinterpret_cast<uint8_t*>(dst + layout.data_offset() + layout.data_bytes - 1);
    *last = static_cast<uint8_t>(*last & 0xF0);
  }
  info.weight = meta_like(info.w_shape, dense_dtype);
  if (bias.defined()) {
    LS_CHECK(bias.is_floating_point(), "layer '", name, "' has a non-float bias");
    info.b_shape = bias.sizes().vec();
    info.b_dtype = bias.scalar_type();
    info.b_host = adopt(*store_, keepalive_, info.bias, name + ".bias", &info.b_index, &info.b_bytes);
  }
  return register_layer_locked(std::move(info));
}

int Engine::add_conv(const std::string& name, torch::Tensor weight, torch::Tensor bias,
                     const ConvSpec& spec, quant::Format format) {
  LS_CHECK(spec.dims >= 1 && spec.dims <= 3, "Conv layer '", name, "': only 1-3 spatial dims");
  LS_CHECK(weight.dim() == spec.dims + 2, "Conv", spec.dims, "d layer '", name, "' needs a ",
           spec.dims + 2, "-D weight, got ", shape_str(weight.sizes().vec()));
  auto check_len = [&](const std::vector<int64_t>& v, const char* what) {
    LS_CHECK(static_cast<int>(v.size()) == spec.dims, "Conv layer '", name, "': ", what,
             " needs ", spec.dims, " values, got ", v.size());
  };
  check_len(spec.stride, "stride");
  check_len(spec.dilation, "dilation");
  if (!spec.same) check_len(spec.padding, "padding");
  LayerInfo info;
  info.name = name;
  info.is_conv = true;
  info.conv = spec;
  info.weight = weight;
  info.bias = bias;
  return add_layer(std::move(info), format);
}

size_t Engine::grad_bytes(const LayerInfo& l) const {
  if (l.is_group) return 0;  // its gradients are the caller's
  return align256(l.w_bytes) + l.b_bytes;
}

void Engine::build_scheduler_locked() {
  std::vector<LayerSpec> specs;
  size_t largest = 0, largest_grad = 0;
  int largest_i = 0;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const LayerInfo& l = *layers_[i];
    LayerSpec s;
    s.name = l.name;
    if (l.is_embedding) {  // looked up in place, never fetched: an empty spec keeps the indices
      specs.push_back(std::move(s));
      continue;
    }
    size_t copied = 0;
    if (l.is_group) {
      for (const auto& e : l.parts) {
        s.parts.push_back(store_->buffer(e.index));
        copied += align256(e.bytes);
      }
    } else {
      s.parts.push_back(store_->buffer(l.w_index));
      if (l.bias.defined()) s.parts.push_back(store_->buffer(l.b_index));
      copied = align256(l.w_bytes) + align256(l.b_bytes);
    }
    s.workspace_bytes = workspace_bytes(l);
    if (s.workspace_bytes) {
      s.post_copy = l.is_group ? make_group_post_copy(l, s.parts.size()) : make_post_copy(l, s.parts.size());
      s.post_copy_label = l.is_group || l.qformat != quant::Format::None ? "dequant" : "cast";
    }
    const size_t bytes = copied + align256(s.workspace_bytes);
    if (bytes > largest) {
      largest = bytes;
      largest_i = static_cast<int>(i);
    }
    largest_grad = std::max(largest_grad, grad_bytes(l));
    specs.push_back(std::move(s));
  }
  const size_t slot_bytes = std::max(largest, largest_grad);
  SchedulerOptions so;
  so.slot_bytes = slot_bytes;
  so.post_copy_stream = dequant_stream_;
  so.prefetch_depth = opts_.prefetch;
  if (opts_.cache_across_steps) {
    // Opt-in: slot content stays valid across steps while the parameters'
    // version counters (bumped by in-place writes on the parameters:
    // optimizers, load_state_dict, copy_) do not change, and prefetching runs
    // across step boundaries. Writes through `.data` do not bump the counter
    // and would go unnoticed: that is why this is not the default.
    std::vector<std::vector<torch::Tensor>> params;
    for (const auto& l : layers_) {
      params.push_back({l->weight, l->bias});
      for (const auto& e : l->parts) params.back().push_back(e.param);
    }
    so.content_version = [params = std::move(params)](int layer) -> uint64_t {
      // Any in-place write bumps one of the counters, which only grow.
      uint64_t v = 0;
      for (const auto& t : params[static_cast<size_t>(layer)])
        if (t.defined()) v = v * 1000003u + static_cast<uint64_t>(t._version());
      return v;
    };
  }
  int slots = opts_.slots > 0 ? opts_.slots : opts_.prefetch + 2;
  if (opts_.budget_bytes >= 0) {
    const size_t budget = static_cast<size_t>(opts_.budget_bytes);
    LS_CHECK(budget >= 2 * slot_bytes, "budget of ", budget, " bytes is smaller than what the "
             "largest streamed layer '", layers_[static_cast<size_t>(largest_i)]->name,
             "' needs: 2 slots of ", slot_bytes, " bytes (", 2 * slot_bytes, " bytes; the layer takes ",
             largest, " bytes in a slot",
             layers_[static_cast<size_t>(largest_i)]->qformat != quant::Format::None
                 ? ": its packed weight and the weight dequantized on the device"
                 : layers_[static_cast<size_t>(largest_i)]->cast_w
                       ? ": its weight and the copy cast to compute_dtype '" + opts_.compute_dtype + "'"
                       : std::string(),
             "). Raise the budget to at least ", 2 * slot_bytes,
             " bytes or exclude that layer from streaming.");
    const int fit = static_cast<int>(std::min<size_t>(budget / slot_bytes, 1 << 20));
    if (opts_.slots > 0) {
      LS_CHECK(opts_.slots <= fit, "slots=", opts_.slots, " slots of ", slot_bytes,
               " bytes do not fit in the budget of ", budget, " bytes (at most ", fit, ")");
    } else {
      slots = std::min(slots, fit);
    }
    so.budget_bytes = budget;
  }
  slots = std::max(slots, 2);
  so.num_slots = slots;
  so.prefetch_depth = std::min(opts_.prefetch, slots - 1);
  sched_ = std::make_unique<Scheduler>(*backend_, transfer_, std::move(specs), so);
  if (tracer_) sched_->set_trace(tracer_);
}

void Engine::ensure_scheduler() {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  LS_CHECK(!detached_, "this layerstream handle was detached; its layers run their original "
           "forward now. Call offload() again to stream them.");
  if (!sched_) build_scheduler_locked();
}

Scheduler& Engine::scheduler() {
  ensure_scheduler();
  return *sched_;
}

Stream Engine::compute_stream() {
  if (inline_compute_) return inline_compute_;
  void* native = cuda_glue::current_stream(compute_device_.index());
  std::lock_guard<std::recursive_mutex> lock(mu_);
  auto it = wrapped_streams_.find(native);
  if (it != wrapped_streams_.end()) return it->second;
  Stream s = backend_->wrap_stream(native, "compute");
  wrapped_streams_[native] = s;
  return s;
}

Phase Engine::current_phase() const {
  return torch::autograd::get_current_graph_task_id() == -1 ? Phase::Forward : Phase::Backward;
}

void Engine::check_host_alias(const LayerInfo& l) const {
  if (l.is_group) {
    for (const auto& e : l.parts)
      LS_CHECK(e.qformat != quant::Format::None || (e.param.device().is_cpu() && e.param.data_ptr() == e.host),
               "a tensor of streamed layer '", l.name, "' was replaced or moved after offload(); call "
               "handle.detach() first or copy new values in place.");
    return;
  }
  if (l.watched)
    LS_CHECK(l.watched->current_version() == l.watched_version, "the weight of quantized layer '",
             l.name, "' was written in place after offload() (copy_, an in-place op or "
             "load_state_dict into the parameter); layerstream holds it packed on the host and "
             "that write did not reach it. Load new values with load_state_dict() on the offloaded "
             "model (it re-quantizes them; C++: Engine::requantize()), or detach(), write the "
             "weight, and offload() again.");
  if (l.qformat != quant::Format::None) {
    if (auto p = l.watched_param.lock())
      LS_CHECK(!p->requires_grad(), "the weight of quantized layer '", l.name, "' was set to require "
               "grad after offload(); a quantized weight is frozen (no gradient is computed for it). "
               "Train an adapter beside it (LoRA) or do not quantize this layer.");
  }
  if (l.qformat == quant::Format::None)
    LS_CHECK(l.weight.device().is_cpu() && l.weight.data_ptr() == l.w_host, "the weight of streamed "
           "layer '", l.name, "' was replaced or moved after offload() (e.g. by module.to(), "
           ".cuda() or load_state_dict(assign=True)); layerstream keeps streamed weights in host "
           "memory. Call handle.detach() before moving the model, or copy new values in place.");
  if (l.bias.defined())
    LS_CHECK(l.bias.device().is_cpu() && l.bias.data_ptr() == l.b_host, "the bias of streamed "
             "layer '", l.name, "' was replaced or moved after offload(); call handle.detach() "
             "first or copy new values in place.");
}

size_t Engine::dense_weight_bytes(const LayerInfo& l) {
  const torch::ScalarType t = l.qformat != quant::Format::None ? l.q_dtype : l.cast_dtype;
  return static_cast<size_t>(numel_of(l.w_shape)) * c10::elementSize(t);
}

size_t Engine::workspace_bytes(const LayerInfo& l) {
  if (l.is_group) return l.group_ws_bytes;
  size_t bytes = 0;
  if (l.qformat != quant::Format::None || l.cast_w) bytes = align256(dense_weight_bytes(l));
  if (l.cast_b) bytes = l.ws_b_offset + static_cast<size_t>(numel_of(l.b_shape)) * c10::elementSize(l.cast_dtype);
  return bytes;
}

PostCopyFn Engine::make_post_copy(const LayerInfo& l, size_t workspace_part) {
  // Runs on the dequant stream right after the layer's bytes landed in the
  // slot (the scheduler orders it after the copy and the slot's readers after
  // it): packed weight -> workspace in the layer's dense dtype, or dense
  // weight -> workspace cast to compute_dtype; then the bias cast.
  Backend* be = backend_.get();
  const bool quantized = l.qformat != quant::Format::None;
  const quant::PackedLayout layout = l.qlayout;
  const quant::OutDtype qdtype = out_dtype_of(l.q_dtype);
  const bool cast_w = l.cast_w, cast_b = l.cast_b;
  const torch::ScalarType w_dtype = l.w_dtype, b_dtype = l.b_dtype, to = l.cast_dtype;
  const int64_t w_numel = numel_of(l.w_shape), b_numel = numel_of(l.b_shape);
  const size_t ws_b = l.ws_b_offset;
  const bool on_cpu = compute_device_.is_cpu();
  const int device = compute_device_.index();
  const std::string what = (quantized ? "dequantize '" : "cast '") + l.name + "'";
  return [=](const BufferRef& slot, const std::vector<size_t>& off, Stream s) {
    char* base = static_cast<char*>(slot.ptr);
    char* ws = base + off.at(workspace_part);
    const void* w_src = base + off.at(0);
    const void* b_src = cast_b ? base + off.at(1) : nullptr;
    if (be->caps().ordering_checker) {
      be->declare_access(slot, Access::Read, s, what + " (reads the copied weights)");
      be->declare_access(slot, Access::Write, s, what + " (writes the workspace)");
    }
    if (on_cpu) {
      // The sim device: CPU reference code, in order on the stream.
      be->launch_host_func(s, [=] {
        if (quantized) quant::dequantize_cpu(layout, w_src, ws, qdtype, 1);
        if (cast_w) cast_cpu(w_src, w_dtype, ws, to, w_numel);
        if (cast_b) cast_cpu(b_src, b_dtype, ws + ws_b, to, b_numel);
      });
    } else {
      if (quantized) cuda_glue::dequantize_on(layout, w_src, ws, qdtype, device, s.native());
      if (cast_w) cuda_glue::cast_on(w_src, w_dtype, ws, to, w_numel, device, s.native());
      if (cast_b) cuda_glue::cast_on(b_src, b_dtype, ws + ws_b, to, b_numel, device, s.native());
    }
  };
}

PostCopyFn Engine::make_group_post_copy(const LayerInfo& l, size_t workspace_part,
                                        const std::vector<std::pair<int64_t, int64_t>>* runs) {
  // Runs on the dequant stream right after the group's bytes landed in the
  // slot: each packed part -> its dense copy in the workspace (with `runs`,
  // only those experts' rows of the expert-indexed parts, where they lie).
  struct Job {
    size_t part;
    quant::PackedLayout layout;
    quant::OutDtype out;
    size_t ws_offset;   // of the rows' output
    int64_t row_begin, row_end;
  };
  std::vector<Job> jobs;
  for (size_t k = 0; k < l.parts.size(); ++k) {
    const LayerInfo::Part& e = l.parts[k];
    if (e.qformat == quant::Format::None) continue;
    const quant::OutDtype out = out_dtype_of(e.q_dtype);
    if (!runs || !e.by_expert) {
      jobs.push_back({k, e.qlayout, out, e.ws_offset, 0, e.qlayout.rows});
      continue;
    }
    const size_t row_out = static_cast<size_t>(e.qlayout.cols) * quant::out_dtype_bytes(out);
    for (const auto& run : *runs) {
      const int64_t r0 = run.first * e.expert_rows, r1 = run.second * e.expert_rows;
      jobs.push_back({k, e.qlayout, out, e.ws_offset + static_cast<size_t>(r0) * row_out, r0, r1});
    }
  }
  Backend* be = backend_.get();
  const bool on_cpu = compute_device_.is_cpu();
  const int device = compute_device_.index();
  const std::string what = "dequantize '" + l.name + "'";
  return [=](const BufferRef& slot, const std::vector<size_t>& off, Stream s) {
    char* base = static_cast<char*>(slot.ptr);
    char* ws = base + off.at(workspace_part);
    if (be->caps().ordering_checker) {
      be->declare_access(slot, Access::Read, s, what + " (reads the copied tensors)");
      be->declare_access(slot, Access::Write, s, what + " (writes the workspace)");
    }
    for (const Job& j : jobs) {
      const void* src = base + off.at(j.part);
      void* dst = ws + j.ws_offset;
      if (on_cpu)
        be->launch_host_func(
            s, [=] { quant::dequantize_rows_cpu(j.layout, src, j.row_begin, j.row_end, dst, j.out, 1); });
      else
        cuda_glue::dequantize_on(j.layout, src, dst, j.out, device, s.native(), j.row_begin, j.row_end);
    }
  };
}

namespace {
const char* dtype_name(torch::ScalarType t) {
  switch (t) {
    case torch::kFloat: return "float32";
    case torch::kBFloat16: return "bfloat16";
    case torch::kHalf: return "float16";
    case torch::kDouble: return "float64";
    default: return c10::toString(t);
  }
}
}  // namespace

void Engine::note_cast_at_use(const LayerInfo& l, torch::ScalarType from, torch::ScalarType to) {
  if (cast_warned_.exchange(true)) return;
  warn("layer '" + l.name + "' (and any other streamed layer in this case) casts its " +
       dtype_name(from) + " weight to the " + dtype_name(to) + " activations at every use: a temporary "
       "outside the budget, on the compute stream. With compute_dtype=" + dtype_name(to) +
       " (offload(..., compute_dtype=torch." + dtype_name(to) + "); C++: EngineOptions::compute_dtype) "
       "the weight is cast once per copy, inside its slot; the numbers are the same.");
}

Engine::DeviceParams Engine::device_params(const LayerInfo& l, const Lease& lease, torch::ScalarType dtype) {
  DeviceParams p;
  const size_t ws_part = l.bias.defined() ? 2 : 1;  // the workspace follows the copied parts
  const auto on_device = torch::TensorOptions().device(compute_device_);
  if (l.qformat != quant::Format::None) {
    // The dequantized copy in the workspace (frozen: never requires grad).
    p.w_leaf = torch::from_blob(lease.part_ptr(ws_part), l.w_shape, on_device.dtype(l.q_dtype));
  } else {
    // The copy cast to compute_dtype after the transfer (element by element,
    // so in the same memory order), or the copied weight itself.
    const bool cast = l.cast_w && dtype == l.cast_dtype;
    const auto opts = on_device.dtype(cast ? l.cast_dtype : l.w_dtype);
    void* ptr = lease.part_ptr(cast ? ws_part : 0);
    p.w_leaf = l.w_strides.empty() ? torch::from_blob(ptr, l.w_shape, opts)
                                   : torch::from_blob(ptr, l.w_shape, l.w_strides, opts);
    if (l.weight.requires_grad()) p.w_leaf.set_requires_grad(true);
  }
  p.w = p.w_leaf;
  if (p.w.scalar_type() != dtype) {
    note_cast_at_use(l, p.w.scalar_type(), dtype);
    p.w = p.w_leaf.to(dtype);
  }
  if (l.bias.defined()) {
    const bool cast = l.cast_b && dtype == l.cast_dtype;
    p.b_leaf = cast ? torch::from_blob(static_cast<char*>(lease.part_ptr(2)) + l.ws_b_offset, l.b_shape,
                                       on_device.dtype(l.cast_dtype))
                    : torch::from_blob(lease.part_ptr(1), l.b_shape, on_device.dtype(l.b_dtype));
    if (l.bias.requires_grad()) p.b_leaf.set_requires_grad(true);
    p.b = p.b_leaf.scalar_type() == dtype ? p.b_leaf : p.b_leaf.to(dtype);
  }
  return p;
}

namespace {
// The storages of `p` that a recorded graph may save, with their roles
// (Engine::ParkedStorage::role).
std::vector<std::pair<int, c10::Storage>> param_storages(const Engine::DeviceParams& p) {
  std::vector<std::pair<int, c10::Storage>> out{{0, p.w_leaf.storage()}};
  if (!p.w.is_same(p.w_leaf)) out.emplace_back(1, p.w.storage());
  if (p.b_leaf.defined()) out.emplace_back(2, p.b_leaf.storage());
  if (p.b.defined() && !p.b.is_same(p.b_leaf)) out.emplace_back(3, p.b.storage());
  return out;
}

void set_storage(c10::StorageImpl& s, void* ptr) {
  // Non-owning; replacing an owning pointer (a cast copy's) frees its memory.
  s.set_data_ptr_noswap(at::DataPtr(ptr, s.device()));
}
}  // namespace

void Engine::register_storages(int layer, torch::ScalarType dtype, const DeviceParams& p, bool park_now) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  auto& list = parked_[layer];
  list.erase(std::remove_if(list.begin(), list.end(), [](const ParkedStorage& e) { return e.storage.expired(); }),
             list.end());
  for (auto& [role, storage] : param_storages(p)) {
    if (park_now) set_storage(*storage.unsafeGetStorageImpl(), nullptr);
    // (reclaim_copy: a strong reference from the raw pointer, as every torch
    // version has; Storage::getWeakStorageImpl is recent)
    list.push_back({role, dtype,
                    c10::weak_intrusive_ptr<c10::StorageImpl>(
                        c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(storage.unsafeGetStorageImpl()))});
  }
}

void Engine::unpark(int layer, torch::ScalarType dtype, const DeviceParams& fresh) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  std::map<int, c10::Storage> by_role;
  for (auto& [role, storage] : param_storages(fresh)) by_role.emplace(role, storage);
  for (const ParkedStorage& e : parked_[layer]) {
    if (e.dtype != dtype) continue;  // another backward's (other activation dtype)
    auto s = e.storage.lock();
    if (!s) continue;
    auto it = by_role.find(e.role);
    LS_CHECK(it != by_role.end() && it->second.nbytes() == s->nbytes(), "internal: the device parameters of "
             "layer '", layers_.at(static_cast<size_t>(layer))->name, "' changed between its forward and backward");
    set_storage(*s, it->second.mutable_data());
  }
  active_[layer].emplace_back(dtype, fresh);
}

void Engine::park(int layer, torch::ScalarType dtype) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  for (const ParkedStorage& e : parked_[layer])
    if (e.dtype == dtype)
      if (auto s = e.storage.lock()) set_storage(*s, nullptr);
  auto& act = active_[layer];
  for (auto it = act.rbegin(); it != act.rend(); ++it)
    if (it->first == dtype) {
      act.erase(std::next(it).base());
      break;
    }
}

std::optional<Engine::DeviceParams> Engine::active_params(int layer, torch::ScalarType dtype) const {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  auto it = active_.find(layer);
  if (it == active_.end()) return std::nullopt;
  for (auto a = it->second.rbegin(); a != it->second.rend(); ++a)
    if (a->first == dtype) return a->second;
  return std::nullopt;
}

void Engine::push_grads(int layer_index, Lease& scratch, bool has_w, bool has_b) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  LayerInfo& l = *layers_.at(static_cast<size_t>(layer_index));
  Stream cs = compute_stream();
  if (backend_->caps().ordering_checker)
    backend_->declare_access(scratch.slot_buf, Access::Write, cs,
                             "compute writes gradients of '" + l.name + "'");
  // A layer used more than once in one backward: each use gets its own
  // staging buffer; accumulate_locked() sums them before touching .grad.
  // Uses are tagged with the graph task, which applies them when it ends.
  const size_t use = l.pending.size();
  if (l.grad_staging.size() <= use) l.grad_staging.resize(use + 1);
  HostBuffer& staging = l.grad_staging[use];
  if (!staging.data()) {
    bool fell_back = false;
    staging = HostBuffer::allocate(*backend_, grad_bytes(l), opts_.pin_memory,
                                   l.name + ".grad-staging" + (use ? "." + std::to_string(use) : ""),
                                   &fell_back);
    l.grad_b_offset = align256(l.w_bytes);
    if (fell_back)
      warn_once("grad-staging-pageable", "could not pin the gradient staging buffer of '" + l.name +
                                             "'; using pageable memory (slower gradient copies)");
  }
  Event computed = backend_->create_event();
  backend_->record(computed, cs);
  backend_->wait(grad_stream_, computed);
  auto span = trace_begin(grad_stream_);
  if (has_w) {
    backend_->copy_async(staging.ref(), 0, scratch.slot_buf, 0, l.w_bytes, grad_stream_);
    d2h_bytes_ += l.w_bytes;
  }
  if (has_b) {
    backend_->copy_async(staging.ref(), l.grad_b_offset, scratch.slot_buf, l.grad_b_offset,
                         l.b_bytes, grad_stream_);
    d2h_bytes_ += l.b_bytes;
  }
  trace_end(grad_stream_, span, "grad", "D2H grad " + l.name,
            (has_w ? l.w_bytes : 0) + (has_b ? l.b_bytes : 0));
  scheduler().note_d2h((has_w ? l.w_bytes : 0) + (has_b ? l.b_bytes : 0));
  backend_->record(l.grad_done, grad_stream_);
  scheduler().release(scratch, grad_stream_);
  l.pending.push_back({has_w, has_b, torch::autograd::get_current_graph_task_id()});
  if (use == 0) pending_.push_back(layer_index);
}

namespace {
// Moves the staged uses of `l` (and their staging buffers, which keep their
// pairing) that `pick` selects to the front, in arrival order; returns how
// many. The rest keep their relative order behind them.
template <typename Pick>
size_t partition_uses(Engine::LayerInfo& l, Pick pick) {
  size_t n = 0;
  for (size_t u = 0; u < l.pending.size(); ++u) {
    if (!pick(l.pending[u])) continue;
    if (u != n) {
      std::rotate(l.pending.begin() + static_cast<std::ptrdiff_t>(n),
                  l.pending.begin() + static_cast<std::ptrdiff_t>(u),
                  l.pending.begin() + static_cast<std::ptrdiff_t>(u) + 1);
      std::rotate(l.grad_staging.begin() + static_cast<std::ptrdiff_t>(n),
                  l.grad_staging.begin() + static_cast<std::ptrdiff_t>(u),
                  l.grad_staging.begin() + static_cast<std::ptrdiff_t>(u) + 1);
    }
    ++n;
  }
  return n;
}

// Drops the first `n` staged uses; their buffers go to the back for reuse
// (a later copy into one is ordered after the earlier copy on the gradient
// stream, and the host reads it only after waiting for the later one).
void drop_front_uses(Engine::LayerInfo& l, size_t n) {
  l.pending.erase(l.pending.begin(), l.pending.begin() + static_cast<std::ptrdiff_t>(n));
  std::rotate(l.grad_staging.begin(), l.grad_staging.begin() + static_cast<std::ptrdiff_t>(n),
              l.grad_staging.end());
}
}  // namespace

void Engine::accumulate_locked(LayerInfo& l, int task) {
  const size_t n = partition_uses(l, [task](const LayerInfo::StagedUse& u) {
    return task == kAnyTask || u.task == task || u.task == -1;
  });
  if (n == 0) return;
  backend_->synchronize(l.grad_done);
  if (backend_->caps().ordering_checker)
    for (size_t u = 0; u < n; ++u)
      backend_->declare_host_access(l.grad_staging[u].ref(), Access::Read,
                                    "host accumulates gradients of '" + l.name + "'");
  torch::NoGradGuard ng;
  // Sum this backward's gradients of the weight (or bias) in arrival order,
  // then add the sum to .grad once: the order autograd uses for a leaf that
  // gets several gradients, so the result is bit-identical.
  auto acc = [&](torch::Tensor& param, bool weight, size_t offset, const std::vector<int64_t>& shape,
                 torch::ScalarType dt) {
    torch::Tensor sum;
    bool owned = false;
    for (size_t u = 0; u < n; ++u) {
      if (!(weight ? l.pending[u].w : l.pending[u].b)) continue;
      torch::Tensor g = torch::from_blob(static_cast<char*>(l.grad_staging[u].data()) + offset, shape,
                                         torch::TensorOptions().dtype(dt));
      if (!sum.defined()) {
        sum = g;
      } else {
        if (!owned) sum = sum.clone();
        owned = true;
        sum.add_(g);
      }
    }
    if (!sum.defined()) return;
    torch::Tensor& grad = param.mutable_grad();
    if (!grad.defined()) {
      if (param.is_contiguous()) {
        grad = owned ? sum : sum.clone();
      } else {
        // The parameter's layout (channels_last, transposed), as autograd
        // lays out a new .grad.
        grad = torch::empty_like(param);
        grad.copy_(sum);
      }
    } else {
      grad.add_(sum);
    }
  };
  acc(l.weight, true, 0, l.w_shape, l.w_dtype);
  if (l.bias.defined()) acc(l.bias, false, l.grad_b_offset, l.b_shape, l.b_dtype);
  drop_front_uses(l, n);
}

void Engine::drain_grads(int task) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  std::vector<int> still;
  for (int i : pending_) {
    LayerInfo& l = *layers_.at(static_cast<size_t>(i));
    accumulate_locked(l, task);
    if (!l.pending.empty()) still.push_back(i);
  }
  pending_ = std::move(still);
}

void Engine::discard_task(int task) noexcept {
  try {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    auto& t = callback_tasks_;
    t.erase(std::remove(t.begin(), t.end(), task), t.end());
    bool dropped = false;
    std::vector<int> still;
    for (int i : pending_) {
      LayerInfo& l = *layers_.at(static_cast<size_t>(i));
      const size_t n = partition_uses(l, [task](const LayerInfo::StagedUse& u) { return u.task == task; });
      drop_front_uses(l, n);
      dropped = dropped || n > 0;
      if (!l.pending.empty()) still.push_back(i);
    }
    pending_ = std::move(still);
    if (dropped) {
      ++failed_backwards_;
      failed_backward_unreported_ = true;
    }
  } catch (...) {
    // Runs from a destructor inside the autograd engine: never throw there.
  }
}

void Engine::ensure_backward_callback() {
  const int task = torch::autograd::get_current_graph_task_id();
  if (task == -1) return;
  {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    if (std::find(callback_tasks_.begin(), callback_tasks_.end(), task) != callback_tasks_.end())
      return;
    callback_tasks_.push_back(task);
  }
  // The callback runs only when the backward succeeds. When it fails, the
  // graph task is destroyed with the callback unrun, and so is `guard`:
  // its destructor drops what this backward staged (see discard_task()).
  struct TaskGuard {
    std::weak_ptr<Engine> engine;
    int task;
    std::atomic<bool> ran{false};
    ~TaskGuard() {
      if (ran.load()) return;
      if (auto self = engine.lock()) self->discard_task(task);
    }
  };
  auto guard = std::make_shared<TaskGuard>();
  guard->engine = shared_from_this();
  guard->task = task;
  torch::autograd::Engine::get_default_engine().queue_callback([guard] {
    guard->ran = true;
    auto self = guard->engine.lock();
    if (!self) return;
    {
      std::lock_guard<std::recursive_mutex> lock(self->mu_);
      auto& t = self->callback_tasks_;
      t.erase(std::remove(t.begin(), t.end(), guard->task), t.end());
    }
    auto scope = self->device_scope();
    self->drain_grads(guard->task);
  });
}

void Engine::report_failed_backward() {
  // On every call: a plain load, no lock, in the common case.
  if (!failed_backward_unreported_.load(std::memory_order_relaxed) || !failed_backward_unreported_.exchange(false))
    return;
  warn_once("failed-backward-" + std::to_string(id_),
            "a backward pass through streamed layers raised an exception; the weight gradients it had "
            "already computed for streamed layers were dropped, not added to .grad (plain autograd "
            "would have added them). Zero the gradients (optimizer.zero_grad()) before the next "
            "step, as after any failed backward; stats()['failed_backwards'] counts these.");
}

void Engine::synchronize() {
  auto scope = device_scope();
  std::lock_guard<std::recursive_mutex> lock(mu_);
  drain_grads(-1);
  backend_->synchronize(grad_stream_);
  if (sched_) sched_->quiesce();
  wait_lookups_locked();
}

void Engine::wait_lookups_locked() {
  for (const auto& l : layers_)
    if (l->is_embedding && l->last_read) backend_->synchronize(l->last_read);
}

void Engine::detach(const std::vector<torch::Device>& devices) {
  auto scope = device_scope();
  std::lock_guard<std::recursive_mutex> lock(mu_);
  LS_CHECK(!detached_, "this layerstream handle was already detached");
  synchronize();
  LS_CHECK(devices.empty() || devices.size() == layers_.size(), "detach needs one device per layer");
  torch::NoGradGuard ng;
  for (size_t i = 0; i < layers_.size(); ++i) {
    LayerInfo& l = *layers_[i];
    const torch::Device dev = devices.empty() ? torch::Device(torch::kCPU) : devices[i];
    if (l.is_group) {
      // Its tensors are its parts (below).
    } else if (l.qformat != quant::Format::None) {
      // The caller restores quantized weights from dequantized_weight().
    } else if (l.shared_weight && l.weight.data_ptr() != l.w_host) {
      // Tied: already restored by the first layer that shares it (the one that
      // adopted it, registered first), to that layer's device.
    } else {
      l.weight.set_data(l.weight.detach().clone().to(dev));
    }
    if (l.bias.defined()) l.bias.set_data(l.bias.detach().clone().to(dev));
    for (auto& e : l.parts)  // quantized parts: the caller restores them from dequantized_part()
      if (e.qformat == quant::Format::None) e.param.set_data(e.param.detach().clone().to(dev));
  }
  sched_.reset();
  fetched_.clear();
  detached_ = true;
}

std::map<std::string, double> Engine::stats() const {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  std::map<std::string, double> m;
  SchedulerStats st = sched_ ? sched_->stats() : SchedulerStats{};
  m["steps"] = static_cast<double>(st.steps + carried_.steps);
  m["acquires"] = static_cast<double>(st.acquires + carried_.acquires);
  m["hits"] = static_cast<double>(st.hits + carried_.hits);
  m["misses"] = static_cast<double>(st.misses + carried_.misses);
  m["deviations"] = static_cast<double>(st.deviations + carried_.deviations);
  m["retraces"] = static_cast<double>(st.retraces + carried_.retraces);
  m["failed_backwards"] = static_cast<double>(failed_backwards_);
  const uint64_t gathered = gathered_bytes_.load();
  m["h2d_bytes"] = static_cast<double>(st.h2d_bytes + carried_.h2d_bytes + gathered);
  m["gathered_bytes"] = static_cast<double>(gathered);
  m["d2h_bytes"] = static_cast<double>(d2h_bytes_);
  m["stall_seconds"] = st.host_wait_seconds + carried_.host_wait_seconds;
  m["slots"] = st.num_slots;
  m["slot_bytes"] = static_cast<double>(st.slot_bytes);
  m["max_slots_held"] = st.max_slots_held;
  m["budget_bytes"] = static_cast<double>(opts_.budget_bytes);
  m["layers"] = static_cast<double>(layers_.size());
  int quantized = 0, embeddings = 0, groups = 0;
  for (const auto& l : layers_) {
    bool packed = l->qformat != quant::Format::None;
    for (const auto& e : l->parts) packed = packed || e.qformat != quant::Format::None;
    quantized += packed ? 1 : 0;
    embeddings += l->is_embedding ? 1 : 0;
    groups += l->is_group ? 1 : 0;
  }
  m["quantized_layers"] = quantized;
  m["embedding_layers"] = embeddings;
  m["group_layers"] = groups;
  m["routed_fetches"] = static_cast<double>(routed_fetches_.load());
  const HostStoreStats hs = store_->stats();
  m["pinned_bytes"] = static_cast<double>(hs.pinned_bytes);
  m["pageable_bytes"] = static_cast<double>(hs.pageable_bytes);
  if (auto* sim = dynamic_cast<SimBackend*>(backend_.get())) {
    m["peak_device_bytes"] = static_cast<double>(sim->stats().peak_device_bytes);
  } else {
    m["peak_device_bytes"] = static_cast<double>(cuda_glue::peak_device_bytes(*backend_));
  }
  m["ordering_errors"] = static_cast<double>(backend_->ordering_errors().size());
  return m;
}

std::vector<std::string> Engine::ordering_errors() const { return backend_->ordering_errors(); }

torch::Tensor Engine::grad_to_host(const torch::Tensor& g, torch::ScalarType dtype) {
  torch::Tensor h = g.to(dtype).to(torch::kCPU);  // synchronous on CUDA
  const uint64_t bytes = static_cast<uint64_t>(h.numel()) * h.element_size();
  {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    d2h_bytes_ += bytes;
  }
  scheduler().note_d2h(bytes);
  return h;
}

std::shared_ptr<double> Engine::trace_begin(Stream s) {
  return trace_stream_begin(tracer_, *backend_, s);
}

void Engine::trace_end(Stream s, const std::shared_ptr<double>& start, const std::string& lane,
                       const std::string& name, uint64_t bytes) {
  if (start) trace_stream_end(tracer_, *backend_, s, start, {lane, name, 0, 0, bytes});
}

std::vector<std::pair<StepStats, double>> Engine::step_stats() const {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  std::vector<std::pair<StepStats, double>> out;
  if (!sched_) return out;
  for (const StepStats& st : sched_->step_stats()) {
    const double overlap = tracer_ ? tracer_->overlap_fraction("transfer", "compute", st.start_us, st.end_us)
                                   : std::numeric_limits<double>::quiet_NaN();
    out.emplace_back(st, overlap);
  }
  return out;
}

std::string Engine::trace_json() const { return tracer_ ? tracer_->to_chrome_json() : ""; }

torch::Tensor Engine::packed_codes(int index) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  const LayerInfo& l = *layers_.at(static_cast<size_t>(index));
  LS_CHECK(l.qformat != quant::Format::None, "layer '", l.name, "' is not quantized");
  torch::Tensor out = torch::empty({static_cast<int64_t>(l.qlayout.data_bytes)}, torch::kUInt8);
  std::memcpy(out.data_ptr(), static_cast<const char*>(l.w_host) + l.qlayout.data_offset(),
              l.qlayout.data_bytes);
  return out;
}

torch::Tensor Engine::dequantized_weight(int index) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  const LayerInfo& l = *layers_.at(static_cast<size_t>(index));
  LS_CHECK(l.qformat != quant::Format::None, "layer '", l.name, "' is not quantized");
  torch::Tensor dense = torch::empty(l.w_shape, torch::TensorOptions().dtype(torch::kFloat));
  quant::dequantize_cpu(l.qlayout, l.w_host, dense.data_ptr(), quant::OutDtype::F32, 0);
  return dense.to(l.w_dtype);
}

std::string Engine::layer_format(int index) const {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  const LayerInfo& l = *layers_.at(static_cast<size_t>(index));
  return l.qformat == quant::Format::None ? "" : quant::to_string(l.qformat);
}

// ---------------------------------------------------------------------------
// Autograd functions
// ---------------------------------------------------------------------------
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::shared_ptr<Engine> engine_from(AutogradContext* ctx) {
  const uint64_t id = static_cast<uint64_t>(ctx->saved_data["engine"].toInt());
  auto e = Engine::lookup(id);
  LS_CHECK(e != nullptr, "the layerstream engine of this graph was destroyed before backward "
           "(the offload handle was detached or garbage-collected); keep the handle alive until "
           "backward completes");
  return e;
}

void check_input(Engine& e, const Engine::LayerInfo& l, const torch::Tensor& x) {
  LS_CHECK(x.device() == e.compute_device(), "layer '", l.name, "' streams to ",
           e.device_name(), " (tensors on ", e.compute_device().str(), ") but its input is on ",
           x.device().str(), "; move the input to ", e.compute_device().str());
  LS_CHECK(is_float_activation(x.scalar_type()), "layer '", l.name, "' got a ", x.scalar_type(),
           " input; activations must be float32, bfloat16 or float16");
}

bool wants_grad(const torch::Tensor& p) {
  return p.defined() && p.requires_grad() && p.is_floating_point();
}

// A plain loss.backward(): autograd accumulates into every leaf's .grad. Then
// layerstream copies weight gradients back asynchronously and accumulates them
// itself. Otherwise (torch.autograd.grad, backward(inputs=...)) autograd must
// decide where each gradient goes, so they are returned to it.
bool plain_backward() {
  const auto* info = torch::autograd::get_current_graph_task_exec_info();
  return info == nullptr || info->empty();
}

// backward(create_graph=True) runs backward functions with grad mode on, to
// build a graph of the gradients (double backward, e.g. a gradient penalty).
// A streamed layer cannot take part: its device weight is a slot that is
// reused right after (a graph saving it would read other weights later), and
// it is not the parameter (the weight's share of the second derivative would
// be missing). Refuse instead of returning silently wrong numbers.
void check_no_create_graph(const Engine::LayerInfo& l) {
  LS_CHECK(!torch::GradMode::is_enabled(), "layer '", l.name, "': backward with create_graph=True "
           "(double backward, e.g. a gradient penalty) is not supported through a streamed layer; "
           "keep the layers it must differentiate through resident (offload(exclude=[...])) or "
           "compute that gradient without create_graph");
}

// ctx->get_saved_variables(), naming the layer when autograd's version check
// fails (its weight or input was written in place after the forward); any
// other error (e.g. a second backward through a freed graph) is autograd's
// own, passed on as it is.
variable_list saved_variables_of(AutogradContext* ctx, const Engine::LayerInfo& l) {
  try {
    return ctx->get_saved_variables();
  } catch (const c10::Error& err) {
    if (std::string(err.what_without_backtrace()).find("modified by an inplace operation") == std::string::npos)
      throw;
    LS_FAIL("streamed layer '", l.name, "': a tensor its backward needs (its weight or its input) "
             "was modified in place after the forward pass (e.g. an optimizer step or a weight edit "
             "before this backward); autograd raises the same for a resident layer. ",
             err.what_without_backtrace());
  }
  return {};
}

// A slot held for the compute stream `cs`, released when this goes out of
// scope: after the work that reads it was enqueued, or when that work threw.
class SlotLease {
 public:
  SlotLease(Scheduler& sched, Lease lease, Stream cs) : sched_(sched), lease_(std::move(lease)), cs_(cs) {}
  SlotLease(const SlotLease&) = delete;
  SlotLease& operator=(const SlotLease&) = delete;
  ~SlotLease() {
    try {
      sched_.release(lease_, cs_);
    } catch (const std::exception& err) {  // a destructor must not throw; nothing can be undone here
      warn(std::string("layerstream: releasing a slot failed: ") + err.what());
    }
  }
  const Lease& get() const { return lease_; }

 private:
  Scheduler& sched_;
  Lease lease_;
  Stream cs_;
};

// Note [Same calls as the resident module]
// Bit-exactness with the resident model holds only if a streamed layer issues
// the resident module's ATen/BLAS calls on operands of the same shapes,
// strides and requires_grad: at::matmul folds a 3-D+ input into one GEMM
// only when the weight requires grad, at::_convolution picks its backend by
// grad mode, mm's backward transposes its product by the weight's layout, and
// each BLAS rounds these variants differently on some CPUs. So the streamed
// op does not reimplement the module's math; it runs the module's own call
// (torch::linear, at::convNd) on leaves that stand in for the parameters
// (Engine::device_params: views of the slot with the parameters'
// requires_grad) under the caller's grad mode, and with a gradient to come,
// keeps the autograd graph that call recorded and runs it in backward with
// the autograd engine itself: op for op the resident module's graph.
//
// The graph's saved tensors must not pin slot memory (the slot is reused
// right after the forward): the storages of the device parameters it may
// have saved (the leaves, and their cast-at-use copies) are *parked* after
// the forward (data pointer null; a cast copy's memory freed), and in
// backward pointed at the re-fetched slot (and fresh cast copies) before the
// graph runs, then parked again (the way FSDP frees and restores parameter
// storage under saved tensors). Only the storages change: the saved tensors'
// metadata and version counters stay, so autograd's checks hold. The
// storages are registered per layer (Engine::register_storages), not per
// graph: under a non-reentrant checkpoint the graph's saved tensors are the
// ones its recompute made, which the backward of the layer must point at the
// fetched weights too; a recompute run inside the layer's own backward
// computes on that backward's weights (Engine::active_params). The weight
// and bias gradients of a Linear or conv read no weight, so a backward that
// needs no input gradient fetches nothing.

// What a streamed op's forward keeps for its backward.
struct KeptGraph : torch::CustomClassHolder {
  torch::autograd::Edge root;  // the op's output in the recorded graph
  torch::Tensor x, w, b;       // the leaves the graph was recorded on (b may be undefined)
  torch::ScalarType dtype = torch::kFloat;  // the activations' (device_params)
};

// New leaves on the memory of `p` (other storage objects, same pointers), as
// device_params() would make them: for a forward run inside the layer's own
// backward, whose storages that backward parks when it ends.
Engine::DeviceParams alias_params(const Engine::DeviceParams& p, torch::ScalarType dtype) {
  const auto alias = [](const torch::Tensor& t) {
    torch::Tensor a = torch::from_blob(t.data_ptr(), t.sizes(), t.strides(), t.options());
    if (t.requires_grad()) a.set_requires_grad(true);
    return a;
  };
  Engine::DeviceParams out;
  out.w_leaf = alias(p.w_leaf);
  out.w = out.w_leaf.scalar_type() == dtype ? out.w_leaf : out.w_leaf.to(dtype);
  if (p.b_leaf.defined()) {
    out.b_leaf = alias(p.b_leaf);
    out.b = out.b_leaf.scalar_type() == dtype ? out.b_leaf : out.b_leaf.to(dtype);
  }
  return out;
}

// Note [The kept graph runs in the caller's graph task]
// Engine::execute would run a kept graph as a graph task of its own, and
// non-reentrant checkpointing keys its recompute by the current graph task:
// each streamed layer of a checkpointed region would recompute the whole
// region again (N layers, N recomputes), and each nested task costs a graph
// task's setup. In a plain backward (no exec_info: every edge computes) the
// graph is small and runs here instead, node by node as the autograd engine
// runs nodes: only the nodes that lead to a wanted leaf, in the engine's
// order (highest sequence number first among the ready ones), gradients
// summed per input as its input buffers do, each node's outputs validated
// (cast and shaped) by the engine's own validate_outputs, and the saved
// variables released after the node unless the graph is kept.
variable_list run_kept_graph(const torch::autograd::Edge& root, const torch::Tensor& go,
                             const torch::autograd::edge_list& wanted, bool keep_graph) {
  using torch::autograd::Node;
  using NodePtr = decltype(torch::autograd::Edge::function);
  std::unordered_map<Node*, size_t> want;
  for (size_t i = 0; i < wanted.size(); ++i) want.emplace(wanted[i].function.get(), i);
  std::unordered_map<Node*, bool> needed;  // a path to a wanted leaf (the graph is a DAG)
  const std::function<bool(Node*)> leads = [&](Node* n) {
    auto it = needed.find(n);
    if (it != needed.end()) return it->second;
    bool need = false;
    for (const auto& e : n->next_edges())
      if (e.is_valid() && (want.count(e.function.get()) || leads(e.function.get()))) need = true;
    needed[n] = need;
    return need;
  };
  variable_list got(wanted.size());
  if (!leads(root.function.get())) return got;
  std::unordered_map<Node*, int> deps;
  for (const auto& [n, need] : needed)
    if (need)
      for (const auto& e : n->next_edges())
        if (e.is_valid() && !want.count(e.function.get()) && needed[e.function.get()]) ++deps[e.function.get()];
  const auto add = [](torch::Tensor& into, torch::Tensor&& g) {
    if (!g.defined()) return;
    into = into.defined() ? into + g : std::move(g);
  };
  std::unordered_map<Node*, variable_list> inputs;
  const auto buffer = [&](Node* n) -> variable_list& {
    auto& b = inputs[n];
    if (b.empty()) b.resize(n->num_inputs());
    return b;
  };
  auto later = [](const NodePtr& a, const NodePtr& b) { return a->sequence_nr() < b->sequence_nr(); };
  std::priority_queue<NodePtr, std::vector<NodePtr>, decltype(later)> ready(later);
  buffer(root.function.get())[root.input_nr] = go;
  ready.push(root.function);
  while (!ready.empty()) {
    NodePtr fn = ready.top();
    ready.pop();
    variable_list in = std::move(buffer(fn.get()));
    inputs.erase(fn.get());
    if (!keep_graph) fn->will_release_variables();
    variable_list out = (*fn)(std::move(in));
    if (!keep_graph) fn->release_variables();
    torch::autograd::validate_outputs(fn->next_edges(), out,
                                      [&](const std::string& msg) { return fn->name() + ": " + msg; });
    for (size_t i = 0; i < out.size(); ++i) {
      const auto& e = fn->next_edge(i);
      if (!e.is_valid()) continue;
      Node* to = e.function.get();
      auto w = want.find(to);
      if (w != want.end()) {
        add(got[w->second], std::move(out[i]));
        continue;
      }
      if (!needed[to]) continue;
      add(buffer(to)[e.input_nr], std::move(out[i]));
      if (--deps[to] == 0) ready.push(e.function);
    }
  }
  return got;
}

// The resident module's own call (Note [Same calls as the resident module]).
torch::Tensor layer_op(const Engine::LayerInfo& l, const torch::Tensor& x, const torch::Tensor& w,
                       const torch::Tensor& b) {
  if (!l.is_conv) return torch::linear(x, w, b);
  const ConvSpec& c = l.conv;
  switch (c.dims) {
    case 1:
      return c.same ? at::conv1d(x, w, b, c.stride, "same", c.dilation, c.groups)
                    : at::conv1d(x, w, b, c.stride, c.padding, c.dilation, c.groups);
    case 2:
      return c.same ? at::conv2d(x, w, b, c.stride, "same", c.dilation, c.groups)
                    : at::conv2d(x, w, b, c.stride, c.padding, c.dilation, c.groups);
    default:
      return c.same ? at::conv3d(x, w, b, c.stride, "same", c.dilation, c.groups)
                    : at::conv3d(x, w, b, c.stride, c.padding, c.dilation, c.groups);
  }
}

// A streamed layer's computation without an autograd node of its own (no
// gradient can flow): fetch, compute under the caller's grad mode, release.
torch::Tensor streamed_forward(Engine* e, Engine::LayerInfo& l, int layer, const torch::Tensor& x) {
  Stream cs = e->compute_stream();
  SlotLease lease(e->scheduler(), e->scheduler().acquire(layer, cs, e->current_phase()), cs);
  auto span = e->trace_begin(cs);
  const Engine::DeviceParams p = e->device_params(l, lease.get(), x.scalar_type());
  torch::Tensor out = layer_op(l, x, p.w, p.b);
  if (span) e->trace_end(cs, span, "compute", std::string("fwd ") + l.name);
  return out;
}

// A streamed Linear or convolution when a gradient can flow.
struct StreamedFn : public torch::autograd::Function<StreamedFn> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor x, torch::Tensor weight,
                               torch::Tensor bias, Engine* e, int64_t layer, bool via_autograd) {
    Engine::LayerInfo& l = e->layer(static_cast<int>(layer));
    auto kept = c10::make_intrusive<KeptGraph>();
    kept->dtype = x.scalar_type();
    const int index = static_cast<int>(layer);
    torch::Tensor out;
    // Inside this layer's own backward (a non-reentrant checkpoint recomputing
    // its region to unpack a saved tensor): on the weights that backward holds.
    const std::optional<Engine::DeviceParams> active = e->active_params(index, kept->dtype);
    {
      Stream cs = e->compute_stream();
      std::optional<SlotLease> lease;
      if (!active) lease.emplace(e->scheduler(), e->scheduler().acquire(index, cs, e->current_phase()), cs);
      auto span = e->trace_begin(cs);
      at::AutoGradMode grad_on(true);  // as the resident module's call runs
      kept->x = x.detach();
      if (x.requires_grad()) kept->x.requires_grad_(true);
      const Engine::DeviceParams p =
          active ? alias_params(*active, kept->dtype) : e->device_params(l, lease->get(), kept->dtype);
      kept->w = p.w_leaf;
      kept->b = p.b_leaf;
      torch::Tensor recorded = layer_op(l, kept->x, p.w, p.b);
      if (recorded.requires_grad()) kept->root = torch::autograd::impl::gradient_edge(recorded);
      out = recorded.detach();
      if (span) e->trace_end(cs, span, "compute", std::string("fwd ") + l.name);
      // Parked now, before the slot goes back (or, inside the layer's
      // backward, when that backward ends).
      e->register_storages(index, kept->dtype, p, /*park_now=*/!active);
    }
    ctx->saved_data["via_autograd"] = via_autograd;
    ctx->saved_data["engine"] = static_cast<int64_t>(e->id());
    ctx->saved_data["layer"] = layer;
    ctx->saved_data["graph"] = c10::IValue::make_capsule(kept);
    // The parameter is saved (no copy) where the resident module's graph
    // saves the weight (a Linear when the input gradient needs it, a conv
    // always): unpacking checks its version, so an in-place write between
    // forward and backward raises autograd's error instead of
    // differentiating through the new values.
    ctx->save_for_backward({l.is_conv || x.requires_grad() ? weight : torch::Tensor()});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto e = engine_from(ctx);
    const int layer = static_cast<int>(ctx->saved_data["layer"].toInt());
    Engine::LayerInfo& l = e->layer(layer);
    check_no_create_graph(l);
    auto scope = e->device_scope();
    saved_variables_of(ctx, l);  // the version check
    auto kept = c10::static_intrusive_pointer_cast<KeptGraph>(ctx->saved_data["graph"].toCapsule());
    const variable_list none(6);
    const torch::Tensor& go = grads[0];
    if (!go.defined() || !kept->root.is_valid()) return none;
    const bool need_x = ctx->needs_input_grad(0) && kept->x.requires_grad();
    const bool need_w = ctx->needs_input_grad(1) && kept->w.requires_grad() && wants_grad(l.weight);
    const bool need_b = l.bias.defined() && ctx->needs_input_grad(2) && kept->b.defined() &&
                        kept->b.requires_grad() && wants_grad(l.bias);
    if (!need_x && !need_w && !need_b) return none;
    const bool via_autograd = ctx->saved_data["via_autograd"].toBool() || !plain_backward();
    const bool keep_graph = torch::autograd::get_current_graph_task_keep_graph();
    torch::autograd::edge_list wanted;
    for (const auto& [need, leaf] : {std::pair{need_x, &kept->x}, {need_w, &kept->w}, {need_b, &kept->b}})
      if (need) wanted.push_back(torch::autograd::impl::gradient_edge(*leaf));
    Stream cs = e->compute_stream();
    Scheduler& sched = e->scheduler();
    // Note [The kept graph runs in the caller's graph task]; under
    // torch.autograd.grad / backward(inputs=...) the autograd engine runs it
    // (the caller's exec_info would prune the kept graph's edges).
    const bool plain = plain_backward();
    const auto run = [&] {
      if (plain) return run_kept_graph(kept->root, go, wanted, keep_graph);
      return torch::autograd::Engine::get_default_engine().execute({kept->root}, {go}, keep_graph,
                                                                  /*create_graph=*/false,
                                                                  /*accumulate_grad=*/false, wanted);
    };
    variable_list got;
    if (!need_x) {
      // The weight and bias gradients of a Linear or convolution are functions
      // of the input and the output gradient only: the graph reads no weight
      // (a read of a parked storage would raise, not return garbage), so the
      // weights are not fetched again.
      got = run();
    } else {
      SlotLease lease(sched, sched.acquire(layer, cs, Phase::Backward), cs);
      auto span = e->trace_begin(cs);
      const Engine::DeviceParams fresh = e->device_params(l, lease.get(), kept->dtype);
      e->unpark(layer, kept->dtype, fresh);
      try {
        got = run();
      } catch (...) {
        e->park(layer, kept->dtype);
        throw;
      }
      e->park(layer, kept->dtype);  // before the slot goes back: nothing may point into it
      if (span) e->trace_end(cs, span, "compute", std::string("bwd ") + l.name);
    }
    if (!keep_graph) kept->root = torch::autograd::Edge();
    size_t k = 0;
    const torch::Tensor gx = need_x ? got[k++] : torch::Tensor();
    const torch::Tensor gw = need_w ? got[k++] : torch::Tensor();
    const torch::Tensor gb = need_b ? got[k++] : torch::Tensor();
    if ((need_w || need_b) && via_autograd) {
      // Returned to autograd (host copies, synchronous), which routes them.
      return {gx, need_w ? e->grad_to_host(gw, l.w_dtype) : torch::Tensor(),
              need_b ? e->grad_to_host(gb, l.b_dtype) : torch::Tensor(), torch::Tensor(), torch::Tensor(),
              torch::Tensor()};
    }
    if (need_w || need_b) {
      // Into the scratch slot in the parameters' dtypes (as autograd's cast
      // back would), then to the host on the gradient stream.
      Lease scratch = sched.acquire_scratch(cs);
      try {
        const auto dopts = torch::TensorOptions().device(e->compute_device());
        if (need_w) torch::from_blob(scratch.part_ptr(0), l.w_shape, dopts.dtype(l.w_dtype)).copy_(gw);
        if (need_b)
          torch::from_blob(static_cast<char*>(scratch.slot_buf.ptr) + align256(l.w_bytes), l.b_shape,
                           dopts.dtype(l.b_dtype))
              .copy_(gb);
      } catch (...) {
        sched.release(scratch, cs);
        throw;
      }
      e->push_grads(layer, scratch, need_w, need_b);
      e->ensure_backward_callback();
    }
    return {gx, torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

// Under torch.autocast, Linear and convolutions run in the autocast dtype:
// the input is cast here as autocast would cast it (differentiably, so its
// gradient is cast back), and the weight follows the activation dtype by the
// dtype rule (the compute_dtype copy in the slot when it matches). Without
// this, autocast would cast the weight inside the op, outside the budget.
torch::Tensor autocast_input(const torch::Tensor& x, c10::DeviceType device) {
  if (!at::autocast::is_autocast_enabled(device)) return x;
  const torch::ScalarType to = at::autocast::get_autocast_dtype(device);
  const torch::ScalarType t = x.scalar_type();
  if (!x.is_floating_point() || t == torch::kDouble || t == to) return x;
  return x.to(to);
}

// torch.jit.trace (torch::jit::trace) would record the device weight of this
// one call, a view of a slot that holds other layers later, as a constant:
// the traced module would compute with whatever that memory holds.
void check_not_tracing(const Engine::LayerInfo& l) {
  LS_CHECK(!torch::jit::tracer::isTracing(), "streamed layer '", l.name, "' cannot be recorded by "
           "torch.jit.trace: its weights are copied into reused device memory at each call, which "
           "a trace would freeze. Trace the model before offload() or after handle.detach(), or "
           "use torch.compile (each streamed layer is a graph break).");
}

const char* kind_of(const Engine::LayerInfo& l) {
  return l.is_conv ? "a convolution" : l.is_embedding ? "an embedding" : l.is_group ? "a tensor group" : "a Linear";
}
}  // namespace

namespace {
// Whether a gradient can flow through the layer's call (else it runs without
// an autograd node of its own, as the resident module would record none).
bool needs_node(const torch::Tensor& x, const Engine::LayerInfo& l) {
  return torch::GradMode::is_enabled() &&
         (x.requires_grad() || l.weight.requires_grad() || (l.bias.defined() && l.bias.requires_grad()));
}
}  // namespace

Engine::LayerInfo& Engine::call_layer(int index, const char* kind) {
  report_failed_backward();
  LayerInfo& l = layer(index);
  check_not_tracing(l);
  LS_CHECK(std::strcmp(kind_of(l), kind) == 0, "layer '", l.name, "' is ", kind_of(l), ", not ", kind);
  return l;
}

torch::Tensor Engine::linear(int layer_index, const torch::Tensor& x_in, bool grads_via_autograd) {
  auto scope = device_scope();
  LayerInfo& l = call_layer(layer_index, "a Linear");
  check_input(*this, l, x_in);
  const torch::Tensor x = autocast_input(x_in, compute_device_.type());
  check_host_alias(l);
  ensure_scheduler();
  // No gradient can flow (no_grad / inference, or nothing requires grad):
  // skip the autograd node entirely.
  if (!needs_node(x, l)) return streamed_forward(this, l, layer_index, x);
  // Autograd inputs must be defined tensors: without a bias, the weight
  // stands in (the functions read the bias from the layer, never from here).
  return StreamedFn::apply(x, l.weight, l.bias.defined() ? l.bias : l.weight, this,
                           static_cast<int64_t>(layer_index), grads_via_autograd || l.shared_weight);
}

torch::Tensor Engine::conv(int layer_index, const torch::Tensor& x_in, bool grads_via_autograd) {
  auto scope = device_scope();
  LayerInfo& l = call_layer(layer_index, "a convolution");
  check_input(*this, l, x_in);
  const torch::Tensor x = autocast_input(x_in, compute_device_.type());
  check_host_alias(l);
  ensure_scheduler();
  LS_CHECK(x.dim() == l.conv.dims + 1 || x.dim() == l.conv.dims + 2, "Conv", l.conv.dims, "d layer '", l.name,
           "' expects a ", l.conv.dims + 1, "-D or ", l.conv.dims + 2, "-D input, got ", x.dim(), "-D");
  if (!needs_node(x, l)) return streamed_forward(this, l, layer_index, x);
  return StreamedFn::apply(x, l.weight, l.bias.defined() ? l.bias : l.weight, this,
                           static_cast<int64_t>(layer_index), grads_via_autograd || l.shared_weight);
}

namespace {
// A trainable table's lookup: forward reads the rows (Engine::lookup); backward
// computes the weight's gradient on the host with torch's own embedding backward
// (the resident module's numbers on the sim device; on CUDA the same fp32 sums,
// in another order), from the output gradient's rows copied back and the ids, and
// returns it to autograd, which accumulates it into .grad.
struct EmbeddingFn : public torch::autograd::Function<EmbeddingFn> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor ids, torch::Tensor weight, Engine* e,
                               int64_t layer) {
    Engine::LayerInfo& l = e->layer(static_cast<int>(layer));
    ctx->saved_data["engine"] = static_cast<int64_t>(e->id());
    ctx->saved_data["layer"] = layer;
    ctx->save_for_backward({ids});
    return e->lookup(l, ids);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto e = engine_from(ctx);
    Engine::LayerInfo& l = e->layer(static_cast<int>(ctx->saved_data["layer"].toInt()));
    check_no_create_graph(l);
    auto scope = e->device_scope();
    const torch::Tensor go = grads[0];
    if (!go.defined() || !ctx->needs_input_grad(1)) return {torch::Tensor(), torch::Tensor(), torch::Tensor(),
                                                            torch::Tensor()};
    const torch::Tensor ids = saved_variables_of(ctx, l)[0];
    torch::Tensor go_host = go.to(torch::kCPU);  // synchronous on CUDA: the rows, not the table
    e->count_d2h(static_cast<uint64_t>(go_host.numel()) * go_host.element_size());
    // CUDA's embedding backward sums a repeated id's rows in fp32 and rounds
    // once; the CPU op (the sim device's reference) sums in the gradient's dtype.
    if (!e->compute_device().is_cpu() && go_host.is_floating_point() && go_host.element_size() < 4)
      go_host = go_host.to(torch::kFloat);
    torch::Tensor gw = torch::embedding_backward(go_host, ids.to(torch::kCPU), l.w_shape[0], l.padding_idx,
                                                 l.scale_grad_by_freq, l.sparse);
    return {torch::Tensor(), gw.to(l.w_dtype), torch::Tensor(), torch::Tensor()};
  }
};
}  // namespace

void Engine::count_d2h(uint64_t bytes) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  d2h_bytes_ += bytes;
}

torch::Tensor Engine::embedding(int layer_index, const torch::Tensor& ids) {
  auto scope = device_scope();
  LayerInfo& l = call_layer(layer_index, "an embedding");
  LS_CHECK(ids.device() == compute_device_, "embedding layer '", l.name, "' streams to ", device_name_,
           " (tensors on ", compute_device_.str(), ") but its ids are on ", ids.device().str(),
           "; move them to ", compute_device_.str());
  LS_CHECK(ids.scalar_type() == torch::kLong || ids.scalar_type() == torch::kInt, "embedding layer '",
           l.name, "' got ", ids.scalar_type(), " ids; they must be int64 or int32");
  check_host_alias(l);
  if (torch::GradMode::is_enabled() && l.weight.requires_grad())
    return EmbeddingFn::apply(ids, l.weight, this, static_cast<int64_t>(layer_index));
  return lookup(l, ids);
}

torch::Tensor Engine::lookup(LayerInfo& l, const torch::Tensor& ids) {
  torch::NoGradGuard ng;  // the result's graph, if any, is EmbeddingFn's
  Stream cs = compute_stream();
  auto span = trace_begin(cs);
  const uint64_t bytes = static_cast<uint64_t>(ids.numel()) *
                         static_cast<uint64_t>(l.w_shape[1] * static_cast<int64_t>(c10::elementSize(l.w_dtype)));
  torch::Tensor out;
  if (compute_device_.is_cpu()) {
    // The sim device computes on the host: the lookup reads the store directly.
    if (backend_->caps().ordering_checker)
      backend_->declare_host_access(store_->buffer(l.w_index), Access::Read, "lookup in '" + l.name + "'");
    out = torch::embedding(l.weight.detach(), ids);
  } else if (l.w_host_mapped != nullptr) {
    // Kernels read the pinned store through its device mapping: only the rows named.
    const auto opts = torch::TensorOptions().dtype(l.w_dtype).device(compute_device_);
    const torch::Tensor table =
        at::for_blob(l.w_host_mapped, l.w_shape)
            .strides(l.w_strides.empty() ? at::OptionalIntArrayRef() : at::OptionalIntArrayRef(l.w_strides))
            .target_device(compute_device_)
            .options(opts)
            .make_tensor();
    out = torch::embedding(table, ids);
    std::lock_guard<std::recursive_mutex> lock(mu_);
    backend_->record(l.last_read, cs);
  } else {
    // Pageable store: the device cannot read it; gather on the host, then copy.
    out = torch::embedding(l.weight.detach(), ids.to(torch::kCPU)).to(compute_device_);
  }
  gathered_bytes_ += bytes;
  if (span) trace_end(cs, span, "compute", "lookup " + l.name, bytes);
  return out;
}

}  // namespace layerstream
