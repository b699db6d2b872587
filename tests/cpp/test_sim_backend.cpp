// Tests of the sim backend's device model: memory, streams, events, copies,
// link timing, jitter, shutdown and thread safety. The ordering checker has
// its own file (test_sim_checker.cpp).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "backends/sim/sim_backend.h"

// The sim backend backs its buffers with aligned operator new (64 bytes). This
// test binary replaces the aligned forms of operator new/delete (all of them,
// so every such allocation is paired with its own release) to count the live
// ones: SimMemory.UnfreedBuffersAreReleasedByTheDestructor checks that the
// backend's destructor really releases buffers the caller never freed.
#include <cstdlib>
#include <new>

namespace {
std::atomic<long> g_live_aligned{0};

void* counted_aligned_alloc(std::size_t bytes, std::align_val_t align) noexcept {
  void* p = nullptr;
  const std::size_t a = std::max(static_cast<std::size_t>(align), sizeof(void*));
  if (posix_memalign(&p, a, bytes ? bytes : 1) != 0) return nullptr;
  g_live_aligned.fetch_add(1);
  return p;
}

void counted_aligned_free(void* p) noexcept {
  if (!p) return;
  g_live_aligned.fetch_sub(1);
  std::free(p);
}
}  // namespace

void* operator new(std::size_t n, std::align_val_t a) {
  if (void* p = counted_aligned_alloc(n, a)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n, std::align_val_t a) {
  if (void* p = counted_aligned_alloc(n, a)) return p;
  throw std::bad_alloc();
}
void* operator new(std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  return counted_aligned_alloc(n, a);
}
void* operator new[](std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  return counted_aligned_alloc(n, a);
}
void operator delete(void* p, std::align_val_t) noexcept { counted_aligned_free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { counted_aligned_free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { counted_aligned_free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { counted_aligned_free(p); }
void operator delete(void* p, std::align_val_t, const std::nothrow_t&) noexcept { counted_aligned_free(p); }
void operator delete[](void* p, std::align_val_t, const std::nothrow_t&) noexcept { counted_aligned_free(p); }

namespace layerstream {
namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// Copies that never sleep.
SimOptions instant() {
  SimOptions o;
  o.h2d_gbps = 0;
  o.d2h_gbps = 0;
  o.latency_us = 0;
  return o;
}

// A gate a host function can block a stream on.
class Gate {
 public:
  void open() {
    {
      std::lock_guard<std::mutex> l(m_);
      open_ = true;
    }
    cv_.notify_all();
  }
  void pass() {
    std::unique_lock<std::mutex> l(m_);
    cv_.wait(l, [&] { return open_; });
  }

 private:
  std::mutex m_;
  std::condition_variable cv_;
  bool open_ = false;
};

void fill(const BufferRef& b, uint8_t seed) {
  auto* p = static_cast<uint8_t*>(b.ptr);
  for (size_t i = 0; i < b.bytes; ++i) p[i] = static_cast<uint8_t>(seed + i * 7);
}

// ---------------------------------------------------------------- capabilities

TEST(SimCaps, ReportsEverythingTheSimCanDo) {
  SimOptions o = instant();
  o.device_memory_bytes = 12345;
  auto sim = make_sim_backend(o);
  const Capabilities& c = sim->caps();
  EXPECT_EQ(c.name, "sim");
  EXPECT_TRUE(c.pinned_host_memory);
  EXPECT_TRUE(c.host_functions);
  EXPECT_TRUE(c.inline_streams);
  EXPECT_TRUE(c.ordering_checker);
  EXPECT_TRUE(c.simulated);
  EXPECT_FALSE(c.wrap_native_streams);
  EXPECT_EQ(c.device_memory_bytes, 12345u);
  EXPECT_THROW(sim->wrap_stream(nullptr, "x"), Error);

  o.checker = false;
  EXPECT_FALSE(make_sim_backend(o)->caps().ordering_checker);
}

TEST(SimCaps, RejectsInvalidOptions) {
  SimOptions o;
  o.jitter = 1.5;
  EXPECT_THROW(SimBackend{o}, Error);
  o.jitter = 0;
  o.latency_us = -1;
  EXPECT_THROW(SimBackend{o}, Error);
}

// ---------------------------------------------------------------- memory

TEST(SimMemory, DeviceBuffersAreAlignedCountedAndKinded) {
  auto sim = make_sim_backend(instant());
  BufferRef a = sim->alloc_device(100, "a");
  BufferRef b = sim->alloc_device(1000, "b");
  EXPECT_EQ(a.kind, MemoryKind::Device);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a.ptr) % 64, 0u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b.ptr) % 64, 0u);
  EXPECT_NE(a.id, b.id);
  EXPECT_EQ(a.label, "a");
  EXPECT_EQ(sim->stats().device_bytes_in_use, 1100u);
  sim->free(a);
  EXPECT_EQ(sim->stats().device_bytes_in_use, 1000u);
  EXPECT_EQ(sim->stats().peak_device_bytes, 1100u);
  sim->free(b);
  EXPECT_EQ(sim->stats().device_bytes_in_use, 0u);
}

TEST(SimMemory, OutOfMemoryNamesRequestUseAndLimit) {
  SimOptions o = instant();
  o.device_memory_bytes = 1 << 20;
  auto sim = make_sim_backend(o);
  DeviceBuffer keep(*sim, 600 << 10, "keep");
  try {
    sim->alloc_device(500 << 10, "too.big");
    FAIL() << "expected an out-of-memory error";
  } catch (const Error& e) {
    const std::string m = e.message();
    EXPECT_NE(m.find("out of memory"), std::string::npos) << m;
    EXPECT_NE(m.find("too.big"), std::string::npos) << m;
    EXPECT_NE(m.find(std::to_string(500 << 10)), std::string::npos) << m;
    EXPECT_NE(m.find(std::to_string(600 << 10)), std::string::npos) << m;
    EXPECT_NE(m.find(std::to_string(1 << 20)), std::string::npos) << m;
  }
  // Exactly filling the device works.
  DeviceBuffer rest(*sim, (1 << 20) - (600 << 10), "rest");
  EXPECT_EQ(sim->stats().device_bytes_in_use, size_t(1) << 20);
  EXPECT_THROW(sim->alloc_device(1), Error);
  EXPECT_THROW(sim->alloc_device(~size_t(0)), Error);
}

TEST(SimMemory, PinnedHostMemoryAndFallbackHook) {
  auto sim = make_sim_backend(instant());
  bool fell_back = true;
  HostBuffer h = HostBuffer::allocate(*sim, 256, true, "pinned", &fell_back);
  EXPECT_FALSE(fell_back);
  EXPECT_EQ(h.kind(), MemoryKind::HostPinned);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(h.data()) % 64, 0u);
  EXPECT_TRUE(sim->pin_existing(h.data(), 256));

  sim->set_fail_pinned_allocations(true);
  EXPECT_THROW(sim->alloc_host(256, true, "x"), Error);
  EXPECT_FALSE(sim->pin_existing(h.data(), 256));
  HostBuffer p = HostBuffer::allocate(*sim, 256, true, "fallback", &fell_back);
  EXPECT_TRUE(fell_back);
  EXPECT_EQ(p.kind(), MemoryKind::HostPageable);

  SimOptions o = instant();
  o.fail_pinned_allocations = true;
  auto sim2 = make_sim_backend(o);
  HostBuffer q = HostBuffer::allocate(*sim2, 64, true, "q", &fell_back);
  EXPECT_TRUE(fell_back);
  EXPECT_EQ(q.kind(), MemoryKind::HostPageable);
  EXPECT_EQ(sim2->stats().device_bytes_in_use, 0u);
}

TEST(SimMemory, FreeingForeignOrTwiceIsAnError) {
  auto sim = make_sim_backend(instant());
  BufferRef a = sim->alloc_device(64, "a");
  BufferRef sub = sim->subregion(a, 0, 32, "a.sub");
  EXPECT_THROW(sim->free(sub), Error);  // same pointer, but a sub-region is not owned
  sim->free(a);
  EXPECT_THROW(sim->free(a), Error);
  int x = 0;
  EXPECT_THROW(sim->free(sim->wrap(&x, sizeof x, MemoryKind::HostPageable, "x")), Error);
}

TEST(SimMemory, UnfreedBuffersAreReleasedByTheDestructor) {
  const long at_start = g_live_aligned.load();
  auto sim = make_sim_backend(instant());
  const long before = g_live_aligned.load();
  BufferRef freed = sim->alloc_device(1024, "freed.device");
  sim->alloc_device(4096, "leaked.device");
  sim->alloc_host(4096, true, "leaked.host");
  sim->alloc_host(100, false, "leaked.pageable");
  EXPECT_EQ(g_live_aligned.load() - before, 4) << "each buffer is one aligned allocation";
  sim->free(freed);
  EXPECT_EQ(g_live_aligned.load() - before, 3);
  EXPECT_EQ(sim->stats().device_bytes_in_use, 4096u);
  sim.reset();
  EXPECT_EQ(g_live_aligned.load(), at_start) << "the destructor must release the 3 buffers never freed";
}

// ---------------------------------------------------------------- FIFO order

struct FifoCase {
  std::string name;
  bool inline_stream;
  int ops;
};

void PrintTo(const FifoCase& c, std::ostream* os) { *os << c.name; }

class SimFifo : public ::testing::TestWithParam<FifoCase> {};

TEST_P(SimFifo, OperationsRunInEnqueueOrder) {
  SimOptions o = instant();
  o.latency_us = 1;  // copies in between take a little time
  auto sim = make_sim_backend(o);
  Stream s = GetParam().inline_stream ? sim->create_inline_stream("fifo") : sim->create_stream("fifo");
  HostBuffer h = HostBuffer::allocate(*sim, 64, true);
  DeviceBuffer d(*sim, 64);
  std::vector<int> seen;
  std::mutex m;
  std::vector<int> expected(GetParam().ops);
  std::iota(expected.begin(), expected.end(), 0);
  for (int i = 0; i < GetParam().ops; ++i) {
    sim->launch_host_func(s, [&, i] {
      std::lock_guard<std::mutex> l(m);
      seen.push_back(i);
    });
    if (i % 10 == 0) sim->copy_async(d.ref(), 0, h.ref(), 0, 64, s);
  }
  sim->synchronize(s);
  EXPECT_EQ(seen, expected);
  EXPECT_EQ(sim->stream_name(s), "fifo");
  sim->destroy_stream(s);
  EXPECT_THROW(sim->synchronize(s), Error);
}

INSTANTIATE_TEST_SUITE_P(Streams, SimFifo,
                         ::testing::Values(FifoCase{"Worker_1", false, 1},
                                           FifoCase{"Worker_500", false, 500},
                                           FifoCase{"Inline_1", true, 1},
                                           FifoCase{"Inline_500", true, 500}),
                         [](const ::testing::TestParamInfo<FifoCase>& i) { return i.param.name; });

TEST(SimStreams, StreamsRunConcurrently) {
  auto sim = make_sim_backend(instant());
  Stream a = sim->create_stream("a"), b = sim->create_stream("b");
  Gate gate;
  std::atomic<bool> b_ran{false};
  sim->launch_host_func(a, [&] { gate.pass(); });
  sim->launch_host_func(b, [&] { b_ran = true; });
  sim->synchronize(b);  // would hang if b waited for a
  EXPECT_TRUE(b_ran);
  gate.open();
  sim->synchronize(a);
}

// ---------------------------------------------------------------- copies

struct CopyCase {
  std::string name;
  MemoryKind dst, src;
  size_t dst_offset, src_offset, bytes;
};

void PrintTo(const CopyCase& c, std::ostream* os) { *os << c.name; }

class SimCopy : public ::testing::TestWithParam<CopyCase> {};

BufferRef alloc_kind(SimBackend& sim, MemoryKind k, size_t bytes, const std::string& label) {
  if (k == MemoryKind::Device) return sim.alloc_device(bytes, label);
  return sim.alloc_host(bytes, k == MemoryKind::HostPinned, label);
}

TEST_P(SimCopy, MovesExactlyTheRequestedBytes) {
  const CopyCase& c = GetParam();
  auto sim = make_sim_backend(instant());
  Stream s = sim->create_stream("copy");
  const size_t size = 4096 + 64;
  BufferRef src = alloc_kind(*sim, c.src, size, "src");
  BufferRef dst = alloc_kind(*sim, c.dst, size, "dst");
  EXPECT_EQ(src.kind, c.src);
  EXPECT_EQ(dst.kind, c.dst);
  fill(src, 3);
  std::memset(dst.ptr, 0xEE, size);
  sim->copy_async(dst, c.dst_offset, src, c.src_offset, c.bytes, s);
  sim->synchronize(s);
  const auto* d = static_cast<const uint8_t*>(dst.ptr);
  const auto* p = static_cast<const uint8_t*>(src.ptr);
  EXPECT_EQ(std::memcmp(d + c.dst_offset, p + c.src_offset, c.bytes), 0);
  for (size_t i = 0; i < size; ++i) {
    if (i >= c.dst_offset && i < c.dst_offset + c.bytes) continue;
    ASSERT_EQ(d[i], 0xEE) << "byte " << i << " outside the copied range was touched";
  }
  SimStats st = sim->stats();
  EXPECT_EQ(st.copies, 1u);
  const bool h2d = src.is_host() && !dst.is_host(), d2h = !src.is_host() && dst.is_host();
  EXPECT_EQ(st.h2d_bytes, h2d ? c.bytes : 0u);
  EXPECT_EQ(st.d2h_bytes, d2h ? c.bytes : 0u);
  EXPECT_EQ(st.h2d_copies + st.d2h_copies + st.d2d_copies + st.h2h_copies, 1u);
  sim->free(src);
  sim->free(dst);
}

INSTANTIATE_TEST_SUITE_P(
    Directions, SimCopy,
    ::testing::Values(
        CopyCase{"H2D_pinned", MemoryKind::Device, MemoryKind::HostPinned, 0, 0, 4096},
        CopyCase{"H2D_pageable_offsets", MemoryKind::Device, MemoryKind::HostPageable, 64, 7, 4000},
        CopyCase{"D2H", MemoryKind::HostPinned, MemoryKind::Device, 0, 0, 4096},
        CopyCase{"D2H_offsets", MemoryKind::HostPageable, MemoryKind::Device, 13, 64, 1},
        CopyCase{"D2D", MemoryKind::Device, MemoryKind::Device, 5, 9, 4096},
        CopyCase{"H2H", MemoryKind::HostPinned, MemoryKind::HostPageable, 0, 0, 4096},
        CopyCase{"ZeroBytes", MemoryKind::Device, MemoryKind::HostPinned, 4, 4, 0}),
    [](const ::testing::TestParamInfo<CopyCase>& i) { return i.param.name; });

TEST(SimCopyErrors, OutOfBoundsAndNullAreRejected) {
  auto sim = make_sim_backend(instant());
  Stream s = sim->create_stream("s");
  DeviceBuffer d(*sim, 100, "dev");
  HostBuffer h = HostBuffer::allocate(*sim, 100, true, "host");
  EXPECT_THROW(sim->copy_async(d.ref(), 50, h.ref(), 0, 51, s), Error);
  EXPECT_THROW(sim->copy_async(d.ref(), 0, h.ref(), 60, 41, s), Error);
  EXPECT_THROW(sim->copy_async(BufferRef{}, 0, h.ref(), 0, 1, s), Error);
  EXPECT_THROW(sim->copy_async(d.ref(), 0, h.ref(), 0, 1, Stream{}), Error);
  auto other = make_sim_backend(instant());
  EXPECT_THROW(sim->copy_async(d.ref(), 0, h.ref(), 0, 1, other->create_stream("x")), Error);
  try {
    sim->copy_async(d.ref(), 50, h.ref(), 0, 51, s);
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("dev"), std::string::npos) << e.what();
  }
}

// ---------------------------------------------------------------- events

TEST(SimEvents, NeverRecordedEventIsCompleteAndWaitIsNoOp) {
  auto sim = make_sim_backend(instant());
  Stream s = sim->create_stream("s");
  Event ev = sim->create_event();
  EXPECT_TRUE(sim->query(ev));
  EXPECT_TRUE(ev.query());
  ev.synchronize();
  sim->wait(s, ev);  // no-op
  std::atomic<bool> ran{false};
  sim->launch_host_func(s, [&] { ran = true; });
  sim->synchronize(s);
  EXPECT_TRUE(ran);
}

TEST(SimEvents, RecordQuerySynchronize) {
  auto sim = make_sim_backend(instant());
  Stream s = sim->create_stream("s");
  Gate gate;
  Event ev = sim->create_event();
  sim->launch_host_func(s, [&] { gate.pass(); });
  ev.record(s);
  EXPECT_FALSE(ev.query());
  gate.open();
  ev.synchronize();
  EXPECT_TRUE(ev.query());
}

TEST(SimEvents, WaitOrdersAnotherStream) {
  auto sim = make_sim_backend(instant());
  Stream a = sim->create_stream("a"), b = sim->create_stream("b");
  Gate gate;
  std::atomic<int> step{0};
  Event ev = sim->create_event();
  sim->launch_host_func(a, [&] {
    gate.pass();
    step = 1;
  });
  sim->record(ev, a);
  sim->wait(b, ev);
  std::atomic<int> seen{-1};
  sim->launch_host_func(b, [&] { seen = step.load(); });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(seen.load(), -1) << "b ran past its wait";
  gate.open();
  sim->synchronize(b);
  EXPECT_EQ(seen.load(), 1);
}

TEST(SimEvents, WaitCapturesTheVersionAtEnqueueTime) {
  auto sim = make_sim_backend(instant());
  Stream slow = sim->create_stream("slow"), fast = sim->create_stream("fast"),
         waiter = sim->create_stream("waiter");
  Gate gate;
  Event ev = sim->create_event();
  sim->launch_host_func(slow, [&] { gate.pass(); });
  sim->record(ev, slow);  // version 1: pending
  sim->wait(waiter, ev);  // captures version 1
  sim->record(ev, fast);  // version 2: completes quickly
  std::atomic<bool> ran{false};
  sim->launch_host_func(waiter, [&] { ran = true; });
  sim->synchronize(fast);
  ev.synchronize();  // the newest version (2)
  EXPECT_TRUE(ev.query());
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(ran) << "the wait must refer to version 1, still pending";
  gate.open();
  sim->synchronize(waiter);
  EXPECT_TRUE(ran);
}

TEST(SimEvents, WaitBeforeRecordIsNoOp) {
  auto sim = make_sim_backend(instant());
  Stream a = sim->create_stream("a"), b = sim->create_stream("b");
  Gate gate;
  Event ev = sim->create_event();
  sim->wait(b, ev);  // never recorded yet: no-op
  sim->launch_host_func(a, [&] { gate.pass(); });
  sim->record(ev, a);
  std::atomic<bool> ran{false};
  sim->launch_host_func(b, [&] { ran = true; });
  sim->synchronize(b);  // must not hang on a's later version
  EXPECT_TRUE(ran);
  gate.open();
  sim->synchronize(a);
}

TEST(SimEvents, DestroyingPendingEventIsSafe) {
  auto sim = make_sim_backend(instant());
  Stream a = sim->create_stream("a"), b = sim->create_stream("b");
  Gate gate;
  sim->launch_host_func(a, [&] { gate.pass(); });
  {
    Event ev = sim->create_event();
    sim->record(ev, a);
    sim->wait(b, ev);
  }  // destroyed while pending
  std::atomic<bool> ran{false};
  sim->launch_host_func(b, [&] { ran = true; });
  gate.open();
  sim->synchronize(b);
  EXPECT_TRUE(ran);
}

TEST(SimEvents, ForeignOrEmptyEventsAreRejected) {
  auto sim = make_sim_backend(instant());
  auto other = make_sim_backend(instant());
  Stream s = sim->create_stream("s");
  Event foreign = other->create_event();
  EXPECT_THROW(sim->record(foreign, s), Error);
  EXPECT_THROW(sim->wait(s, foreign), Error);
  Event empty;
  EXPECT_THROW(sim->query(empty), Error);
  EXPECT_THROW(empty.query(), Error);
}

TEST(SimInline, RecordCompletesImmediatelyAndWaitBlocksTheCaller) {
  auto sim = make_sim_backend(instant());
  Stream in = sim->create_inline_stream("inline");
  Stream w = sim->create_stream("worker");
  Event ev = sim->create_event();
  sim->record(ev, in);
  EXPECT_TRUE(ev.query());

  std::atomic<bool> done{false};
  sim->launch_host_func(w, [&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    done = true;
  });
  sim->record(ev, w);
  const auto t0 = Clock::now();
  sim->wait(in, ev);  // blocks this thread
  EXPECT_TRUE(done);
  EXPECT_GE(ms_since(t0), 20.0);

  // Inline operations run on the calling thread, synchronously.
  const auto me = std::this_thread::get_id();
  std::thread::id ran_on;
  sim->launch_host_func(in, [&] { ran_on = std::this_thread::get_id(); });
  EXPECT_EQ(ran_on, me);
  HostBuffer h = HostBuffer::allocate(*sim, 32, true);
  DeviceBuffer d(*sim, 32);
  fill(h.ref(), 9);
  sim->copy_async(d.ref(), 0, h.ref(), 0, 32, in);
  EXPECT_EQ(std::memcmp(d.data(), h.data(), 32), 0);
  sim->synchronize(in);
  sim->destroy_stream(in);
}

TEST(SimHostFunc, ExceptionIsReportedAtTheNextSynchronize) {
  auto sim = make_sim_backend(instant());
  Stream s = sim->create_stream("boom");
  sim->launch_host_func(s, [] { throw std::runtime_error("kaput"); });
  try {
    sim->synchronize(s);
    FAIL() << "expected the host function's error";
  } catch (const Error& e) {
    EXPECT_NE(e.message().find("kaput"), std::string::npos) << e.message();
    EXPECT_NE(e.message().find("boom"), std::string::npos) << e.message();
  }
  sim->synchronize(s);  // reported once
}

// ---------------------------------------------------------------- timing

TEST(SimTiming, TenMegabytesAtOneGigabytePerSecondTakeTenMilliseconds) {
  SimOptions o;
  o.h2d_gbps = 1.0;
  o.latency_us = 0;
  auto sim = make_sim_backend(o);
  Stream s = sim->create_stream("t");
  HostBuffer h = HostBuffer::allocate(*sim, 10'000'000, true);
  DeviceBuffer d(*sim, 10'000'000);
  const auto t0 = Clock::now();
  sim->copy_async(d.ref(), 0, h.ref(), 0, h.bytes(), s);
  sim->synchronize(s);
  EXPECT_GE(ms_since(t0), 9.5);
}

TEST(SimTiming, LatencyAppliesPerCopy) {
  SimOptions o = instant();
  o.latency_us = 2000;  // 2 ms, infinite bandwidth
  auto sim = make_sim_backend(o);
  Stream s = sim->create_stream("t");
  HostBuffer h = HostBuffer::allocate(*sim, 64, true);
  DeviceBuffer d(*sim, 64);
  const auto t0 = Clock::now();
  for (int i = 0; i < 5; ++i) sim->copy_async(d.ref(), 0, h.ref(), 0, 64, s);
  sim->synchronize(s);
  EXPECT_GE(ms_since(t0), 9.5);
}

TEST(SimTiming, SameDirectionCopiesShareTheLink) {
  SimOptions o = instant();
  o.h2d_gbps = 0.02;  // 1 MB = 50 ms; small buffers keep memcpy cost out of it
  auto sim = make_sim_backend(o);
  Stream a = sim->create_stream("a"), b = sim->create_stream("b");
  HostBuffer h = HostBuffer::allocate(*sim, 1'000'000, true);
  DeviceBuffer d1(*sim, 1'000'000), d2(*sim, 1'000'000);
  const auto t0 = Clock::now();
  sim->copy_async(d1.ref(), 0, h.ref(), 0, h.bytes(), a);
  sim->copy_async(d2.ref(), 0, h.ref(), 0, h.bytes(), b);
  sim->synchronize(a);
  sim->synchronize(b);
  EXPECT_GE(ms_since(t0), 99.0) << "two 50 ms copies on one link must take at least their sum";
}

TEST(SimTiming, OppositeDirectionsOverlap) {
  SimOptions o = instant();
  o.h2d_gbps = 0.0125;  // 1 MB = 80 ms each way
  o.d2h_gbps = 0.0125;
  auto sim = make_sim_backend(o);
  Stream up = sim->create_stream("up"), down = sim->create_stream("down");
  HostBuffer h1 = HostBuffer::allocate(*sim, 1'000'000, true), h2 = HostBuffer::allocate(*sim, 1'000'000, true);
  DeviceBuffer d1(*sim, 1'000'000), d2(*sim, 1'000'000);
  const auto t0 = Clock::now();
  sim->copy_async(d1.ref(), 0, h1.ref(), 0, h1.bytes(), up);
  sim->copy_async(h2.ref(), 0, d2.ref(), 0, d2.bytes(), down);
  sim->synchronize(up);
  sim->synchronize(down);
  const double ms = ms_since(t0);
  EXPECT_GE(ms, 79.0);
  // Serialized they would take 160 ms; the bound is loose on purpose.
  EXPECT_LT(ms, 150.0) << "H2D and D2H are separate links and must overlap";
  SimStats st = sim->stats();
  EXPECT_EQ(st.h2d_bytes, 1'000'000u);
  EXPECT_EQ(st.d2h_bytes, 1'000'000u);
  EXPECT_EQ(st.h2d_copies, 1u);
  EXPECT_EQ(st.d2h_copies, 1u);
}

// ---------------------------------------------------------------- jitter

TEST(SimJitter, FactorSequenceIsReproducibleAndBounded) {
  auto seq = [](double j, uint64_t seed) {
    std::vector<double> v;
    for (uint64_t i = 0; i < 1000; ++i) v.push_back(SimBackend::jitter_factor(j, seed, i));
    return v;
  };
  const auto a = seq(0.1, 42), b = seq(0.1, 42), c = seq(0.1, 43);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  double sum = 0;
  for (double f : a) {
    EXPECT_GE(f, 0.9);
    EXPECT_LE(f, 1.1);
    sum += f;
  }
  EXPECT_NEAR(sum / a.size(), 1.0, 0.01);
  EXPECT_GT(*std::max_element(a.begin(), a.end()), 1.05);
  EXPECT_LT(*std::min_element(a.begin(), a.end()), 0.95);
  for (double f : seq(0.0, 42)) EXPECT_EQ(f, 1.0);
}

// ---------------------------------------------------------------- shutdown

TEST(SimShutdown, DestructorDrainsWorkInFlight) {
  std::atomic<int> ran{0};
  const auto t0 = Clock::now();
  {
    SimOptions o = instant();
    o.latency_us = 500;  // 100 copies ≈ 50 ms
    auto sim = make_sim_backend(o);
    Stream s = sim->create_stream("slow"), t = sim->create_stream("other");
    BufferRef h = sim->alloc_host(65536, true, "h");  // never freed by the test
    BufferRef d = sim->alloc_device(65536, "d");
    Event ev = sim->create_event();
    for (int i = 0; i < 100; ++i) {
      sim->copy_async(d, 0, h, 0, 65536, s);
      if (i == 50) {
        sim->record(ev, s);
        sim->wait(t, ev);
      }
    }
    sim->launch_host_func(s, [&] { ++ran; });
    sim->launch_host_func(t, [&] { ++ran; });
  }  // backend destroyed with ~100 copies queued
  EXPECT_EQ(ran.load(), 2);
  EXPECT_GE(ms_since(t0), 45.0);
}

TEST(SimShutdown, DestroyStreamDrainsThenJoins) {
  auto sim = make_sim_backend(instant());
  Stream s = sim->create_stream("s");
  std::atomic<int> ran{0};
  for (int i = 0; i < 20; ++i)
    sim->launch_host_func(s, [&] {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
      ++ran;
    });
  sim->destroy_stream(s);
  EXPECT_EQ(ran.load(), 20);
  EXPECT_THROW(sim->launch_host_func(s, [] {}), Error);
}

// ---------------------------------------------------------------- threads

TEST(SimThreads, ManyHostThreadsUseTheBackendConcurrently) {
  SimOptions o = instant();
  o.latency_us = 20;
  auto sim = make_sim_backend(o);
  constexpr int kThreads = 6, kIters = 40, kBytes = 4096;
  std::vector<std::thread> threads;
  std::atomic<int> mismatches{0};
  Stream shared = sim->create_stream("shared");
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      Stream s = sim->create_stream("t" + std::to_string(t));
      HostBuffer src = HostBuffer::allocate(*sim, kBytes, true, "src" + std::to_string(t));
      HostBuffer back = HostBuffer::allocate(*sim, kBytes, true, "back" + std::to_string(t));
      for (int i = 0; i < kIters; ++i) {
        DeviceBuffer d(*sim, kBytes, "dev" + std::to_string(t));
        fill(src.ref(), static_cast<uint8_t>(t * 31 + i));
        Event ev = sim->create_event();
        sim->copy_async(d.ref(), 0, src.ref(), 0, kBytes, s);
        sim->record(ev, s);
        sim->wait(shared, ev);
        sim->copy_async(back.ref(), 0, d.ref(), 0, kBytes, shared);
        Event done = sim->create_event();
        sim->record(done, shared);
        if (i % 2) {
          done.synchronize();
        } else {
          while (!done.query()) std::this_thread::yield();
        }
        if (std::memcmp(src.data(), back.data(), kBytes) != 0) ++mismatches;
        (void)sim->stats();
        (void)sim->ordering_errors();
      }
      sim->destroy_stream(s);
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(mismatches.load(), 0);
  EXPECT_TRUE(sim->ordering_errors().empty()) << sim->ordering_errors().front();
  EXPECT_EQ(sim->stats().copies, uint64_t(kThreads) * kIters * 2);
  EXPECT_EQ(sim->stats().device_bytes_in_use, 0u);
}

}  // namespace
}  // namespace layerstream
