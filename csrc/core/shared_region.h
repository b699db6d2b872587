// layerstream — a host memory region shared by the processes of one node
// (torch-free). docs/design/distributed.md, "One host copy per node".
//
// The region is an anonymous memory file (memfd_create): it has no name in
// any file system, so nothing outlives the processes that map it: when the
// last one exits (or crashes), the kernel frees it. One process creates it;
// the others open it through /proc/<creator pid>/fd/<fd> while the creator
// still holds that descriptor (the creator closes it once every process has
// mapped the region: close_fd()). The file is sparse: pages cost RAM only when
// written, so the capacity can be a generous bound.
//
// carve() hands out page-aligned ranges in call order: processes that carve
// the same sizes in the same order get the same offsets, which is how the
// host stores of one node's ranks find the same tensors (HostStore::share).
// Ownership: the object owns the mapping (munmap in the destructor) and, in
// the creator until close_fd(), the descriptor. Thread safety: carve() is
// synchronised; the memory itself is the callers' to order.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

namespace layerstream {

class SharedRegion {
 public:
  // Creates a region of `capacity` bytes (rounded up to pages), mapped here.
  static std::shared_ptr<SharedRegion> create(size_t capacity, const std::string& label);
  // Maps the region another process of this machine created: its pid, its
  // descriptor number and the capacity it reported.
  static std::shared_ptr<SharedRegion> open(int64_t pid, int fd, size_t capacity);
  SharedRegion(const SharedRegion&) = delete;
  SharedRegion& operator=(const SharedRegion&) = delete;
  ~SharedRegion();

  char* base() const { return base_; }
  size_t capacity() const { return capacity_; }
  bool creator() const { return creator_; }
  int64_t pid() const { return pid_; }  // the creator's
  int fd() const { return fd_; }        // the creator's descriptor number (-1 once closed here)
  // Closes the creator's descriptor (after every process has opened it).
  void close_fd();

  // The offset of a new page-aligned range of `bytes` bytes (at least one
  // page); throws when the capacity is exhausted.
  size_t carve(size_t bytes);
  size_t used() const;

  static size_t page_size();

 private:
  SharedRegion() = default;
  char* base_ = nullptr;
  size_t capacity_ = 0;
  bool creator_ = false;
  int64_t pid_ = 0;
  int fd_ = -1;
  mutable std::mutex mu_;
  size_t used_ = 0;
};

}  // namespace layerstream
