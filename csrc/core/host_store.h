// layerstream — host store: per-tensor host storage for streamed weights.
//
// Each tensor gets its own HostBuffer, pinned through the backend when
// possible. If pinning fails, the tensor falls back to pageable memory and
// ONE warning is issued per store (copies from pageable memory are slower
// and, on CUDA, not truly asynchronous). Bytes are accounted in stats().
//
// Ownership: the store owns every buffer it hands out; BufferRefs and data
// pointers stay valid until the store is destroyed. The caller guarantees no
// pending copy still reads a buffer when the store is destroyed.
// Thread safety: add() and the accessors may be called concurrently.
#pragma once

#include <deque>
#include <mutex>
#include <string>

#include "runtime.h"

namespace layerstream {

struct HostStoreStats {
  size_t tensors = 0;
  size_t pinned_bytes = 0;
  size_t pageable_bytes = 0;
  size_t total_bytes() const { return pinned_bytes + pageable_bytes; }
};

class HostStore {
 public:
  // want_pinned=false stores everything in pageable memory (no warning).
  // pinned_cap >= 0: at most that many bytes are pinned; tensors beyond it
  // are pageable (no warning: the host budget asked for it).
  explicit HostStore(Backend& backend, bool want_pinned = true, int64_t pinned_cap = -1);
  HostStore(const HostStore&) = delete;
  HostStore& operator=(const HostStore&) = delete;

  // Adds a tensor of `bytes` bytes, copying `src` into it when non-null.
  // Returns its index. The buffer is 64-byte aligned.
  size_t add(size_t bytes, const void* src, const std::string& name);

  const BufferRef& buffer(size_t index) const;
  // Adds a tensor of `bytes` bytes for the caller to fill, to be claimed
  // by claim() (a tensor read from a file straight into the store).
  size_t add_unclaimed(size_t bytes, const std::string& name);
  // The index of the unclaimed tensor (add_unclaimed) whose buffer starts at
  // `ptr` with `bytes` bytes, now claimed; -1 if there is none.
  int64_t claim(const void* ptr, size_t bytes);
  const std::string& name(size_t index) const;
  size_t size() const;
  HostStoreStats stats() const;

 private:
  struct Entry {
    HostBuffer buf;
    std::string name;
    bool unclaimed = false;
  };
  Backend& backend_;
  bool want_pinned_;
  int64_t pinned_cap_;
  mutable std::mutex mu_;
  std::deque<Entry> entries_;  // deque: references stay valid as it grows
  HostStoreStats stats_;
  bool warned_ = false;
};

}  // namespace layerstream
