// layerstream — the simulated asynchronous device ("sim" backend).
//
// A product, not a mock (docs/design/sim-backend.md): every stream is a
// worker thread executing its queue in FIFO order, events behave like CUDA
// events, copies really move the bytes and take simulated link time
// (latency + bytes / bandwidth, one shared link per direction), and an
// ordering checker based on vector clocks reports every buffer access that is
// not ordered after the previous conflicting access.
//
// Device memory is plain 64-byte-aligned host memory counted against
// SimOptions::device_memory_bytes. See docs/design/sim-backend.md.
//
// Quick use:
//   layerstream::SimOptions o;
//   o.h2d_gbps = 1.0;
//   auto sim = layerstream::make_sim_backend(o);
//   Stream s = sim->create_stream("transfer");
//   ... copy_async / record / wait / declare_access ...
//   for (auto& e : sim->ordering_errors()) std::cerr << e << "\n";
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/runtime.h"

namespace layerstream {

// The simulated device's memory unless SimOptions says otherwise: 16 GiB.
constexpr size_t kDefaultDeviceMemory = size_t(16) << 30;

struct SimOptions {
  // Link bandwidths in GB/s (1e9 bytes per second). 0 or negative = infinite.
  double h2d_gbps = 25.0;
  double d2h_gbps = 25.0;
  // Fixed cost of every host<->device copy, in microseconds (applies even
  // with infinite bandwidth; set 0 too for copies that never sleep).
  double latency_us = 5.0;
  // Relative jitter of copy durations in [0, 1): 0.1 = each copy takes
  // between 90% and 110% of its nominal time. Deterministic given `seed`.
  double jitter = 0.0;
  uint64_t seed = 1;
  // alloc_device beyond this throws layerstream::Error. The default is the
  // capacity budget shares (offload(budget="auto"/"40%")) see on "sim".
  size_t device_memory_bytes = kDefaultDeviceMemory;
  // Track and check buffer accesses (caps().ordering_checker).
  bool checker = true;
  // Throw layerstream::Error at the racy call (copy_async, declare_access,
  // declare_host_access, ...) instead of recording the error.
  bool abort_on_ordering_error = false;
  // Test hook: alloc_host(pinned=true) and pin_existing fail, so callers'
  // pageable fallback can be exercised. Also settable at run time.
  bool fail_pinned_allocations = false;
};

struct SimStats {
  uint64_t h2d_bytes = 0, d2h_bytes = 0;
  uint64_t h2d_copies = 0, d2h_copies = 0, d2d_copies = 0, h2h_copies = 0;
  uint64_t copies = 0;               // all completed copies
  size_t device_bytes_in_use = 0;    // currently allocated with alloc_device
  size_t peak_device_bytes = 0;      // high-water mark of device_bytes_in_use
};

class SimBackend final : public Backend {
 public:
  explicit SimBackend(SimOptions opts = {});
  // Drains every stream (all enqueued work runs), joins the workers and
  // releases memory that was never freed.
  ~SimBackend() override;
  SimBackend(const SimBackend&) = delete;
  SimBackend& operator=(const SimBackend&) = delete;

  const Capabilities& caps() const override;
  MemoryStats memory_stats() const override;

  BufferRef alloc_device(size_t bytes, const std::string& label = {}) override;
  BufferRef alloc_host(size_t bytes, bool pinned, const std::string& label = {}) override;
  bool pin_existing(void* ptr, size_t bytes) override;
  void unpin_existing(void* ptr) override;
  // With the checker, a free is a host write of the buffer and of every
  // tracked region inside it: an access not ordered before it (a copy that
  // may still read it) is an ordering error. Then they are forgotten.
  void free(const BufferRef& buf) override;
  void unwrap(const BufferRef& buf) override;  // the checker forgets its region

  Stream create_stream(const std::string& name) override;
  Stream create_inline_stream(const std::string& name) override;
  void destroy_stream(Stream s) override;
  void synchronize(Stream s) override;

  void copy_async(const BufferRef& dst, size_t dst_offset, const BufferRef& src, size_t src_offset,
                  size_t bytes, Stream s) override;

  Event create_event() override;
  void record(Event& ev, Stream s) override;
  void wait(Stream s, const Event& ev) override;
  void synchronize(const Event& ev) override;
  bool query(const Event& ev) override;

  void launch_host_func(Stream s, std::function<void()> fn) override;

  void declare_access(const BufferRef& buf, Access a, Stream s, const std::string& what) override;
  void declare_host_access(const BufferRef& buf, Access a, const std::string& what) override;
  std::vector<std::string> ordering_errors() const override;
  void clear_ordering_errors() override;

  // ---- sim-specific ----
  const SimOptions& options() const;
  SimStats stats() const;
  void set_fail_pinned_allocations(bool fail);
  // Name given at create_stream / create_inline_stream.
  std::string stream_name(Stream s) const;

  // The duration factor of the index-th copy on a link whose jitter seed is
  // `seed`: 1 + jitter * u with u uniform in [-1, 1), a pure function of
  // (seed, index). The H2D link uses seed, the D2H link seed + 1; copies are
  // numbered per link in the order they claim it.
  static double jitter_factor(double jitter, uint64_t seed, uint64_t index);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

std::shared_ptr<SimBackend> make_sim_backend(SimOptions opts = {});

}  // namespace layerstream
