#include "runtime.h"

#include <atomic>

namespace layerstream {

const char* to_string(MemoryKind k) {
  switch (k) {
    case MemoryKind::Device: return "device";
    case MemoryKind::HostPinned: return "host-pinned";
    case MemoryKind::HostPageable: return "host-pageable";
  }
  return "?";
}

uint64_t next_buffer_id() {
  static std::atomic<uint64_t> counter{1};
  return counter.fetch_add(1, std::memory_order_relaxed);
}

void Event::record(Stream s) {
  LS_CHECK(backend_ != nullptr, "Event::record on an empty event");
  backend_->record(*this, s);
}
void Event::synchronize() const {
  LS_CHECK(backend_ != nullptr, "Event::synchronize on an empty event");
  backend_->synchronize(*this);
}
bool Event::query() const {
  LS_CHECK(backend_ != nullptr, "Event::query on an empty event");
  return backend_->query(*this);
}

void Backend::unsupported(const char* what) const {
  LS_FAIL("backend '", caps().name, "' does not support ", what);
}

BufferRef Backend::subregion(const BufferRef& parent, size_t offset, size_t bytes,
                             const std::string& label) {
  LS_CHECK(parent.ptr != nullptr, "subregion of a null buffer");
  LS_CHECK(offset <= parent.bytes && bytes <= parent.bytes - offset, "subregion [", offset, ", ",
           offset + bytes, ") is outside its parent buffer of ", parent.bytes, " bytes");
  BufferRef r;
  r.ptr = static_cast<char*>(parent.ptr) + offset;
  r.bytes = bytes;
  r.kind = parent.kind;
  r.id = next_buffer_id();
  r.label = label.empty() ? parent.label + "[" + std::to_string(offset) + "]" : label;
  return r;
}

BufferRef Backend::wrap(void* ptr, size_t bytes, MemoryKind kind, const std::string& label) {
  BufferRef r;
  r.ptr = ptr;
  r.bytes = bytes;
  r.kind = kind;
  r.id = next_buffer_id();
  r.label = label;
  return r;
}

Stream Backend::create_inline_stream(const std::string&) { unsupported("inline streams"); }
Stream Backend::wrap_stream(void*, const std::string&) { unsupported("wrapping native streams"); }
void Backend::launch_host_func(Stream, std::function<void()>) { unsupported("host functions"); }

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    reset();
    backend_ = o.backend_;
    ref_ = std::move(o.ref_);
    o.backend_ = nullptr;
    o.ref_ = BufferRef{};
  }
  return *this;
}

void DeviceBuffer::reset() {
  if (backend_ && ref_.ptr) backend_->free(ref_);
  backend_ = nullptr;
  ref_ = BufferRef{};
}

HostBuffer HostBuffer::allocate(Backend& backend, size_t bytes, bool want_pinned,
                                const std::string& label, bool* fell_back) {
  HostBuffer h;
  h.backend_ = &backend;
  if (fell_back) *fell_back = false;
  if (want_pinned && backend.caps().pinned_host_memory) {
    try {
      h.ref_ = backend.alloc_host(bytes, true, label);
      return h;
    } catch (const Error&) {
      // fall through to pageable memory
    }
  }
  if (want_pinned && fell_back) *fell_back = true;
  h.ref_ = backend.alloc_host(bytes, false, label);
  return h;
}

HostBuffer& HostBuffer::operator=(HostBuffer&& o) noexcept {
  if (this != &o) {
    reset();
    backend_ = o.backend_;
    ref_ = std::move(o.ref_);
    o.backend_ = nullptr;
    o.ref_ = BufferRef{};
  }
  return *this;
}

void HostBuffer::reset() {
  if (backend_ && ref_.ptr) backend_->free(ref_);
  backend_ = nullptr;
  ref_ = BufferRef{};
}

}  // namespace layerstream
