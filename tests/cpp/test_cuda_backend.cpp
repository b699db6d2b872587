// Tests of the CUDA backend. They need a visible CUDA device; without one
// every test skips except NoGpu.*, which checks the no-device behaviour.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "backends/cuda/arena_allocator.h"
#include "backends/cuda/cuda_backend.h"

using namespace layerstream;

namespace {

#define REQUIRE_CUDA_DEVICE()                                    \
  do {                                                           \
    if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device visible"; \
  } while (0)

void fill_pattern(void* p, size_t n, uint32_t seed) {
  auto* b = static_cast<unsigned char*>(p);
  uint32_t x = seed * 2654435761u + 1;
  for (size_t i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    b[i] = static_cast<unsigned char>(x >> 24);
  }
}

template <typename F>
std::string error_message(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "<no layerstream::Error thrown>";
}

}  // namespace

// ------------------------------------------------------------ no device

TEST(NoGpu, AvailabilityNeverThrowsAndFactoryFailsClearly) {
  bool available = true;
  int count = -1;
  EXPECT_NO_THROW(available = cuda_device_available(&count));
  EXPECT_NO_THROW(cuda_device_available());
  if (available) {
    EXPECT_GT(count, 0);
    GTEST_SKIP() << "a CUDA device is visible; the no-device path cannot be tested here";
  }
  EXPECT_FALSE(available);
  EXPECT_EQ(count, 0);
  std::string msg = error_message([] { make_cuda_backend(CudaOptions{}); });
  EXPECT_NE(msg.find("no CUDA device visible"), std::string::npos) << msg;
  EXPECT_NE(msg.find("sim backend"), std::string::npos) << msg;
}

// The arena allocator is plain C++: tested here without a GPU.
TEST(NoGpu, ArenaFirstFitAndCoalescing) {
  detail::ArenaAllocator a;
  a.reset(1024);
  size_t o0 = 1, o1 = 1, o2 = 1, o = 1;
  ASSERT_TRUE(a.allocate(256, &o0));
  ASSERT_TRUE(a.allocate(256, &o1));
  ASSERT_TRUE(a.allocate(256, &o2));
  EXPECT_EQ(o0, 0u);
  EXPECT_EQ(o1, 256u);
  EXPECT_EQ(o2, 512u);
  EXPECT_FALSE(a.allocate(512, &o));
  EXPECT_EQ(a.free_bytes(), 256u);
  a.release(o1, 256);
  ASSERT_TRUE(a.allocate(256, &o));  // first fit: the hole, not the tail
  EXPECT_EQ(o, 256u);
  a.release(o, 256);
  a.release(o0, 256);  // coalesces with the hole
  EXPECT_EQ(a.free_blocks(), 2u);
  EXPECT_EQ(a.largest_free_block(), 512u);
  ASSERT_TRUE(a.allocate(512, &o));
  EXPECT_EQ(o, 0u);
  a.release(o, 512);
  a.release(o2, 256);  // coalesces on both sides
  EXPECT_EQ(a.free_blocks(), 1u);
  EXPECT_EQ(a.free_bytes(), 1024u);
  EXPECT_EQ(a.largest_free_block(), 1024u);
  a.reset(0);
  EXPECT_FALSE(a.allocate(256, &o));
}

TEST(NoGpu, ArenaRejectsBadReleases) {
  detail::ArenaAllocator a;
  a.reset(1024);
  size_t o0 = 0, o1 = 0;
  ASSERT_TRUE(a.allocate(256, &o0));
  ASSERT_TRUE(a.allocate(256, &o1));
  a.release(o0, 256);
  EXPECT_THROW(a.release(o0, 256), Error);    // twice
  EXPECT_THROW(a.release(128, 256), Error);   // overlaps the free block [0, 256)
  EXPECT_THROW(a.release(1024, 256), Error);  // outside the arena
  EXPECT_EQ(a.free_bytes(), 1024u - 256u);
}

// Random allocate/release against a byte map: blocks never overlap, the
// offset is the lowest fitting one, and the accounting matches.
TEST(NoGpu, ArenaRandomizedAgainstAByteMap) {
  constexpr size_t kUnit = 256, kUnits = 64;
  detail::ArenaAllocator a;
  a.reset(kUnit * kUnits);
  std::vector<int> used(kUnits, 0);
  std::map<size_t, size_t> live;  // offset -> bytes
  std::mt19937 rng(99);
  for (int step = 0; step < 5000; ++step) {
    if (!live.empty() && rng() % 2 == 0) {
      auto it = live.begin();
      std::advance(it, static_cast<long>(rng() % live.size()));
      a.release(it->first, it->second);
      for (size_t u = it->first / kUnit; u < (it->first + it->second) / kUnit; ++u) used[u] = 0;
      live.erase(it);
    } else {
      const size_t units = 1 + rng() % 8;
      size_t want = SIZE_MAX;  // the lowest run of `units` free units
      for (size_t u = 0, run = 0; u < kUnits; ++u) {
        run = used[u] ? 0 : run + 1;
        if (run == units) {
          want = (u + 1 - units) * kUnit;
          break;
        }
      }
      size_t off = 0;
      const bool ok = a.allocate(units * kUnit, &off);
      // First fit over free *blocks* equals the lowest fitting run because
      // adjacent free blocks are always coalesced.
      ASSERT_EQ(ok, want != SIZE_MAX) << "step " << step;
      if (!ok) continue;
      ASSERT_EQ(off, want) << "step " << step;
      for (size_t u = off / kUnit; u < off / kUnit + units; ++u) {
        ASSERT_EQ(used[u], 0) << "overlapping blocks at step " << step;
        used[u] = 1;
      }
      live[off] = units * kUnit;
    }
    size_t in_use = 0;
    for (int x : used) in_use += static_cast<size_t>(x) * kUnit;
    ASSERT_EQ(a.free_bytes(), kUnit * kUnits - in_use) << "step " << step;
  }
}

// ------------------------------------------------------------ with a device

TEST(CudaBackend, CapsAndBadDevice) {
  REQUIRE_CUDA_DEVICE();
  auto be = make_cuda_backend({});
  const Capabilities& c = be->caps();
  EXPECT_EQ(c.name, "cuda");
  EXPECT_TRUE(c.pinned_host_memory);
  EXPECT_TRUE(c.host_functions);
  EXPECT_TRUE(c.wrap_native_streams);
  EXPECT_FALSE(c.inline_streams);
  EXPECT_FALSE(c.ordering_checker);
  EXPECT_FALSE(c.simulated);
  EXPECT_GT(c.device_memory_bytes, 0u);
  EXPECT_THROW(be->create_inline_stream("x"), Error);

  int count = 0;
  ASSERT_TRUE(cuda_device_available(&count));
  CudaOptions bad;
  bad.device = count;
  std::string msg = error_message([&] { make_cuda_backend(bad); });
  EXPECT_NE(msg.find("out of range"), std::string::npos) << msg;
}

TEST(CudaBackend, RoundTripBytesIdentical) {
  REQUIRE_CUDA_DEVICE();
  auto be = make_cuda_backend({});
  Stream s = be->create_stream("copy");
  EXPECT_NE(s.native(), nullptr);
  for (bool pinned : {true, false}) {
    const size_t n = (4u << 20) + 3;  // odd size on purpose
    HostBuffer src = HostBuffer::allocate(*be, n, pinned, "src");
    HostBuffer dst = HostBuffer::allocate(*be, n, pinned, "dst");
    EXPECT_EQ(src.kind(), pinned ? MemoryKind::HostPinned : MemoryKind::HostPageable);
    DeviceBuffer dev(*be, n, "dev");
    fill_pattern(src.data(), n, pinned ? 1 : 2);
    std::memset(dst.data(), 0, n);
    be->copy_async(dev.ref(), 0, src.ref(), 0, n, s);
    be->copy_async(dst.ref(), 0, dev.ref(), 0, n, s);
    be->synchronize(s);
    EXPECT_EQ(std::memcmp(src.data(), dst.data(), n), 0) << "pinned=" << pinned;

    // Offsets: copy the middle of src into the start of dev, then back to an offset.
    std::memset(dst.data(), 0, n);
    be->copy_async(dev.ref(), 0, src.ref(), 1001, 5000, s);
    be->copy_async(dst.ref(), 17, dev.ref(), 0, 5000, s);
    be->synchronize(s);
    EXPECT_EQ(std::memcmp(static_cast<char*>(src.data()) + 1001,
                          static_cast<char*>(dst.data()) + 17, 5000),
              0);
  }
  // Device to device.
  const size_t n = 1 << 16;
  HostBuffer src = HostBuffer::allocate(*be, n, true);
  HostBuffer dst = HostBuffer::allocate(*be, n, true);
  DeviceBuffer a(*be, n), b(*be, n);
  fill_pattern(src.data(), n, 3);
  be->copy_async(a.ref(), 0, src.ref(), 0, n, s);
  be->copy_async(b.ref(), 0, a.ref(), 0, n, s);
  be->copy_async(dst.ref(), 0, b.ref(), 0, n, s);
  be->synchronize(s);
  EXPECT_EQ(std::memcmp(src.data(), dst.data(), n), 0);
  be->destroy_stream(s);
}

TEST(CudaBackend, CopyBoundsAndOwnershipErrors) {
  REQUIRE_CUDA_DEVICE();
  auto be = make_cuda_backend({});
  Stream s = be->create_stream("s");
  DeviceBuffer dev(*be, 1024, "weights");
  HostBuffer host = HostBuffer::allocate(*be, 1024, true, "staging");
  std::string msg = error_message([&] { be->copy_async(dev.ref(), 1000, host.ref(), 0, 100, s); });
  EXPECT_NE(msg.find("past the end of destination"), std::string::npos) << msg;
  EXPECT_NE(msg.find("weights"), std::string::npos) << msg;
  msg = error_message([&] { be->copy_async(dev.ref(), 0, host.ref(), SIZE_MAX, 2, s); });
  EXPECT_NE(msg.find("past the end of source"), std::string::npos) << msg;
  EXPECT_THROW(be->copy_async(dev.ref(), 0, BufferRef{}, 0, 1, s), Error);

  BufferRef sub = be->subregion(dev.ref(), 0, 512, "sub");
  msg = error_message([&] { be->free(sub); });
  EXPECT_NE(msg.find("did not allocate"), std::string::npos) << msg;

  be->destroy_stream(s);
  msg = error_message([&] { be->synchronize(s); });
  EXPECT_NE(msg.find("not a live stream"), std::string::npos) << msg;
  EXPECT_THROW(be->destroy_stream(s), Error);
}

TEST(CudaBackend, EventsOrderTwoStreams) {
  REQUIRE_CUDA_DEVICE();
  auto be = make_cuda_backend({});
  Stream a = be->create_stream("A");
  Stream b = be->create_stream("B");
  const size_t n = 64u << 20;  // large enough that B would overtake A without the wait
  HostBuffer src = HostBuffer::allocate(*be, n, true, "src");
  HostBuffer dst = HostBuffer::allocate(*be, n, true, "dst");
  DeviceBuffer dev(*be, n, "dev");
  for (int round = 0; round < 3; ++round) {
    fill_pattern(src.data(), n, 10 + round);
    std::memset(dst.data(), 0, n);
    Event ev = be->create_event();
    be->copy_async(dev.ref(), 0, src.ref(), 0, n, a);
    be->record(ev, a);
    be->wait(b, ev);
    be->copy_async(dst.ref(), 0, dev.ref(), 0, n, b);
    Event done = be->create_event();
    done.record(b);
    done.synchronize();
    EXPECT_TRUE(done.query());
    EXPECT_EQ(std::memcmp(src.data(), dst.data(), n), 0) << "round " << round;
  }
  // A never-recorded event: wait is a no-op, query is true, synchronize returns.
  Event fresh = be->create_event();
  be->wait(b, fresh);
  EXPECT_TRUE(be->query(fresh));
  be->synchronize(fresh);
  be->destroy_stream(a);
  be->destroy_stream(b);
}

TEST(CudaBackend, QueryBeforeAndAfter) {
  REQUIRE_CUDA_DEVICE();
  auto be = make_cuda_backend({});
  Stream s = be->create_stream("s");
  std::atomic<bool> release{false};
  be->launch_host_func(s, [&] {
    while (!release.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  });
  Event ev = be->create_event();
  be->record(ev, s);
  EXPECT_FALSE(be->query(ev));
  EXPECT_FALSE(ev.query());  // still pending, and not-ready leaves no error behind
  release.store(true);
  be->synchronize(ev);
  EXPECT_TRUE(be->query(ev));
  // The backend is still healthy after not-ready answers.
  DeviceBuffer d(*be, 256);
  HostBuffer h = HostBuffer::allocate(*be, 256, true);
  be->copy_async(d.ref(), 0, h.ref(), 0, 256, s);
  be->synchronize(s);

  // Destroying a pending event is fine.
  release.store(false);
  be->launch_host_func(s, [&] {
    while (!release.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  });
  {
    Event pending = be->create_event();
    be->record(pending, s);
  }
  release.store(true);
  be->synchronize(s);
  be->destroy_stream(s);
}

TEST(CudaBackend, TimingEvents) {
  REQUIRE_CUDA_DEVICE();
  auto be = make_cuda_backend({});
  Stream s = be->create_stream("s");
  Event t0 = be->create_timing_event();
  Event t1 = be->create_timing_event();
  const size_t n = 8u << 20;
  HostBuffer h = HostBuffer::allocate(*be, n, true);
  DeviceBuffer d(*be, n);
  be->record(t0, s);
  be->copy_async(d.ref(), 0, h.ref(), 0, n, s);
  be->record(t1, s);
  be->synchronize(t1);
  EXPECT_GE(be->elapsed_ms(t0, t1), 0.f);
  Event plain = be->create_event();
  be->record(plain, s);
  be->synchronize(plain);
  std::string msg = error_message([&] { be->elapsed_ms(t0, plain); });
  EXPECT_NE(msg.find("create_timing_event"), std::string::npos) << msg;
  EXPECT_NE(be->native_event(t0), nullptr);
  be->destroy_stream(s);
}

TEST(CudaBackend, ArenaAllocationAndOom) {
  REQUIRE_CUDA_DEVICE();
  CudaOptions opts;
  opts.arena_bytes = 1u << 20;
  auto be = make_cuda_backend(opts);
  const size_t q = 256u << 10;
  BufferRef a = be->alloc_device(q, "a");
  BufferRef b = be->alloc_device(q, "b");
  BufferRef c = be->alloc_device(q, "c");
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a.ptr) % 256, 0u);
  EXPECT_EQ(static_cast<char*>(b.ptr) - static_cast<char*>(a.ptr), static_cast<ptrdiff_t>(q));
  CudaMemoryStats st = be->cuda_memory_stats();
  EXPECT_EQ(st.device_bytes_in_use, 3 * q);
  EXPECT_EQ(st.arena_bytes, opts.arena_bytes);
  EXPECT_EQ(st.arena_free_bytes, q);

  std::string msg = error_message([&] { be->alloc_device(2 * q, "big"); });
  EXPECT_NE(msg.find("arena out of memory"), std::string::npos) << msg;
  EXPECT_NE(msg.find(std::to_string(2 * q)), std::string::npos) << msg;   // requested
  EXPECT_NE(msg.find(std::to_string(q) + " bytes free"), std::string::npos) << msg;
  EXPECT_NE(msg.find(std::to_string(opts.arena_bytes)), std::string::npos) << msg;
  EXPECT_NE(msg.find("'big'"), std::string::npos) << msg;

  // Freed blocks are reused and coalesce.
  be->free(b);
  BufferRef b2 = be->alloc_device(q - 100, "b2");
  EXPECT_EQ(b2.ptr, b.ptr);
  be->free(b2);
  be->free(a);
  BufferRef ab = be->alloc_device(2 * q, "ab");  // a and b merged
  EXPECT_EQ(ab.ptr, a.ptr);
  be->free(ab);
  be->free(c);
  st = be->cuda_memory_stats();
  EXPECT_EQ(st.device_bytes_in_use, 0u);
  EXPECT_EQ(st.device_bytes_peak, 3 * q);
  EXPECT_EQ(st.arena_free_bytes, opts.arena_bytes);
  EXPECT_EQ(st.arena_largest_free_block, opts.arena_bytes);

  // Arena memory is real device memory.
  Stream s = be->create_stream("s");
  DeviceBuffer whole(*be, opts.arena_bytes, "whole");
  HostBuffer h1 = HostBuffer::allocate(*be, opts.arena_bytes, true);
  HostBuffer h2 = HostBuffer::allocate(*be, opts.arena_bytes, true);
  fill_pattern(h1.data(), opts.arena_bytes, 7);
  be->copy_async(whole.ref(), 0, h1.ref(), 0, opts.arena_bytes, s);
  be->copy_async(h2.ref(), 0, whole.ref(), 0, opts.arena_bytes, s);
  be->synchronize(s);
  EXPECT_EQ(std::memcmp(h1.data(), h2.data(), opts.arena_bytes), 0);
  be->destroy_stream(s);
}

TEST(CudaBackend, DeviceOomWithoutArenaIsClearAndRecoverable) {
  REQUIRE_CUDA_DEVICE();
  auto be = make_cuda_backend({});
  std::string msg = error_message([&] { be->alloc_device(size_t(1) << 60, "huge"); });
  EXPECT_NE(msg.find("cudaMalloc"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'huge'"), std::string::npos) << msg;
  // The failure left no error behind: the backend keeps working.
  DeviceBuffer d(*be, 4096);
  Stream s = be->create_stream("s");
  HostBuffer h = HostBuffer::allocate(*be, 4096, true);
  be->copy_async(d.ref(), 0, h.ref(), 0, 4096, s);
  be->synchronize(s);
  EXPECT_EQ(be->cuda_memory_stats().device_bytes_in_use, 4096u);
  be->destroy_stream(s);
}

TEST(CudaBackend, PinnedAllocationAndPinExisting) {
  REQUIRE_CUDA_DEVICE();
  auto be = make_cuda_backend({});
  BufferRef p = be->alloc_host(1 << 20, true, "pinned");
  EXPECT_EQ(p.kind, MemoryKind::HostPinned);
  EXPECT_EQ(be->cuda_memory_stats().pinned_bytes, size_t(1) << 20);
  BufferRef q = be->alloc_host(1000, false, "pageable");
  EXPECT_EQ(q.kind, MemoryKind::HostPageable);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(q.ptr) % 64, 0u);

  const size_t n = 4u << 20;
  void* mem = std::aligned_alloc(4096, n);
  ASSERT_NE(mem, nullptr);
  EXPECT_FALSE(be->pin_existing(nullptr, n));
  ASSERT_TRUE(be->pin_existing(mem, n));
  EXPECT_FALSE(be->pin_existing(mem, n));  // already registered: nothing changes
  CudaMemoryStats st = be->cuda_memory_stats();
  EXPECT_EQ(st.pinned_registered_bytes, n);
  EXPECT_EQ(st.pinned_bytes, n + (size_t(1) << 20));

  // Registered memory works as a copy source/destination.
  Stream s = be->create_stream("s");
  BufferRef reg = be->wrap(mem, n, MemoryKind::HostPinned, "registered");
  DeviceBuffer d(*be, n);
  HostBuffer out = HostBuffer::allocate(*be, n, true);
  fill_pattern(mem, n, 5);
  be->copy_async(d.ref(), 0, reg, 0, n, s);
  be->copy_async(out.ref(), 0, d.ref(), 0, n, s);
  be->synchronize(s);
  EXPECT_EQ(std::memcmp(mem, out.data(), n), 0);

  be->unpin_existing(mem);
  EXPECT_EQ(be->cuda_memory_stats().pinned_registered_bytes, 0u);
  EXPECT_THROW(be->unpin_existing(mem), Error);
  std::free(mem);
  be->free(p);
  be->free(q);
  EXPECT_THROW(be->free(p), Error);  // double free is caught
  // Only `out` is left pinned.
  EXPECT_EQ(be->cuda_memory_stats().pinned_bytes, out.kind() == MemoryKind::HostPinned ? n : 0u);
  be->destroy_stream(s);
}

TEST(CudaBackend, PinnedHostMemoryIsReadableFromTheDevice) {
  // Streamed embedding tables are read by device kernels through this mapping.
  REQUIRE_CUDA_DEVICE();
  auto be = make_cuda_backend({});
  const size_t n = 1 << 20;
  BufferRef p = be->alloc_host(n, true, "pinned");
  BufferRef q = be->alloc_host(n, false, "pageable");
  EXPECT_EQ(be->device_address_of_host(q), nullptr);
  void* dev = be->device_address_of_host(p);
  ASSERT_NE(dev, nullptr);
  // CUDA's own view of the allocation: pinned host memory whose device
  // mapping is the address returned (kernel reads through it are covered by
  // the embedding parity tests on CUDA).
  cudaPointerAttributes attr{};
  ASSERT_EQ(cudaPointerGetAttributes(&attr, p.ptr), cudaSuccess);
  EXPECT_EQ(attr.type, cudaMemoryTypeHost);
  EXPECT_EQ(attr.devicePointer, dev);
  fill_pattern(p.ptr, n, 11);
  // The mapped address names the same bytes (the copy's direction is inferred).
  void* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, n), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d, static_cast<char*>(dev) + 4096, n - 4096, cudaMemcpyDefault), cudaSuccess);
  std::vector<unsigned char> back(n - 4096);
  ASSERT_EQ(cudaMemcpy(back.data(), d, n - 4096, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(std::memcmp(back.data(), static_cast<char*>(p.ptr) + 4096, n - 4096), 0);
  cudaFree(d);
  be->free(p);
  be->free(q);
}

TEST(CudaBackend, HostFunctionsRunInOrder) {
  REQUIRE_CUDA_DEVICE();
  auto be = make_cuda_backend({});
  Stream s = be->create_stream("s");
  const size_t n = 1 << 20;
  HostBuffer src = HostBuffer::allocate(*be, n, true);
  HostBuffer dst = HostBuffer::allocate(*be, n, true);
  DeviceBuffer d(*be, n);
  fill_pattern(src.data(), n, 9);
  std::memset(dst.data(), 0, n);

  std::mutex mu;
  std::vector<int> order;
  bool data_ok = false;
  for (int i = 0; i < 50; ++i) {
    be->launch_host_func(s, [&, i] {
      std::lock_guard<std::mutex> lock(mu);
      order.push_back(i);
    });
    if (i == 25) {
      be->copy_async(d.ref(), 0, src.ref(), 0, n, s);
      be->copy_async(dst.ref(), 0, d.ref(), 0, n, s);
      be->launch_host_func(s, [&] {
        std::lock_guard<std::mutex> lock(mu);
        data_ok = std::memcmp(src.data(), dst.data(), n) == 0;
      });
    }
  }
  // A throwing host function is reported, not fatal.
  be->launch_host_func(s, [] { throw std::runtime_error("boom"); });
  be->synchronize(s);
  std::lock_guard<std::mutex> lock(mu);
  ASSERT_EQ(order.size(), 50u);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(order[i], i);
  EXPECT_TRUE(data_ok);
  std::vector<std::string> errs = be->take_host_function_errors();
  ASSERT_EQ(errs.size(), 1u);
  EXPECT_EQ(errs[0], "boom");
  EXPECT_THROW(be->launch_host_func(s, std::function<void()>{}), Error);
  be->destroy_stream(s);
}

TEST(CudaBackend, WrappedStreamIsNotOwned) {
  REQUIRE_CUDA_DEVICE();
  auto be = make_cuda_backend({});
  Stream owner = be->create_stream("framework");
  Stream w = be->wrap_stream(owner.native(), "wrapped");
  EXPECT_EQ(w.native(), owner.native());
  EXPECT_NE(w, owner);
  const size_t n = 1 << 16;
  HostBuffer h = HostBuffer::allocate(*be, n, true);
  HostBuffer o = HostBuffer::allocate(*be, n, true);
  DeviceBuffer d(*be, n);
  fill_pattern(h.data(), n, 4);
  be->copy_async(d.ref(), 0, h.ref(), 0, n, w);
  be->destroy_stream(w);  // forgets it; the native stream lives on
  be->copy_async(o.ref(), 0, d.ref(), 0, n, owner);
  be->synchronize(owner);
  EXPECT_EQ(std::memcmp(h.data(), o.data(), n), 0);
  EXPECT_EQ(be->native_stream(owner), owner.native());
  // The legacy default stream can be wrapped too.
  Stream def = be->wrap_stream(nullptr, "default");
  be->copy_async(o.ref(), 0, d.ref(), 0, n, def);
  be->synchronize(def);
  be->destroy_stream(def);
  be->destroy_stream(owner);
}

TEST(CudaBackend, ConcurrentUseFromThreads) {
  REQUIRE_CUDA_DEVICE();
  auto be = make_cuda_backend({});
  const size_t n = 1 << 18;
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      try {
        Stream s = be->create_stream("t" + std::to_string(t));
        for (int i = 0; i < 10; ++i) {
          HostBuffer h = HostBuffer::allocate(*be, n, true);
          HostBuffer o = HostBuffer::allocate(*be, n, true);
          DeviceBuffer d(*be, n);
          fill_pattern(h.data(), n, static_cast<uint32_t>(t * 100 + i));
          be->copy_async(d.ref(), 0, h.ref(), 0, n, s);
          be->copy_async(o.ref(), 0, d.ref(), 0, n, s);
          Event ev = be->create_event();
          be->record(ev, s);
          be->synchronize(ev);
          if (std::memcmp(h.data(), o.data(), n) != 0) ++failures;
        }
        be->destroy_stream(s);
      } catch (const std::exception&) {
        ++failures;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  CudaMemoryStats st = be->cuda_memory_stats();
  EXPECT_EQ(st.device_bytes_in_use, 0u);
  EXPECT_EQ(st.pinned_bytes, 0u);
}

TEST(CudaBackend, WrapsDefaultStreamHandles) {
  REQUIRE_CUDA_DEVICE();
  auto be = make_cuda_backend({});
  const size_t n = 1 << 16;
  HostBuffer h = HostBuffer::allocate(*be, n, true);
  HostBuffer o = HostBuffer::allocate(*be, n, true);
  DeviceBuffer d(*be, n);
  fill_pattern(h.data(), n, 21);
  for (cudaStream_t handle : {cudaStreamLegacy, cudaStreamPerThread}) {
    std::memset(o.data(), 0, n);
    Stream s = be->wrap_stream(static_cast<void*>(handle), "default");
    Event ev = be->create_event();
    be->copy_async(d.ref(), 0, h.ref(), 0, n, s);
    be->copy_async(o.ref(), 0, d.ref(), 0, n, s);
    be->record(ev, s);
    be->synchronize(ev);
    EXPECT_EQ(std::memcmp(h.data(), o.data(), n), 0);
    be->destroy_stream(s);
  }
}

TEST(CudaBackend, WrapStreamOfAnotherDeviceIsRejected) {
  REQUIRE_CUDA_DEVICE();
  int count = 0;
  ASSERT_TRUE(cuda_device_available(&count));
  if (count < 2) GTEST_SKIP() << "needs two CUDA devices";
  auto be = make_cuda_backend({});  // device 0
  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  cudaStream_t other = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  std::string msg = error_message([&] { be->wrap_stream(other, "elsewhere"); });
  EXPECT_NE(msg.find("belongs to CUDA device 1"), std::string::npos) << msg;
  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(other), cudaSuccess);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
}

// A backend on device 1 used from a thread whose current device is 0: every
// call selects device 1 and leaves device 0 current for the caller.
TEST(CudaBackend, UsesItsDeviceAndRestoresTheCallers) {
  REQUIRE_CUDA_DEVICE();
  int count = 0;
  ASSERT_TRUE(cuda_device_available(&count));
  if (count < 2) GTEST_SKIP() << "needs two CUDA devices";
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  CudaOptions opts;
  opts.device = 1;
  auto be = make_cuda_backend(opts);
  auto current = [] {
    int d = -1;
    EXPECT_EQ(cudaGetDevice(&d), cudaSuccess);
    return d;
  };
  EXPECT_EQ(current(), 0);
  Stream a = be->create_stream("a");
  Stream b = be->create_stream("b");
  int dev = -1;
  ASSERT_EQ(cudaStreamGetDevice(static_cast<cudaStream_t>(a.native()), &dev), cudaSuccess);
  EXPECT_EQ(dev, 1);
  const size_t n = 1 << 20;
  HostBuffer h = HostBuffer::allocate(*be, n, true);
  HostBuffer o = HostBuffer::allocate(*be, n, true);
  DeviceBuffer d(*be, n);
  cudaPointerAttributes attr{};
  ASSERT_EQ(cudaPointerGetAttributes(&attr, d.data()), cudaSuccess);
  EXPECT_EQ(attr.device, 1);
  fill_pattern(h.data(), n, 33);
  Event ev = be->create_event();
  be->copy_async(d.ref(), 0, h.ref(), 0, n, a);
  be->record(ev, a);
  be->wait(b, ev);
  be->copy_async(o.ref(), 0, d.ref(), 0, n, b);
  be->synchronize(b);
  EXPECT_EQ(std::memcmp(h.data(), o.data(), n), 0);
  EXPECT_EQ(current(), 0);
  Stream def = be->wrap_stream(nullptr, "legacy");  // device 1's legacy stream
  be->copy_async(o.ref(), 0, d.ref(), 0, n, def);
  be->synchronize(def);
  EXPECT_EQ(current(), 0);
  be->destroy_stream(def);
  be->destroy_stream(a);
  be->destroy_stream(b);
  EXPECT_EQ(current(), 0);
}

TEST(CudaBackend, HostFunctionClosureIsReleasedAfterItRuns) {
  REQUIRE_CUDA_DEVICE();
  auto be = make_cuda_backend({});
  Stream s = be->create_stream("s");
  auto token = std::make_shared<int>(0);
  be->launch_host_func(s, [token] { ++*token; });
  be->launch_host_func(s, [token] { throw std::runtime_error("after " + std::to_string(*token)); });
  be->synchronize(s);
  EXPECT_EQ(*token, 1);
  EXPECT_EQ(token.use_count(), 1) << "the closures (and what they capture) must be destroyed";
  EXPECT_EQ(be->take_host_function_errors().size(), 1u);
  be->destroy_stream(s);
}

TEST(CudaBackend, EventMayOutliveItsBackend) {
  REQUIRE_CUDA_DEVICE();
  (void)cudaGetLastError();  // start clean whatever earlier tests left
  Event ev;
  {
    auto be = make_cuda_backend({});
    Stream s = be->create_stream("s");
    ev = be->create_event();
    be->record(ev, s);
    be->synchronize(ev);
  }
  ev = Event();  // destroys the CUDA event after the backend is gone: no crash, no error left
  EXPECT_EQ(cudaPeekAtLastError(), cudaSuccess);
}
