// layerstream — a checkpoint file that weights are read from after loading.
//
// A SourceFile keeps the file open and remembers its identity (size,
// modification time, inode, device): the one recorded when the checkpoint's
// header was read (FileIdentity, carried in FileRange), else the one it had
// when it was opened. Every read first checks that the path still names that
// same, unchanged file: a checkpoint rewritten or truncated after loading
// (even before offload() opened it) is an error naming the file and the
// tensor, never other weights (docs/design/host-tier.md, "Files change").
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
struct ReadCheck;  // checksum.h

// What a file was when it was recorded: size, modification time (ns), inode
// and device. All zero: not recorded. Plain value.
struct FileIdentity {
  uint64_t size = 0;
  int64_t mtime_ns = 0;
  uint64_t inode = 0, device = 0;
  bool recorded() const { return size != 0 || mtime_ns != 0 || inode != 0 || device != 0; }
  bool operator==(const FileIdentity& o) const {
    return size == o.size && mtime_ns == o.mtime_ns && inode == o.inode && device == o.device;
  }
  bool operator!=(const FileIdentity& o) const { return !(*this == o); }
  // The identity of the open file `fd` (fstat); throws layerstream::Error
  // naming `path` when it cannot be read.
  static FileIdentity of(int fd, const std::string& path);
};

class SourceFile {
 public:
  // Whose file it is, for what errors tell the user to do.
  enum class Kind {
    Checkpoint,  // the user's: restore it, or load the model again
    QuantCache,  // layerstream's quantization cache (core/io/quant_cache.h): offload() again
  };
  // Opens `path` for reading. Its identity is `recorded` when that is
  // recorded (e.g. when its header was read: a file changed since then fails
  // check()), else the one it has now. Throws layerstream::Error naming the
  // file when it cannot be opened.
  static std::shared_ptr<SourceFile> open(const std::string& path, const FileIdentity& recorded = {},
                                          Kind kind = Kind::Checkpoint);
  ~SourceFile();
  SourceFile(const SourceFile&) = delete;
  SourceFile& operator=(const SourceFile&) = delete;

  const std::string& path() const { return path_; }
  uint64_t size() const { return identity_.size; }
  int64_t mtime_ns() const { return identity_.mtime_ns; }
  const FileIdentity& identity() const { return identity_; }

  // Throws layerstream::Error (naming the file and `tensor`) when the open
  // file or the path is no longer the file of identity(): replaced,
  // truncated, grown or modified (size, mtime or inode differ), or gone.
  void check(const std::string& tensor) const;

  // Reads [offset, offset + bytes) into `dst`: check(), then pread() calls of
  // `chunk_bytes`, front to back over one contiguous segment per thread of
  // `pool` (segments of at least 4 MiB; its workers and the calling thread),
  // else on the calling thread. A short read or an I/O error throws
  // layerstream::Error naming the file, the tensor and the offset.
  void read(void* dst, uint64_t offset, uint64_t bytes, const std::string& tensor,
            optim::ThreadPool* pool = nullptr, uint64_t chunk_bytes = 1ull << 20) const;
  // Checks `bytes` bytes at `data`, read from this file for `tensor`, against
  // `check` unless a read already verified them (core/io/checksum.h): throws
  // layerstream::Error naming the file and the tensor on a mismatch.
  void verify(const void* data, uint64_t bytes, const std::string& tensor, ReadCheck& check) const;
  // A process-wide pool of 4 reader threads (created on first use).
  static optim::ThreadPool& readers();

  // Asks the kernel to drop the file's pages from the page cache
  // (posix_fadvise DONTNEED): benchmarks read it cold.
  void drop_page_cache() const;

 private:
  SourceFile() = default;
  std::string path_;
  int fd_ = -1;
  Kind kind_ = Kind::Checkpoint;
  FileIdentity identity_;  // what it must be (recorded, else as opened)
  FileIdentity opened_;    // what fd_ is
};

}  // namespace layerstream
