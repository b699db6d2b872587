// The host tier (core/io) and the shared host store: SourceFile reads and identity checks; the Stager
// under the Scheduler on the sim device with the ordering checker: layers
// read from a file (the disk tier) and from pageable memory, mixed with plain
// pinned layers, over random schedules — every slot byte-identical to its
// source, zero ordering errors; the cache keeps layers by farthest next use;
// a file changed mid-run is an error, never other weights.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <thread>

#include "backends/sim/sim_backend.h"
#include "core/error.h"
#include "core/host_store.h"
#include "core/io/checksum.h"
#include "core/io/source_file.h"
#include "core/optim/thread_pool.h"
#include "core/scheduler.h"

using namespace layerstream;

namespace {

std::string temp_path(const std::string& name) {
  return testing::TempDir() + "/ls_stager_" + std::to_string(::getpid()) + "_" + name;
}

std::vector<unsigned char> random_bytes(size_t n, std::mt19937& rng) {
  std::vector<unsigned char> b(n);
  for (auto& x : b) x = static_cast<unsigned char>(rng());
  return b;
}

void write_file(const std::string& path, const std::vector<unsigned char>& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.message();
  }
  return "";
}

TEST(SourceFile, ReadsInChunksOnAPoolAndChecksIdentity) {
  std::mt19937 rng(7);
  const std::string path = temp_path("read.bin");
  const auto bytes = random_bytes(12 << 20, rng);
  write_file(path, bytes);
  auto f = SourceFile::open(path);
  EXPECT_EQ(f->size(), bytes.size());
  optim::ThreadPool pool(3);
  std::vector<unsigned char> out(bytes.size() - 12345);
  f->read(out.data(), 12345, out.size(), "t", &pool, 4096 + 17);  // 3 segments of many odd-sized chunks
  EXPECT_EQ(0, std::memcmp(out.data(), bytes.data() + 12345, out.size()));
  f->read(out.data(), 0, 1000, "t");  // calling thread only
  EXPECT_EQ(0, std::memcmp(out.data(), bytes.data(), 1000));
  EXPECT_NE(error_of([&] { f->read(out.data(), bytes.size() - 10, 11, "w.past"); }).find("past the end"),
            std::string::npos);
  // Rewritten with other content of the same size: the modification time
  // (or inode) differs, and the message names the file and the tensor.
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  auto other = bytes;
  other[5] ^= 1;
  write_file(path, other);
  const std::string msg = error_of([&] { f->read(out.data(), 0, 10, "blk.3.weight"); });
  EXPECT_NE(msg.find("changed after it was loaded"), std::string::npos) << msg;
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find("blk.3.weight"), std::string::npos) << msg;
  std::remove(path.c_str());
  EXPECT_NE(error_of([&] { f->check("x"); }).find("is gone"), std::string::npos);
  EXPECT_NE(error_of([&] { SourceFile::open(path); }).find("cannot open"), std::string::npos);
}

// checksum64 (core/io/checksum.h): every one-bit change of a buffer and every
// length changes it, for all the tails of the word loop; fixed width hex.
TEST(Checksum, EveryBitFlipAndEveryLengthChangesIt) {
  std::mt19937 rng(11);
  for (size_t n : {0, 1, 7, 8, 9, 31, 32, 33, 63, 100}) {
    auto b = random_bytes(n, rng);
    const uint64_t base = checksum64(b.data(), n);
    for (size_t i = 0; i < n; ++i)
      for (int bit = 0; bit < 8; ++bit) {
        b[i] ^= static_cast<unsigned char>(1 << bit);
        EXPECT_NE(checksum64(b.data(), n), base) << n << " " << i << " " << bit;
        b[i] ^= static_cast<unsigned char>(1 << bit);
      }
    EXPECT_EQ(checksum64(b.data(), n), base);
  }
  const std::vector<unsigned char> zeros(64, 0);
  for (size_t n = 0; n < 64; ++n) EXPECT_NE(checksum64(zeros.data(), n), checksum64(zeros.data(), n + 1)) << n;
  uint64_t back = 0;
  EXPECT_TRUE(parse_checksum(checksum_hex(0x0123456789abcdefull), &back));
  EXPECT_EQ(back, 0x0123456789abcdefull);
  EXPECT_EQ(checksum_hex(5), "0000000000000005");
  EXPECT_FALSE(parse_checksum("0123456789ABCDEF", &back));
  EXPECT_FALSE(parse_checksum("123", &back));
}

// SourceFile::verify: bytes as written pass (and are not hashed again); other
// bytes are an error naming the file and the tensor, and stay unverified.
TEST(SourceFile, VerifyChecksBytesOnceAndNamesTheFile) {
  std::mt19937 rng(3);
  const std::string path = temp_path("verify.bin");
  const auto bytes = random_bytes(5000, rng);
  write_file(path, bytes);
  auto f = SourceFile::open(path, {}, SourceFile::Kind::QuantCache);
  ReadCheck good(checksum64(bytes.data(), bytes.size()));
  std::vector<unsigned char> out(bytes.size());
  f->read(out.data(), 0, out.size(), "w");
  f->verify(out.data(), out.size(), "w", good);
  EXPECT_TRUE(good.verified.load());
  out[10] ^= 1;
  f->verify(out.data(), out.size(), "w", good);  // verified once: not checked again
  ReadCheck bad(checksum64(bytes.data(), bytes.size()) ^ 1);
  const std::string msg = error_of([&] { f->verify(bytes.data(), bytes.size(), "blk.2.weight", bad); });
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find("'blk.2.weight' does not hold the bytes written there"), std::string::npos) << msg;
  EXPECT_NE(msg.find("Delete it"), std::string::npos) << msg;
  EXPECT_FALSE(bad.verified.load());
  std::remove(path.c_str());
}

TEST(SourceFile, ARecordedIdentityIsCheckedByAFileOpenedLater) {
  std::mt19937 rng(8);
  const std::string path = temp_path("recorded.bin");
  const auto bytes = random_bytes(4096, rng);
  write_file(path, bytes);
  FileIdentity recorded;
  {
    auto first = SourceFile::open(path);  // e.g. when its header was read
    recorded = first->identity();
  }
  EXPECT_TRUE(recorded.recorded());
  std::vector<unsigned char> out(16);
  SourceFile::open(path, recorded)->read(out.data(), 0, out.size(), "t");  // unchanged: reads
  auto other = bytes;
  other[5] ^= 1;
  write_file(path, other);
  struct timespec times[2] = {{0, UTIME_OMIT}, {static_cast<time_t>(recorded.mtime_ns / 1000000000 + 1), 0}};
  ASSERT_EQ(0, ::utimensat(AT_FDCWD, path.c_str(), times, 0));  // a later modification time, without waiting
  // Opened only now, after the change: the recorded identity, not the one at open, decides.
  auto later = SourceFile::open(path, recorded);
  const std::string msg = error_of([&] { later->read(out.data(), 0, out.size(), "blk.0.weight"); });
  EXPECT_NE(msg.find("changed after it was loaded"), std::string::npos) << msg;
  EXPECT_NE(msg.find("Load the model again"), std::string::npos) << msg;
  // Layerstream's own cache file says so, and what to do.
  const std::string cache = error_of([&] {
    SourceFile::open(path, recorded, SourceFile::Kind::QuantCache)->check("blk.0.weight");
  });
  EXPECT_NE(cache.find("quantization cache file"), std::string::npos) << cache;
  EXPECT_NE(cache.find("offload() again"), std::string::npos) << cache;
  std::remove(path.c_str());
}

// A model of `n` layers: each one part of random size, from the file (even
// layers), from pageable memory (every third odd one) or pinned (the rest).
struct Model {
  std::vector<LayerSpec> specs;
  std::vector<std::vector<unsigned char>> content;
  std::vector<std::vector<unsigned char>> memory;  // sources of memory layers (kept alive)
  std::shared_ptr<SourceFile> file;
  size_t largest = 0;
};

Model make_model(Backend& be, HostStore& store, int n, std::mt19937& rng, const std::string& path,
                 bool all_from_file = false, size_t fixed = 0) {
  Model m;
  std::vector<unsigned char> file_bytes;
  std::vector<std::pair<int, size_t>> at;  // layer -> offset in the file
  for (int l = 0; l < n; ++l) {
    const size_t bytes = fixed ? fixed : 1 + rng() % 6000;
    m.content.push_back(random_bytes(bytes, rng));
    if (all_from_file || l % 2 == 0 || l % 3 == 0) m.largest = std::max(m.largest, (bytes + 255) / 256 * 256);
  }
  for (int l = 0; l < n; ++l) {
    if (all_from_file || l % 2 == 0) {
      at.push_back({l, file_bytes.size() + 13});  // unaligned offsets
      file_bytes.resize(file_bytes.size() + 13);
      file_bytes.insert(file_bytes.end(), m.content[l].begin(), m.content[l].end());
    }
  }
  write_file(path, file_bytes);
  m.file = SourceFile::open(path);
  m.memory.resize(static_cast<size_t>(n));
  for (int l = 0; l < n; ++l) {
    LayerSpec spec;
    spec.name = "layer" + std::to_string(l);
    const auto& c = m.content[static_cast<size_t>(l)];
    const bool from_file = all_from_file || l % 2 == 0;
    if (from_file || l % 3 == 0) {
      StagedPart p;
      p.bytes = c.size();
      p.tensor = spec.name + ".weight";
      if (from_file) {
        p.file = m.file;
        for (auto& [k, off] : at)
          if (k == l) p.offset = off;
      } else {
        m.memory[static_cast<size_t>(l)] = c;
        p.memory = m.memory[static_cast<size_t>(l)].data();
      }
      spec.staged.push_back(p);
      BufferRef size_only;
      size_only.bytes = c.size();
      size_only.kind = MemoryKind::HostPageable;
      spec.parts.push_back(size_only);
    } else {
      spec.parts.push_back(store.buffer(store.add(c.size(), c.data(), spec.name)));
    }
    m.specs.push_back(spec);
  }
  (void)be;
  return m;
}

bool slot_matches(const Lease& lease, const std::vector<unsigned char>& c) {
  return std::memcmp(lease.part_ptr(0), c.data(), c.size()) == 0;
}

struct Params {
  int prefetch, slots, entries;
  bool async_compute;
};

class StagedSchedule : public testing::TestWithParam<Params> {};

TEST_P(StagedSchedule, NoRacesBytesExact) {
  const Params p = GetParam();
  SimOptions o;
  o.h2d_gbps = 0;
  o.latency_us = 0;
  o.jitter = 0;
  auto sim = make_sim_backend(o);
  std::mt19937 rng(99u + static_cast<unsigned>(p.prefetch * 7 + p.entries));
  HostStore store(*sim);
  const int n = 7 + static_cast<int>(rng() % 4);
  const std::string path = temp_path("sched" + std::to_string(p.prefetch) + std::to_string(p.entries) + ".bin");
  Model m = make_model(*sim, store, n, rng, path);
  SchedulerOptions so;
  so.num_slots = p.slots;
  so.prefetch_depth = p.prefetch;
  so.staging.cache_bytes = m.largest * static_cast<size_t>(p.entries);
  so.staging.reader_threads = 2;
  so.staging.chunk_bytes = 1000;  // several chunks per layer
  Stream transfer = sim->create_stream("transfer");
  Stream compute = p.async_compute ? sim->create_stream("compute") : sim->create_inline_stream("compute");
  int mismatches = 0;
  {
    Scheduler sched(*sim, transfer, m.specs, so);
    for (int step = 0; step < 30; ++step) {
      std::vector<std::pair<int, Phase>> seq;
      for (int i = 0; i < n; ++i) seq.push_back({i, Phase::Forward});
      for (int i = n - 1; i >= 0; --i) seq.push_back({i, Phase::Backward});
      if (step > 2 && rng() % 3 == 0) std::swap(seq[1 + rng() % (seq.size() - 2)], seq[1 + rng() % (seq.size() - 2)]);
      for (auto [layer, phase] : seq) {
        Lease lease = sched.acquire(layer, compute, phase);
        const auto& c = m.content[static_cast<size_t>(layer)];
        sim->launch_host_func(compute, [&mismatches, lease, &c] {
          if (!slot_matches(lease, c)) ++mismatches;
        });
        sched.release(lease, compute);
      }
      sim->synchronize(compute);
    }
    const SchedulerStats st = sched.stats();
    EXPECT_GT(st.staging.reads, 0u);
    EXPECT_GT(st.staging.file_bytes, 0u);
    EXPECT_EQ(st.staging.entries, static_cast<uint64_t>(p.entries));
  }
  EXPECT_EQ(mismatches, 0);
  EXPECT_TRUE(sim->ordering_errors().empty()) << sim->ordering_errors().front();
  std::remove(path.c_str());
}

INSTANTIATE_TEST_SUITE_P(Schedules, StagedSchedule,
                         testing::Values(Params{0, 2, 2, false}, Params{2, 4, 2, true}, Params{2, 4, 3, false},
                                         Params{3, 5, 5, true}, Params{1, 3, 12, true}, Params{4, 6, 4, true}));

// Forward-only cyclic steps over n equal layers, all from the file. With e
// entries and read-ahead r, keeping by farthest next use reads at most
// n - e + r layers per step; least-recently used would read all n every
// step. With entries for all, nothing is read after the first step.
uint64_t reads_per_step(int n, int entries, int prefetch = 1, int slots = 2) {
  SimOptions o;
  o.h2d_gbps = 0;
  o.latency_us = 0;
  auto sim = make_sim_backend(o);
  std::mt19937 rng(5);
  HostStore store(*sim);
  const std::string path = temp_path("belady" + std::to_string(entries) + ".bin");
  Model m = make_model(*sim, store, n, rng, path, /*all_from_file=*/true, /*fixed=*/1024);
  SchedulerOptions so;
  so.num_slots = slots;
  so.prefetch_depth = prefetch;
  so.staging.cache_bytes = 1024 * static_cast<size_t>(entries);
  Stream transfer = sim->create_stream("transfer");
  Stream compute = sim->create_inline_stream("compute");
  Scheduler sched(*sim, transfer, m.specs, so);
  uint64_t before = 0;
  for (int step = 0; step < 6; ++step) {
    if (step == 4) before = sched.stats().staging.reads;
    for (int i = 0; i < n; ++i) {
      Lease lease = sched.acquire(i, compute, Phase::Forward);
      EXPECT_TRUE(slot_matches(lease, m.content[static_cast<size_t>(i)])) << "layer " << i;
      sched.release(lease, compute);
    }
  }
  const uint64_t per_step = (sched.stats().staging.reads - before) / 2;
  std::remove(path.c_str());
  return per_step;
}

TEST(StagerCache, KeepsByFarthestNextUse) {
  // Read-ahead depth here: prefetch 1 + 1 = 2.
  for (uint64_t e : {4u, 7u, 9u}) {
    const uint64_t r = reads_per_step(10, static_cast<int>(e));
    EXPECT_LE(r, 10u - e + 2u) << e << " entries";
    EXPECT_LT(r, 10u) << e << " entries";
  }
  EXPECT_EQ(reads_per_step(10, 10), 0u);
}

// A device prefetch deeper than the entries (Note [Staging skips what a slot
// serves], scheduler.cpp): the layers already copied into slots kept their
// entries as if needed soonest, and the others were read twice a step (12
// layers, 3 entries, prefetch 4: 21 reads a step).
TEST(StagerCache, APrefetchDeeperThanTheEntriesReadsEachLayerOnce) {
  for (int prefetch : {3, 4, 6}) {
    const uint64_t r = reads_per_step(12, 3, prefetch, prefetch + 2);
    EXPECT_LE(r, 12u - 3u + static_cast<uint64_t>(prefetch) + 1u) << "prefetch " << prefetch;
    EXPECT_LE(r, 12u) << "prefetch " << prefetch;
  }
}

TEST(StagerCache, TooSmallIsAClearError) {
  auto sim = make_sim_backend(SimOptions{});
  std::mt19937 rng(3);
  HostStore store(*sim);
  const std::string path = temp_path("small.bin");
  Model m = make_model(*sim, store, 4, rng, path, true, 5000);
  SchedulerOptions so;
  so.staging.cache_bytes = 5120;  // one entry
  Stream transfer = sim->create_stream("transfer");
  const std::string msg = error_of([&] { Scheduler s(*sim, transfer, m.specs, so); });
  EXPECT_NE(msg.find("at least two of the largest such layer"), std::string::npos) << msg;
  EXPECT_NE(msg.find("host_budget"), std::string::npos) << msg;
  std::remove(path.c_str());
}

// A layer read from pageable memory keeps its bytes in a staging entry for the
// rest of the step. An in-place write to its host tensor within the step (two
// calls that share one; Note [When a step begins] in scheduler.cpp) bumps its
// version: the next fetch reads the memory again rather than serve the entry
// (the slot's own copy was evicted, so only the entry could serve it).
TEST(StagerCache, AnInPlaceWriteToALayerReadFromMemoryIsReadAgainWithinAStep) {
  SimOptions o;
  o.h2d_gbps = 0;
  o.latency_us = 0;
  auto sim = make_sim_backend(o);
  constexpr size_t kBytes = 512;
  std::vector<std::vector<unsigned char>> bytes(4, std::vector<unsigned char>(kBytes));
  std::vector<LayerSpec> specs;
  for (int l = 0; l < 4; ++l) {
    for (size_t i = 0; i < kBytes; ++i) bytes[l][i] = static_cast<unsigned char>(l * 31 + i);
    LayerSpec spec;
    spec.name = "layer" + std::to_string(l);
    StagedPart p;
    p.bytes = kBytes;
    p.memory = bytes[l].data();
    p.tensor = spec.name + ".weight";
    spec.staged.push_back(p);
    BufferRef size_only;
    size_only.bytes = kBytes;
    size_only.kind = MemoryKind::HostPageable;
    spec.parts.push_back(size_only);
    specs.push_back(spec);
  }
  std::vector<uint64_t> version(4, 0);
  const auto served_current = [&](bool versioned) {
    SchedulerOptions so;
    so.num_slots = 2;
    so.prefetch_depth = 0;
    so.staging.cache_bytes = 4 * kBytes;  // every layer keeps its entry
    if (versioned) so.write_version = [&](int l) { return version[static_cast<size_t>(l)]; };
    Stream transfer = sim->create_stream("transfer");
    Stream compute = sim->create_inline_stream("compute");
    Scheduler sched(*sim, transfer, specs, so);
    for (int l : {0, 1, 2, 3}) {
      Lease x = sched.acquire(l, compute);
      sched.release(x, compute);
    }
    sim->synchronize(transfer);
    for (auto& b : bytes[0]) b = static_cast<unsigned char>(b ^ 0x5a);  // e.g. param.mul_() under no_grad
    version[0]++;
    const uint64_t entry_hits = sched.stats().staging.hits;
    Lease x = sched.acquire(0, compute, Phase::Backward);  // the same step
    const bool current = std::memcmp(x.part_ptr(0), bytes[0].data(), kBytes) == 0;
    sched.release(x, compute);
    EXPECT_EQ(sched.stats().misses, 5u) << "layer 0's slot was not evicted: the entry is not what is tested";
    if (!versioned) {
      EXPECT_EQ(sched.stats().staging.hits, entry_hits + 1);
    }
    return current;
  };
  EXPECT_FALSE(served_current(false)) << "without the version the entry's old bytes are served: the test shows nothing";
  EXPECT_TRUE(served_current(true));
  EXPECT_TRUE(sim->ordering_errors().empty());
}

// The file is rewritten between steps: the next read fails, the step raises
// naming the file and tensor, and no slot handed out before the error holds
// anything but the loaded bytes or NaN bytes.
TEST(StagerFile, ChangedFileIsAnErrorNeverOtherWeights) {
  SimOptions o;
  o.h2d_gbps = 0;
  o.latency_us = 0;
  auto sim = make_sim_backend(o);
  std::mt19937 rng(11);
  HostStore store(*sim);
  const std::string path = temp_path("changed.bin");
  Model m = make_model(*sim, store, 6, rng, path, true, 2048);
  SchedulerOptions so;
  so.num_slots = 3;
  so.prefetch_depth = 1;
  so.staging.cache_bytes = 2048 * 3;
  Stream transfer = sim->create_stream("transfer");
  Stream compute = sim->create_inline_stream("compute");
  Scheduler sched(*sim, transfer, m.specs, so);
  auto run_step = [&] {
    for (int i = 0; i < 6; ++i) {
      Lease lease = sched.acquire(i, compute, Phase::Forward);
      sim->synchronize(transfer);
      const auto* b = static_cast<const unsigned char*>(lease.part_ptr(0));
      const bool nan = std::all_of(b, b + 2048, [](unsigned char x) { return x == 0xFF; });
      EXPECT_TRUE(nan || slot_matches(lease, m.content[static_cast<size_t>(i)])) << "layer " << i;
      sched.release(lease, compute);
    }
  };
  run_step();
  run_step();
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  std::ifstream in(path, std::ios::binary);
  std::vector<unsigned char> bytes((std::istreambuf_iterator<char>(in)), {});
  bytes[100] ^= 0x55;
  write_file(path, bytes);
  std::string msg;
  for (int tries = 0; tries < 3 && msg.empty(); ++tries) msg = error_of([&] { run_step(); sched.quiesce(); });
  EXPECT_NE(msg.find("changed after it was loaded"), std::string::npos) << msg;
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  std::remove(path.c_str());
}

}  // namespace

// The host store shared by a node's ranks (core/shared_region.h,
// docs/design/distributed.md): two stores over one memory file, as two ranks
// map it (here both in this process, the second through /proc/<pid>/fd like
// another rank): same sizes in the same order give the same tensors; only the
// writer copies; a non-shareable tensor stays private; the digest tells
// layouts apart; the region frees nothing it did not carve.
TEST(SharedStore, TwoStoresOverOneRegionSeeTheSameTensors) {
  auto sim = make_sim_backend(SimOptions{});
  Backend& backend = *sim;
  auto region = SharedRegion::create(1 << 20, "store");
  auto mapped = SharedRegion::open(region->pid(), region->fd(), region->capacity());
  EXPECT_NE(static_cast<void*>(region->base()), static_cast<void*>(mapped->base()));
  HostStore writer(backend), reader(backend);
  writer.share(region, /*writer=*/true);
  reader.share(mapped, /*writer=*/false);
  std::mt19937 rng(7);
  const auto a = random_bytes(5000, rng), b = random_bytes(123, rng), c = random_bytes(64, rng);
  std::vector<unsigned char> other(5000, 0xEE);
  const size_t wa = writer.add(a.size(), a.data(), "a"), ra = reader.add(other.size(), other.data(), "a");
  const size_t wb = writer.add(b.size(), b.data(), "b"), rb = reader.add(b.size(), nullptr, "b");
  // The reader did not copy its source: it sees the writer's bytes.
  EXPECT_EQ(0, std::memcmp(reader.buffer(ra).ptr, a.data(), a.size()));
  EXPECT_EQ(0, std::memcmp(reader.buffer(rb).ptr, b.data(), b.size()));
  EXPECT_EQ(0u, reinterpret_cast<uintptr_t>(writer.buffer(wb).ptr) % SharedRegion::page_size());
  EXPECT_EQ(writer.layout_digest(), reader.layout_digest());
  EXPECT_TRUE(writer.shares(/*trainable=*/false));
  EXPECT_FALSE(writer.shares(/*trainable=*/true));  // share(..., trainable=true) would
  // A trainable tensor: this process's own memory, outside the region and the digest.
  const size_t wc = writer.add(c.size(), c.data(), "c", /*shareable=*/false);
  EXPECT_FALSE(writer.in_shared(writer.buffer(wc).ptr));
  EXPECT_TRUE(writer.in_shared(writer.buffer(wa).ptr));
  EXPECT_EQ(0, std::memcmp(writer.buffer(wc).ptr, c.data(), c.size()));
  EXPECT_EQ(writer.layout_digest(), reader.layout_digest());
  EXPECT_EQ(writer.stats().shared_bytes, a.size() + b.size());
  // A write through one mapping is seen through the other.
  static_cast<unsigned char*>(writer.buffer(wa).ptr)[17] ^= 0xFF;
  EXPECT_EQ(static_cast<unsigned char*>(reader.buffer(ra).ptr)[17], static_cast<unsigned char>(a[17] ^ 0xFF));
  // A different layout, a different digest.
  reader.add(8, nullptr, "d");
  EXPECT_NE(writer.layout_digest(), reader.layout_digest());
  // Full: a clear error, not an overlap.
  EXPECT_THROW(writer.add(2 << 20, nullptr, "too big"), Error);
  // Once the creator closed its descriptor, nobody else can open the region.
  region->close_fd();
  EXPECT_THROW(SharedRegion::open(region->pid(), 1000000, region->capacity()), Error);
}
