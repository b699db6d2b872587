#include "scheduler.h"

#include <algorithm>
#include <chrono>
#include <sstream>

#include "slot_layout.h"

namespace layerstream {

Scheduler::Scheduler(Backend& backend, Stream transfer, std::vector<LayerSpec> layers,
                     SchedulerOptions options)
    : backend_(backend), transfer_(transfer), opts_(options) {
  LS_CHECK(transfer_.backend() == &backend_, "the transfer stream belongs to another backend");
  post_ = opts_.post_copy_stream ? opts_.post_copy_stream : transfer_;
  LS_CHECK(post_.backend() == &backend_, "the post-copy stream belongs to another backend");
  LS_CHECK(opts_.num_slots >= 1, "num_slots must be at least 1, got ", opts_.num_slots);
  LS_CHECK(bool(opts_.parts_stale) == bool(opts_.refresh_parts),
           "SchedulerOptions: parts_stale and refresh_parts go together (one is set, the other is not)");
  LS_CHECK(opts_.prefetch_depth >= 0, "prefetch depth must be >= 0, got ", opts_.prefetch_depth);
  LS_CHECK(!layers.empty(), "the scheduler needs at least one layer");

  size_t largest = 0;
  size_t largest_index = 0;
  layers_.reserve(layers.size());
  for (size_t i = 0; i < layers.size(); ++i) {
    Layer l;
    l.spec = std::move(layers[i]);
    size_t off = 0;
    LS_CHECK(l.spec.staged.empty() || l.spec.staged.size() == l.spec.parts.size(), "layer '", l.spec.name,
             "' has ", l.spec.staged.size(), " staged sources for ", l.spec.parts.size(), " parts");
    for (size_t k = 0; k < l.spec.staged.size(); ++k)
      LS_CHECK(l.spec.staged[k].bytes == l.spec.parts[k].bytes, "layer '", l.spec.name, "' part #", k,
               ": its staged source has ", l.spec.staged[k].bytes, " bytes, the part ", l.spec.parts[k].bytes);
    for (const BufferRef& p : l.spec.parts) {
      LS_CHECK(p.ptr != nullptr || p.bytes == 0 || !l.spec.staged.empty(), "layer '", l.spec.name,
               "' has a null part");
      LS_CHECK(p.is_host(), "layer '", l.spec.name, "' part '", p.label,
               "' must be host memory, got ", to_string(p.kind));
      l.offsets.push_back(off);
      off = slot_layout::align(off + p.bytes);
      l.copy_bytes += p.bytes;
      l.part_copy.push_back(p.bytes);
    }
    if (l.spec.workspace_bytes > 0) {
      l.offsets.push_back(off);
      off = slot_layout::align(off + l.spec.workspace_bytes);
    }
    l.bytes = off;
    if (l.bytes > largest) {
      largest = l.bytes;
      largest_index = i;
    }
    layers_.push_back(std::move(l));
  }
  size_t slot_bytes = opts_.slot_bytes ? slot_layout::align(opts_.slot_bytes) : largest;
  if (slot_bytes == 0) slot_bytes = slot_layout::kAlign;
  LS_CHECK(slot_bytes >= largest, "slot size ", slot_bytes, " bytes is smaller than layer '",
           layers_[largest_index].spec.name, "' (", largest, " bytes)");
  const size_t need = slot_bytes * static_cast<size_t>(opts_.num_slots);
  LS_CHECK(need <= opts_.budget_bytes, "device budget of ", opts_.budget_bytes,
           " bytes is too small: ", opts_.num_slots, " slots of ", slot_bytes,
           " bytes are needed (", need, " bytes; the largest streamed layer is '",
           layers_[largest_index].spec.name, "' with ", largest,
           " bytes). Raise the budget to at least ", need, " bytes or use fewer slots.");

  pool_ = std::make_unique<SlotPool>(backend_, slot_bytes, opts_.num_slots, opts_.budget_bytes);
  slots_.resize(static_cast<size_t>(opts_.num_slots));
  for (SlotState& s : slots_) {
    s.ready = backend_.create_event();
    s.copied = backend_.create_event();
  }
  loaded_.assign(layers_.size(), -1);
  copied_version_.assign(layers_.size(), 0);
  fetched_in_.assign(layers_.size(), 0);
  staged_version_.assign(layers_.size(), 0);
  if (opts_.content_version) opts_.write_version = nullptr;  // content_version checks every reuse
  std::vector<std::vector<StagedPart>> staged(layers_.size());
  bool any_staged = false;
  for (size_t i = 0; i < layers_.size(); ++i) {
    staged[i] = layers_[i].spec.staged;
    any_staged = any_staged || !staged[i].empty();
  }
  if (any_staged) stager_ = std::make_unique<Stager>(backend_, std::move(staged), opts_.staging);
  stats_.device_bytes = pool_->device_bytes();
  stats_.slot_bytes = pool_->slot_bytes();
  stats_.num_slots = opts_.num_slots;
  if (!opts_.trace.empty()) {
    for (int layer : opts_.trace)
      LS_CHECK(layer >= 0 && layer < num_layers(), "SchedulerOptions::trace names layer #", layer, " (there are ",
               num_layers(), ")");
    LS_CHECK(opts_.trace_forward.empty() || opts_.trace_forward.size() == opts_.trace.size(),
             "SchedulerOptions::trace_forward has ", opts_.trace_forward.size(), " entries for a trace of ",
             opts_.trace.size());
    trace_ = opts_.trace;
    trace_fwd_ = opts_.trace_forward.empty() ? std::vector<bool>(trace_.size(), true) : opts_.trace_forward;
    recording_ = false;
  }
}

Scheduler::~Scheduler() {
  try {
    backend_.synchronize(transfer_);
    if (post_ != transfer_) backend_.synchronize(post_);
    if (stager_) stager_->synchronize();
  } catch (...) {
    // Shutting down: the pool's destructor waits for the slots regardless.
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < slots_.size(); ++i) {
    // Slots still held (prefetched, or leaked leases) are returned so the pool
    // can wait for them; the transfer stream (ordered after any post-copy
    // work) is their last user.
    if (!pool_->is_free(static_cast<int>(i))) {
      fence_post_copy_locked(static_cast<int>(i));
      pool_->release(static_cast<int>(i), transfer_);
    }
  }
}

void Scheduler::fence_post_copy_locked(int slot) {
  if (post_ != transfer_) backend_.wait(transfer_, slots_[static_cast<size_t>(slot)].ready);
}

void Scheduler::release_prefetched_locked(int slot) {
  SlotState& st = slots_[static_cast<size_t>(slot)];
  st.use = Use::Free;
  fence_post_copy_locked(slot);
  pool_->release(slot, transfer_);
}

void Scheduler::note_held_locked() {
  const int held = pool_->num_slots() - pool_->num_free();
  stats_.max_slots_held = std::max(stats_.max_slots_held, held);
  cur_step_.max_slots_held = std::max(cur_step_.max_slots_held, held);
}

// Note [When a step begins]
// A step is one call of the model (its forward and, in training, the
// backward that follows); nothing tells the scheduler when a call begins, so
// it reads that from the fetches (auto_step). Content cached in slots is
// dropped at a step boundary, because the host weights may change between
// calls (an optimizer step, a merged LoRA, a user's write through `.data`),
// so a missed boundary is not only a miscounted step: it serves a later call
// the weights of an earlier one. The trace's first layer fetched again in the
// forward phase is the common sign, but a call may skip that layer (a
// conditional first block, a LoRA module that peft's merge_and_unload()
// removed, an adapter disabled), and then the boundary never came: the
// weights an optimizer had changed were read from the slots of the step
// before. So the next forward fetch also begins a step
//  * after the owner said a call begins (begin_call(): the engine's Python
//    layer calls it from a forward pre-hook on the offloaded model), and
//  * after a backward ended (backward_ended(), called before an optimizer
//    may run; the engine's end of a backward that computed weight
//    gradients), or after any backward fetch of this step (a backward of
//    frozen layers, or of a compiled tensor group, calls no
//    backward_ended()), whichever layer it is;
//    these are exact for what they see.
// Replaying, a forward fetch of a layer already fetched in this step that the
// rest of the trace does not expect as a forward fetch begins one too (the
// next call of an inner module the owner does not see, or a forward after
// one the trace did not describe; under a training trace every layer comes
// again in the backward, hence the phase of each entry, trace_fwd_); a layer
// the trace fetches several times in a forward (a shared block in a loop) is
// expected, so such models keep their steps. Calls that none of these
// separate (an inner module called again while the first step is still being
// recorded) share a step: SchedulerOptions::write_version then still catches
// in-place writes between them, not writes through `.data` (which is why
// handle.synchronize() exists).
void Scheduler::advance_trace_locked(int layer, Phase phase) {
  const bool forward = opts_.auto_step && phase == Phase::Forward;
  if (forward && backward_in_step_) boundary_due_ = true;  // a forward after this step's backward
  if (phase == Phase::Backward) backward_in_step_ = true;
  if (recording_) {
    if (forward && !trace_.empty() && (trace_.front() == layer || boundary_due_)) {
      begin_step_locked();
    } else {
      if (trace_.size() < opts_.max_trace_length) {
        trace_.push_back(layer);
        trace_fwd_.push_back(phase == Phase::Forward);
        trace_gen_++;
      }
      if (forward) boundary_due_ = false;  // the first fetch of all
      fetched_in_[static_cast<size_t>(layer)] = step_serial_;
      return;
    }
  } else if (forward && acquires_in_step_ > 0 &&
             (boundary_due_ || (pos_ > 0 && trace_.front() == layer) ||
              (fetched_in_[static_cast<size_t>(layer)] == step_serial_ && !expected_later_locked(layer)))) {
    begin_step_locked();
  }
  if (forward) boundary_due_ = false;  // this fetch is the call's first, in any case
  fetched_in_[static_cast<size_t>(layer)] = step_serial_;
  if (recording_) {  // first step just ended above
    return;
  }
  if (observed_.size() < opts_.max_trace_length) {
    observed_.push_back(layer);
    observed_fwd_.push_back(phase == Phase::Forward);
  }
  if (pos_ < trace_.size() && trace_[pos_] == layer) {
    ++pos_;
    return;
  }
  stats_.deviations++;
  step_deviations_++;
  for (size_t j = pos_; j < trace_.size(); ++j) {
    if (trace_[j] == layer) {
      pos_ = j + 1;
      return;
    }
  }
  for (size_t j = 0; j < pos_ && j < trace_.size(); ++j) {
    if (trace_[j] == layer) {
      pos_ = j + 1;
      return;
    }
  }
  // Unknown layer: keep the position.
}

bool Scheduler::expected_later_locked(int layer) {
  const std::vector<uint32_t>& at = positions_locked(layer);
  for (auto it = std::lower_bound(at.begin(), at.end(), static_cast<uint32_t>(pos_)); it != at.end(); ++it)
    if (trace_fwd_[*it]) return true;
  return false;  // later only in the backward (or not at all): a new call
}

int Scheduler::next_use_distance_locked(int layer, size_t window) const {
  if (recording_ || trace_.empty()) return -1;
  if (opts_.content_version) {  // the window wraps into the next step
    for (size_t j = 0; j < window && j < trace_.size(); ++j)
      if (trace_[(pos_ + j) % trace_.size()] == layer) return static_cast<int>(j);
    return -1;
  }
  for (size_t j = pos_; j < trace_.size() && j < pos_ + window; ++j)
    if (trace_[j] == layer) return static_cast<int>(j - pos_);
  return -1;
}

namespace {
// Note [Busy slots last]
// A free slot whose last users' work still runs (a gradient's all-reduce and
// copy to the host in the scratch slot, a compute that read it) makes its new
// writer wait: a stream stalls behind that work (the transfer stream's FIFO,
// all the copies queued after), and an inline compute stream blocks the
// host. So a busy slot costs 2 more than an idle one of the same content:
// empty idle, then idle content not needed soon, then the busy ones, and
// the window's content last.
int64_t with_busy(int64_t cost, bool busy) { return cost >= 0 && busy ? cost + 2 : cost; }
}  // namespace

int Scheduler::obtain_slot_locked(bool on_demand) {
  const size_t window = static_cast<size_t>(opts_.prefetch_depth) + 1;
  auto cost = [&](int64_t tag, bool busy) -> int64_t {
    if (tag == SlotPool::kNoTag) return with_busy(0, busy);
    const int d = next_use_distance_locked(static_cast<int>(tag), window);
    if (d < 0) return with_busy(1, busy);  // cached content not needed soon
    if (!on_demand) return -1;             // never evict what the window needs
    return with_busy(1000000 - d, busy);   // evict the one needed last
  };
  std::optional<int> got = pool_->acquire(transfer_, cost);
  if (got) {
    const int s = *got;
    const int64_t old = pool_->tag(s);
    if (old >= 0 && loaded_[static_cast<size_t>(old)] == s) loaded_[static_cast<size_t>(old)] = -1;
    pool_->set_tag(s, SlotPool::kNoTag);
    return s;
  }
  if (!on_demand) return -1;
  // Repurpose a prefetched slot: the new copy is ordered after the old one
  // on the transfer stream, and nothing else has read the slot since.
  int victim = -1;
  int victim_dist = -2;
  for (int s = 0; s < pool_->num_slots(); ++s) {
    if (slots_[static_cast<size_t>(s)].use != Use::Prefetched) continue;
    const int64_t tag = pool_->tag(s);
    int d = tag >= 0 ? next_use_distance_locked(static_cast<int>(tag), trace_.size() + 1) : -1;
    if (d < 0) d = 1 << 30;
    if (d > victim_dist) {
      victim = s;
      victim_dist = d;
    }
  }
  if (victim >= 0) {
    const int64_t old = pool_->tag(victim);
    if (old >= 0 && loaded_[static_cast<size_t>(old)] == victim) loaded_[static_cast<size_t>(old)] = -1;
    pool_->set_tag(victim, SlotPool::kNoTag);
    slots_[static_cast<size_t>(victim)].use = Use::Free;
    // The old content's post-copy work may still read/write the slot.
    fence_post_copy_locked(victim);
    return victim;
  }
  std::ostringstream held;
  for (int s = 0; s < pool_->num_slots(); ++s) {
    const int64_t tag = pool_->tag(s);
    held << (s ? ", " : "") << (tag >= 0 ? layers_[static_cast<size_t>(tag)].spec.name : "scratch");
  }
  LS_FAIL("all ", pool_->num_slots(), " device slots are held at once (", held.str(),
          "): more layers are in use simultaneously than there are slots. Increase the number "
          "of slots (and the budget) or release leases earlier; if several threads run the "
          "model at once where its calls do not take turns (a torch.compile'd model, C++), "
          "let one thread call it at a time (a lock around the call).");
}

void Scheduler::issue_copy_locked(int layer, int slot) {
  Layer& l = layers_[static_cast<size_t>(layer)];
  if (opts_.parts_stale && opts_.parts_stale(layer)) {
    LS_CHECK(l.spec.staged.empty(), "layer '", l.spec.name, "' is staged: its host bytes cannot be remade");
    if (l.copied_once) backend_.synchronize(l.last_copy);  // earlier copies have read the old bytes
    std::vector<size_t> bytes = l.part_copy;
    opts_.refresh_parts(layer, bytes);
    LS_CHECK(bytes.size() == l.spec.parts.size(), "refresh_parts of layer '", l.spec.name, "' gave ",
             bytes.size(), " sizes for ", l.spec.parts.size(), " parts");
    l.copy_bytes = 0;
    for (size_t i = 0; i < bytes.size(); ++i) {
      LS_CHECK(bytes[i] <= l.spec.parts[i].bytes, "refresh_parts of layer '", l.spec.name, "': part #", i,
               " needs ", bytes[i], " bytes, more than its ", l.spec.parts[i].bytes, " in a slot");
      l.copy_bytes += bytes[i];
    }
    l.part_copy = std::move(bytes);
  }
  const BufferRef& dst = pool_->slot(slot);
  std::vector<uint64_t> src_off;
  const BufferRef* staged = l.spec.staged.empty() ? nullptr : &copy_source_locked(layer, &src_off);
  const std::shared_ptr<double> started = trace_stream_begin(tracer_, backend_, transfer_);
  for (size_t i = 0; i < l.spec.parts.size(); ++i) {
    const BufferRef& src = l.spec.parts[i];
    const size_t n = l.part_copy[i];
    if (n == 0) continue;
    if (staged)
      backend_.copy_async(dst, l.offsets[i], *staged, src_off[i], n, transfer_);
    else
      backend_.copy_async(dst, l.offsets[i], src, 0, n, transfer_);
  }
  if (!l.copied_once) l.last_copy = backend_.create_event();
  backend_.record(l.last_copy, transfer_);
  l.copied_once = true;
  if (staged) copies_issued_locked(layer);
  if (started)
    trace_stream_end(tracer_, backend_, transfer_, started,
                     {"transfer", "H2D " + l.spec.name, 0, 0, l.copy_bytes});
  SlotState& st = slots_[static_cast<size_t>(slot)];
  if (l.spec.post_copy) {
    if (post_ != transfer_) {
      backend_.record(st.copied, transfer_);
      backend_.wait(post_, st.copied);
    }
    const std::shared_ptr<double> pstart = trace_stream_begin(tracer_, backend_, post_);
    l.spec.post_copy(dst, l.offsets, post_);
    if (pstart)
      trace_stream_end(tracer_, backend_, post_, pstart,
                       {"post-copy", l.spec.post_copy_label + " " + l.spec.name, 0, 0, l.spec.workspace_bytes});
    backend_.record(st.ready, post_);
  } else {
    backend_.record(st.ready, transfer_);
  }
  if (opts_.content_version)
    copied_version_[static_cast<size_t>(layer)] = opts_.content_version(layer);
  else if (opts_.write_version)
    copied_version_[static_cast<size_t>(layer)] = opts_.write_version(layer);
  pool_->set_tag(slot, layer);
  loaded_[static_cast<size_t>(layer)] = slot;
  stats_.copies++;
  stats_.h2d_bytes += l.copy_bytes;
  cur_step_.h2d_bytes += l.copy_bytes;
}

// True when `layer` is loaded (or in flight) with current content. Stale
// content (the host data changed since its copy) is forgotten here.
bool Scheduler::loaded_valid_locked(int layer) {
  const int s = loaded_[static_cast<size_t>(layer)];
  if (s < 0) return false;
  const auto& version = opts_.content_version ? opts_.content_version : opts_.write_version;
  if (!version || version(layer) == copied_version_[static_cast<size_t>(layer)]) return true;
  SlotState& st = slots_[static_cast<size_t>(s)];
  loaded_[static_cast<size_t>(layer)] = -1;
  if (st.use == Use::InUse) return false;  // its holder keeps reading the old copy
  if (st.use == Use::Prefetched) release_prefetched_locked(s);
  pool_->set_tag(s, SlotPool::kNoTag);
  return false;
}

void Scheduler::prefetch_locked(int current_layer, Phase phase) {
  const int k = opts_.prefetch_depth;
  if (k <= 0) return;
  // The next k layers that may be prefetched (set_prefetch(): others are
  // passed over without counting).
  std::vector<int> want;
  auto take = [&](int l) {
    if (layers_[static_cast<size_t>(l)].prefetch) want.push_back(l);
    return want.size() < static_cast<size_t>(k);
  };
  if (recording_) {
    // No trace yet: guess the neighbours in registration order.
    if (current_layer < 0) return;
    const int dir = phase == Phase::Forward ? 1 : -1;
    for (int l = current_layer + dir; l >= 0 && l < num_layers() && take(l); l += dir) {
    }
  } else if (opts_.content_version) {
    // Versioned content: prefetch across the step boundary into the next step.
    for (size_t j = 0; j < trace_.size() && take(trace_[(pos_ + j) % trace_.size()]); ++j) {
    }
  } else {
    for (size_t j = pos_; j < trace_.size() && take(trace_[j]); ++j) {
    }
  }
  for (int l : want) {
    if (loaded_valid_locked(l)) continue;
    const int s = obtain_slot_locked(false);
    if (s < 0) break;
    slots_[static_cast<size_t>(s)].use = Use::Prefetched;
    issue_copy_locked(l, s);
  }
  note_held_locked();
  read_ahead_locked();
}

Lease Scheduler::make_lease_locked(int layer, int slot, bool hit) const {
  Lease lease;
  lease.layer = layer;
  lease.slot = slot;
  lease.slot_buf = pool_->slot(slot);
  if (layer >= 0) {
    lease.offsets = layers_[static_cast<size_t>(layer)].offsets;
  } else {
    lease.offsets = {0};  // scratch: one part covering the slot
  }
  lease.hit = hit;
  return lease;
}

Lease Scheduler::acquire(int layer, Stream compute, Phase phase) {
  LS_CHECK(layer >= 0 && layer < num_layers(), "no streamed layer #", layer, " (there are ",
           num_layers(), ")");
  return acquire_impl(layer, compute, phase, nullptr);
}

Lease Scheduler::acquire_partial(int layer, Stream compute, Phase phase, const PartialCopy& copy) {
  LS_CHECK(layer >= 0 && layer < num_layers(), "no streamed layer #", layer, " (there are ",
           num_layers(), ")");
  const Layer& l = layers_[static_cast<size_t>(layer)];
  LS_CHECK(copy.ranges.size() == l.spec.parts.size(), "partial copy of layer '", l.spec.name, "' names ",
           copy.ranges.size(), " parts; the layer has ", l.spec.parts.size());
  for (size_t i = 0; i < copy.ranges.size(); ++i)
    for (const auto& r : copy.ranges[i])
      LS_CHECK(r.first <= l.spec.parts[i].bytes && r.second <= l.spec.parts[i].bytes - r.first,
               "partial copy of layer '", l.spec.name, "': bytes [", r.first, ", ", r.first + r.second,
               ") are outside part #", i, " (", l.spec.parts[i].bytes, " bytes)");
  return acquire_impl(layer, compute, phase, &copy);
}

Lease Scheduler::acquire_impl(int layer, Stream compute, Phase phase, const PartialCopy* partial) {
  const Event* ready = nullptr;
  Lease lease;
  {
    std::lock_guard<std::mutex> lock(mu_);
    check_staging_locked();
    stats_.acquires++;
    advance_trace_locked(layer, phase);
    acquires_in_step_++;
    cur_step_.acquires++;
    last_phase_ = phase;
    const bool hit = loaded_valid_locked(layer);
    int s = loaded_[static_cast<size_t>(layer)];
    if (s >= 0) {  // loaded or in flight (whole, also for a partial acquire)
      SlotState& st = slots_[static_cast<size_t>(s)];
      if (st.use == Use::Free) {
        // Cached content in a free slot: take it back (orders `compute`
        // after the slot's previous users, which is harmless).
        pool_->acquire_slot(s, compute);
      }
      st.use = Use::InUse;
      st.refs++;
      stats_.hits++;
      cur_step_.hits++;
    } else {
      s = obtain_slot_locked(true);
      SlotState& st = slots_[static_cast<size_t>(s)];
      if (partial)
        issue_partial_copy_locked(layer, s, *partial);
      else
        issue_copy_locked(layer, s);
      st.use = Use::InUse;
      st.refs = 1;
      stats_.misses++;
      cur_step_.misses++;
    }
    note_held_locked();
    prefetch_locked(layer, phase);
    ready = &slots_[static_cast<size_t>(s)].ready;
    lease = make_lease_locked(layer, s, hit);
  }
  // The slot is InUse, so its ready event is not re-recorded concurrently.
  const auto t0 = std::chrono::steady_clock::now();
  backend_.wait(compute, *ready);
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (backend_.caps().ordering_checker)  // skip building the description otherwise
    backend_.declare_access(lease.slot_buf, Access::Read, compute,
                            "compute reads '" + layers_[static_cast<size_t>(layer)].spec.name + "'");
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.host_wait_seconds += waited;
    cur_step_.host_wait_seconds += waited;
    if (tracer_ && waited > 1e-6) {
      const double end = tracer_->now_us();
      tracer_->add(TraceSlice{"stall", "wait " + layers_[static_cast<size_t>(layer)].spec.name,
                              end - waited * 1e6, end, 0});
    }
  }
  return lease;
}

void Scheduler::issue_partial_copy_locked(int layer, int slot, const PartialCopy& copy) {
  Layer& l = layers_[static_cast<size_t>(layer)];
  const BufferRef& dst = pool_->slot(slot);
  SlotState& st = slots_[static_cast<size_t>(slot)];
  uint64_t bytes = 0;
  std::vector<uint64_t> src_off;
  const BufferRef* staged = l.spec.staged.empty() ? nullptr : &copy_source_locked(layer, &src_off);
  const std::shared_ptr<double> started = trace_stream_begin(tracer_, backend_, transfer_);
  for (size_t i = 0; i < l.spec.parts.size(); ++i)
    for (const auto& r : copy.ranges[i]) {
      if (r.second == 0) continue;
      if (staged)
        backend_.copy_async(dst, l.offsets[i] + r.first, *staged, src_off[i] + r.first, r.second, transfer_);
      else
        backend_.copy_async(dst, l.offsets[i] + r.first, l.spec.parts[i], r.first, r.second, transfer_);
      bytes += r.second;
    }
  // wait_copies_read() waits for this one too (a re-code of the bytes it reads).
  if (!l.copied_once) l.last_copy = backend_.create_event();
  backend_.record(l.last_copy, transfer_);
  l.copied_once = true;
  if (staged) copies_issued_locked(layer);
  if (started)
    trace_stream_end(tracer_, backend_, transfer_, started,
                     {"transfer", "H2D " + l.spec.name + " (part)", 0, 0, bytes});
  if (copy.post_copy) {
    if (post_ != transfer_) {
      backend_.record(st.copied, transfer_);
      backend_.wait(post_, st.copied);
    }
    const std::shared_ptr<double> pstart = trace_stream_begin(tracer_, backend_, post_);
    copy.post_copy(dst, l.offsets, post_);
    if (pstart)
      trace_stream_end(tracer_, backend_, post_, pstart,
                       {"post-copy", l.spec.post_copy_label + " " + l.spec.name + " (part)", 0, 0, 0});
    backend_.record(st.ready, post_);
  } else {
    backend_.record(st.ready, transfer_);
  }
  // The content is this acquire's alone: the slot stays untagged (as
  // obtain_slot_locked left it), so no later acquire takes it for the layer.
  stats_.copies++;
  stats_.h2d_bytes += bytes;
  cur_step_.h2d_bytes += bytes;
}

void Scheduler::set_prefetch(int layer, bool allowed) {
  LS_CHECK(layer >= 0 && layer < num_layers(), "no streamed layer #", layer, " (there are ",
           num_layers(), ")");
  std::lock_guard<std::mutex> lock(mu_);
  layers_[static_cast<size_t>(layer)].prefetch = allowed;
}

void Scheduler::wait_copies_read(int layer) {
  LS_CHECK(layer >= 0 && layer < num_layers(), "no streamed layer #", layer, " (there are ",
           num_layers(), ")");
  std::lock_guard<std::mutex> lock(mu_);
  const Layer& l = layers_[static_cast<size_t>(layer)];
  if (l.copied_once) backend_.synchronize(l.last_copy);
}

// Note [No copy in flight at a step's end]
// Without content_version the host may write weights between steps (the
// optimizer, load_state_dict) and nothing checks a copy that read them
// meanwhile; replay keeps its prefetches inside the trace, so every copy is
// taken, and waited for, before the step ends. Two cases escape: while
// recording, the backward guesses the next layer by index, and the first
// layer's backward (its input needs no gradient) reads no weight, so its
// guessed copy is never taken; a step that leaves the trace can leave its
// prefetches too. Their content is dropped at the next boundary, so no
// result reads it, but the copy itself reads host memory that the
// optimizer then writes: a data race (ThreadSanitizer saw it on the sim
// device; a DMA on CUDA). The engine calls wait_unused_prefetches() when a
// backward ends, before any optimizer runs: it waits only when such a copy
// exists, i.e. in those rare steps.
void Scheduler::wait_unused_prefetches() {
  std::lock_guard<std::mutex> lock(mu_);
  if (opts_.content_version) return;
  for (const SlotState& st : slots_)
    if (st.use == Use::Prefetched) backend_.synchronize(st.ready);
}

void Scheduler::backward_ended() {
  wait_unused_prefetches();
  begin_call();
}

void Scheduler::begin_call() {
  std::lock_guard<std::mutex> lock(mu_);
  boundary_due_ = true;
}

Lease Scheduler::acquire_scratch(Stream user) {
  std::lock_guard<std::mutex> lock(mu_);
  // Take a slot without a pending copy if possible; the pool orders `user`
  // after the slot's previous users.
  const size_t window = static_cast<size_t>(opts_.prefetch_depth) + 1;
  auto cost = [&](int64_t tag, bool busy) -> int64_t {  // Note [Busy slots last]
    if (tag == SlotPool::kNoTag) return with_busy(0, busy);
    const int d = next_use_distance_locked(static_cast<int>(tag), window);
    return with_busy(d < 0 ? 1 : 1000000 - d, busy);
  };
  std::optional<int> got = pool_->acquire(user, cost);
  int s;
  if (got) {
    s = *got;
    const int64_t old = pool_->tag(s);
    if (old >= 0 && loaded_[static_cast<size_t>(old)] == s) loaded_[static_cast<size_t>(old)] = -1;
    pool_->set_tag(s, SlotPool::kNoTag);
  } else {
    // Only prefetched slots left: repurpose one; `user` must wait for the
    // copy that is in flight into it.
    s = obtain_slot_locked(true);
    backend_.wait(user, slots_[static_cast<size_t>(s)].ready);
  }
  SlotState& st = slots_[static_cast<size_t>(s)];
  st.use = Use::InUse;
  st.refs = 1;
  note_held_locked();
  return make_lease_locked(-1, s, false);
}

void Scheduler::release(Lease& lease, Stream last_user) {
  LS_CHECK(lease.slot >= 0, "release of an empty lease");
  std::lock_guard<std::mutex> lock(mu_);
  SlotState& st = slots_.at(static_cast<size_t>(lease.slot));
  LS_INTERNAL_CHECK(st.use == Use::InUse && st.refs > 0, "release of slot ", lease.slot,
                    " that is not in use");
  // Leases of one slot may be released on different streams: each release but
  // the last records its stream's point, chained into the next releaser's stream,
  // so the free event the last one records follows every releaser's reads.
  if (st.others_recorded) backend_.wait(last_user, st.others);
  if (--st.refs == 0) {
    st.others_recorded = false;
    st.use = Use::Free;
    pool_->release(lease.slot, last_user);
  } else {
    if (!st.others) st.others = backend_.create_event();
    backend_.record(st.others, last_user);
    st.others_recorded = true;
  }
  const int layer = lease.layer;
  lease = Lease{};
  prefetch_locked(layer, last_phase_);
}

void Scheduler::drop_content_locked() {
  for (int s = 0; s < pool_->num_slots(); ++s) {
    SlotState& st = slots_[static_cast<size_t>(s)];
    if (st.use == Use::InUse) continue;
    const int64_t tag = pool_->tag(s);
    if (tag >= 0 && loaded_[static_cast<size_t>(tag)] == s) loaded_[static_cast<size_t>(tag)] = -1;
    if (st.use == Use::Prefetched) release_prefetched_locked(s);
    pool_->set_tag(s, SlotPool::kNoTag);
  }
}

void Scheduler::begin_step_locked() {
  if (recording_ && !trace_.empty()) {
    recording_ = false;
  } else if (!recording_ && acquires_in_step_ > 0) {
    // Re-learn the order when the trace stopped describing the steps. A step
    // that ran the whole trace and went on (a training step after an
    // inference trace) replaces it at once: steps that follow the old trace
    // are prefixes of the new one, so this cannot thrash.
    const bool extends = opts_.retrace_after > 0 && observed_.size() > trace_.size() &&
                         std::equal(trace_.begin(), trace_.end(), observed_.begin());
    deviating_steps_ = step_deviations_ > 0 ? deviating_steps_ + 1 : 0;
    if (extends || (opts_.retrace_after > 0 && deviating_steps_ >= opts_.retrace_after &&
                    !observed_.empty())) {
      trace_.swap(observed_);
      trace_fwd_.swap(observed_fwd_);
      trace_gen_++;
      stats_.retraces++;
      deviating_steps_ = 0;
    }
  }
  observed_.clear();
  observed_fwd_.clear();
  step_deviations_ = 0;
  if (acquires_in_step_ > 0) {
    cur_step_.step = stats_.steps;
    cur_step_.num_slots = pool_->num_slots();
    if (tracer_) {
      cur_step_.end_us = tracer_->now_us();
      tracer_->mark_step(stats_.steps + 1);
    }
    steps_.push_back(cur_step_);
    if (steps_.size() > 4096) steps_.pop_front();
    stats_.steps++;
    cur_step_ = StepStats{};
    if (tracer_) cur_step_.start_us = tracer_->now_us();
  }
  acquires_in_step_ = 0;
  boundary_due_ = false;
  backward_in_step_ = false;
  ++step_serial_;
  pos_ = 0;
  if (!opts_.content_version) drop_content_locked();
  else if (opts_.step_begins)
    for (size_t l = 0; l < loaded_.size(); ++l)
      if (loaded_[l] >= 0) opts_.step_begins(static_cast<int>(l));
  if (stager_) stager_->forget_memory_layers();
}

void Scheduler::begin_step() {
  std::lock_guard<std::mutex> lock(mu_);
  begin_step_locked();
  check_staging_locked();
}

void Scheduler::quiesce() {
  backend_.synchronize(transfer_);
  if (post_ != transfer_) backend_.synchronize(post_);
  std::lock_guard<std::mutex> lock(mu_);
  drop_content_locked();
  if (stager_) stager_->forget_memory_layers();
  check_staging_locked();
}

void Scheduler::check_staging() {
  std::lock_guard<std::mutex> lock(mu_);
  check_staging_locked();
}

void Scheduler::check_staging_locked() {
  if (!stager_) return;
  std::string err = stager_->take_error();
  if (err.empty()) return;
  // Every copy made from a staging entry since may hold the failed read's
  // NaN bytes: forget them all (a later acquire reads again).
  stager_->forget_all();
  drop_content_locked();
  LS_FAIL(err);
}

const BufferRef& Scheduler::copy_source_locked(int layer, std::vector<uint64_t>* src_offsets) {
  // A staging entry is a cached copy too: read a layer from memory again
  // after an in-place write to it (the version), as a slot's copy is.
  const auto& version = opts_.content_version ? opts_.content_version : opts_.write_version;
  if (version) {
    const uint64_t v = version(layer);
    if (v != staged_version_[static_cast<size_t>(layer)]) stager_->forget_memory_layer(layer);
    staged_version_[static_cast<size_t>(layer)] = v;
  }
  return stager_->stage(layer, transfer_, [this](int l) { return next_use_cyclic_locked(l); }, src_offsets);
}

void Scheduler::copies_issued_locked(int layer) { stager_->copied(layer, transfer_); }

const std::vector<uint32_t>& Scheduler::positions_locked(int layer) {
  if (positions_gen_ != trace_gen_) {
    positions_.assign(layers_.size(), {});
    for (size_t j = 0; j < trace_.size(); ++j)
      positions_[static_cast<size_t>(trace_[j])].push_back(static_cast<uint32_t>(j));
    positions_gen_ = trace_gen_;
  }
  return positions_[static_cast<size_t>(layer)];
}

// Note [Staging skips what a slot serves]
// The staging cache keeps the entries whose layers the trace needs soonest
// (Belady). But the device prefetch runs ahead of pos_: the next layers are
// copied into device slots before they are computed, and once a layer's copy
// is in its slot, its staging entry serves nothing until its next use after
// that. Measured from pos_ alone, such entries looked needed soonest and were
// kept, and the entries of layers not yet copied were evicted instead; with a
// prefetch of at least the number of entries that read every layer about
// twice per step (12 layers, 3 entries, prefetch 4: 21 reads a step instead of
// 12). So within the span the prefetch covers, a layer already in a valid
// slot counts from its following use, and read_ahead() passes it over.
// Correctness does not depend on it: a layer evicted from its slot before its
// use is read again on demand (stage()).
size_t Scheduler::prefetch_span_locked() {
  const int k = opts_.prefetch_depth;
  if (k <= 0 || trace_.empty()) return 0;
  const bool wraps = static_cast<bool>(opts_.content_version);  // prefetch_locked() crosses the step boundary
  const size_t end = wraps ? trace_.size() : trace_.size() - std::min(pos_, trace_.size());
  int taken = 0;
  for (size_t j = 0; j < end; ++j)
    if (layers_[static_cast<size_t>(trace_[(pos_ + j) % trace_.size()])].prefetch && ++taken == k) return j + 1;
  return end;
}

bool Scheduler::served_from_slot_locked(int layer, size_t d, size_t span) {
  const int s = loaded_[static_cast<size_t>(layer)];
  if (s < 0 || d >= span) return false;
  const auto& version = opts_.content_version ? opts_.content_version : opts_.write_version;
  return !version || version(layer) == copied_version_[static_cast<size_t>(layer)];
}

int64_t Scheduler::next_use_cyclic_locked(int layer) {
  if (recording_ || trace_.empty()) return -1;
  const std::vector<uint32_t>& at = positions_locked(layer);
  if (at.empty()) return -1;
  // Its uses from pos_ on, unwrapped (k-th: this step's, then the next's).
  const size_t here = static_cast<size_t>(std::lower_bound(at.begin(), at.end(), static_cast<uint32_t>(pos_)) -
                                          at.begin());
  auto use = [&](size_t k) {
    const size_t i = here + k;
    return static_cast<int64_t>(at[i % at.size()]) + static_cast<int64_t>(i / at.size() * trace_.size()) -
           static_cast<int64_t>(pos_);
  };
  const int64_t d = use(0);
  const bool served = loaded_[static_cast<size_t>(layer)] >= 0 &&
                      served_from_slot_locked(layer, static_cast<size_t>(d), prefetch_span_locked());
  return served ? use(1) : d;
}

void Scheduler::read_ahead_locked() {
  if (!stager_ || recording_ || trace_.empty()) return;
  // The next layers the trace needs that come from files, in order, one
  // pass around the trace at most.
  std::vector<int> upcoming;
  const int depth = opts_.staging.read_ahead > 0 ? opts_.staging.read_ahead : opts_.prefetch_depth + 1;
  const size_t want = std::min<size_t>(static_cast<size_t>(depth), stager_->stats().entries);
  const size_t span = prefetch_span_locked();  // once: pos_ does not move here
  for (size_t j = 0; j < trace_.size() && upcoming.size() < want; ++j) {
    const int l = trace_[(pos_ + j) % trace_.size()];
    if (stager_->staged(l) && !served_from_slot_locked(l, j, span) &&
        std::find(upcoming.begin(), upcoming.end(), l) == upcoming.end())
      upcoming.push_back(l);
  }
  stager_->read_ahead(upcoming, [this](int l) { return next_use_cyclic_locked(l); });
}

std::vector<StepStats> Scheduler::step_stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return std::vector<StepStats>(steps_.begin(), steps_.end());
}

void Scheduler::note_d2h(uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  cur_step_.d2h_bytes += bytes;
}

void Scheduler::set_trace(std::shared_ptr<TraceRecorder> trace) {
  std::lock_guard<std::mutex> lock(mu_);
  tracer_ = std::move(trace);
  if (tracer_) cur_step_.start_us = tracer_->now_us();
}

std::vector<int> Scheduler::trace() const {
  std::lock_guard<std::mutex> lock(mu_);
  return trace_;
}

std::vector<bool> Scheduler::trace_forward() const {
  std::lock_guard<std::mutex> lock(mu_);
  return trace_fwd_;
}

SchedulerStats Scheduler::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  SchedulerStats s = stats_;
  if (acquires_in_step_ > 0) s.steps++;  // the step under way (a step ends when the next begins)
  s.recording = recording_;
  if (stager_) s.staging = stager_->stats();
  return s;
}

}  // namespace layerstream
