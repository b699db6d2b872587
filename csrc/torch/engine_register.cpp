// layerstream — LibTorch glue: layer registration (Linear, conv, embedding, pre-packed), host adoption, tied weights, requantize
// (the engine's rooms: engine_impl.h).
#include "engine_impl.h"

#include "core/io/checksum.h"
#include "core/lossless.h"

#include <c10/util/strides.h>

#include <algorithm>
#include <cstring>

#include "core/log.h"

namespace layerstream {

namespace {
// The strides a weight keeps in the host store and its slot: its own when they
// are not the row-major ones of its sizes and it is dense; else none (made
// row-major). Not !is_contiguous(): that ignores the strides of size-1 dims,
// and a conv picks its memory format from them (a channels_last 1x1 conv
// weight [o, i, 1, 1] has strides (i, 1, i, i); given (i, 1, 1, 1) the conv
// computes in another format, other numbers).
std::vector<int64_t> strides_to_keep(const torch::Tensor& t) {
  if (t.strides() == c10::IntArrayRef(c10::contiguous_strides(t.sizes())) || !t.is_non_overlapping_and_dense())
    return {};
  return t.strides().vec();
}
}  // namespace

void* adopt(HostStore& store, const std::shared_ptr<void>& keep, torch::Tensor& param,
            const std::string& name, size_t* index, size_t* bytes, std::vector<int64_t>* strides) {
  torch::NoGradGuard ng;
  torch::Tensor src = param.detach().to(torch::kCPU);
  std::vector<int64_t> kept = strides ? strides_to_keep(src) : std::vector<int64_t>{};
  const bool keep_layout = !kept.empty();
  if (!keep_layout) src = src.contiguous();
  *bytes = static_cast<size_t>(src.numel()) * src.element_size();
  if (strides) *strides = std::move(kept);
  // Read from a file straight into the store (Engine::read_file): no copy.
  const int64_t claimed = src.is_contiguous() && src.storage_offset() == 0 ? store.claim(src.data_ptr(), *bytes) : -1;
  if (claimed >= 0) {
    *index = static_cast<size_t>(claimed);
    param.set_data(src);
    return src.data_ptr();
  }
  // A trainable tensor stays out of a shared store unless the ranks step it in
  // shards (HostStore::share): else every rank's optimizer would write it.
  *index = store.add(*bytes, src.data_ptr(), name, /*shareable=*/store.shares(param.requires_grad()));
  void* ptr = store.buffer(*index).ptr;
  auto keepalive = keep;
  const auto opts = torch::TensorOptions().dtype(src.scalar_type());
  torch::Tensor alias = keep_layout ? torch::from_blob(ptr, src.sizes(), src.strides(), [keepalive](void*) {}, opts)
                                    : torch::from_blob(ptr, src.sizes(), [keepalive](void*) {}, opts);
  param.set_data(alias);
  return ptr;
}

namespace {
void watch(EngineImpl::LayerInfo& l, const torch::Tensor& param) {
  const c10::VariableVersion& v = param.unsafeGetTensorImpl()->version_counter();
  if (!v.enabled()) return;  // an inference tensor cannot be written in place later
  l.watched = v;
  l.watched_version = v.current_version();
  l.watched_param = c10::weak_intrusive_ptr<c10::TensorImpl>(param.getIntrusivePtr());
}
}  // namespace

// Note [The dense parameter of a quantized layer]
// In C++ offload() packs a weight and leaves the module's dense parameter as
// it is (offload.h): the engine computes with the packed copy, and the user
// may free the dense one to save host RAM. Engine::requantize() loaded new
// values into the packed copy only: torch::save() and detach() then gave the
// old ones back, silently; and a freed parameter was saved and left empty (0
// elements) by detach(). Now requantize() also writes the values into the
// dense parameter when it still has the layer's shape, and detach() fills a
// freed one (another shape) with the dequantized values (what the layer
// computed with); LinearImpl/ConvImpl's save() writes those for a freed one.
// Python replaces the parameter by a data-less stand-in and restores it
// itself (Handle._dequantized), so only a plain tensor is touched here.
torch::Tensor EngineImpl::LayerInfo::plain_dense_param() const {
  auto p = watched_param.lock();
  if (!p || p->key_set().has(c10::DispatchKey::Python) || !p->has_storage()) return {};
  return torch::Tensor(c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>::reclaim(p.release()));
}

void EngineImpl::watch_weight(int index, const torch::Tensor& param) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  LayerInfo& l = layer(index);
  LS_CHECK(param.defined(), "watch_weight: layer '", l.name, "': undefined tensor");
  watch(l, param);
}

torch::Tensor quantized_values(const torch::Tensor& weight, int64_t rows, int64_t cols, const std::string& format,
                               std::optional<torch::ScalarType> dequant) {
  const quant::Format f = quant::parse_format(format);
  LS_CHECK(f != quant::Format::None && f != quant::Format::Lossless && !quant::is_gguf(f), "quantized_values: ",
           format, " is not a format offload() quantizes to with a loss (int8, fp8, nf4, int4)");
  LS_CHECK(rows * cols == weight.numel(), "quantized_values: a [", rows, ", ", cols, "] view of a weight of ",
           weight.numel(), " elements");
  const torch::Tensor src = weight.detach().to(torch::kCPU).contiguous();
  const quant::PackedLayout layout = quant::layout_for(f, rows, cols);
  std::vector<uint8_t> packed(layout.total_bytes());
  quant::pack(f, src.data_ptr(), src_dtype_of(src.scalar_type(), "weight"), rows, cols, packed.data(), 0);
  const torch::ScalarType to = dequant.value_or(src.scalar_type());
  torch::Tensor out = torch::empty({rows, cols}, src.options().dtype(to));
  quant::dequantize_cpu(layout, packed.data(), out.data_ptr(), out_dtype_of(to), 0);
  return out.reshape(weight.sizes()).to(weight.scalar_type());
}

bool resident_quantized_rounds(torch::ScalarType weight, std::optional<torch::ScalarType> dequant) {
  return dequant && c10::promoteTypes(weight, *dequant) != weight;
}

std::string shared_write_refusal(const std::string& what, const std::string& how) {
  return what + " " + how + ": it sits in the host store this node's ranks share (share_host_store), where a "
         "write reaches every rank of the node (peft's merge_adapter() on rank 0 alone merges the adapter into "
         "every rank's weights; on every rank, once per rank). Write frozen weights before offload() (load the "
         "checkpoint first), evaluate with the adapter unmerged, or offload with share_host_store=False (one host "
         "copy per process: each rank writes its own).";
}

std::string shared_requantize_refusal(const std::string& what) {
  return shared_write_refusal(what, "cannot be re-quantized after offload() (copy_, load_state_dict())");
}

uint64_t tensor_checksum(const torch::Tensor& t) {
  const torch::Tensor c = t.detach().to(torch::kCPU).contiguous();
  return checksum64(c.data_ptr(), static_cast<uint64_t>(c.numel()) * c.element_size());
}

void EngineImpl::requantize(int index, const torch::Tensor& dense) {
  auto scope = device_scope();
  LetGoAfterUnlock let_go;  // Note [Saved tensors are let go after the lock]
  std::lock_guard<std::recursive_mutex> lock(mu_);
  const std::string why = requantize_refusal(index, -1);
  if (!why.empty()) LS_FAIL(why);
  LayerInfo& l = layer(index);
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
  wait_all_locked();  // no copy may read the host buffer while it changes; forgets cached slots
  std::memcpy(l.w_host, packed.data(), l.w_bytes);
  // A write, as far as autograd's version checks go: a backward whose forward
  // used the old values raises (see saved_variables_of()).
  if (l.weight.unsafeGetTensorImpl()->version_counter().enabled())
    l.weight.unsafeGetTensorImpl()->bump_version();
  // Note [The dense parameter of a quantized layer]: C++'s parameter takes them too.
  if (torch::Tensor param = l.plain_dense_param(); param.defined() && param.sizes().vec() == l.w_shape)
    param.copy_(dense.detach());
  // The packed weight now holds these values: an earlier stray write to the
  // watched parameter no longer matters.
  if (l.watched) l.watched_version = l.watched->current_version();
}

int EngineImpl::add_layer(LayerInfo info, quant::Format format) {
  auto scope = device_scope();
  std::lock_guard<std::recursive_mutex> lock(mu_);
  LS_CHECK(!detached_, "this layerstream handle was detached; create a new one with offload()");
  LS_CHECK(info.weight.defined(), "layer '", info.name, "' has no weight");
  LS_CHECK(info.weight.is_floating_point(), "layer '", info.name, "' has a ",
           dtype_name(info.weight.scalar_type()), " weight; only floating-point weights can be streamed");
  info.w_shape = info.weight.sizes().vec();
  info.w_dtype = info.weight.scalar_type();
  if (share_weight_locked(info, format)) {
    // Tied: the other layer's host copy is this layer's too.
  } else if (format == quant::Format::None ||
             (format == quant::Format::Lossless && info.weight.requires_grad())) {
    info.w_host = adopt(*store_, keepalive_, info.weight, info.name + ".weight", &info.w_index, &info.w_bytes,
                        &info.w_strides);
    // Trainable and lossless: dense here, coded on the bus (engine_coded.cpp).
    if (format == quant::Format::Lossless) make_coded_locked(info);
  } else {
    LS_CHECK(!info.weight.requires_grad(), "layer '", info.name, "': a quantized weight cannot be "
             "trained; freeze it first (weight.requires_grad_(False) in Python, requires_grad_(false) in C++, as "
             "QLoRA does with the base model) or do not quantize this layer");
    torch::NoGradGuard ng;
    torch::Tensor src = info.weight.detach().to(torch::kCPU);
    // Lossless codes element by element: in the weight's own memory order
    // (channels_last), so that the decoded weight is viewed with its strides
    // and the conv computes as the resident one. The other formats pack rows
    // of the logical (row-major) order.
    if (format == quant::Format::Lossless) info.w_strides = strides_to_keep(src);
    if (info.w_strides.empty()) src = src.contiguous();
    const int64_t rows = info.w_shape[0];
    const int64_t cols = rows ? src.numel() / rows : 0;
    try {
      const quant::SrcDtype dtype = src_dtype_of(src.scalar_type(), info.name);
      if (format == quant::Format::Lossless) {
        // Coded (core/lossless.h): its size is known after the analysis; the
        // slot decodes it into the weight's own dtype, bit for bit.
        const lossless::Analysis a = lossless::analyze(dtype, src.data_ptr(), src.numel());
        info.qlayout = quant::lossless_layout(rows, cols, a.total_bytes());
        info.w_bytes = info.qlayout.total_bytes();
        info.w_index = store_->add(info.w_bytes, nullptr, info.name + ".weight[lossless]");
        info.w_host = store_->buffer(info.w_index).ptr;
        lossless::encode(a, src.data_ptr(), info.w_host, info.w_bytes);
      } else {
        info.qlayout = quant::layout_for(format, rows, cols);
        info.w_bytes = info.qlayout.total_bytes();
        info.w_index = store_->add(info.w_bytes, nullptr, info.name + ".weight[" + quant::to_string(format) + "]");
        info.w_host = store_->buffer(info.w_index).ptr;
        quant::pack(format, src.data_ptr(), dtype, rows, cols, info.w_host, 0);
      }
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

bool EngineImpl::share_weight_locked(LayerInfo& info, quant::Format format) {
  const auto same = [](const torch::Tensor& a, const torch::Tensor& b) { return a.defined() && a.is_same(b); };
  for (const auto& l : layers_) {
    LS_CHECK(!info.bias.defined() || (!same(l->bias, info.bias) && !same(l->weight, info.bias)),
             "layer '", info.name, "' shares its bias with already streamed layer '", l->name,
             "'; only weights can be shared between streamed layers (tied weights): keep one of "
             "them resident");
    LS_CHECK(!same(l->bias, info.weight), "layer '", info.name, "' uses the bias of already streamed "
             "layer '", l->name, "' as its weight; keep one of them resident");
    for (const auto& e : l->parts())
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

int EngineImpl::register_layer_locked(LayerInfo info) {
  // A lossless weight decodes into its own dtype (dequant_dtype does not apply;
  // a compute_dtype casts it at use).
  if (info.qformat != quant::Format::None)
    info.q_dtype = info.qformat == quant::Format::Lossless ? info.w_dtype : dequant_dtype_.value_or(info.w_dtype);
  // An embedding's output is in its weight's dtype, as torch's lookup: never cast.
  if (compute_dtype_ && !info.is_table() && !info.is_group()) {
    info.cast_dtype = *compute_dtype_;
    // A coded weight is decoded into its own dtype (cast at use).
    info.cast_w = info.qformat == quant::Format::None && !info.coded && info.w_dtype != *compute_dtype_;
    info.cast_b = info.bias.defined() && info.b_dtype != *compute_dtype_;
  }
  // The bias copy goes after the device weight in the workspace (if any).
  if (info.cast_b) info.ws_b_offset = layout_of(info).workspace_offsets[1];
  info.grad_done = backend_->create_event();
  layers_.push_back(std::make_unique<LayerInfo>(std::move(info)));
  // A new layer invalidates the scheduler (its slot size and trace).
  retire_scheduler_locked();
  suspended_trace_.clear();
  suspended_trace_forward_.clear();
  return static_cast<int>(layers_.size()) - 1;
}

int EngineImpl::add_linear(const std::string& name, torch::Tensor weight, torch::Tensor bias,
                       quant::Format format) {
  LS_CHECK(weight.dim() == 2, "Linear layer '", name, "' needs a 2-D weight, got ",
           shape_str(weight.sizes().vec()));
  LayerInfo info;
  info.name = name;
  info.weight = weight;
  info.bias = bias;
  return add_layer(std::move(info), format);
}

int EngineImpl::add_embedding(const std::string& name, torch::Tensor weight, int64_t padding_idx,
                          bool scale_grad_by_freq, bool sparse) {
  auto scope = device_scope();
  std::lock_guard<std::recursive_mutex> lock(mu_);
  LS_CHECK(!detached_, "this layerstream handle was detached; create a new one with offload()");
  LS_CHECK(weight.defined() && weight.dim() == 2, "embedding layer '", name, "' needs a 2-D weight, got ",
           weight.defined() ? shape_str(weight.sizes().vec()) : std::string("none"));
  LS_CHECK(weight.is_floating_point(), "embedding layer '", name, "' has a ", dtype_name(weight.scalar_type()),
           " weight; only floating-point weights can be streamed");
  LayerInfo info;
  info.name = name;
  info.kind = TableKind{};
  info.weight = weight;
  const int64_t rows = weight.size(0);
  LS_CHECK(padding_idx == -1 || (padding_idx >= 0 && padding_idx < rows), "embedding layer '", name,
           "': padding_idx ", padding_idx, " must be -1 (none) or a row index below ", rows);
  TableKind& table = info.table();
  table.padding_idx = padding_idx;
  table.scale_grad_by_freq = scale_grad_by_freq;
  table.sparse = sparse;
  info.w_shape = weight.sizes().vec();
  info.w_dtype = weight.scalar_type();
  if (!share_weight_locked(info, quant::Format::None))
    info.w_host = adopt(*store_, keepalive_, info.weight, name + ".weight", &info.w_index, &info.w_bytes,
                        &info.w_strides);
  table.last_read = backend_->create_event();
  table.w_host_mapped = backend_->device_address_of_host(store_->buffer(info.w_index));
  return register_layer_locked(std::move(info));
}

int EngineImpl::add_linear_int8(const std::string& name, torch::Tensor data,
                            torch::Tensor scales, torch::Tensor bias, torch::ScalarType dense_dtype) {
  LS_CHECK(data.dim() == 2 && data.scalar_type() == torch::kChar, "layer '", name,
           "': pre-quantized weight must be a 2-D int8 tensor, got ", dtype_name(data.scalar_type()), " ",
           shape_str(data.sizes().vec()));
  const int64_t rows = data.size(0), cols = data.size(1);
  torch::Tensor sc = scales.detach().to(torch::kCPU).to(torch::kFloat).contiguous().reshape({-1});
  LS_CHECK(sc.numel() == rows || sc.numel() == 1, "layer '", name, "': int8 weight has ", rows,
           " rows but ", sc.numel(), " scales (need one per row or one per tensor)");
  if (sc.numel() == 1) sc = sc.expand({rows}).contiguous();
  return add_linear_packed(name, quant::Format::Int8, data, sc, bias, rows, cols, dense_dtype);
}

int EngineImpl::add_linear_packed(const std::string& name, quant::Format format, torch::Tensor codes,
                              torch::Tensor scales, torch::Tensor bias, int64_t rows, int64_t cols,
                              torch::ScalarType dense_dtype) {
  auto scope = device_scope();
  std::lock_guard<std::recursive_mutex> lock(mu_);
  LS_CHECK(!detached_, "this layerstream handle was detached; create a new one with offload()");
  LS_CHECK(format == quant::Format::Int8 || format == quant::Format::Fp8E4M3 || format == quant::Format::NF4 ||
               quant::is_gguf(format),
           "layer '", name, "': pre-packed weights are supported in the int8, fp8, nf4 and GGUF formats, got ",
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
  if (layout.scale_bytes != 0)  // GGUF blocks carry their scales: `sc` is empty (no data pointer)
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

int EngineImpl::add_conv(const std::string& name, torch::Tensor weight, torch::Tensor bias,
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
  info.kind = ConvKind{spec};
  info.weight = weight;
  info.bias = bias;
  return add_layer(std::move(info), format);
}

torch::Tensor EngineImpl::packed_codes(int index) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  const LayerInfo& l = layer(index);
  LS_CHECK(l.qformat != quant::Format::None, "layer '", l.name, "' is not quantized");
  LS_CHECK(!l.on_disk(), "layer '", l.name, "' streams its packed weight from ", l.w_file->path,
           " (the disk tier): its codes are read there on every use, not held in host memory");
  torch::Tensor out = torch::empty({static_cast<int64_t>(l.qlayout.data_bytes)}, torch::kUInt8);
  std::memcpy(out.data_ptr(), static_cast<const char*>(l.w_host) + l.qlayout.data_offset(),
              l.qlayout.data_bytes);
  return out;
}

torch::Tensor EngineImpl::dequantized_weight(int index) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  const LayerInfo& l = layer(index);
  LS_CHECK(l.qformat != quant::Format::None, "layer '", l.name, "' is not quantized");
  LS_CHECK(!l.on_disk(), "layer '", l.name, "' streams its packed weight from ", l.w_file->path,
           " (the disk tier): it is not held in host memory");
  if (l.qformat == quant::Format::Lossless) {  // bit for bit, in its own dtype and strides
    const auto opts = torch::TensorOptions().dtype(l.w_dtype);
    torch::Tensor dense = l.w_strides.empty() ? torch::empty(l.w_shape, opts)
                                              : torch::empty_strided(l.w_shape, l.w_strides, opts);
    quant::dequantize_cpu(l.qlayout, l.w_host, dense.data_ptr(), out_dtype_of(l.w_dtype), 0);
    return dense;
  }
  torch::Tensor dense = torch::empty(l.w_shape, torch::TensorOptions().dtype(torch::kFloat));
  quant::dequantize_cpu(l.qlayout, l.w_host, dense.data_ptr(), quant::OutDtype::F32, 0);
  return dense.to(l.w_dtype);
}

std::string EngineImpl::layer_format(int index) const {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  const LayerInfo& l = layer(index);
  return l.qformat == quant::Format::None ? "" : quant::to_string(l.qformat);  // a coded dense weight: ""
}

}  // namespace layerstream
