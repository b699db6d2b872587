// layerstream — the runtime interface every backend implements.
//
// This header is torch-free and CUDA-free. It describes a device with
// asynchronous streams, CUDA-like events, device and host buffers and async
// copies. Two backends implement it: `sim` (a simulated device, see
// backends/sim/sim_backend.h) and `cuda` (backends/cuda/cuda_backend.h).
//
// Semantics (the same on every backend, modelled on CUDA):
//  * A Stream executes the operations enqueued on it in FIFO order,
//    asynchronously with respect to the host. Streams of one backend run
//    concurrently with each other unless ordered by events.
//  * An Event marks a point in a stream. record(ev, s) captures "everything
//    enqueued on s so far"; re-recording creates a new version and later
//    waits refer to the newest version at the time the wait is enqueued.
//    wait(s, ev) makes all later work on s wait for that version (no-op if the
//    event was never recorded). synchronize(ev) blocks the calling host
//    thread; query(ev) returns whether the version has completed.
//  * Host memory handed to copy_async must stay alive and untouched by the
//    host until the copy is known to be complete (event sync or query).
//  * Buffers are plain handles (BufferRef); ownership is by whoever allocated
//    them, and they are released with Backend::free. DeviceBuffer/HostBuffer
//    below are RAII owners.
//
// Ordering checker: backends that can (caps().ordering_checker) track every
// access to every buffer, tagged with the stream (or the host) that made it,
// and report an access that is not ordered after the previous conflicting
// access (by stream order, event waits or host waits). Copies declare their
// own accesses; compute that reads or writes a buffer declares it with
// declare_access / declare_host_access.
//
// Thread safety: all Backend methods may be called from any thread
// concurrently. Stream is a value (copyable). Event is move-only; one Event
// object must not be used by two threads at once without external locking.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "error.h"

namespace layerstream {

class Backend;

enum class MemoryKind : uint8_t { Device, HostPinned, HostPageable };
const char* to_string(MemoryKind k);

enum class Access : uint8_t { Read, Write };

// What a backend can do. Optional operations fail with a clear
// "backend X does not support Y" error when the capability is false.
struct Capabilities {
  std::string name;                 // "sim" or "cuda"
  bool pinned_host_memory = false;  // alloc_host(pinned=true) can succeed
  bool host_functions = false;      // launch_host_func is supported
  bool inline_streams = false;      // create_inline_stream is supported
  bool wrap_native_streams = false; // wrap_stream(void*) is supported
  bool ordering_checker = false;    // accesses are checked (see above)
  bool simulated = false;           // true for the sim device
  size_t device_memory_bytes = 0;   // total device memory (0 = unknown)
};

// A non-owning handle to a buffer (or a tracked sub-region of one).
// `id` identifies the region for the ordering checker; two BufferRefs with
// the same id are the same region. A default BufferRef is null.
struct BufferRef {
  void* ptr = nullptr;
  size_t bytes = 0;
  MemoryKind kind = MemoryKind::Device;
  uint64_t id = 0;
  std::string label;  // for error messages; may be empty

  explicit operator bool() const { return ptr != nullptr; }
  bool is_host() const { return kind != MemoryKind::Device; }
};

// A stream handle: a value, cheap to copy, does not own the stream. Valid
// while its backend lives and until Backend::destroy_stream.
class Stream {
 public:
  Stream() = default;
  Stream(Backend* backend, uint64_t id, void* native = nullptr)
      : backend_(backend), id_(id), native_(native) {}
  Backend* backend() const { return backend_; }
  uint64_t id() const { return id_; }
  // Backend-native handle (cudaStream_t for cuda, nullptr for sim).
  void* native() const { return native_; }
  explicit operator bool() const { return backend_ != nullptr; }
  bool operator==(const Stream& o) const { return backend_ == o.backend_ && id_ == o.id_; }
  bool operator!=(const Stream& o) const { return !(*this == o); }

 private:
  Backend* backend_ = nullptr;
  uint64_t id_ = 0;
  void* native_ = nullptr;
};

// The backend-specific state of an event. Backends subclass it.
struct EventImpl {
  virtual ~EventImpl() = default;
};

// A move-only event handle. Destroying an event that is still pending is
// safe (the backend keeps what it needs until the work completes).
class Event {
 public:
  Event() = default;
  Event(Backend* backend, std::unique_ptr<EventImpl> impl)
      : backend_(backend), impl_(std::move(impl)) {}
  Event(Event&&) noexcept = default;
  Event& operator=(Event&&) noexcept = default;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  explicit operator bool() const { return impl_ != nullptr; }
  Backend* backend() const { return backend_; }
  EventImpl* impl() const { return impl_.get(); }

  // Conveniences forwarding to the backend.
  void record(Stream s);
  void synchronize() const;
  bool query() const;

 private:
  Backend* backend_ = nullptr;
  std::unique_ptr<EventImpl> impl_;
};

// Device memory accounting of a backend (a snapshot).
struct MemoryStats {
  size_t device_bytes_in_use = 0;  // bytes handed out by alloc_device (as requested)
  size_t device_bytes_peak = 0;    // high-water mark of device_bytes_in_use
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const Capabilities& caps() const = 0;
  // Thread-safe.
  virtual MemoryStats memory_stats() const = 0;

  // ---- memory ----
  // Device memory. Throws layerstream::Error when out of memory.
  virtual BufferRef alloc_device(size_t bytes, const std::string& label = {}) = 0;
  // Host memory. With pinned=true the backend tries page-locked memory and
  // throws if it cannot; callers wanting a fallback use HostBuffer::allocate.
  virtual BufferRef alloc_host(size_t bytes, bool pinned, const std::string& label = {}) = 0;
  // Registers existing host memory as pinned (cudaHostRegister) if possible;
  // returns false (and changes nothing) when it cannot.
  virtual bool pin_existing(void* ptr, size_t bytes) { (void)ptr; (void)bytes; return false; }
  virtual void unpin_existing(void* ptr) { (void)ptr; }
  // The address at which kernels on this backend's device read the host
  // memory `host` directly (pinned memory mapped into the device's address
  // space: cudaHostGetDevicePointer), or nullptr when they cannot (pageable
  // memory; the sim device, whose computations run on the host anyway). Such
  // reads cross the bus when the kernel runs: the memory must stay alive and
  // unwritten by the host until that work is done (record an event after it).
  virtual void* device_address_of_host(const BufferRef& host) { (void)host; return nullptr; }
  // Frees memory from alloc_device/alloc_host. The caller guarantees that no
  // pending work still uses it (synchronize the events that used it first).
  virtual void free(const BufferRef& buf) = 0;
  // A tracked sub-region [offset, offset+bytes) of `parent` with its own
  // checker id. The sub-region is not owned; do not free it.
  virtual BufferRef subregion(const BufferRef& parent, size_t offset, size_t bytes,
                              const std::string& label = {});
  // Wraps memory the backend did not allocate (e.g. a framework tensor) so
  // that it can be used in copies and tracked. Not owned; do not free it.
  virtual BufferRef wrap(void* ptr, size_t bytes, MemoryKind kind, const std::string& label = {});
  // Forgets a buffer from wrap() once its owner is done with it (the framework
  // frees or reuses the memory): a checking backend drops what it recorded about
  // it, which otherwise stays for the backend's life. The caller guarantees that
  // no pending work still uses it. No-op by default.
  virtual void unwrap(const BufferRef& buf) { (void)buf; }

  // ---- streams ----
  virtual Stream create_stream(const std::string& name) = 0;
  // A stream whose operations run synchronously on the calling host thread:
  // wait(s, ev) blocks the caller. Its accesses count as host accesses.
  // Only where caps().inline_streams.
  virtual Stream create_inline_stream(const std::string& name);
  // Wraps a native stream (cudaStream_t) owned by someone else.
  virtual Stream wrap_stream(void* native, const std::string& name);
  virtual void destroy_stream(Stream s) = 0;
  // Blocks the calling thread until all work enqueued on s so far is done.
  virtual void synchronize(Stream s) = 0;

  // ---- copies ----
  // Copies `bytes` from src+src_offset to dst+dst_offset, in stream order.
  virtual void copy_async(const BufferRef& dst, size_t dst_offset, const BufferRef& src,
                          size_t src_offset, size_t bytes, Stream s) = 0;

  // ---- events ----
  virtual Event create_event() = 0;
  virtual void record(Event& ev, Stream s) = 0;
  virtual void wait(Stream s, const Event& ev) = 0;
  virtual void synchronize(const Event& ev) = 0;
  virtual bool query(const Event& ev) = 0;

  // ---- work on a stream ----
  // Runs fn on the stream, in order (like cudaLaunchHostFunc). fn must not
  // call back into the backend on the same stream. Only where
  // caps().host_functions.
  virtual void launch_host_func(Stream s, std::function<void()> fn);

  // ---- ordering checker ----
  // Declares that work enqueued next on `s` reads/writes `buf`. A no-op on
  // backends without the checker.
  virtual void declare_access(const BufferRef& buf, Access a, Stream s, const std::string& what) {
    (void)buf; (void)a; (void)s; (void)what;
  }
  // Declares that the host (the calling thread) reads/writes `buf` now.
  virtual void declare_host_access(const BufferRef& buf, Access a, const std::string& what) {
    (void)buf; (void)a; (void)what;
  }
  // Ordering errors found so far (empty without the checker).
  virtual std::vector<std::string> ordering_errors() const { return {}; }
  virtual void clear_ordering_errors() {}

 protected:
  [[noreturn]] void unsupported(const char* what) const;
};

// RAII owner of a device buffer.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(Backend& backend, size_t bytes, const std::string& label = {})
      : backend_(&backend), ref_(backend.alloc_device(bytes, label)) {}
  DeviceBuffer(DeviceBuffer&& o) noexcept { *this = std::move(o); }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { reset(); }
  void reset();
  const BufferRef& ref() const { return ref_; }
  void* data() const { return ref_.ptr; }
  size_t bytes() const { return ref_.bytes; }

 private:
  Backend* backend_ = nullptr;
  BufferRef ref_;
};

// RAII owner of host memory: pinned through the backend when possible, else
// pageable (aligned to 64 bytes). `kind()` says which one was obtained.
class HostBuffer {
 public:
  HostBuffer() = default;
  // Tries pinned memory when want_pinned; on failure falls back to pageable
  // memory and sets *fell_back (if given) to true.
  static HostBuffer allocate(Backend& backend, size_t bytes, bool want_pinned,
                             const std::string& label = {}, bool* fell_back = nullptr);
  HostBuffer(HostBuffer&& o) noexcept { *this = std::move(o); }
  HostBuffer& operator=(HostBuffer&& o) noexcept;
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  ~HostBuffer() { reset(); }
  void reset();
  const BufferRef& ref() const { return ref_; }
  void* data() const { return ref_.ptr; }
  size_t bytes() const { return ref_.bytes; }
  MemoryKind kind() const { return ref_.kind; }

 private:
  Backend* backend_ = nullptr;
  BufferRef ref_;
};

// Monotonic ids for checker regions, shared by all backends.
uint64_t next_buffer_id();

}  // namespace layerstream
