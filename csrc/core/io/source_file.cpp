#include "source_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "checksum.h"
#include "core/error.h"
#include "core/optim/thread_pool.h"

namespace layerstream {

namespace {
FileIdentity identity_of(const struct stat& st) {
  FileIdentity id;
  id.size = static_cast<uint64_t>(st.st_size);
  id.mtime_ns = static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  id.inode = static_cast<uint64_t>(st.st_ino);
  id.device = static_cast<uint64_t>(st.st_dev);
  return id;
}

// What a user does about a changed or missing file of this kind.
const char* remedy(SourceFile::Kind kind) {
  return kind == SourceFile::Kind::QuantCache
             ? " layerstream's quantization cache file (cache_dir=) is not the one offload() checked: another "
               "offload() rebuilt it for a changed checkpoint, or something else wrote or removed it. Leave the "
               "files of cache_dir alone while a model uses them, and offload() again (it rebuilds the cache)"
             : " layerstream does not use weights other than those it loaded, and a file put back is another "
               "file (its inode and modification time). Load the model again (load_safetensors(), or "
               "read_checkpoint() in C++) and offload() it";
}
}  // namespace

void SourceFile::verify(const void* data, uint64_t bytes, const std::string& tensor, ReadCheck& check) const {
  if (check.verified.load(std::memory_order_acquire)) return;
  const uint64_t got = checksum64(data, bytes);
  LS_CHECK(got == check.expected, path_, ": tensor '", tensor, "' does not hold the bytes written there (checksum ",
           checksum_hex(got), ", written ", checksum_hex(check.expected), "): the file was damaged or changed in "
           "place after it was written.",
           kind_ == Kind::QuantCache ? " Delete it (it is layerstream's quantization cache file; offload() builds it "
                                       "again), and check the disk"
                                     : remedy(kind_));
  check.verified.store(true, std::memory_order_release);
}

FileIdentity FileIdentity::of(int fd, const std::string& path) {
  struct stat st {};
  LS_CHECK(::fstat(fd, &st) == 0, path, ": cannot stat: ", std::strerror(errno));
  return identity_of(st);
}

std::shared_ptr<SourceFile> SourceFile::open(const std::string& path, const FileIdentity& recorded, Kind kind) {
  std::shared_ptr<SourceFile> f(new SourceFile());
  f->path_ = path;
  f->kind_ = kind;
  // O_NONBLOCK: a FIFO put under the name does not block the open (no effect
  // on a regular file's reads); it is refused below.
  f->fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  LS_CHECK(f->fd_ >= 0, path, ": cannot open for reading: ", std::strerror(errno));
  struct stat st {};
  LS_CHECK(::fstat(f->fd_, &st) == 0 && S_ISREG(st.st_mode), path, ": not a regular file (a FIFO, socket, "
           "device or directory); weights are read from regular files only.", remedy(kind));
  f->opened_ = FileIdentity::of(f->fd_, path);
  f->identity_ = recorded.recorded() ? recorded : f->opened_;
  return f;
}

SourceFile::~SourceFile() {
  if (fd_ >= 0) ::close(fd_);
}

void SourceFile::check(const std::string& tensor) const {
  struct stat st {};
  if (::stat(path_.c_str(), &st) != 0)
    LS_FAIL(path_, ": the file is gone (", std::strerror(errno), "); tensor '", tensor, "' is read from it.",
            remedy(kind_));
  const FileIdentity now = identity_of(st);
  if (now == identity_ && opened_ == identity_) return;
  const FileIdentity& seen = now != identity_ ? now : opened_;  // the one that differs
  LS_FAIL(path_, ": the file changed after it was loaded (size ", identity_.size, " -> ", seen.size, " bytes",
          seen.mtime_ns != identity_.mtime_ns ? ", modification time differs" : "",
          seen.inode != identity_.inode || seen.device != identity_.device ? ", another file now has its name" : "",
          "); tensor '", tensor, "' is read from it on every use.", remedy(kind_));
}

void SourceFile::read(void* dst, uint64_t offset, uint64_t bytes, const std::string& tensor,
                      optim::ThreadPool* pool, uint64_t chunk_bytes) const {
  check(tensor);
  const uint64_t size = identity_.size;
  LS_CHECK(offset <= size && bytes <= size - offset, path_, ": tensor '", tensor, "' (", bytes,
           " bytes at offset ", offset, ") lies past the end of the file (", size, " bytes): truncated?");
  if (bytes == 0) return;
  chunk_bytes = std::max<uint64_t>(chunk_bytes, 4096);
  // One contiguous segment per thread, each read front to back in chunks: every
  // thread's reads are sequential (the kernel's readahead follows them), and the
  // segments keep several requests in flight (docs/design/host-tier.md, "Reading").
  const uint64_t min_segment = 4ull << 20;
  const int64_t segments = pool ? static_cast<int64_t>(std::max<uint64_t>(
                                      1, std::min<uint64_t>(pool->threads(), bytes / min_segment)))
                                : 1;
  const uint64_t per = (bytes + static_cast<uint64_t>(segments) - 1) / static_cast<uint64_t>(segments);
  char* out = static_cast<char*>(dst);
  auto one = [&](int64_t seg) {
    uint64_t at = static_cast<uint64_t>(seg) * per;
    const uint64_t end = std::min(bytes, at + per);
    while (at < end) {
      const size_t want = static_cast<size_t>(std::min(end - at, chunk_bytes));
      const ssize_t got = ::pread(fd_, out + at, want, static_cast<off_t>(offset + at));
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0)
        LS_FAIL(path_, ": reading tensor '", tensor, "' failed at offset ", offset + at, ": ",
                got < 0 ? std::strerror(errno) : "unexpected end of file (truncated?)");
      at += static_cast<uint64_t>(got);
    }
  };
  if (segments > 1) {
    pool->run(segments, one);
  } else {
    one(0);
  }
}

optim::ThreadPool& SourceFile::readers() {
  static optim::ThreadPool* pool = new optim::ThreadPool(4);  // never destroyed (see thread_pool.h)
  return *pool;
}

void SourceFile::drop_page_cache() const {
#ifdef POSIX_FADV_DONTNEED
  ::posix_fadvise(fd_, 0, 0, POSIX_FADV_DONTNEED);
#endif
}

}  // namespace layerstream
