// layerstream — the simulated asynchronous device. See sim_backend.h and
// docs/design/sim-backend.md.
//
// Structure:
//  * StreamState: one per stream. Worker streams own a thread that pops Ops
//    from a FIFO queue; inline streams have no thread and run on the caller.
//  * Link: one per direction (H2D, D2H), a shared resource with a "free at"
//    time. A copy claims [max(now, free_at), +duration) under the link mutex,
//    moves the bytes, then sleeps until its end WITHOUT holding any lock.
//  * EventVersion: every record() makes a fresh version {done, cv, snapshot};
//    the event points at the newest; waits capture the newest at enqueue.
//  * The ordering checker runs at ENQUEUE time under its own mutex. Every
//    stream's logical clock only depends on work enqueued before (host
//    snapshots, earlier ops, event versions recorded earlier), so computing
//    it when the op is enqueued gives exactly the clock it has when it runs,
//    independent of timing, and lets abort_on_ordering_error throw on the
//    caller's thread at the racy call. Enqueue order is a linear extension of
//    happens-before, so checking accesses in that order is sound.
#include "backends/sim/sim_backend.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <new>
#include <thread>
#include <unordered_map>
#include <utility>

#include "core/align.h"

namespace layerstream {
namespace {

using Clock = std::chrono::steady_clock;
constexpr std::size_t kAlign = 64;
constexpr uint32_t kHostAgent = 0;

// A vector clock indexed by agent (0 = the host, 1.. = worker streams).
struct VClock {
  std::vector<uint64_t> c;
  uint64_t get(std::size_t i) const { return i < c.size() ? c[i] : 0; }
  void tick(std::size_t i) {
    if (c.size() <= i) c.resize(i + 1, 0);
    ++c[i];
  }
  void join(const VClock& o) {
    if (o.c.size() > c.size()) c.resize(o.c.size(), 0);
    for (std::size_t i = 0; i < o.c.size(); ++i) c[i] = std::max(c[i], o.c[i]);
  }
};

// One recorded version of an event.
struct EventVersion {
  std::mutex m;
  std::condition_variable cv;
  bool done = false;
  VClock snapshot;  // written once at enqueue, under the checker mutex

  void complete() {
    {
      std::lock_guard<std::mutex> l(m);
      done = true;
    }
    cv.notify_all();
  }
  void wait_done() {
    std::unique_lock<std::mutex> l(m);
    cv.wait(l, [&] { return done; });
  }
  bool is_done() {
    std::lock_guard<std::mutex> l(m);
    return done;
  }
};

struct SimEventImpl final : EventImpl {
  std::mutex m;
  std::shared_ptr<EventVersion> newest;  // null: never recorded
  std::shared_ptr<EventVersion> get() {
    std::lock_guard<std::mutex> l(m);
    return newest;
  }
  void set(std::shared_ptr<EventVersion> v) {
    std::lock_guard<std::mutex> l(m);
    newest = std::move(v);
  }
};

enum class CopyDir : uint8_t { H2D, D2H, D2D, H2H };
const char* dir_name(CopyDir d) {
  switch (d) {
    case CopyDir::H2D: return "H2D";
    case CopyDir::D2H: return "D2H";
    case CopyDir::D2D: return "D2D";
    case CopyDir::H2H: return "H2H";
  }
  return "?";
}

struct Op {
  enum class Kind : uint8_t { Copy, Record, Wait, HostFunc } kind = Kind::Copy;
  void* dst = nullptr;
  const void* src = nullptr;
  std::size_t bytes = 0;
  CopyDir dir = CopyDir::H2D;
  std::shared_ptr<EventVersion> version;
  std::function<void()> fn;
};

struct StreamState {
  uint64_t id = 0;
  std::string name;
  bool is_inline = false;
  uint32_t agent = kHostAgent;  // inline streams are the host
  std::string who;              // "stream 'x'" / "host (inline stream 'x')"
  VClock clock;                 // guarded by the checker mutex

  std::mutex mu;
  std::condition_variable cv;
  std::deque<Op> queue;
  bool busy = false;  // the worker is executing an op (guarded by mu)
  bool stop = false;
  std::thread worker;
};

// A host<->device link: one shared resource with a "busy until" time.
struct Link {
  std::mutex mu;
  Clock::time_point free_at{};
  uint64_t count = 0;
  double gbps = 0, latency_us = 0, jitter = 0;
  uint64_t seed = 0;

  // Claims the link for one copy; returns when the copy ends.
  Clock::time_point schedule(std::size_t bytes) {
    double us = latency_us + (gbps > 0 ? static_cast<double>(bytes) / (gbps * 1e3) : 0.0);
    std::lock_guard<std::mutex> l(mu);
    const uint64_t index = count++;
    Clock::time_point now = Clock::now();
    if (us <= 0) return now;
    us *= SimBackend::jitter_factor(jitter, seed, index);
    const Clock::time_point start = std::max(now, free_at);
    const Clock::time_point end =
        start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double, std::micro>(us));
    free_at = end;
    return end;
  }
};

// One access made or about to be made, for the checker.
struct AccessRec {
  uint32_t agent = 0;
  uint64_t clock = 0;
  Access access = Access::Read;
  std::string who;
  std::string what;
};

struct RegionState {
  std::string label;
  uintptr_t begin = 0;
  bool has_write = false;
  AccessRec last_write;
  std::vector<AccessRec> reads;  // reads since the last write, at most one per agent
};

struct PendingAccess {
  const BufferRef* buf;
  Access access;
  const std::string* what;
};

std::string buffer_name(const BufferRef& b) {
  return b.label.empty() ? "buffer#" + std::to_string(b.id) : b.label;
}

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

}  // namespace

struct SimBackend::Impl {
  SimOptions opts;
  Capabilities caps;
  std::atomic<bool> fail_pinned{false};

  // ---- memory ----
  struct Alloc {
    std::size_t bytes;
    MemoryKind kind;
    uint64_t id;
  };
  mutable std::mutex mem_mu;
  std::unordered_map<void*, Alloc> allocs;
  std::size_t device_in_use = 0, device_peak = 0;

  // ---- copy statistics ----
  std::atomic<uint64_t> bytes_by_dir[4] = {};
  std::atomic<uint64_t> copies_by_dir[4] = {};

  Link h2d, d2h;

  // ---- streams ----
  mutable std::mutex streams_mu;
  std::map<uint64_t, std::shared_ptr<StreamState>> streams;
  uint64_t next_stream_id = 1;
  uint32_t next_agent = 1;

  // ---- errors from host functions run on workers ----
  std::mutex deferred_mu;
  std::string deferred_error;

  // ---- checker (all guarded by ck_mu) ----
  mutable std::mutex ck_mu;
  VClock host_clock;
  std::unordered_map<uint64_t, RegionState> regions;
  std::vector<std::string> errors;

  std::shared_ptr<StreamState> find(Backend* self, Stream s) const {
    LS_CHECK(s.backend() == self, "stream ", s.id(),
             " does not belong to this sim backend (it is null or from another backend)");
    std::lock_guard<std::mutex> l(streams_mu);
    auto it = streams.find(s.id());
    LS_CHECK(it != streams.end(), "unknown or destroyed sim stream id ", s.id());
    return it->second;
  }

  static std::shared_ptr<EventVersion> version_of(Backend* self, const Event& ev) {
    LS_CHECK(ev.impl() != nullptr, "empty event (create it with create_event)");
    LS_CHECK(ev.backend() == self, "event belongs to another backend");
    auto* impl = dynamic_cast<SimEventImpl*>(ev.impl());
    LS_CHECK(impl != nullptr, "event was not created by the sim backend");
    return impl->get();
  }

  // ---- checker ----
  static std::string describe(const BufferRef& buf, const AccessRec& cur, const AccessRec& prev) {
    std::string msg = "ordering error on buffer '" + buffer_name(buf) + "' (id " +
                      std::to_string(buf.id) + "): " + cur.who +
                      (cur.access == Access::Write ? " writes" : " reads") + " it in \"" + cur.what +
                      "\", which is not ordered after " + prev.who +
                      (prev.access == Access::Write ? " writing" : " reading") + " it in \"" +
                      prev.what + "\"; ";
    if (cur.agent == kHostAgent) {
      msg += "the host must first wait for that work (synchronize an event recorded on " + prev.who +
             " after it, or synchronize the stream)";
    } else {
      msg += "make " + cur.who + " wait on an event recorded on " + prev.who + " after that access";
    }
    return msg;
  }

  // Checks accesses made by `agent` with clock `vc` (ck_mu held). Throws
  // without changing anything when abort_on_ordering_error finds a race;
  // otherwise records the errors and updates the regions.
  void check_and_commit(const std::vector<PendingAccess>& acc, uint32_t agent, const VClock& vc,
                        const std::string& who) {
    std::vector<std::string> found;
    std::vector<AccessRec> recs;
    recs.reserve(acc.size());
    for (const PendingAccess& p : acc) {
      AccessRec cur;
      cur.agent = agent;
      cur.clock = vc.get(agent);
      cur.access = p.access;
      cur.who = who;
      cur.what = *p.what;
      if (p.buf->id != 0) {
        auto it = regions.find(p.buf->id);
        if (it != regions.end()) {
          const RegionState& r = it->second;
          auto covered = [&](const AccessRec& prev) {
            return prev.agent == agent || vc.get(prev.agent) >= prev.clock;
          };
          if (r.has_write && !covered(r.last_write)) found.push_back(describe(*p.buf, cur, r.last_write));
          if (p.access == Access::Write) {
            for (const AccessRec& rd : r.reads)
              if (!covered(rd)) found.push_back(describe(*p.buf, cur, rd));
          }
        }
      }
      recs.push_back(std::move(cur));
    }
    if (!found.empty() && opts.abort_on_ordering_error) {
      std::string all = found.front();
      for (std::size_t i = 1; i < found.size(); ++i) all += "\n" + found[i];
      LS_FAIL(all);
    }
    for (std::size_t i = 0; i < acc.size(); ++i) {
      const BufferRef& buf = *acc[i].buf;
      if (buf.id == 0) continue;
      RegionState& r = regions[buf.id];
      r.label = buffer_name(buf);
      r.begin = reinterpret_cast<uintptr_t>(buf.ptr);
      if (acc[i].access == Access::Write) {
        r.has_write = true;
        r.last_write = std::move(recs[i]);
        r.reads.clear();
      } else {
        auto it = std::find_if(r.reads.begin(), r.reads.end(),
                               [&](const AccessRec& a) { return a.agent == agent; });
        if (it != r.reads.end()) *it = std::move(recs[i]);
        else r.reads.push_back(std::move(recs[i]));
      }
    }
    for (std::string& e : found) errors.push_back(std::move(e));
  }

  // A host access now (the host is one agent; inline streams are the host).
  void host_access(const std::vector<PendingAccess>& acc, const std::string& who) {
    if (!opts.checker || acc.empty()) return;
    std::lock_guard<std::mutex> l(ck_mu);
    VClock next = host_clock;
    next.tick(kHostAgent);
    check_and_commit(acc, kHostAgent, next, who);
    host_clock = std::move(next);
  }

  void host_join(const std::shared_ptr<EventVersion>& v) {
    if (!opts.checker || !v) return;
    std::lock_guard<std::mutex> l(ck_mu);
    host_clock.join(v->snapshot);
  }

  // True when `op` takes no simulated time and cannot block: a copy over a
  // zero-cost link (infinite bandwidth and no latency, or device-to-device),
  // a record, or a wait whose version already completed.
  bool instant(const Op& op) {
    switch (op.kind) {
      case Op::Kind::Copy: {
        const Link* link = op.dir == CopyDir::H2D ? &h2d : op.dir == CopyDir::D2H ? &d2h : nullptr;
        return link == nullptr || (link->gbps <= 0 && link->latency_us <= 0);
      }
      case Op::Kind::Record: return true;
      case Op::Kind::Wait: return op.version->is_done();
      case Op::Kind::HostFunc: return false;
    }
    return false;
  }

  void push(StreamState& st, Op&& op) {
    {
      std::lock_guard<std::mutex> l(st.mu);
      LS_CHECK(!st.stop, "sim stream '", st.name, "' is being destroyed; cannot enqueue work on it");
      if (st.queue.empty() && !st.busy && instant(op)) {
        // Fast path: the stream is idle and the op takes no time, so running
        // it now is a valid schedule (as if the device were infinitely fast).
        // The stream's lock keeps the worker from starting anything before it
        // completes, so FIFO order holds. It saves a thread hand-off per op.
        execute(st, op);
        return;
      }
      st.queue.push_back(std::move(op));
    }
    st.cv.notify_one();
  }

  // Enqueues `op` on a worker stream. With the checker, computes the op's
  // clock = join(stream clock, host clock) + tick (+ the waited version's
  // snapshot), checks its accesses, and snapshots the clock into a recorded
  // version. `op` may be null for declare_access (an access at this stream
  // position without work).
  void enqueue(StreamState& st, Op* op, const std::vector<PendingAccess>& acc) {
    if (!opts.checker) {
      if (op) push(st, std::move(*op));
      return;
    }
    std::lock_guard<std::mutex> l(ck_mu);
    VClock next = st.clock;
    next.join(host_clock);
    next.tick(st.agent);
    if (op && op->kind == Op::Kind::Wait) next.join(op->version->snapshot);
    if (op && op->kind == Op::Kind::Record) op->version->snapshot = next;
    check_and_commit(acc, st.agent, next, st.who);
    st.clock = std::move(next);
    if (op) push(st, std::move(*op));
  }

  void do_copy(void* dst, const void* src, std::size_t bytes, CopyDir dir) {
    Link* link = dir == CopyDir::H2D ? &h2d : dir == CopyDir::D2H ? &d2h : nullptr;
    // The bytes move inside the modelled transfer time (the memmove is the
    // simulator's cost, not the link's), then the copy completes at its end.
    Clock::time_point end{};
    if (link) end = link->schedule(bytes);
    if (bytes) std::memmove(dst, src, bytes);
    if (link) std::this_thread::sleep_until(end);  // no lock held
    const int d = static_cast<int>(dir);
    bytes_by_dir[d].fetch_add(bytes, std::memory_order_relaxed);
    copies_by_dir[d].fetch_add(1, std::memory_order_relaxed);
  }

  void execute(StreamState& st, Op& op) {
    switch (op.kind) {
      case Op::Kind::Copy: do_copy(op.dst, op.src, op.bytes, op.dir); break;
      case Op::Kind::Record: op.version->complete(); break;
      case Op::Kind::Wait: op.version->wait_done(); break;
      case Op::Kind::HostFunc:
        try {
          op.fn();
        } catch (const std::exception& e) {
          set_deferred("a host function on sim stream '" + st.name + "' threw: " + e.what());
        } catch (...) {
          set_deferred("a host function on sim stream '" + st.name + "' threw an unknown exception");
        }
        break;
    }
  }

  void set_deferred(std::string msg) {
    std::lock_guard<std::mutex> l(deferred_mu);
    if (deferred_error.empty()) deferred_error = std::move(msg);
  }

  void rethrow_deferred() {
    std::string msg;
    {
      std::lock_guard<std::mutex> l(deferred_mu);
      msg.swap(deferred_error);
    }
    if (!msg.empty()) LS_FAIL(msg);
  }

  void worker_loop(StreamState* st) {
    for (;;) {
      Op op;
      {
        std::unique_lock<std::mutex> l(st->mu);
        st->cv.wait(l, [&] { return st->stop || !st->queue.empty(); });
        if (st->queue.empty()) return;  // stopped and drained
        op = std::move(st->queue.front());
        st->queue.pop_front();
        st->busy = true;
      }
      execute(*st, op);
      std::lock_guard<std::mutex> l(st->mu);
      st->busy = false;
    }
  }

  static void stop_and_join(StreamState& st) {
    {
      std::lock_guard<std::mutex> l(st.mu);
      st.stop = true;
    }
    st.cv.notify_all();
    if (st.worker.joinable()) st.worker.join();
  }

  // A free is a host write of the buffer and of every tracked region that
  // starts inside it: an access not ordered before it (a copy that may still
  // read the memory) is an ordering error. Then the regions are forgotten.
  void forget_memory(uintptr_t begin, std::size_t bytes) {
    if (!opts.checker) return;
    std::lock_guard<std::mutex> l(ck_mu);
    auto covered = [&](const AccessRec& a) { return a.agent == kHostAgent || host_clock.get(a.agent) >= a.clock; };
    for (auto it = regions.begin(); it != regions.end();) {
      if (it->second.begin >= begin && it->second.begin < begin + std::max<std::size_t>(bytes, 1)) {
        const RegionState& r = it->second;
        const AccessRec* open = r.has_write && !covered(r.last_write) ? &r.last_write : nullptr;
        for (const AccessRec& rd : r.reads)
          if (!open && !covered(rd)) open = &rd;
        if (open)
          errors.push_back("free of '" + r.label + "' while " + open->who + " may still " +
                           (open->access == Access::Write ? "write" : "read") + " it (" + open->what +
                           "): the host must wait for that work (synchronize its event) before freeing");
        it = regions.erase(it);
      } else {
        ++it;
      }
    }
  }
};

double SimBackend::jitter_factor(double jitter, uint64_t seed, uint64_t index) {
  if (jitter <= 0) return 1.0;
  const uint64_t r = splitmix64(splitmix64(seed) ^ (index * 0xD1B54A32D192ED03ull));
  const double u = static_cast<double>(r >> 11) * (1.0 / 9007199254740992.0);  // [0, 1)
  return 1.0 + jitter * (2.0 * u - 1.0);
}

SimBackend::SimBackend(SimOptions opts) : impl_(new Impl) {
  LS_CHECK(opts.jitter >= 0 && opts.jitter < 1, "SimOptions::jitter must be in [0, 1) (got ",
           opts.jitter, "); 0.1 means ±10%");
  LS_CHECK(opts.latency_us >= 0, "SimOptions::latency_us must be >= 0 (got ", opts.latency_us, ")");
  impl_->opts = opts;
  impl_->fail_pinned = opts.fail_pinned_allocations;
  Capabilities& c = impl_->caps;
  c.name = "sim";
  c.pinned_host_memory = true;
  c.host_functions = true;
  c.inline_streams = true;
  c.wrap_native_streams = false;
  c.ordering_checker = opts.checker;
  c.simulated = true;
  c.device_memory_bytes = opts.device_memory_bytes;
  impl_->h2d.gbps = opts.h2d_gbps;
  impl_->d2h.gbps = opts.d2h_gbps;
  impl_->h2d.latency_us = impl_->d2h.latency_us = opts.latency_us;
  impl_->h2d.jitter = impl_->d2h.jitter = opts.jitter;
  impl_->h2d.seed = opts.seed;
  impl_->d2h.seed = opts.seed + 1;
}

SimBackend::~SimBackend() {
  std::vector<std::shared_ptr<StreamState>> all;
  {
    std::lock_guard<std::mutex> l(impl_->streams_mu);
    for (auto& kv : impl_->streams) all.push_back(kv.second);
    impl_->streams.clear();
  }
  // Stop all first, then join: each worker drains its own queue; waits on
  // versions recorded on other streams complete because those drain too.
  for (auto& st : all) {
    {
      std::lock_guard<std::mutex> l(st->mu);
      st->stop = true;
    }
    st->cv.notify_all();
  }
  for (auto& st : all)
    if (st->worker.joinable()) st->worker.join();
  std::lock_guard<std::mutex> l(impl_->mem_mu);
  for (auto& kv : impl_->allocs) ::operator delete(kv.first, std::align_val_t(kAlign));
  impl_->allocs.clear();
}

const Capabilities& SimBackend::caps() const { return impl_->caps; }
const SimOptions& SimBackend::options() const { return impl_->opts; }
void SimBackend::set_fail_pinned_allocations(bool fail) { impl_->fail_pinned = fail; }

MemoryStats SimBackend::memory_stats() const {
  std::lock_guard<std::mutex> l(impl_->mem_mu);
  MemoryStats s;
  s.device_bytes_in_use = impl_->device_in_use;
  s.device_bytes_peak = impl_->device_peak;
  return s;
}

SimStats SimBackend::stats() const {
  SimStats s;
  auto b = [&](CopyDir d) { return impl_->bytes_by_dir[static_cast<int>(d)].load(); };
  auto n = [&](CopyDir d) { return impl_->copies_by_dir[static_cast<int>(d)].load(); };
  s.h2d_bytes = b(CopyDir::H2D);
  s.d2h_bytes = b(CopyDir::D2H);
  s.h2d_copies = n(CopyDir::H2D);
  s.d2h_copies = n(CopyDir::D2H);
  s.d2d_copies = n(CopyDir::D2D);
  s.h2h_copies = n(CopyDir::H2H);
  s.copies = s.h2d_copies + s.d2h_copies + s.d2d_copies + s.h2h_copies;
  std::lock_guard<std::mutex> l(impl_->mem_mu);
  s.device_bytes_in_use = impl_->device_in_use;
  s.peak_device_bytes = impl_->device_peak;
  return s;
}

// ---------------------------------------------------------------- memory

static void* aligned_alloc_or_null(std::size_t bytes) {
  std::size_t rounded = round_up(std::max<std::size_t>(bytes, 1), kAlign);
  return ::operator new(rounded, std::align_val_t(kAlign), std::nothrow);
}

BufferRef SimBackend::alloc_device(size_t bytes, const std::string& label) {
  std::lock_guard<std::mutex> l(impl_->mem_mu);
  const std::size_t limit = impl_->opts.device_memory_bytes;
  const std::size_t used = impl_->device_in_use;
  LS_CHECK(bytes <= limit && used <= limit - bytes, "sim device out of memory: cannot allocate ",
           bytes, " bytes for '", label, "' (", used, " bytes in use, limit ", limit,
           " bytes); free device buffers or raise SimOptions::device_memory_bytes");
  void* p = aligned_alloc_or_null(bytes);
  LS_CHECK(p != nullptr, "sim: the host could not provide ", bytes, " bytes to back device buffer '",
           label, "'");
  BufferRef r;
  r.ptr = p;
  r.bytes = bytes;
  r.kind = MemoryKind::Device;
  r.id = next_buffer_id();
  r.label = label;
  impl_->allocs[p] = {bytes, MemoryKind::Device, r.id};
  impl_->device_in_use += bytes;
  impl_->device_peak = std::max(impl_->device_peak, impl_->device_in_use);
  return r;
}

BufferRef SimBackend::alloc_host(size_t bytes, bool pinned, const std::string& label) {
  LS_CHECK(!(pinned && impl_->fail_pinned), "sim: pinned host allocation of ", bytes,
           " bytes for '", label,
           "' refused (the fail_pinned_allocations test hook is on); use pageable memory");
  void* p = aligned_alloc_or_null(bytes);
  LS_CHECK(p != nullptr, "sim: out of host memory allocating ", bytes, " bytes for '", label, "'");
  const MemoryKind kind = pinned ? MemoryKind::HostPinned : MemoryKind::HostPageable;
  BufferRef r;
  r.ptr = p;
  r.bytes = bytes;
  r.kind = kind;
  r.id = next_buffer_id();
  r.label = label;
  std::lock_guard<std::mutex> l(impl_->mem_mu);
  impl_->allocs[p] = {bytes, kind, r.id};
  return r;
}

bool SimBackend::pin_existing(void* ptr, size_t bytes) {
  return ptr != nullptr && bytes > 0 && !impl_->fail_pinned;
}
void SimBackend::unpin_existing(void*) {}

void SimBackend::free(const BufferRef& buf) {
  if (!buf.ptr) return;
  Impl::Alloc a;
  {
    std::lock_guard<std::mutex> l(impl_->mem_mu);
    auto it = impl_->allocs.find(buf.ptr);
    LS_CHECK(it != impl_->allocs.end() && it->second.id == buf.id, "sim: free of '", buffer_name(buf),
             "' which was not allocated by this backend (or was freed already; sub-regions and "
             "wrapped buffers are not owned and must not be freed)");
    a = it->second;
    impl_->allocs.erase(it);
    if (a.kind == MemoryKind::Device) impl_->device_in_use -= a.bytes;
  }
  impl_->forget_memory(reinterpret_cast<uintptr_t>(buf.ptr), a.bytes);
  ::operator delete(buf.ptr, std::align_val_t(kAlign));
}

void SimBackend::unwrap(const BufferRef& buf) {
  if (!impl_->opts.checker || buf.id == 0) return;
  std::lock_guard<std::mutex> l(impl_->ck_mu);
  impl_->regions.erase(buf.id);
}

// ---------------------------------------------------------------- streams

Stream SimBackend::create_stream(const std::string& name) {
  auto st = std::make_shared<StreamState>();
  {
    std::lock_guard<std::mutex> l(impl_->streams_mu);
    st->id = impl_->next_stream_id++;
    st->agent = impl_->next_agent++;
  }
  st->name = name.empty() ? "stream" + std::to_string(st->id) : name;
  st->who = "stream '" + st->name + "'";
  StreamState* raw = st.get();
  Impl* impl = impl_.get();
  st->worker = std::thread([impl, raw] { impl->worker_loop(raw); });
  std::lock_guard<std::mutex> l(impl_->streams_mu);
  impl_->streams[st->id] = st;
  return Stream(this, st->id);
}

Stream SimBackend::create_inline_stream(const std::string& name) {
  auto st = std::make_shared<StreamState>();
  std::lock_guard<std::mutex> l(impl_->streams_mu);
  st->id = impl_->next_stream_id++;
  st->is_inline = true;
  st->agent = kHostAgent;
  st->name = name.empty() ? "inline" + std::to_string(st->id) : name;
  st->who = "host (inline stream '" + st->name + "')";
  impl_->streams[st->id] = st;
  return Stream(this, st->id);
}

void SimBackend::destroy_stream(Stream s) {
  std::shared_ptr<StreamState> st = impl_->find(this, s);
  {
    std::lock_guard<std::mutex> l(impl_->streams_mu);
    impl_->streams.erase(st->id);
  }
  Impl::stop_and_join(*st);
}

std::string SimBackend::stream_name(Stream s) const {
  return impl_->find(const_cast<SimBackend*>(this), s)->name;
}

void SimBackend::synchronize(Stream s) {
  std::shared_ptr<StreamState> st = impl_->find(this, s);
  if (!st->is_inline) {
    Op op;
    op.kind = Op::Kind::Record;
    op.version = std::make_shared<EventVersion>();
    std::shared_ptr<EventVersion> v = op.version;
    impl_->enqueue(*st, &op, {});
    v->wait_done();
    impl_->host_join(v);
  }
  impl_->rethrow_deferred();
}

// ---------------------------------------------------------------- copies

void SimBackend::copy_async(const BufferRef& dst, size_t dst_offset, const BufferRef& src,
                            size_t src_offset, size_t bytes, Stream s) {
  LS_CHECK(dst.ptr != nullptr && src.ptr != nullptr, "copy_async with a null buffer (dst '",
           buffer_name(dst), "', src '", buffer_name(src), "')");
  LS_CHECK(dst_offset <= dst.bytes && bytes <= dst.bytes - dst_offset, "copy_async: ", bytes,
           " bytes at offset ", dst_offset, " do not fit in destination '", buffer_name(dst), "' of ",
           dst.bytes, " bytes");
  LS_CHECK(src_offset <= src.bytes && bytes <= src.bytes - src_offset, "copy_async: ", bytes,
           " bytes at offset ", src_offset, " are outside source '", buffer_name(src), "' of ",
           src.bytes, " bytes");
  std::shared_ptr<StreamState> st = impl_->find(this, s);
  const CopyDir dir = src.is_host() ? (dst.is_host() ? CopyDir::H2H : CopyDir::H2D)
                                    : (dst.is_host() ? CopyDir::D2H : CopyDir::D2D);
  const std::string what = std::string("copy ") + dir_name(dir) + " '" + buffer_name(dst) + "' <- '" +
                           buffer_name(src) + "'";
  std::vector<PendingAccess> acc{{&src, Access::Read, &what}, {&dst, Access::Write, &what}};
  void* d = static_cast<char*>(dst.ptr) + dst_offset;
  const void* sp = static_cast<const char*>(src.ptr) + src_offset;
  if (st->is_inline) {
    impl_->host_access(acc, st->who);
    impl_->do_copy(d, sp, bytes, dir);
    return;
  }
  Op op;
  op.kind = Op::Kind::Copy;
  op.dst = d;
  op.src = sp;
  op.bytes = bytes;
  op.dir = dir;
  impl_->enqueue(*st, &op, acc);
}

// ---------------------------------------------------------------- events

Event SimBackend::create_event() { return Event(this, std::make_unique<SimEventImpl>()); }

void SimBackend::record(Event& ev, Stream s) {
  Impl::version_of(this, ev);  // validates
  std::shared_ptr<StreamState> st = impl_->find(this, s);
  auto v = std::make_shared<EventVersion>();
  auto* impl = static_cast<SimEventImpl*>(ev.impl());
  if (st->is_inline) {
    if (impl_->opts.checker) {
      std::lock_guard<std::mutex> l(impl_->ck_mu);
      v->snapshot = impl_->host_clock;
    }
    v->done = true;
    impl->set(std::move(v));
    return;
  }
  Op op;
  op.kind = Op::Kind::Record;
  op.version = v;
  impl_->enqueue(*st, &op, {});
  impl->set(std::move(v));
}

void SimBackend::wait(Stream s, const Event& ev) {
  std::shared_ptr<EventVersion> v = Impl::version_of(this, ev);  // newest at enqueue time
  std::shared_ptr<StreamState> st = impl_->find(this, s);
  if (!v) return;  // never recorded: no-op
  if (st->is_inline) {
    v->wait_done();
    impl_->host_join(v);
    return;
  }
  Op op;
  op.kind = Op::Kind::Wait;
  op.version = std::move(v);
  impl_->enqueue(*st, &op, {});
}

void SimBackend::synchronize(const Event& ev) {
  std::shared_ptr<EventVersion> v = Impl::version_of(this, ev);
  if (v) {
    v->wait_done();
    impl_->host_join(v);
  }
  impl_->rethrow_deferred();
}

bool SimBackend::query(const Event& ev) {
  std::shared_ptr<EventVersion> v = Impl::version_of(this, ev);
  if (!v) return true;
  if (!v->is_done()) return false;
  impl_->host_join(v);
  return true;
}

// ---------------------------------------------------------------- host functions

void SimBackend::launch_host_func(Stream s, std::function<void()> fn) {
  LS_CHECK(static_cast<bool>(fn), "launch_host_func with an empty function");
  std::shared_ptr<StreamState> st = impl_->find(this, s);
  if (st->is_inline) {
    fn();
    return;
  }
  Op op;
  op.kind = Op::Kind::HostFunc;
  op.fn = std::move(fn);
  impl_->enqueue(*st, &op, {});
}

// ---------------------------------------------------------------- checker

void SimBackend::declare_access(const BufferRef& buf, Access a, Stream s, const std::string& what) {
  std::shared_ptr<StreamState> st = impl_->find(this, s);
  if (!impl_->opts.checker) return;
  std::vector<PendingAccess> acc{{&buf, a, &what}};
  if (st->is_inline) impl_->host_access(acc, st->who);
  else impl_->enqueue(*st, nullptr, acc);
}

void SimBackend::declare_host_access(const BufferRef& buf, Access a, const std::string& what) {
  std::vector<PendingAccess> acc{{&buf, a, &what}};
  impl_->host_access(acc, "host");
}

std::vector<std::string> SimBackend::ordering_errors() const {
  std::lock_guard<std::mutex> l(impl_->ck_mu);
  return impl_->errors;
}

void SimBackend::clear_ordering_errors() {
  std::lock_guard<std::mutex> l(impl_->ck_mu);
  impl_->errors.clear();
}

std::shared_ptr<SimBackend> make_sim_backend(SimOptions opts) {
  return std::make_shared<SimBackend>(opts);
}

}  // namespace layerstream
