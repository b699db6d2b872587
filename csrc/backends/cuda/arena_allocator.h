// layerstream — the first-fit range allocator behind CudaOptions::arena_bytes.
//
// Plain C++ (no CUDA), so that it is tested without a GPU
// (tests/cpp/test_cuda_backend.cpp, NoGpu.Arena*). Not locked: CudaBackend
// calls it under its own mutex.
#pragma once

#include <algorithm>
#include <cstddef>
#include <iterator>
#include <map>

#include "core/error.h"

namespace layerstream {
namespace detail {

// First-fit allocator over [0, size) with a free list ordered by offset;
// freed blocks coalesce with their neighbours.
class ArenaAllocator {
 public:
  void reset(size_t size) {
    free_.clear();
    size_ = size;
    free_bytes_ = size;
    if (size > 0) free_[0] = size;
  }
  // Takes the lowest-addressed free block of at least `bytes` (callers round
  // `bytes` up to their alignment; offsets then keep it). Returns false when
  // no block fits.
  bool allocate(size_t bytes, size_t* offset) {
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second < bytes) continue;
      size_t off = it->first;
      size_t rest = it->second - bytes;
      free_.erase(it);
      if (rest > 0) free_[off + bytes] = rest;
      free_bytes_ -= bytes;
      *offset = off;
      return true;
    }
    return false;
  }
  // Returns [offset, offset + bytes), which allocate() handed out.
  void release(size_t offset, size_t bytes) {
    LS_INTERNAL_CHECK(offset <= size_ && bytes <= size_ - offset,
                      "arena block released outside the arena");
    size_t start = offset;
    size_t len = bytes;
    auto next = free_.lower_bound(offset);
    LS_INTERNAL_CHECK(next == free_.end() || next->first >= offset + bytes,
                      "arena block released twice or overlapping a free block");
    if (next != free_.begin()) {
      auto prev = std::prev(next);
      LS_INTERNAL_CHECK(prev->first + prev->second <= offset, "arena block overlaps a free block");
      if (prev->first + prev->second == offset) {
        start = prev->first;
        len += prev->second;
        free_.erase(prev);
      }
    }
    if (next != free_.end() && next->first == offset + bytes) {
      len += next->second;
      free_.erase(next);
    }
    free_[start] = len;
    free_bytes_ += bytes;
  }
  size_t size() const { return size_; }
  size_t free_bytes() const { return free_bytes_; }
  size_t largest_free_block() const {
    size_t best = 0;
    for (const auto& kv : free_) best = std::max(best, kv.second);
    return best;
  }
  size_t free_blocks() const { return free_.size(); }

 private:
  std::map<size_t, size_t> free_;  // offset -> size
  size_t size_ = 0;
  size_t free_bytes_ = 0;
};

}  // namespace detail
}  // namespace layerstream
