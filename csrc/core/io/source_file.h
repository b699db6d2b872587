// layerstream — a checkpoint file that weights are read from after loading.
//
// A SourceFile keeps the file open and remembers its identity (size,
// modification time, inode) from when it was opened. Every read first checks
// that the path still names that same, unchanged file: a checkpoint rewritten
// or truncated after loading is an error naming the file and the tensor, never
// other weights (docs/design/host-tier.md, "Files change").
//
// Reads use pread() straight into the destination, one contiguous segment per
// reader thread (plain reads beat page-faulting mmap copies, and several
// sequential streams beat one; docs/design/host-tier.md, "Reading").
//
// Ownership: shared (std::shared_ptr); the descriptor closes with the last
// owner. Thread safety: all methods may be called concurrently (pread has no
// shared file position).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

namespace layerstream {
namespace optim {
class ThreadPool;
}

class SourceFile {
 public:
  // Opens `path` for reading and records its identity. Throws
  // layerstream::Error naming the file when it cannot be opened.
  static std::shared_ptr<SourceFile> open(const std::string& path);
  ~SourceFile();
  SourceFile(const SourceFile&) = delete;
  SourceFile& operator=(const SourceFile&) = delete;

  const std::string& path() const { return path_; }
  uint64_t size() const { return size_; }
  int64_t mtime_ns() const { return mtime_ns_; }

  // Throws layerstream::Error (naming the file and `tensor`) when the path no
  // longer names the file as it was at open(): replaced, truncated, grown or
  // modified (size, mtime or inode differ), or gone.
  void check(const std::string& tensor) const;

  // Reads [offset, offset + bytes) into `dst`: check(), then pread() calls of
  // `chunk_bytes`, front to back over one contiguous segment per thread of
  // `pool` (segments of at least 4 MiB; its workers and the calling thread),
  // else on the calling thread. A short read or an I/O error throws
  // layerstream::Error naming the file, the tensor and the offset.
  void read(void* dst, uint64_t offset, uint64_t bytes, const std::string& tensor,
            optim::ThreadPool* pool = nullptr, uint64_t chunk_bytes = 1ull << 20) const;
  // A process-wide pool of 4 reader threads (created on first use).
  static optim::ThreadPool& readers();

  // Asks the kernel to drop the file's pages from the page cache
  // (posix_fadvise DONTNEED): benchmarks read it cold.
  void drop_page_cache() const;

 private:
  SourceFile() = default;
  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0;
  int64_t mtime_ns_ = 0;
  uint64_t inode_ = 0, device_ = 0;
};

}  // namespace layerstream
