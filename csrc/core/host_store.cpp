#include "host_store.h"

#include <algorithm>
#include <cstring>

#include "align.h"
#include "error.h"
#include "log.h"

namespace layerstream {

HostStore::HostStore(Backend& backend, bool want_pinned, int64_t pinned_cap)
    : backend_(backend), want_pinned_(want_pinned), pinned_cap_(pinned_cap) {}

HostStore::~HostStore() {
  for (Entry& e : entries_)
    if (e.borrowed && e.borrowed.kind == MemoryKind::HostPinned) backend_.unpin_existing(e.borrowed.ptr);
}

void HostStore::share(std::shared_ptr<SharedRegion> region, bool writer, bool trainable) {
  std::lock_guard<std::mutex> lock(mu_);
  LS_CHECK(entries_.empty(), "HostStore::share must come before the first tensor");
  LS_CHECK(region != nullptr, "HostStore::share: no region");
  region_ = std::move(region);
  writer_ = writer;
  share_trainable_ = trainable;
}

uint64_t HostStore::layout_digest() const {
  std::lock_guard<std::mutex> lock(mu_);
  return digest_;
}

BufferRef HostStore::carve_locked(size_t bytes, bool pin, const std::string& name) {
  const size_t off = region_->carve(bytes);
  BufferRef r;
  r.ptr = region_->base() + off;
  r.bytes = bytes == 0 ? 1 : bytes;
  const size_t page = SharedRegion::page_size();
  r.kind = pin && backend_.pin_existing(r.ptr, round_up(r.bytes, page)) ? MemoryKind::HostPinned
                                                                                   : MemoryKind::HostPageable;
  r.id = next_buffer_id();
  r.label = name;
  const auto mix = [this](const void* p, size_t n) {
    for (size_t i = 0; i < n; ++i) digest_ = (digest_ ^ static_cast<const unsigned char*>(p)[i]) * 1099511628211ull;
  };
  mix(name.data(), name.size());
  mix(&bytes, sizeof bytes);
  mix(&off, sizeof off);
  return r;
}

size_t HostStore::add(size_t bytes, const void* src, const std::string& name, bool shareable) {
  bool fell_back = false;
  bool pin = want_pinned_;
  if (pin && pinned_cap_ >= 0) {
    std::lock_guard<std::mutex> lock(mu_);
    pin = stats_.pinned_bytes + bytes <= static_cast<uint64_t>(pinned_cap_);
  }
  if (region_ && shareable) {
    // Carved in call order (the order is the layout every sharer agrees on).
    std::lock_guard<std::mutex> lock(mu_);
    Entry e{HostBuffer(), carve_locked(bytes, pin, name), name};
    if (writer_ && src && bytes) std::memcpy(e.borrowed.ptr, src, bytes);
    (e.borrowed.kind == MemoryKind::HostPinned ? stats_.pinned_bytes : stats_.pageable_bytes) += bytes;
    stats_.shared_bytes += bytes;
    stats_.tensors++;
    entries_.push_back(std::move(e));
    return entries_.size() - 1;
  }
  // Allocate outside the lock: pinning can be slow.
  HostBuffer buf = HostBuffer::allocate(backend_, bytes == 0 ? 1 : bytes, pin, name, &fell_back);
  if (src && bytes) std::memcpy(buf.data(), src, bytes);
  std::lock_guard<std::mutex> lock(mu_);
  if (fell_back && !warned_) {
    warned_ = true;
    warn("could not allocate pinned host memory for '" + name + "' (" + std::to_string(bytes) +
         " bytes); using pageable memory for it and any further tensors that cannot be pinned. "
         "Host-to-device copies from pageable memory are slower and less asynchronous; raise the "
         "locked-memory limit (ulimit -l) or free host RAM to get pinned memory.");
  }
  if (buf.kind() == MemoryKind::HostPinned) {
    stats_.pinned_bytes += bytes;
  } else {
    stats_.pageable_bytes += bytes;
  }
  stats_.tensors++;
  entries_.push_back(Entry{std::move(buf), BufferRef{}, name});
  return entries_.size() - 1;
}

const BufferRef& HostStore::buffer(size_t index) const {
  std::lock_guard<std::mutex> lock(mu_);
  LS_CHECK(index < entries_.size(), "host store has no tensor #", index);
  return entries_[index].ref();
}

size_t HostStore::add_unclaimed(size_t bytes, const std::string& name) {
  const size_t i = add(bytes, nullptr, name);
  std::lock_guard<std::mutex> lock(mu_);
  entries_[i].unclaimed = true;
  return i;
}

int64_t HostStore::claim(const void* ptr, size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = entries_.size(); i-- > 0;) {
    Entry& e = entries_[i];
    if (e.unclaimed && e.ref().ptr == ptr && e.ref().bytes == std::max<size_t>(bytes, 1)) {
      e.unclaimed = false;
      return static_cast<int64_t>(i);
    }
  }
  return -1;
}

const std::string& HostStore::name(size_t index) const {
  std::lock_guard<std::mutex> lock(mu_);
  LS_CHECK(index < entries_.size(), "host store has no tensor #", index);
  return entries_[index].name;
}

size_t HostStore::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return entries_.size();
}

HostStoreStats HostStore::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

}  // namespace layerstream
