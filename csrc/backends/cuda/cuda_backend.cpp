// layerstream — the CUDA runtime backend (see cuda_backend.h).
//
// The only file of the backend that includes cuda_runtime.h.
#include "backends/cuda/cuda_backend.h"

#include "backends/cuda/arena_allocator.h"
#include "core/align.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <iterator>
#include <map>
#include <mutex>
#include <unordered_map>
#include <utility>

namespace layerstream {
namespace {

// Clears the calling thread's last-error slot if it holds `err` (the error a
// call just returned), so that a reported, non-sticky error does not leak into
// unrelated cudaGetLastError() checks (e.g. a framework's launch checks).
// Sticky errors (a corrupted context) cannot be cleared and stay visible.
void clear_error(cudaError_t err) {
  if (err != cudaSuccess && cudaPeekAtLastError() == err) (void)cudaGetLastError();
}

void check_cuda(cudaError_t err, const char* call, const char* file, int line,
                const std::string& context = {}) {
  if (err == cudaSuccess) return;
  clear_error(err);
  std::string msg = detail::compose("CUDA call ", call, " failed: ", cudaGetErrorString(err), " (",
                                    cudaGetErrorName(err), ")");
  if (!context.empty()) msg += "; " + context;
  detail::fail(file, line, std::move(msg));
}

}  // namespace
}  // namespace layerstream

// LS_CUDA_CHECK(call): throws layerstream::Error naming the call and the CUDA
// error string when call does not return cudaSuccess.
#define LS_CUDA_CHECK(call) ::layerstream::check_cuda((call), #call, __FILE__, __LINE__)
// LS_CUDA_CHECK_CTX(call, parts...): the same with a composed context sentence.
#define LS_CUDA_CHECK_CTX(call, ...)                                     \
  do {                                                                  \
    cudaError_t ls_cuda_err_ = (call);                                  \
    if (ls_cuda_err_ != cudaSuccess) {                                  \
      ::layerstream::check_cuda(ls_cuda_err_, #call, __FILE__, __LINE__, \
                                ::layerstream::detail::compose(__VA_ARGS__)); \
    }                                                                   \
  } while (0)

namespace layerstream {
namespace {

constexpr size_t kArenaAlign = 256;
constexpr size_t kHostAlign = 64;

// Makes `device` current for the calling thread for the guard's lifetime and
// restores the previous device afterwards (framework code on the same thread
// keeps its own notion of the current device).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    int cur = -1;
    cudaError_t e = cudaGetDevice(&cur);
    if (e != cudaSuccess) {
      clear_error(e);
      cur = -1;
    }
    if (cur != device) {
      LS_CUDA_CHECK_CTX(cudaSetDevice(device), "selecting CUDA device ", device);
      prev_ = cur;
    }
  }
  ~DeviceGuard() {
    if (prev_ >= 0) clear_error(cudaSetDevice(prev_));
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = -1;
};

std::string describe(const BufferRef& b) {
  std::string s = b.label.empty() ? std::string("(unnamed)") : "'" + b.label + "'";
  return s + " [" + to_string(b.kind) + ", " + std::to_string(b.bytes) + " bytes]";
}

std::string quoted(const std::string& label) {
  return label.empty() ? std::string("(unnamed)") : "'" + label + "'";
}

using detail::ArenaAllocator;

struct CudaEventImpl : EventImpl {
  cudaEvent_t event = nullptr;
  bool timing = false;
  std::atomic<bool> recorded{false};
  ~CudaEventImpl() override {
    // Destroying an event with pending work is fine: CUDA defers the release.
    if (event) clear_error(cudaEventDestroy(event));
  }
};

struct StreamEntry {
  cudaStream_t handle = nullptr;
  bool owned = false;
  std::string name;
};

struct Allocation {
  uint64_t id = 0;
  size_t bytes = 0;         // as requested
  MemoryKind kind = MemoryKind::Device;
  bool in_arena = false;
  size_t arena_offset = 0;
  size_t arena_bytes = 0;   // rounded size inside the arena
};

// Exceptions from host functions; shared with in-flight trampolines so that it
// outlives the backend if needed.
struct HostFnErrors {
  std::mutex mu;
  std::vector<std::string> messages;
};

struct HostFnPayload {
  std::function<void()> fn;
  std::shared_ptr<HostFnErrors> errors;
};

void CUDART_CB host_fn_trampoline(void* user_data) {
  std::unique_ptr<HostFnPayload> payload(static_cast<HostFnPayload*>(user_data));
  std::string what;
  try {
    payload->fn();
    return;
  } catch (const std::exception& e) {
    what = e.what();
  } catch (...) {
    what = "unknown exception";
  }
  std::fprintf(stderr, "[layerstream] a host function launched on a CUDA stream threw: %s\n",
               what.c_str());
  std::lock_guard<std::mutex> lock(payload->errors->mu);
  payload->errors->messages.push_back(std::move(what));
}

}  // namespace

bool cuda_device_available(int* count) noexcept {
  int n = 0;
  try {
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
      clear_error(e);
      n = 0;
    }
  } catch (...) {
    n = 0;
  }
  if (count) *count = n;
  return n > 0;
}

struct CudaBackend::State {
  CudaBackend* owner = nullptr;
  CudaOptions opts;
  Capabilities caps;

  mutable std::mutex mu;  // guards everything below; never held across a blocking CUDA call
  std::unordered_map<uint64_t, StreamEntry> streams;
  uint64_t next_stream_id = 1;
  std::unordered_map<void*, Allocation> allocs;
  std::unordered_map<void*, size_t> registered;  // pin_existing ptr -> bytes
  char* arena_base = nullptr;
  ArenaAllocator arena;

  size_t device_in_use = 0;
  size_t device_peak = 0;
  size_t pinned = 0;
  size_t pinned_registered = 0;
  size_t pageable = 0;

  std::shared_ptr<HostFnErrors> host_errors = std::make_shared<HostFnErrors>();

  cudaStream_t resolve(const Stream& s, const char* op) const {
    LS_CHECK(static_cast<bool>(s), op, ": the stream is null; create one with create_stream");
    LS_CHECK(s.backend() == owner, op, ": stream ", s.id(),
             " belongs to another backend, not to this CUDA backend");
    std::lock_guard<std::mutex> lock(mu);
    auto it = streams.find(s.id());
    LS_CHECK(it != streams.end(), op, ": stream ", s.id(),
             " is not a live stream of this CUDA backend (was it destroyed?)");
    return it->second.handle;
  }

  CudaEventImpl* event_of(const Event& ev, const char* op) const {
    LS_CHECK(static_cast<bool>(ev), op, ": the event is empty; create one with create_event");
    LS_CHECK(ev.backend() == owner, op, ": the event belongs to another backend");
    auto* impl = dynamic_cast<CudaEventImpl*>(ev.impl());
    LS_INTERNAL_CHECK(impl != nullptr, "event of the CUDA backend without a CUDA event");
    return impl;
  }

  Event make_event(bool timing) {
    DeviceGuard guard(opts.device);
    auto impl = std::make_unique<CudaEventImpl>();
    impl->timing = timing;
    if (timing) {
      LS_CUDA_CHECK(cudaEventCreateWithFlags(&impl->event, cudaEventDefault));
    } else {
      LS_CUDA_CHECK(cudaEventCreateWithFlags(&impl->event, cudaEventDisableTiming));
    }
    return Event(owner, std::move(impl));
  }

  void add_device_bytes(size_t bytes) {
    device_in_use += bytes;
    device_peak = std::max(device_peak, device_in_use);
  }
};

CudaBackend::CudaBackend(CudaOptions options) : st_(std::make_unique<State>()) {
  st_->owner = this;
  st_->opts = options;
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    clear_error(e);
    LS_FAIL("no CUDA device visible (cudaGetDeviceCount: ", cudaGetErrorString(e),
            "); the cuda backend needs an NVIDIA GPU and a working driver; use the sim backend "
            "on machines without one");
  }
  LS_CHECK(count > 0, "no CUDA device visible; the cuda backend needs an NVIDIA GPU; use the sim "
           "backend on machines without one");
  LS_CHECK(options.device >= 0 && options.device < count, "CudaOptions::device = ", options.device,
           " is out of range: ", count, " CUDA device(s) visible (valid: 0..", count - 1, ")");

  DeviceGuard guard(options.device);
  size_t free_bytes = 0, total_bytes = 0;
  LS_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));

  Capabilities& c = st_->caps;
  c.name = "cuda";
  c.pinned_host_memory = true;
  c.host_functions = true;
  c.inline_streams = false;
  c.wrap_native_streams = true;
  c.ordering_checker = false;
  c.simulated = false;
  c.device_memory_bytes = total_bytes;

  if (options.arena_bytes > 0) {
    void* base = nullptr;
    LS_CUDA_CHECK_CTX(cudaMalloc(&base, options.arena_bytes), "allocating the device arena of ",
                      options.arena_bytes, " bytes (CudaOptions::arena_bytes) on device ",
                      options.device, " with ", free_bytes, " of ", total_bytes,
                      " bytes free; lower arena_bytes");
    st_->arena_base = static_cast<char*>(base);
    st_->arena.reset(options.arena_bytes);
  }
}

CudaBackend::~CudaBackend() {
  // Best effort and noexcept: errors here are cleared, not thrown.
  State& st = *st_;
  int prev = -1;
  cudaError_t get_err = cudaGetDevice(&prev);
  if (get_err != cudaSuccess) {
    clear_error(get_err);
    prev = -1;
  }
  clear_error(cudaSetDevice(st.opts.device));
  for (auto& kv : st.streams) {
    if (!kv.second.owned) continue;
    clear_error(cudaStreamSynchronize(kv.second.handle));
    clear_error(cudaStreamDestroy(kv.second.handle));
  }
  st.streams.clear();
  for (auto& kv : st.allocs) {
    const Allocation& a = kv.second;
    switch (a.kind) {
      case MemoryKind::Device:
        if (!a.in_arena) clear_error(cudaFree(kv.first));
        break;
      case MemoryKind::HostPinned: clear_error(cudaFreeHost(kv.first)); break;
      case MemoryKind::HostPageable: std::free(kv.first); break;
    }
  }
  st.allocs.clear();
  for (auto& kv : st.registered) clear_error(cudaHostUnregister(kv.first));
  st.registered.clear();
  if (st.arena_base) clear_error(cudaFree(st.arena_base));
  st.arena_base = nullptr;
  if (prev >= 0) clear_error(cudaSetDevice(prev));
}

const Capabilities& CudaBackend::caps() const { return st_->caps; }
int CudaBackend::device() const { return st_->opts.device; }
const CudaOptions& CudaBackend::options() const { return st_->opts; }

// ---------------------------------------------------------------- memory

BufferRef CudaBackend::alloc_device(size_t bytes, const std::string& label) {
  State& st = *st_;
  Allocation a;
  a.id = next_buffer_id();
  a.bytes = bytes;
  a.kind = MemoryKind::Device;
  void* ptr = nullptr;
  if (st.arena_base) {
    LS_CHECK(bytes <= SIZE_MAX - kArenaAlign, "alloc_device: ", bytes, " bytes is too large");
    size_t rounded = round_up(std::max<size_t>(bytes, 1), kArenaAlign);
    std::lock_guard<std::mutex> lock(st.mu);
    size_t offset = 0;
    LS_CHECK(st.arena.allocate(rounded, &offset), "CUDA device arena out of memory: cannot allocate ",
             bytes, " bytes for ", quoted(label), " (", rounded, " with ", kArenaAlign,
             "-byte alignment); the arena of ", st.arena.size(), " bytes has ",
             st.arena.free_bytes(), " bytes free, the largest free block is ",
             st.arena.largest_free_block(),
             " bytes. Raise CudaOptions::arena_bytes or free device buffers first");
    a.in_arena = true;
    a.arena_offset = offset;
    a.arena_bytes = rounded;
    ptr = st.arena_base + offset;
    st.allocs[ptr] = a;
    st.add_device_bytes(bytes);
  } else {
    DeviceGuard guard(st.opts.device);
    cudaError_t e = cudaMalloc(&ptr, std::max<size_t>(bytes, 1));
    if (e != cudaSuccess) {
      clear_error(e);
      size_t free_bytes = 0, total_bytes = 0;
      clear_error(cudaMemGetInfo(&free_bytes, &total_bytes));
      check_cuda(e, "cudaMalloc(&ptr, bytes)", __FILE__, __LINE__,
                 detail::compose("allocating ", bytes, " bytes of device memory for ",
                                 quoted(label), " on device ", st.opts.device, " (", free_bytes,
                                 " of ", total_bytes, " bytes free)"));
    }
    std::lock_guard<std::mutex> lock(st.mu);
    st.allocs[ptr] = a;
    st.add_device_bytes(bytes);
  }
  BufferRef r;
  r.ptr = ptr;
  r.bytes = bytes;
  r.kind = MemoryKind::Device;
  r.id = a.id;
  r.label = label;
  return r;
}

BufferRef CudaBackend::alloc_host(size_t bytes, bool pinned, const std::string& label) {
  State& st = *st_;
  Allocation a;
  a.id = next_buffer_id();
  a.bytes = bytes;
  void* ptr = nullptr;
  if (pinned) {
    a.kind = MemoryKind::HostPinned;
    DeviceGuard guard(st.opts.device);
    LS_CUDA_CHECK_CTX(cudaHostAlloc(&ptr, std::max<size_t>(bytes, 1), cudaHostAllocPortable),
                      "allocating ", bytes, " bytes of pinned host memory for ", quoted(label),
                      " (use HostBuffer::allocate for a pageable fallback, or pinned=false)");
  } else {
    a.kind = MemoryKind::HostPageable;
    LS_CHECK(bytes <= SIZE_MAX - kHostAlign, "alloc_host: ", bytes, " bytes is too large");
    size_t rounded = round_up(std::max<size_t>(bytes, 1), kHostAlign);
    ptr = std::aligned_alloc(kHostAlign, rounded);
    LS_CHECK(ptr != nullptr, "out of host memory: cannot allocate ", bytes,
             " bytes of pageable host memory for ", quoted(label));
  }
  {
    std::lock_guard<std::mutex> lock(st.mu);
    st.allocs[ptr] = a;
    if (pinned) st.pinned += bytes;
    else st.pageable += bytes;
  }
  BufferRef r;
  r.ptr = ptr;
  r.bytes = bytes;
  r.kind = a.kind;
  r.id = a.id;
  r.label = label;
  return r;
}

bool CudaBackend::pin_existing(void* ptr, size_t bytes) {
  State& st = *st_;
  if (ptr == nullptr || bytes == 0) return false;
  {
    std::lock_guard<std::mutex> lock(st.mu);
    if (st.registered.count(ptr)) return false;
  }
  DeviceGuard guard(st.opts.device);
  cudaError_t e = cudaHostRegister(ptr, bytes, cudaHostRegisterPortable);
  if (e != cudaSuccess) {
    clear_error(e);
    return false;
  }
  std::lock_guard<std::mutex> lock(st.mu);
  st.registered[ptr] = bytes;
  st.pinned += bytes;
  st.pinned_registered += bytes;
  return true;
}

void CudaBackend::unpin_existing(void* ptr) {
  State& st = *st_;
  size_t bytes = 0;
  {
    std::lock_guard<std::mutex> lock(st.mu);
    auto it = st.registered.find(ptr);
    LS_CHECK(it != st.registered.end(), "unpin_existing(", ptr,
             "): this memory was not registered by pin_existing on this CUDA backend");
    bytes = it->second;
    st.registered.erase(it);
    st.pinned -= bytes;
    st.pinned_registered -= bytes;
  }
  DeviceGuard guard(st.opts.device);
  LS_CUDA_CHECK_CTX(cudaHostUnregister(ptr), "unregistering ", bytes, " bytes at ", ptr);
}

void* CudaBackend::device_address_of_host(const BufferRef& host) {
  if (host.ptr == nullptr || host.kind != MemoryKind::HostPinned) return nullptr;
  DeviceGuard guard(st_->opts.device);
  void* dev = nullptr;
  const cudaError_t e = cudaHostGetDevicePointer(&dev, host.ptr, 0);
  if (e != cudaSuccess) {  // e.g. registered without mapping: callers copy instead
    clear_error(e);
    return nullptr;
  }
  return dev;
}

void CudaBackend::free(const BufferRef& buf) {
  State& st = *st_;
  if (buf.ptr == nullptr) return;
  Allocation a;
  {
    std::lock_guard<std::mutex> lock(st.mu);
    auto it = st.allocs.find(buf.ptr);
    LS_CHECK(it != st.allocs.end() && it->second.id == buf.id, "free of buffer ", describe(buf),
             " that this CUDA backend did not allocate (or already freed); sub-regions and "
             "wrapped buffers are not owned: free the buffer they came from");
    a = it->second;
    st.allocs.erase(it);
    switch (a.kind) {
      case MemoryKind::Device:
        st.device_in_use -= a.bytes;
        if (a.in_arena) st.arena.release(a.arena_offset, a.arena_bytes);
        break;
      case MemoryKind::HostPinned: st.pinned -= a.bytes; break;
      case MemoryKind::HostPageable: st.pageable -= a.bytes; break;
    }
  }
  switch (a.kind) {
    case MemoryKind::Device:
      if (!a.in_arena) {
        DeviceGuard guard(st.opts.device);
        LS_CUDA_CHECK_CTX(cudaFree(buf.ptr), "freeing device buffer ", describe(buf));
      }
      break;
    case MemoryKind::HostPinned: {
      DeviceGuard guard(st.opts.device);
      LS_CUDA_CHECK_CTX(cudaFreeHost(buf.ptr), "freeing pinned host buffer ", describe(buf));
      break;
    }
    case MemoryKind::HostPageable: std::free(buf.ptr); break;
  }
}

MemoryStats CudaBackend::memory_stats() const {
  const CudaMemoryStats c = cuda_memory_stats();
  MemoryStats s;
  s.device_bytes_in_use = c.device_bytes_in_use;
  s.device_bytes_peak = c.device_bytes_peak;
  return s;
}

CudaMemoryStats CudaBackend::cuda_memory_stats() const {
  const State& st = *st_;
  std::lock_guard<std::mutex> lock(st.mu);
  CudaMemoryStats s;
  s.device_bytes_in_use = st.device_in_use;
  s.device_bytes_peak = st.device_peak;
  s.pinned_bytes = st.pinned;
  s.pinned_registered_bytes = st.pinned_registered;
  s.pageable_bytes = st.pageable;
  s.arena_bytes = st.arena.size();
  s.arena_free_bytes = st.arena.free_bytes();
  s.arena_largest_free_block = st.arena.largest_free_block();
  return s;
}

// ---------------------------------------------------------------- streams

Stream CudaBackend::create_stream(const std::string& name) {
  State& st = *st_;
  cudaStream_t handle = nullptr;
  {
    DeviceGuard guard(st.opts.device);
    LS_CUDA_CHECK_CTX(cudaStreamCreateWithFlags(&handle, cudaStreamNonBlocking),
                      "creating stream ", quoted(name));
  }
  std::lock_guard<std::mutex> lock(st.mu);
  uint64_t id = st.next_stream_id++;
  st.streams[id] = StreamEntry{handle, true, name};
  return Stream(this, id, handle);
}

Stream CudaBackend::wrap_stream(void* native, const std::string& name) {
  State& st = *st_;
  cudaStream_t handle = static_cast<cudaStream_t>(native);
  if (handle != nullptr && handle != cudaStreamLegacy && handle != cudaStreamPerThread) {
    // Events of this backend live on its device, and cudaEventRecord needs the
    // stream on the same device: reject a stream of another device now, with a
    // clear message, instead of failing later at the first record().
    DeviceGuard guard(st.opts.device);
    int dev = -1;
    LS_CUDA_CHECK_CTX(cudaStreamGetDevice(handle, &dev), "wrap_stream(", quoted(name),
                      "): querying the device of the native stream (is it a live cudaStream_t?)");
    LS_CHECK(dev == st.opts.device, "wrap_stream(", quoted(name), "): the native stream belongs to "
             "CUDA device ", dev, " but this backend runs on device ", st.opts.device,
             "; wrap a stream of device ", st.opts.device, " or create the backend with "
             "CudaOptions::device = ", dev);
  }
  std::lock_guard<std::mutex> lock(st.mu);
  uint64_t id = st.next_stream_id++;
  st.streams[id] = StreamEntry{static_cast<cudaStream_t>(native), false, name};
  return Stream(this, id, native);
}

void CudaBackend::destroy_stream(Stream s) {
  State& st = *st_;
  LS_CHECK(static_cast<bool>(s), "destroy_stream: the stream is null");
  LS_CHECK(s.backend() == this, "destroy_stream: stream ", s.id(),
           " belongs to another backend, not to this CUDA backend");
  StreamEntry entry;
  {
    std::lock_guard<std::mutex> lock(st.mu);
    auto it = st.streams.find(s.id());
    LS_CHECK(it != st.streams.end(), "destroy_stream: stream ", s.id(),
             " is not a live stream of this CUDA backend (destroyed twice?)");
    entry = it->second;
    st.streams.erase(it);
  }
  if (!entry.owned) return;  // wrapped: someone else owns it
  DeviceGuard guard(st.opts.device);
  cudaError_t sync_err = cudaStreamSynchronize(entry.handle);
  clear_error(sync_err);
  cudaError_t destroy_err = cudaStreamDestroy(entry.handle);
  check_cuda(sync_err, "cudaStreamSynchronize(stream)", __FILE__, __LINE__,
             "destroying stream " + quoted(entry.name));
  check_cuda(destroy_err, "cudaStreamDestroy(stream)", __FILE__, __LINE__,
             "destroying stream " + quoted(entry.name));
}

void CudaBackend::synchronize(Stream s) {
  cudaStream_t stream = st_->resolve(s, "synchronize(stream)");
  DeviceGuard guard(st_->opts.device);
  LS_CUDA_CHECK(cudaStreamSynchronize(stream));
}

void* CudaBackend::native_stream(Stream s) const {
  return static_cast<void*>(st_->resolve(s, "native_stream"));
}

// ---------------------------------------------------------------- copies

void CudaBackend::copy_async(const BufferRef& dst, size_t dst_offset, const BufferRef& src,
                             size_t src_offset, size_t bytes, Stream s) {
  LS_CHECK(dst.ptr != nullptr, "copy_async: the destination buffer ", describe(dst), " is null");
  LS_CHECK(src.ptr != nullptr, "copy_async: the source buffer ", describe(src), " is null");
  LS_CHECK(dst_offset <= dst.bytes && bytes <= dst.bytes - dst_offset,
           "copy_async: copying ", bytes, " bytes at offset ", dst_offset,
           " runs past the end of destination ", describe(dst));
  LS_CHECK(src_offset <= src.bytes && bytes <= src.bytes - src_offset,
           "copy_async: copying ", bytes, " bytes at offset ", src_offset,
           " runs past the end of source ", describe(src));
  cudaStream_t stream = st_->resolve(s, "copy_async");
  if (bytes == 0) return;
  DeviceGuard guard(st_->opts.device);
  LS_CUDA_CHECK_CTX(cudaMemcpyAsync(static_cast<char*>(dst.ptr) + dst_offset,
                                    static_cast<const char*>(src.ptr) + src_offset, bytes,
                                    cudaMemcpyDefault, stream),
                    "copying ", bytes, " bytes from ", describe(src), " to ", describe(dst));
}

// ---------------------------------------------------------------- events

Event CudaBackend::create_event() { return st_->make_event(false); }
Event CudaBackend::create_timing_event() { return st_->make_event(true); }

void CudaBackend::record(Event& ev, Stream s) {
  CudaEventImpl* impl = st_->event_of(ev, "record");
  cudaStream_t stream = st_->resolve(s, "record");
  DeviceGuard guard(st_->opts.device);
  LS_CUDA_CHECK(cudaEventRecord(impl->event, stream));
  impl->recorded.store(true, std::memory_order_release);
}

void CudaBackend::wait(Stream s, const Event& ev) {
  CudaEventImpl* impl = st_->event_of(ev, "wait");
  cudaStream_t stream = st_->resolve(s, "wait");
  if (!impl->recorded.load(std::memory_order_acquire)) return;  // never recorded: no-op
  DeviceGuard guard(st_->opts.device);
  LS_CUDA_CHECK(cudaStreamWaitEvent(stream, impl->event, 0));
}

void CudaBackend::synchronize(const Event& ev) {
  CudaEventImpl* impl = st_->event_of(ev, "synchronize(event)");
  if (!impl->recorded.load(std::memory_order_acquire)) return;
  DeviceGuard guard(st_->opts.device);
  LS_CUDA_CHECK(cudaEventSynchronize(impl->event));
}

bool CudaBackend::query(const Event& ev) {
  CudaEventImpl* impl = st_->event_of(ev, "query");
  if (!impl->recorded.load(std::memory_order_acquire)) return true;
  DeviceGuard guard(st_->opts.device);
  cudaError_t e = cudaEventQuery(impl->event);
  if (e == cudaSuccess) return true;
  if (e == cudaErrorNotReady) {
    clear_error(e);  // "not ready" is an answer, not an error
    return false;
  }
  check_cuda(e, "cudaEventQuery(event)", __FILE__, __LINE__);
  return false;
}

float CudaBackend::elapsed_ms(const Event& start, const Event& end) {
  CudaEventImpl* a = st_->event_of(start, "elapsed_ms");
  CudaEventImpl* b = st_->event_of(end, "elapsed_ms");
  LS_CHECK(a->timing && b->timing,
           "elapsed_ms needs two events from create_timing_event(); create_event() makes events "
           "without timing");
  LS_CHECK(a->recorded.load() && b->recorded.load(),
           "elapsed_ms: both events must have been recorded on a stream");
  DeviceGuard guard(st_->opts.device);
  float ms = 0.f;
  LS_CUDA_CHECK_CTX(cudaEventElapsedTime(&ms, a->event, b->event),
                    "both events must be complete (synchronize the end event first)");
  return ms;
}

void* CudaBackend::native_event(const Event& ev) const {
  return static_cast<void*>(st_->event_of(ev, "native_event")->event);
}

// ---------------------------------------------------------------- host functions

void CudaBackend::launch_host_func(Stream s, std::function<void()> fn) {
  LS_CHECK(static_cast<bool>(fn), "launch_host_func: the function is empty");
  cudaStream_t stream = st_->resolve(s, "launch_host_func");
  auto payload = std::make_unique<HostFnPayload>();
  payload->fn = std::move(fn);
  payload->errors = st_->host_errors;
  DeviceGuard guard(st_->opts.device);
  LS_CUDA_CHECK(cudaLaunchHostFunc(stream, host_fn_trampoline, payload.get()));
  (void)payload.release();  // the trampoline owns it now
}

std::vector<std::string> CudaBackend::take_host_function_errors() {
  std::lock_guard<std::mutex> lock(st_->host_errors->mu);
  std::vector<std::string> out;
  out.swap(st_->host_errors->messages);
  return out;
}

std::shared_ptr<CudaBackend> make_cuda_backend(CudaOptions options) {
  return std::make_shared<CudaBackend>(options);
}

}  // namespace layerstream
