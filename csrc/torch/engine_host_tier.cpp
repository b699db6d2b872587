// layerstream — LibTorch glue: the host tier (docs/design/host-tier.md):
// tensors read from a file straight into the host store, Linear layers whose
// frozen weights stay in their file (the disk tier), and the staged sources
// the scheduler reads such layers (and pageable store tensors) from
// (the engine's rooms: engine_impl.h).
#include "engine_impl.h"
#include "core/planner.h"  // format_bytes

#include <sys/mman.h>

#include <cerrno>
#include <cstring>
#include <functional>
#include <memory>

namespace layerstream {

std::shared_ptr<SourceFile> EngineImpl::open_file_locked(const FileRange& r) const {
  auto it = files_.find(r.path);
  if (it != files_.end() && (!r.identity.recorded() || it->second->identity() == r.identity)) return it->second;
  return nullptr;
}

std::shared_ptr<SourceFile> EngineImpl::file_locked(const FileRange& r) {
  if (auto open = open_file_locked(r)) return open;
  // Not open yet, or open as another version of the file (a range recorded
  // before or after a change): this range's version, checked at every read.
  auto f = SourceFile::open(r.path, r.identity, r.kind);
  files_[r.path] = f;
  return f;
}

torch::Tensor EngineImpl::read_file(const FileRange& src, const std::vector<int64_t>& shape,
                                    torch::ScalarType dtype, std::optional<torch::ScalarType> file_dtype) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  LS_CHECK(!detached_, "this layerstream handle was detached; create a new one with offload()");
  const torch::ScalarType from = file_dtype.value_or(dtype);
  LS_CHECK(from == dtype || (c10::isFloatingType(from) && c10::isFloatingType(dtype)), src.path, ": tensor '",
           src.tensor, "' is ", dtype_name(from), " in the file; only floating-point tensors are cast as read (to ",
           dtype_name(dtype), ")");
  const int64_t numel = numel_of(shape);
  const uint64_t want = static_cast<uint64_t>(numel) * c10::elementSize(from);
  LS_CHECK(want == src.bytes, src.path, ": tensor '", src.tensor, "' has ", src.bytes, " bytes in the file; ",
           shape_str(shape), " of ", dtype_name(from), " needs ", want);
  // The disk tier's open file when it reads this one too, else one opened for
  // this read alone: a checkpoint whose weights were all read into RAM is
  // closed, and a deleted one frees its disk space (docs/design/host-tier.md,
  // "Open files").
  std::shared_ptr<SourceFile> file = open_file_locked(src);
  if (!file) file = SourceFile::open(src.path, src.identity, src.kind);
  const size_t index = store_->add_unclaimed(static_cast<uint64_t>(numel) * c10::elementSize(dtype), src.tensor);
  void* ptr = store_->buffer(index).ptr;
  // Several threads, large chunks: core/io/source_file.h.
  optim::ThreadPool* readers = opts_.reader_threads > 1 ? &SourceFile::readers() : nullptr;
  if (from == dtype || numel == 0) {
    file->read(ptr, src.offset, src.bytes, src.tensor, readers);
  } else {  // Cast as read (docs/design/host-tier.md): a bounded temporary, never the whole tensor twice
    const int64_t chunk = std::min<int64_t>(
        numel, std::max<int64_t>(1, (int64_t{64} << 20) / static_cast<int64_t>(c10::elementSize(from))));
    // Mapped on its own, not taken from malloc: between the store's buffers, the
    // heap kept each freed temporary's hole (an fp32 file into a bf16 model took
    // twice the model's RSS; test_host_tier.py measures it).
    const size_t tmp_bytes = static_cast<size_t>(chunk) * c10::elementSize(from);
    void* raw = ::mmap(nullptr, tmp_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    LS_CHECK(raw != MAP_FAILED, "cannot map ", format_bytes(tmp_bytes), " to cast '", src.tensor,
             "' as it is read: ", std::strerror(errno));
    std::unique_ptr<void, std::function<void(void*)>> unmap(raw, [tmp_bytes](void* p) { ::munmap(p, tmp_bytes); });
    torch::Tensor out = torch::from_blob(ptr, {numel}, torch::TensorOptions().dtype(dtype));
    torch::Tensor tmp = torch::from_blob(raw, {chunk}, torch::TensorOptions().dtype(from));
    for (int64_t i = 0; i < numel; i += chunk) {
      const int64_t n = std::min(chunk, numel - i);
      file->read(tmp.data_ptr(), src.offset + static_cast<uint64_t>(i) * c10::elementSize(from),
                 static_cast<uint64_t>(n) * c10::elementSize(from), src.tensor, readers);
      out.narrow(0, i, n).copy_(tmp.narrow(0, 0, n));
    }
  }
  auto keepalive = keepalive_;
  return torch::from_blob(ptr, shape, [keepalive](void*) {}, torch::TensorOptions().dtype(dtype));
}

int EngineImpl::add_linear_on_disk(const std::string& name, const torch::Tensor& weight, const FileRange& w,
                                   torch::Tensor bias, const std::optional<FileRange>& b, quant::Format format) {
  auto scope = device_scope();
  std::lock_guard<std::recursive_mutex> lock(mu_);
  LS_CHECK(!detached_, "this layerstream handle was detached; create a new one with offload()");
  LS_CHECK(weight.defined() && weight.is_floating_point(), "layer '", name, "': a weight on disk must be a "
           "floating-point tensor (its shape and dtype)");
  LS_CHECK(!weight.requires_grad(), "layer '", name, "': its weight requires grad, so it must be in host "
           "RAM (the optimizer writes it); only frozen weights can stay in their file. Raise host_budget, "
           "or freeze it (LoRA trains adapters beside a frozen base)");
  LayerInfo info;
  info.name = name;
  info.kind = LinearKind{};
  info.w_shape = weight.sizes().vec();
  info.w_dtype = weight.scalar_type();
  info.w_bytes = static_cast<size_t>(weight.numel()) * weight.element_size();
  if (format != quant::Format::None) {  // packed (core/io/quant_cache.h)
    LS_CHECK(!quant::is_gguf(format) && format != quant::Format::Lossless && weight.dim() == 2, "layer '", name,
             "': a weight on disk is packed only in int8, fp8, nf4 or int4 (core/io/quant_cache.h), and only for "
             "Linear layers");
    info.qformat = format;
    info.qlayout = quant::layout_for(format, info.w_shape[0], info.w_shape[1]);
    info.w_bytes = info.qlayout.total_bytes();
  }
  LS_CHECK(info.w_bytes == w.bytes, w.path, ": tensor '", w.tensor, "' has ", w.bytes, " bytes in the file; '",
           name, ".weight' ", shape_str(info.w_shape), " of ", dtype_name(info.w_dtype),
           format != quant::Format::None ? std::string(" packed in ") + quant::to_string(format) : std::string(),
           " needs ", info.w_bytes);
  file_locked(w)->check(w.tensor);
  info.w_file = w;
  if (w.checksum) info.w_check = std::make_shared<ReadCheck>(*w.checksum);
  info.weight = meta_like(info.w_shape, info.w_dtype);
  if (bias.defined()) {
    LS_CHECK(bias.is_floating_point(), "layer '", name, "' has a non-float bias");
    info.b_shape = bias.sizes().vec();
    info.b_dtype = bias.scalar_type();
    if (b) {
      LS_CHECK(!bias.requires_grad(), "layer '", name, "': a bias read from its file must be frozen");
      info.b_bytes = static_cast<size_t>(bias.numel()) * bias.element_size();
      LS_CHECK(info.b_bytes == b->bytes, b->path, ": tensor '", b->tensor, "' has ", b->bytes,
               " bytes in the file; '", name, ".bias' needs ", info.b_bytes);
      file_locked(*b)->check(b->tensor);
      info.b_file = *b;
      info.bias = meta_like(info.b_shape, info.b_dtype);
    } else {
      info.bias = bias;
      info.b_host = adopt(*store_, keepalive_, info.bias, name + ".bias", &info.b_index, &info.b_bytes);
    }
  }
  return register_layer_locked(std::move(info));
}

void EngineImpl::staged_sources_locked(const LayerInfo& l, LayerSpec& s) {
  if (l.is_table()) return;
  if (l.on_disk()) {
    s.parts.clear();
    auto from_file = [&](const FileRange& r, std::shared_ptr<ReadCheck> check) {
      StagedPart p;
      p.file = file_locked(r);
      p.check = std::move(check);
      p.offset = r.offset;
      p.bytes = r.bytes;
      p.tensor = r.tensor;
      s.staged.push_back(p);
      BufferRef size_only;
      size_only.bytes = r.bytes;
      size_only.kind = MemoryKind::HostPageable;
      size_only.label = r.tensor;
      s.parts.push_back(size_only);
    };
    from_file(*l.w_file, l.w_check);
    if (l.b_file) {
      from_file(*l.b_file, nullptr);
    } else if (l.bias.defined()) {
      const BufferRef& b = store_->buffer(l.b_index);
      StagedPart p;
      p.memory = b.ptr;
      p.bytes = b.bytes;
      p.tensor = l.name + ".bias";
      s.staged.push_back(p);
      s.parts.push_back(b);
    }
    return;
  }
  // Pinned memory was wanted but the store tensor is pageable (beyond the
  // pinned cap, or pinning failed): it crosses through a pinned entry. Not a
  // trainable coded weight, whose bytes are remade just before each copy
  // (engine_coded.cpp): it is copied from where it is.
  if (l.coded) return;
  bool pageable = false;
  for (const BufferRef& p : s.parts) pageable = pageable || p.kind == MemoryKind::HostPageable;
  if (!pageable || !opts_.pin_memory || !backend_->caps().host_functions) return;
  for (const BufferRef& p : s.parts) {
    StagedPart sp;
    sp.memory = p.ptr;
    sp.bytes = p.bytes;
    sp.tensor = p.label.empty() ? l.name : p.label;
    s.staged.push_back(sp);
  }
}

uint64_t EngineImpl::staging_needed_locked(const std::vector<LayerSpec>& specs) const {
  uint64_t largest = 0, disk = 0;
  for (const LayerSpec& s : specs) {
    if (s.staged.empty()) continue;
    uint64_t bytes = 0;
    bool file = false;
    for (const StagedPart& p : s.staged) bytes = slot_layout::align(bytes + p.bytes), file = file || p.file;
    largest = std::max(largest, bytes);
    if (file) disk += bytes;
  }
  if (largest == 0) return 0;
  return std::max<uint64_t>(disk, static_cast<uint64_t>(opts_.prefetch + 2) * largest);
}

}  // namespace layerstream
