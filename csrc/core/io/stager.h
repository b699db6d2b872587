// layerstream — the host tier: layers whose bytes are not in pinned memory.
//
// Some streamed layers cannot be copied to the device straight from pinned
// host memory: their weights stay in the checkpoint file (the disk tier: the
// model is larger than the host budget), or they live in pageable memory
// (beyond the pinned budget). The Stager brings such a layer's bytes into an
// entry of its host cache (pinned when allowed), from which the scheduler's
// transfer stream copies them into the device slot:
//
//   staging stream:  [wait: the entry's last copy done] [read the layer into the entry] [record read_done]
//   transfer stream: [wait: read_done] [copy entry -> slot] [record the entry's copied event]
//
// Reads run as host functions on a staging stream of their own, each read
// spread over a pool of reader threads in large pread() chunks, so the disk
// read of one layer, the host-to-device copy of the one before and the
// compute of the one before that overlap. All ordering is stream-ordered
// (events), none of it blocks the caller, and the sim device's checker sees
// every access. Entries hold layers by farthest next use in the traced
// schedule (Belady: a step's order is known, so the cache keeps what is
// needed soonest); read_ahead() fills entries with the layers the trace
// needs next, ahead of the device prefetch. Layers read from memory are never
// kept across a step boundary (their source may be written by an optimizer);
// layers read from files are (loaded weights do not change; the file is
// checked before every read). docs/design/host-tier.md says why.
//
// A read that fails (the file changed, an I/O error) fills the entry with
// NaN bytes (0xFF) and is reported by error(): the owner raises it at the
// next acquire and at the end of the step, and no finite output is ever
// computed from other weights.
//
// Ownership: the Stager owns its entries (host memory) and its staging
// stream; the memory named by a StagedPart must outlive it. Thread safety:
// none of its own; its owner (the Scheduler) calls it under its lock. Reads
// run on the staging stream and the reader threads.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "../runtime.h"
#include "checksum.h"
#include "source_file.h"

namespace layerstream {
namespace optim {
class ThreadPool;
}

// Where one part of a staged layer comes from: a byte range of a file, or
// pageable host memory.
struct StagedPart {
  std::shared_ptr<SourceFile> file;  // set: read [offset, offset + bytes) of it
  uint64_t offset = 0;
  const void* memory = nullptr;      // else: copy `bytes` from here
  uint64_t bytes = 0;
  std::string tensor;                // for error messages
  // Set: the file's bytes must have this checksum, checked at the part's first
  // read (then marked verified); a mismatch fails the read like an I/O error.
  std::shared_ptr<ReadCheck> check;
};

struct StagerOptions {
  uint64_t cache_bytes = 0;   // host bytes for entries (>= 2 of the largest staged layer)
  bool pinned = true;         // entries in pinned memory (else pageable)
  int reader_threads = 4;     // threads per read (the calling host function included)
  // How many of the next layers of the trace read_ahead() keeps in entries
  // (0: the scheduler's prefetch depth + 1). Deeper hides more disk latency
  // but turns over more of the cache: a cyclic schedule of n layers with e
  // entries reads at most n - e + read_ahead of them per step.
  int read_ahead = 0;
  uint64_t chunk_bytes = 1ull << 20;  // per pread()
};

struct StagerStats {
  uint64_t entries = 0, entry_bytes = 0;
  uint64_t reads = 0, read_bytes = 0;      // layers read into entries, and their bytes
  uint64_t file_bytes = 0;                 // of which from files
  uint64_t hits = 0;                       // stage() found the layer already in an entry
  uint64_t read_aheads = 0;                // reads issued by read_ahead()
  bool pinned = false;
};

class Stager {
 public:
  // The distance (in trace entries) to a layer's next use, -1 when unknown.
  using NextUse = std::function<int64_t(int layer)>;

  // `layers[i]` are the parts of the scheduler's layer i (empty: not staged).
  Stager(Backend& backend, std::vector<std::vector<StagedPart>> layers, const StagerOptions& options);
  ~Stager();
  Stager(const Stager&) = delete;
  Stager& operator=(const Stager&) = delete;

  bool staged(int layer) const;
  // Makes `transfer` wait until `layer`'s bytes are in an entry (issuing the
  // read when they are not) and returns the entry; part i lies at
  // (*offsets)[i] in it. Valid for copies enqueued on `transfer` before
  // copied().
  const BufferRef& stage(int layer, Stream transfer, const NextUse& next_use, std::vector<uint64_t>* offsets);
  // Call after enqueuing the copies from stage()'s buffers on `transfer`.
  void copied(int layer, Stream transfer);
  // Issues reads of `upcoming` layers (in order of need) into entries whose
  // content is needed later than they are (or not at all).
  void read_ahead(const std::vector<int>& upcoming, const NextUse& next_use);
  // Forgets the entries of layers read from memory (at a step boundary).
  void forget_memory_layers();
  // Forgets `layer`'s entry when the layer is read from memory (its source
  // was written: the next stage() reads it again).
  void forget_memory_layer(int layer);
  // Forgets every entry's content (after a failed read).
  void forget_all();
  // The first failed read's message since the last call ("" if none); clears it.
  std::string take_error();
  // Blocks until every read and every copy recorded so far is done.
  void synchronize();
  StagerStats stats() const;

 private:
  struct Entry {
    HostBuffer buf;
    int layer = -1;
    uint64_t tick = 0;        // last stage() or read: older goes first among equals
    bool copy_recorded = false;
    Event read_done, copied;
  };
  bool from_files(int layer) const;  // every part from a file: kept across steps
  int pick_victim(int64_t need_by, const NextUse& next_use, bool must) const;
  void issue_read(int entry, int layer, bool ahead);

  Backend& backend_;
  std::vector<std::vector<StagedPart>> layers_;
  std::vector<int> entry_of_;  // layer -> entry holding (or reading) it, -1
  std::vector<Entry> entries_;
  Stream stage_;
  std::unique_ptr<optim::ThreadPool> readers_;
  StagerOptions opts_;
  uint64_t tick_ = 0;
  StagerStats stats_;
  std::shared_ptr<std::mutex> err_mu_;
  std::shared_ptr<std::string> error_;
};

}  // namespace layerstream
