// layerstream — the CUDA runtime backend.
//
// Implements the Backend interface of core/runtime.h on one CUDA device with
// the CUDA runtime API. This header is CUDA-free: native handles are void*
// (Stream::native() is a cudaStream_t); only cuda_backend.cpp includes
// cuda_runtime.h.
//
// Mapping (see runtime.h for the semantics):
//   create_stream      cudaStreamCreateWithFlags(cudaStreamNonBlocking), owned
//   wrap_stream        a framework's cudaStream_t of the backend's device (checked),
//                      not owned (destroy_stream only forgets it); nullptr means
//                      the device's legacy default stream. cudaStreamPerThread is
//                      accepted but names a different stream on every calling
//                      thread: use it from one thread only.
//   events             cudaEvent_t with cudaEventDisableTiming (create_event) or
//                      with timing (create_timing_event, for elapsed_ms)
//   alloc_device       cudaMalloc per call, or carved from one up-front arena
//                      (CudaOptions::arena_bytes > 0; first-fit with coalescing)
//   alloc_host         cudaHostAlloc when pinned, else 64-byte aligned malloc
//   pin_existing       cudaHostRegister / cudaHostUnregister
//   device_address_of_host  cudaHostGetDevicePointer (pinned memory only)
//   copy_async         cudaMemcpyAsync(cudaMemcpyDefault), bounds-checked
//   launch_host_func   cudaLaunchHostFunc
//
// Every failing CUDA call throws layerstream::Error naming the call and
// cudaGetErrorString. All methods may be called from any thread; each one
// selects the backend's device first, and no lock is held across a blocking
// CUDA call.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "core/runtime.h"

namespace layerstream {

struct CudaOptions {
  int device = 0;          // CUDA device ordinal
  // 0 = no arena: alloc_device calls cudaMalloc per allocation.
  // >0 = one cudaMalloc of this many bytes up front; alloc_device carves
  // 256-byte aligned blocks from it (first fit, freed blocks coalesce) and
  // throws a clear out-of-memory error when no free block is large enough.
  size_t arena_bytes = 0;
};

// Memory accounting of one CudaBackend (a snapshot).
struct CudaMemoryStats {
  size_t device_bytes_in_use = 0;   // bytes handed out by alloc_device (as requested)
  size_t device_bytes_peak = 0;     // high-water mark of device_bytes_in_use
  size_t pinned_bytes = 0;          // alloc_host(pinned) + pin_existing bytes
  size_t pinned_registered_bytes = 0;  // the pin_existing part of pinned_bytes
  size_t pageable_bytes = 0;        // alloc_host(pinned=false) bytes
  size_t arena_bytes = 0;           // arena size (0 = no arena)
  size_t arena_free_bytes = 0;      // free bytes in the arena
  size_t arena_largest_free_block = 0;
};

// True when the CUDA driver is usable and at least one device is visible.
// Never throws; *count (if given) receives the device count (0 on failure).
bool cuda_device_available(int* count = nullptr) noexcept;

class CudaBackend : public Backend {
 public:
  // Throws layerstream::Error when no CUDA device is visible, the ordinal is
  // out of range, or the arena cannot be allocated.
  explicit CudaBackend(CudaOptions options = {});
  ~CudaBackend() override;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  const Capabilities& caps() const override;

  // ---- memory ----
  BufferRef alloc_device(size_t bytes, const std::string& label = {}) override;
  BufferRef alloc_host(size_t bytes, bool pinned, const std::string& label = {}) override;
  bool pin_existing(void* ptr, size_t bytes) override;
  void unpin_existing(void* ptr) override;
  void* device_address_of_host(const BufferRef& host) override;
  void free(const BufferRef& buf) override;

  // ---- streams ----
  Stream create_stream(const std::string& name) override;
  Stream wrap_stream(void* native, const std::string& name) override;
  void destroy_stream(Stream s) override;
  void synchronize(Stream s) override;

  // ---- copies ----
  void copy_async(const BufferRef& dst, size_t dst_offset, const BufferRef& src,
                  size_t src_offset, size_t bytes, Stream s) override;

  // ---- events ----
  Event create_event() override;
  void record(Event& ev, Stream s) override;
  void wait(Stream s, const Event& ev) override;
  void synchronize(const Event& ev) override;
  bool query(const Event& ev) override;

  // ---- work on a stream ----
  // fn runs on a CUDA driver thread; it must not call CUDA. fn is also
  // destroyed there, right after it runs, so what it captures must not call
  // CUDA when destroyed either (do not let it hold the last reference to a
  // DeviceBuffer, HostBuffer, Event or the backend). An exception it throws
  // cannot propagate: it is written to stderr and kept for
  // take_host_function_errors().
  void launch_host_func(Stream s, std::function<void()> fn) override;

  // ---- CUDA-specific ----
  // An event that records timestamps, for telemetry (slower than create_event).
  Event create_timing_event();
  // Milliseconds between two recorded timing events (both must be complete,
  // e.g. synchronize(end) first).
  float elapsed_ms(const Event& start, const Event& end);
  // The cudaEvent_t of an event of this backend.
  void* native_event(const Event& ev) const;
  // The cudaStream_t of a stream of this backend (nullptr = default stream).
  void* native_stream(Stream s) const;

  int device() const;
  const CudaOptions& options() const;
  MemoryStats memory_stats() const override;
  // The CUDA backend's own accounting (pinned memory, arena), a superset.
  CudaMemoryStats cuda_memory_stats() const;
  // Messages of exceptions thrown by host functions since the last call.
  std::vector<std::string> take_host_function_errors();

 private:
  struct State;
  std::unique_ptr<State> st_;
};

// Creates a CudaBackend (throws layerstream::Error, see the constructor).
std::shared_ptr<CudaBackend> make_cuda_backend(CudaOptions options = {});

}  // namespace layerstream
