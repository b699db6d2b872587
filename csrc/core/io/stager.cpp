#include "stager.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "core/log.h"
#include "core/optim/thread_pool.h"
#include "core/slot_layout.h"

namespace layerstream {

namespace {
// Each part's offset in an entry: one after the other, aligned as in a slot.
std::vector<uint64_t> part_offsets(const std::vector<StagedPart>& parts, uint64_t* total) {
  std::vector<uint64_t> off;
  uint64_t at = 0;
  for (const StagedPart& p : parts) {
    off.push_back(at);
    at = slot_layout::align(at + p.bytes);
  }
  if (total) *total = at;
  return off;
}
}  // namespace

Stager::Stager(Backend& backend, std::vector<std::vector<StagedPart>> layers, const StagerOptions& options)
    : backend_(backend), layers_(std::move(layers)), opts_(options) {
  uint64_t largest = 0;
  size_t largest_index = 0;
  for (size_t i = 0; i < layers_.size(); ++i) {
    uint64_t total = 0;
    part_offsets(layers_[i], &total);
    if (total > largest) largest = total, largest_index = i;
    for (const StagedPart& p : layers_[i])
      LS_CHECK(p.file || p.memory || p.bytes == 0, "staged part '", p.tensor, "' has neither a file nor memory");
  }
  entry_of_.assign(layers_.size(), -1);
  if (largest == 0) return;
  LS_CHECK(backend_.caps().host_functions, "the ", backend_.caps().name,
           " backend cannot run host functions on a stream, which reading weights from disk or "
           "pageable memory needs");
  const uint64_t n = opts_.cache_bytes / largest;
  const std::string biggest = layers_[largest_index].empty() ? "" : layers_[largest_index][0].tensor;
  LS_CHECK(n >= 2, "the host memory left for staging layers read from disk or pageable memory is ",
           opts_.cache_bytes, " bytes; at least two of the largest such layer ('", biggest, "', ", largest,
           " bytes) are needed (", 2 * largest, " bytes). Raise host_budget (or pinned_budget)");
  bool fell_back = false;
  for (uint64_t i = 0; i < n; ++i) {
    Entry e;
    e.buf = HostBuffer::allocate(backend_, largest, opts_.pinned, "staging entry " + std::to_string(i), &fell_back);
    e.read_done = backend_.create_event();
    e.copied = backend_.create_event();
    entries_.push_back(std::move(e));
  }
  if (fell_back && opts_.pinned)
    warn("could not allocate pinned host memory for all " + std::to_string(n) +
         " staging entries; some are pageable (slower, less asynchronous host-to-device copies)");
  stats_.entries = n;
  stats_.entry_bytes = largest;
  stats_.pinned = opts_.pinned && !fell_back;
  stage_ = backend_.create_stream("staging");
  readers_ = std::make_unique<optim::ThreadPool>(std::max(1, opts_.reader_threads));
  err_mu_ = std::make_shared<std::mutex>();
  error_ = std::make_shared<std::string>();
}

Stager::~Stager() {
  try {
    synchronize();
  } catch (...) {
  }
  if (!entries_.empty()) backend_.destroy_stream(stage_);
}

bool Stager::staged(int layer) const {
  return layer >= 0 && static_cast<size_t>(layer) < layers_.size() && !layers_[static_cast<size_t>(layer)].empty();
}

bool Stager::from_files(int layer) const {
  for (const StagedPart& p : layers_[static_cast<size_t>(layer)])
    if (!p.file) return false;
  return true;
}

int Stager::pick_victim(int64_t need_by, const NextUse& next_use, bool must) const {
  int best = -1;
  int64_t best_d = -1;
  uint64_t best_tick = 0;
  for (size_t i = 0; i < entries_.size(); ++i) {
    const Entry& e = entries_[i];
    if (e.layer < 0) return static_cast<int>(i);
    int64_t d = next_use(e.layer);
    if (d < 0) d = INT64_MAX;
    if (best < 0 || d > best_d || (d == best_d && e.tick < best_tick)) {
      best = static_cast<int>(i);
      best_d = d;
      best_tick = e.tick;
    }
  }
  if (must) return best;
  const int64_t need = need_by < 0 ? INT64_MAX : need_by;
  return best_d > need ? best : -1;
}

void Stager::issue_read(int entry, int layer, bool ahead) {
  Entry& e = entries_[static_cast<size_t>(entry)];
  if (e.layer >= 0) entry_of_[static_cast<size_t>(e.layer)] = -1;
  // The entry's previous content may still be copying to the device.
  if (e.copy_recorded) backend_.wait(stage_, e.copied);
  e.copy_recorded = false;
  const std::vector<StagedPart>& parts = layers_[static_cast<size_t>(layer)];
  uint64_t total = 0;
  const std::vector<uint64_t> off = part_offsets(parts, &total);
  backend_.declare_access(e.buf.ref(), Access::Write, stage_, "staging read of '" + parts[0].tensor + "'");
  char* dst = static_cast<char*>(e.buf.data());
  optim::ThreadPool* pool = readers_.get();
  const uint64_t chunk = opts_.chunk_bytes;
  backend_.launch_host_func(stage_, [parts, off, total, dst, pool, chunk, mu = err_mu_, err = error_] {
    try {
      for (size_t i = 0; i < parts.size(); ++i) {
        const StagedPart& p = parts[i];
        if (p.file) {
          p.file->read(dst + off[i], p.offset, p.bytes, p.tensor, pool, chunk);
          if (p.check) p.file->verify(dst + off[i], p.bytes, p.tensor, *p.check);
        } else if (p.bytes)
          std::memcpy(dst + off[i], p.memory, p.bytes);
      }
    } catch (const std::exception& ex) {
      // NaN bytes (0xFF) in every float format: nothing finite is computed
      // from this entry; the owner raises the message.
      std::memset(dst, 0xFF, total);
      const auto* le = dynamic_cast<const Error*>(&ex);
      std::lock_guard<std::mutex> lock(*mu);
      if (err->empty()) *err = le ? le->message() : std::string(ex.what());
    }
  });
  backend_.record(e.read_done, stage_);
  e.layer = layer;
  e.tick = ++tick_;
  entry_of_[static_cast<size_t>(layer)] = entry;
  stats_.reads++;
  stats_.read_bytes += total;
  for (const StagedPart& p : parts)
    if (p.file) stats_.file_bytes += p.bytes;
  if (ahead) stats_.read_aheads++;
}

const BufferRef& Stager::stage(int layer, Stream transfer, const NextUse& next_use,
                               std::vector<uint64_t>* offsets) {
  LS_INTERNAL_CHECK(staged(layer), "layer #", layer, " is not staged");
  int e = entry_of_[static_cast<size_t>(layer)];
  if (e >= 0) {
    stats_.hits++;
  } else {
    e = pick_victim(-1, next_use, true);
    issue_read(e, layer, false);
  }
  Entry& en = entries_[static_cast<size_t>(e)];
  en.tick = ++tick_;
  backend_.wait(transfer, en.read_done);
  *offsets = part_offsets(layers_[static_cast<size_t>(layer)], nullptr);
  return en.buf.ref();
}

void Stager::copied(int layer, Stream transfer) {
  const int e = entry_of_[static_cast<size_t>(layer)];
  LS_INTERNAL_CHECK(e >= 0, "layer #", layer, " is not in a staging entry");
  Entry& en = entries_[static_cast<size_t>(e)];
  backend_.record(en.copied, transfer);
  en.copy_recorded = true;
}

void Stager::read_ahead(const std::vector<int>& upcoming, const NextUse& next_use) {
  for (int l : upcoming) {
    if (!staged(l) || !from_files(l)) continue;  // memory: on demand only, within the step
    if (entry_of_[static_cast<size_t>(l)] >= 0) continue;
    const int v = pick_victim(next_use(l), next_use, false);
    if (v < 0) break;
    issue_read(v, l, true);
  }
}

void Stager::forget_memory_layers() {
  for (Entry& e : entries_) {
    if (e.layer < 0 || from_files(e.layer)) continue;
    entry_of_[static_cast<size_t>(e.layer)] = -1;
    e.layer = -1;
  }
}

void Stager::forget_memory_layer(int layer) {
  const int e = entry_of_[static_cast<size_t>(layer)];
  if (e < 0 || from_files(layer)) return;
  entry_of_[static_cast<size_t>(layer)] = -1;
  entries_[static_cast<size_t>(e)].layer = -1;
}

void Stager::forget_all() {
  for (Entry& e : entries_) {
    if (e.layer >= 0) entry_of_[static_cast<size_t>(e.layer)] = -1;
    e.layer = -1;
  }
}

std::string Stager::take_error() {
  if (!err_mu_) return {};
  std::lock_guard<std::mutex> lock(*err_mu_);
  std::string out;
  out.swap(*error_);
  return out;
}

void Stager::synchronize() {
  if (entries_.empty()) return;
  backend_.synchronize(stage_);
  for (Entry& e : entries_)
    if (e.copy_recorded) backend_.synchronize(e.copied);
}

StagerStats Stager::stats() const { return stats_; }

}  // namespace layerstream
