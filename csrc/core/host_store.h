// layerstream — host store: per-tensor host storage for streamed weights.
//
// Each tensor gets its own HostBuffer, pinned through the backend when
// possible. If pinning fails, the tensor falls back to pageable memory and
// ONE warning is issued per store (copies from pageable memory are slower
// and, on CUDA, not truly asynchronous). Bytes are accounted in stats().
//
// A store may instead carve its tensors from a region shared with this
// node's other processes (share(); docs/design/distributed.md).
//
// Ownership: the store owns every buffer it hands out; BufferRefs and data
// pointers stay valid until the store is destroyed. The caller guarantees no
// pending copy still reads a buffer when the store is destroyed.
// Thread safety: add() and the accessors may be called concurrently.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>

#include "runtime.h"
#include "shared_region.h"

namespace layerstream {

struct HostStoreStats {
  size_t tensors = 0;
  size_t pinned_bytes = 0;
  size_t pageable_bytes = 0;
  size_t shared_bytes = 0;  // of the above, in a region shared with other processes (share())
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
  ~HostStore();

  // From now on, tensors are carved from `region` (shared with the other
  // processes of this node, which add the same sizes in the same order:
  // docs/design/distributed.md). `writer`: this process fills them (add()
  // copies `src`); the others only map them (add() copies nothing).
  // `trainable`: trainable tensors are shared too (each rank then steps its
  // shard of them); else they stay private (add(shareable=false)). Call
  // before the first add().
  void share(std::shared_ptr<SharedRegion> region, bool writer, bool trainable = false);
  bool shared() const { return region_ != nullptr; }
  // Whether a tensor that is trainable (or not) goes to the shared region.
  bool shares(bool trainable) const { return region_ && (!trainable || share_trainable_); }
  // Whether `ptr` lies in the shared region.
  bool in_shared(const void* ptr) const {
    const char* p = static_cast<const char*>(ptr);
    return region_ && p >= region_->base() && p < region_->base() + region_->capacity();
  }
  // A digest of the tensors' names, sizes and offsets in order: the same in
  // every process that shares one region, or their stores disagree.
  uint64_t layout_digest() const;

  // Adds a tensor of `bytes` bytes, copying `src` into it when non-null.
  // Returns its index. The buffer is 64-byte aligned. In a shared store
  // (share()), `shareable=false` keeps it in this process's own memory (a
  // trainable weight, which this rank's optimizer writes).
  size_t add(size_t bytes, const void* src, const std::string& name, bool shareable = true);

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
    HostBuffer buf;     // owned memory; or, in a shared store:
    BufferRef borrowed;  // a range of region_
    std::string name;
    bool unclaimed = false;
    const BufferRef& ref() const { return borrowed ? borrowed : buf.ref(); }
  };
  BufferRef carve_locked(size_t bytes, bool pin, const std::string& name);
  Backend& backend_;
  bool want_pinned_;
  int64_t pinned_cap_;
  mutable std::mutex mu_;
  std::deque<Entry> entries_;  // deque: references stay valid as it grows
  HostStoreStats stats_;
  bool warned_ = false;
  std::shared_ptr<SharedRegion> region_;
  bool writer_ = true;
  bool share_trainable_ = false;
  uint64_t digest_ = 1469598103934665603ull;  // FNV-1a over (name, bytes, offset)
};

}  // namespace layerstream
