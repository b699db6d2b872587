#include "shared_region.h"

#include <cerrno>
#include <cstring>

#include "align.h"
#include "error.h"

#if defined(__linux__)
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#endif

namespace layerstream {

size_t SharedRegion::page_size() {
#if defined(__linux__)
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return page;
#else
  return 4096;
#endif
}

#if defined(__linux__)
std::shared_ptr<SharedRegion> SharedRegion::create(size_t capacity, const std::string& label) {
  const size_t cap = round_up(capacity == 0 ? 1 : capacity, page_size());
  const int fd = ::memfd_create(("layerstream-" + label).c_str(), MFD_CLOEXEC);
  LS_CHECK(fd >= 0, "cannot create the shared host store (memfd_create: ", std::strerror(errno),
           "); pass share_host_store=False to keep one host copy per process");
  if (::ftruncate(fd, static_cast<off_t>(cap)) != 0) {
    const int err = errno;
    ::close(fd);
    LS_FAIL("cannot size the shared host store to ", cap, " bytes (ftruncate: ", std::strerror(err), ")");
  }
  void* p = ::mmap(nullptr, cap, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    ::close(fd);
    LS_FAIL("cannot map the shared host store of ", cap, " bytes (mmap: ", std::strerror(err), ")");
  }
  std::shared_ptr<SharedRegion> r(new SharedRegion());
  r->base_ = static_cast<char*>(p);
  r->capacity_ = cap;
  r->creator_ = true;
  r->pid_ = static_cast<int64_t>(::getpid());
  r->fd_ = fd;
  return r;
}

std::shared_ptr<SharedRegion> SharedRegion::open(int64_t pid, int fd, size_t capacity) {
  const std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
  const int mine = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  LS_CHECK(mine >= 0, "cannot open the shared host store of process ", pid, " (", path, ": ",
           std::strerror(errno), "); the ranks of one node must run as the same user in the same "
           "PID namespace, or pass share_host_store=False");
  struct stat st {};
  if (::fstat(mine, &st) != 0 || static_cast<size_t>(st.st_size) != capacity) {
    ::close(mine);
    LS_FAIL("the shared host store of process ", pid, " has ", static_cast<long long>(st.st_size),
            " bytes, not the ", capacity, " it announced");
  }
  void* p = ::mmap(nullptr, capacity, PROT_READ | PROT_WRITE, MAP_SHARED, mine, 0);
  const int err = errno;
  ::close(mine);  // the mapping keeps the memory
  LS_CHECK(p != MAP_FAILED, "cannot map the shared host store (mmap: ", std::strerror(err), ")");
  std::shared_ptr<SharedRegion> r(new SharedRegion());
  r->base_ = static_cast<char*>(p);
  r->capacity_ = capacity;
  r->pid_ = pid;
  r->fd_ = fd;
  return r;
}

SharedRegion::~SharedRegion() {
  if (base_) ::munmap(base_, capacity_);
  if (creator_ && fd_ >= 0) ::close(fd_);
}

void SharedRegion::close_fd() {
  std::lock_guard<std::mutex> lock(mu_);
  if (creator_ && fd_ >= 0) ::close(fd_);
  fd_ = -1;
}
#else
std::shared_ptr<SharedRegion> SharedRegion::create(size_t, const std::string&) {
  LS_FAIL("a shared host store needs Linux (memfd); pass share_host_store=False");
}
std::shared_ptr<SharedRegion> SharedRegion::open(int64_t, int, size_t) {
  LS_FAIL("a shared host store needs Linux (memfd); pass share_host_store=False");
}
SharedRegion::~SharedRegion() = default;
void SharedRegion::close_fd() {}
#endif

size_t SharedRegion::carve(size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  const size_t need = round_up(bytes == 0 ? 1 : bytes, page_size());
  LS_CHECK(used_ + need <= capacity_, "the shared host store is full: ", used_, " of ", capacity_,
           " bytes used, ", need, " more asked");
  const size_t off = used_;
  used_ += need;
  return off;
}

size_t SharedRegion::used() const {
  std::lock_guard<std::mutex> lock(mu_);
  return used_;
}

}  // namespace layerstream
