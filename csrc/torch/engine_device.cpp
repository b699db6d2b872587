// layerstream — LibTorch glue: the slot's post-copy step (dequantize / cast) and the device views of parameters (parking)
// (the engine's rooms: engine_impl.h).
#include "engine_impl.h"

#include <algorithm>
#include <cstring>

#include "core/log.h"
#include "core/lossless.h"

namespace layerstream {

namespace {
// Casts `numel` elements on the CPU, as torch's Tensor::to(dtype) does
// (the sim device's compute_dtype cast, run on a stream worker).
void cast_cpu(const void* src, torch::ScalarType from, void* dst, torch::ScalarType to, int64_t numel) {
  torch::Tensor out = torch::from_blob(dst, {numel}, torch::TensorOptions().dtype(to));
  out.copy_(torch::from_blob(const_cast<void*>(src), {numel}, torch::TensorOptions().dtype(from)));
}
}  // namespace

size_t EngineImpl::dense_weight_bytes(const LayerInfo& l) {
  const torch::ScalarType t = l.qformat != quant::Format::None ? l.q_dtype : l.coded ? l.w_dtype : l.cast_dtype;
  return static_cast<size_t>(numel_of(l.w_shape)) * c10::elementSize(t);
}

slot_layout::Layout EngineImpl::layout_of(const LayerInfo& l) {
  std::vector<slot_layout::Part> parts;
  if (l.is_group()) {
    for (const auto& e : l.parts())
      parts.push_back({e.coded ? e.coded->capacity : e.bytes,
                       e.qformat != quant::Format::None || e.coded
                           ? static_cast<uint64_t>(e.param.numel()) * c10::elementSize(e.q_dtype)
                           : 0});
    return slot_layout::of(parts);
  }
  const bool weight_in_ws = l.qformat != quant::Format::None || l.cast_w || l.coded;
  parts.push_back({l.coded ? l.coded->capacity : l.w_bytes, weight_in_ws ? dense_weight_bytes(l) : 0});
  if (l.bias.defined())
    parts.push_back({l.b_bytes, l.cast_b ? static_cast<uint64_t>(numel_of(l.b_shape)) * c10::elementSize(l.cast_dtype)
                                         : 0});
  return slot_layout::of(parts);
}

PostCopyFn EngineImpl::make_post_copy(const LayerInfo& l, size_t workspace_part) {
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
  const std::string what = (quantized || l.coded ? "dequantize '" : "cast '") + l.name + "'";
  // Lossless on CUDA: the kernel takes the code and layout from the header,
  // read here once from the host copy (the bytes the slot receives).
  std::shared_ptr<const lossless::Header> coded;
  if (l.qformat == quant::Format::Lossless && !on_cpu)
    coded = std::make_shared<const lossless::Header>(
        lossless::read_header(static_cast<const char*>(l.w_host) + layout.data_offset(), layout.data_bytes));
  // A trainable coded weight (engine_coded.cpp): its header changes when it
  // is re-coded, which happens before the copy this step follows.
  const std::shared_ptr<CodedWeight> trainable_coded = l.coded;
  const size_t dense_bytes = dense_weight_bytes(l);
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
      // The sim device: CPU reference code, in order on the stream. A trainable
      // coded weight's header is taken now, as the CUDA launch below takes it,
      // and must be the one of the bytes the slot holds when the step runs.
      std::shared_ptr<const lossless::Header> taken;
      if (trainable_coded) {
        std::lock_guard<std::mutex> g(trainable_coded->mu);
        taken = std::make_shared<const lossless::Header>(trainable_coded->header);
      }
      be->launch_host_func(s, [=] {
        if (quantized) quant::dequantize_cpu(layout, w_src, ws, qdtype, 1);
        if (trainable_coded) {
          const lossless::Header in_slot = lossless::read_header(w_src, trainable_coded->capacity);
          const lossless::Layout &a = in_slot.layout, &b = taken->layout;
          LS_INTERNAL_CHECK(a.dtype == b.dtype && a.numel == b.numel && a.block_elems == b.block_elems &&
                                a.stream_words == b.stream_words &&
                                std::memcmp(in_slot.code_lengths, taken->code_lengths, 256) == 0,
                            "(", what, ": the coded header taken when the decode was issued is not the one of "
                            "the bytes in the slot)");
          lossless::decode(w_src, trainable_coded->capacity, ws, dense_bytes, 1);
        }
        if (cast_w) cast_cpu(w_src, w_dtype, ws, to, w_numel);
        if (cast_b) cast_cpu(b_src, b_dtype, ws + ws_b, to, b_numel);
      });
    } else {
      if (trainable_coded) {
        lossless::Header h;
        {
          std::lock_guard<std::mutex> g(trainable_coded->mu);
          h = trainable_coded->header;
        }
        cuda_glue::lossless_decode_on(h, w_src, trainable_coded->capacity, ws, device, s.native());
      }
      if (coded)
        cuda_glue::lossless_decode_on(*coded, w_src, layout.data_bytes, ws, device, s.native());
      else if (quantized)
        cuda_glue::dequantize_on(layout, w_src, ws, qdtype, device, s.native());
      if (cast_w) cuda_glue::cast_on(w_src, w_dtype, ws, to, w_numel, device, s.native());
      if (cast_b) cuda_glue::cast_on(b_src, b_dtype, ws + ws_b, to, b_numel, device, s.native());
    }
  };
}

void EngineImpl::note_cast_at_use(const LayerInfo& l, torch::ScalarType from, torch::ScalarType to) {
  if (cast_warned_.exchange(true)) return;
  // A quantized weight dequantized to `from` (compute_dtype or dequant_dtype)
  // was rounded through it: dequantized straight to `to`, its numbers change.
  const std::string numbers =
      l.qformat == quant::Format::None
          ? std::string("; the numbers are the same.")
          : std::string("; a quantized weight is then dequantized straight to ") + dtype_name(to) +
                " (the numbers change: now it is rounded through " + dtype_name(from) + ").";
  warn("layer '" + l.name + "' (and any other streamed layer in this case) casts its " +
       dtype_name(from) + " weight to the " + dtype_name(to) + " activations at every use: a temporary "
       "outside the budget, on the compute stream. With compute_dtype=" + dtype_name(to) +
       " (offload(..., compute_dtype=torch." + dtype_name(to) + "); C++: EngineOptions::compute_dtype) "
       "the weight is cast once per copy, inside its slot" + numbers);
}

EngineImpl::DeviceParams EngineImpl::device_params(const LayerInfo& l, const Lease& lease, torch::ScalarType dtype) {
  DeviceParams p;
  const size_t ws_part = l.bias.defined() ? 2 : 1;  // the workspace follows the copied parts
  const auto on_device = torch::TensorOptions().device(compute_device_);
  if (l.qformat != quant::Format::None) {
    // The dequantized copy in the workspace (frozen: never requires grad);
    // a lossless one in the weight's own memory order (add_layer).
    const auto opts = on_device.dtype(l.q_dtype);
    p.w_leaf = l.w_strides.empty() ? torch::from_blob(lease.part_ptr(ws_part), l.w_shape, opts)
                                   : torch::from_blob(lease.part_ptr(ws_part), l.w_shape, l.w_strides, opts);
  } else {
    // The copy cast to compute_dtype after the transfer (element by element,
    // so in the same memory order), the weight decoded from its coded copy
    // (engine_coded.cpp), or the copied weight itself.
    const bool cast = l.cast_w && dtype == l.cast_dtype;
    const auto opts = on_device.dtype(cast ? l.cast_dtype : l.w_dtype);
    void* ptr = lease.part_ptr(cast || l.coded ? ws_part : 0);
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
// (EngineImpl::ParkedStorage::role).
std::vector<std::pair<int, c10::Storage>> param_storages(const EngineImpl::DeviceParams& p) {
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

void EngineImpl::register_storages(int layer, torch::ScalarType dtype, const DeviceParams& p, bool park_now) {
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

void EngineImpl::unpark(int layer, torch::ScalarType dtype, const DeviceParams& fresh) {
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

void EngineImpl::park(int layer, torch::ScalarType dtype) {
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

std::optional<EngineImpl::DeviceParams> EngineImpl::active_params(int layer, torch::ScalarType dtype) const {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  auto it = active_.find(layer);
  if (it == active_.end()) return std::nullopt;
  for (auto a = it->second.rbegin(); a != it->second.rend(); ++a)
    if (a->first == dtype) return a->second;
  return std::nullopt;
}

}  // namespace layerstream
