// layerstream — the fetch scheduler: trace once, prefetch by replay.
//
// The scheduler owns a SlotPool and moves each layer's host buffers into a
// device slot on the transfer stream, ahead of use:
//  * During the first step it records the sequence of layer fetches (forward,
//    checkpoint recompute and backward alike): the trace. While recording, it
//    guesses the next layers by index (ascending in forward, descending in
//    backward).
//  * Afterwards it replays the trace: after every acquire/release it keeps the
//    next `prefetch_depth` trace entries loaded or in flight, as far as free
//    slots allow. Prefetches never cross the end of the trace (the step
//    boundary), so no copy of step N+1 reads host weights the optimizer of
//    step N is still writing; a guess that no one took is waited for when the
//    backward ends (backward_ended()).
//  * When the actual order deviates (unknown layer, skipped layer, different
//    order) it fetches on demand, resynchronises its position in the trace,
//    and counts a deviation. A step that ran the whole trace and went on
//    (the first step was an inference pass and training followed; or steps
//    alternate between an inference pass and training, as a reference model
//    sharing the base weights does in DPO) makes its order the trace at once:
//    without this, every backward fetch would stay on demand, and steps that
//    follow the old trace are prefixes of the new one. Otherwise, after
//    `retrace_after` consecutive steps that deviated, the last step's actual
//    order becomes the trace. A step that follows the trace (or a prefix of
//    it, like an inference step under a training trace) resets the count, so
//    alternating step kinds do not make it thrash.
//  * It never blocks the host waiting for a slot: a slot is reused by making
//    the transfer stream wait on the slot's free event. If every slot is held
//    by a caller, acquire throws (it cannot wait without deadlocking the
//    caller).
//  * A new step starts at begin_step(), or automatically (auto_step) at a
//    forward fetch that begins a new call of the model: the first forward
//    fetch after the owner said so (begin_call()) or a backward ended
//    (backward_ended(); or fetched), a fetch of the trace's first layer, or (replaying) a
//    fetch of a layer already fetched in this step that the trace does not
//    expect again in it as a forward fetch. At a step boundary, content
//    cached in slots is forgotten (weights may have changed) unless
//    SchedulerOptions::content_version tells when they did; between
//    boundaries, SchedulerOptions::write_version (when given) guards each
//    reuse. Note [When a step begins] in scheduler.cpp.
//
// Stream semantics: acquire(layer, compute) makes `compute` wait for the
// layer's copy (and its post-copy work, if any) and declares a read of the
// slot on `compute` (ordering checker). release(lease, s) records the slot's free event on `s`: every
// access to the slot through that lease must be enqueued on `s` (or ordered before it) by then.
// Leases that share a slot (a layer held twice) may be released on different streams: the
// free event follows every releaser's stream (each earlier release's point is waited for
// on the next releaser's stream).
//
// Ownership: the scheduler does not own the host buffers in LayerSpec; they
// must outlive it. It owns the device slots. Thread safety: all methods are
// safe to call from several threads (one internal mutex; blocking waits happen
// outside it).
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "io/stager.h"
#include "runtime.h"
#include "slot_pool.h"
#include "telemetry.h"

namespace layerstream {

// Device work run on a freshly copied slot before it counts as loaded (e.g.
// dequantizing packed weights into the layer's workspace). `offsets` holds
// each part's offset in `slot`, then the workspace's. It must only ENQUEUE
// work on `s` (it is called with the scheduler's lock held) and must declare
// its accesses to `slot` on `s` for the ordering checker.
using PostCopyFn =
    std::function<void(const BufferRef& slot, const std::vector<size_t>& offsets, Stream s)>;

// One streamed layer: host buffers copied, in order, into one slot, each at
// a 256-byte aligned offset, optionally followed by `workspace_bytes` of
// device-only space (not copied) that `post_copy` fills on the device.
struct LayerSpec {
  LayerSpec() = default;
  LayerSpec(std::string n, std::vector<BufferRef> p) : name(std::move(n)), parts(std::move(p)) {}
  std::string name;
  std::vector<BufferRef> parts;
  size_t workspace_bytes = 0;
  PostCopyFn post_copy;  // optional
  std::string post_copy_label = "dequant";  // its name in the timeline ("dequant <layer>")
  // Optional, one per part: where the part's bytes come from when they are
  // not in pinned host memory (a file range: the disk tier; pageable memory:
  // beyond the pinned budget). The layer is then read into a host staging
  // entry before each copy (io/stager.h), and `parts` only give the sizes
  // (their pointers may be null).
  std::vector<StagedPart> staged;
};

enum class Phase : uint8_t { Forward, Backward };

struct SchedulerOptions {
  int num_slots = 4;
  int prefetch_depth = 2;  // 0 = fetch on demand only
  size_t budget_bytes = std::numeric_limits<size_t>::max();
  size_t slot_bytes = 0;   // 0 = the largest layer; larger to fit scratch buffers
  bool auto_step = true;
  size_t max_trace_length = size_t(1) << 20;
  // Consecutive deviating steps after which the last step's order replaces
  // the trace (a step that extends the trace replaces it at once); 0 = never
  // (the first step's trace is kept forever).
  int retrace_after = 2;
  // Optional: the current version of a layer's host data (e.g. the torch
  // tensor version counter, bumped by every in-place write). When given, a
  // slot's content is reused only while the version it was copied at is
  // still current, so content survives step boundaries and prefetching wraps
  // around the end of the trace into the next step (a copy that raced with a
  // host write is detected by the version and redone on demand). Without it,
  // content is dropped at every step boundary and prefetching stops at the
  // end of the trace. Called under the scheduler's lock: must be cheap and
  // must not call back into the scheduler.
  std::function<uint64_t(int layer)> content_version;
  // Optional, with content_version: called when a step begins, before the
  // step's first fetch looks for cached content, for each layer whose content
  // a slot holds (copied or in flight), so the owner can move its version for
  // writes no counter saw (the torch glue: Note [Writes through .data between
  // steps] in torch/engine.cpp). Called under the scheduler's lock, like
  // content_version.
  std::function<void(int layer)> step_begins;
  // Optional, the same kind of version (ignored when content_version is
  // given): checks each reuse of cached content within a step (a layer
  // fetched again while its slot still holds it), without the cross-step
  // reuse content_version brings, so an in-place write between two calls of
  // the model that the step boundary missed is not served stale. Called
  // under the scheduler's lock, like content_version.
  std::function<uint64_t(int layer)> write_version;
  // Where LayerSpec::post_copy work runs. A stream of its own lets the next
  // copy start while the previous layer is post-processed; default (null):
  // the transfer stream. Not owned: it must outlive the scheduler.
  Stream post_copy_stream;
  // The host staging entries of layers with LayerSpec::staged (unused when
  // there are none).
  StagerOptions staging;
  // Optional, both or neither: layers whose host bytes are made just before
  // a copy (the engine: a trainable weight that crosses the bus
  // lossless-coded, re-coded after an optimizer step changed it; Note
  // [Trainable coded weights] in engine_coded.cpp). Before each full copy of
  // a layer, under the scheduler's lock, parts_stale(layer) says whether its
  // parts' host bytes must be remade; if so the scheduler waits (on the host)
  // until its earlier copies of the layer have read them, then calls
  // refresh_parts(layer, copy_bytes), which rewrites them and sets how many
  // bytes of each part to copy from now on (copy_bytes holds the current
  // counts; each at most the part's LayerSpec size, which sizes the slot).
  // Such layers must not be staged. Neither may call back into the scheduler.
  std::function<bool(int layer)> parts_stale;
  std::function<void(int layer, std::vector<size_t>& copy_bytes)> refresh_parts;
  // A fetch order learnt by an earlier scheduler of the same layers (the
  // engine's, rebuilt after suspend()): replayed from the first step instead
  // of recorded. Empty: record the first step.
  std::vector<int> trace;
  // With `trace`: which of its fetches were in the forward phase (that
  // scheduler's trace_forward()); empty: unknown, each read as forward.
  std::vector<bool> trace_forward;
};

// A copy of only some bytes of a layer's parts (e.g. the experts a router
// chose, of a mixture-of-experts layer's tensors): for each part, the
// (offset, bytes) ranges within it to copy, each to the same offset within
// the part's place in the slot; a part with no ranges is not copied. The rest
// of the slot keeps whatever it held. `post_copy` replaces the layer's own
// for this copy (null: none).
struct PartialCopy {
  std::vector<std::vector<std::pair<size_t, size_t>>> ranges;
  PostCopyFn post_copy;
};

// A layer's weights in a slot, held for compute. Move-only by convention.
struct Lease {
  int layer = -1;  // -1 for scratch leases
  int slot = -1;
  BufferRef slot_buf;
  std::vector<size_t> offsets;  // byte offset of each part (then the workspace) in the slot
  bool hit = false;             // already loaded or in flight when acquired
  explicit operator bool() const { return slot >= 0; }
  void* part_ptr(size_t i) const { return static_cast<char*>(slot_buf.ptr) + offsets.at(i); }
};

// Counters of one step (between two step boundaries).
struct StepStats {
  uint64_t step = 0;
  uint64_t acquires = 0, hits = 0, misses = 0;
  uint64_t h2d_bytes = 0;
  uint64_t d2h_bytes = 0;        // reported by the owner through note_d2h()
  double host_wait_seconds = 0;  // stall: time callers blocked waiting for weights
  int max_slots_held = 0;        // most slots held at once
  int num_slots = 0;             // the slots there were
  double start_us = 0, end_us = 0;  // on the trace clock, when tracing
  // Slot utilisation: the share of slots the step held at most at once.
  double slot_utilisation() const { return num_slots ? static_cast<double>(max_slots_held) / num_slots : 0.0; }
};

struct SchedulerStats {
  uint64_t steps = 0;              // steps that acquired a slot, the one under way included
  uint64_t acquires = 0;
  uint64_t hits = 0;               // prefetched / in flight / cached when acquired
  uint64_t misses = 0;             // fetched on demand
  uint64_t deviations = 0;         // acquires that did not match the trace position
  uint64_t retraces = 0;           // times the trace was replaced by a step's actual order
  uint64_t copies = 0;             // host-to-device layer copies issued
  uint64_t h2d_bytes = 0;
  double host_wait_seconds = 0;    // time callers blocked in acquire (inline streams)
  size_t device_bytes = 0;         // the slot arena, constant
  size_t slot_bytes = 0;
  int num_slots = 0;
  int max_slots_held = 0;          // most slots held (in use or prefetched) at once
  bool recording = true;
  StagerStats staging;             // layers read from disk or pageable memory
};

class Scheduler {
 public:
  Scheduler(Backend& backend, Stream transfer, std::vector<LayerSpec> layers,
            SchedulerOptions options);
  ~Scheduler();
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  int num_layers() const { return static_cast<int>(layers_.size()); }
  const LayerSpec& layer(int i) const { return layers_.at(static_cast<size_t>(i)).spec; }
  size_t layer_bytes(int i) const { return layers_.at(static_cast<size_t>(i)).bytes; }

  Lease acquire(int layer, Stream compute, Phase phase = Phase::Forward);
  // As acquire(), but when the layer is not already loaded (or in flight)
  // only `copy`'s ranges are copied, on demand; that content is the caller's
  // alone: it is never reused by a later acquire (which copies again). When
  // the layer is loaded, its whole content is used and nothing is copied.
  // Counts as one acquire of the layer in the trace.
  Lease acquire_partial(int layer, Stream compute, Phase phase, const PartialCopy& copy);
  // Whether replay prefetches `layer` (default true). A layer that is mostly
  // fetched partially is better not prefetched whole: the caller turns it off.
  void set_prefetch(int layer, bool allowed);
  // Blocks until every copy of `layer` issued so far has read its host bytes.
  // For an owner that writes a layer's host bytes while copies of it may be
  // in flight (an optimizer step during the backward; a layer that remakes
  // its bytes ahead of its next copy, then parts_stale must still say so if
  // the copy sizes changed): call this after the change that makes them
  // stale, then write.
  void wait_copies_read(int layer);
  // Blocks until the copies into slots prefetched and not acquired since have
  // read their host bytes; their content stays until the step boundary drops
  // it. Without content_version, replay never prefetches past the end of the
  // trace, but a guess while recording (neighbours by index: a layer whose
  // backward reads no weight, such as the first layer of a network, is
  // guessed and never taken) or a step that left the trace can leave such a
  // copy in flight when the step ends: an owner calls this before the host
  // may write weights (the engine: when a backward ends), so no copy reads
  // them while they change (Note [No copy in flight at a step's end] in
  // scheduler.cpp). Returns at once when nothing was left (every traced
  // step) and with content_version (such copies are checked by version).
  void wait_unused_prefetches();
  // The owner's backward pass ended (the engine: once per autograd graph
  // task that ran streamed layers, before an optimizer may run): waits as
  // wait_unused_prefetches() does, and makes the next forward fetch begin a
  // new step, whichever layer it names (Note [When a step begins]).
  void backward_ended();
  // The owner's model is called again (not from a backward): the next
  // forward fetch begins a new step, as after backward_ended().
  void begin_call();
  // A whole slot as scratch space (e.g. for staging gradients), ordered
  // after the slot's previous users on `user`. Released with release().
  Lease acquire_scratch(Stream user);
  void release(Lease& lease, Stream last_user);

  void begin_step();
  // Blocks until all issued copies completed and forgets cached content.
  // Throws a failed staging read (see check_staging()).
  void quiesce();
  // Throws layerstream::Error when a read of a staged layer (disk tier,
  // pageable memory) failed since the last check, forgetting every cached
  // copy (the failed entry holds NaN bytes). acquire() and begin_step() check.
  void check_staging();

  std::vector<int> trace() const;
  // Per trace() entry: whether that fetch was in the forward phase.
  std::vector<bool> trace_forward() const;
  SchedulerStats stats() const;
  // Completed steps' counters (the most recent 4096), oldest first.
  std::vector<StepStats> step_stats() const;
  // Counts device-to-host bytes into the current step (the owner copies
  // gradients; the scheduler does not see those copies).
  void note_d2h(uint64_t bytes);
  // Records copies (and step boundaries) into `trace`; nullptr stops.
  void set_trace(std::shared_ptr<TraceRecorder> trace);
  const SlotPool& pool() const { return *pool_; }
  const SchedulerOptions& options() const { return opts_; }

 private:
  struct Layer {
    LayerSpec spec;
    std::vector<size_t> offsets;
    size_t bytes = 0;  // slot bytes used (with alignment)
    size_t copy_bytes = 0;
    std::vector<size_t> part_copy;  // bytes copied of each part (refresh_parts may lower them)
    Event last_copy;                // after its latest copy (full or partial)
    bool copied_once = false;
    bool prefetch = true;  // set_prefetch()
  };
  enum class Use : uint8_t { Free, Prefetched, InUse };
  struct SlotState {
    Use use = Use::Free;
    int refs = 0;
    Event ready;   // copy (and post-copy work) done
    Event copied;  // copy done (post-copy work waits on it)
    // A lease released while another still holds the slot: its stream's reads,
    // which the last release's free event must follow (recorded when set).
    Event others;
    bool others_recorded = false;
  };

  void begin_step_locked();
  void drop_content_locked();
  void advance_trace_locked(int layer, Phase phase);
  int next_use_distance_locked(int layer, size_t window) const;
  // Whether the trace names `layer` again as a forward fetch between the
  // current position and its end.
  bool expected_later_locked(int layer);
  int obtain_slot_locked(bool on_demand);
  void issue_copy_locked(int layer, int slot);
  void prefetch_locked(int current_layer, Phase phase);
  void note_held_locked();
  // Orders the transfer stream after the slot's post-copy work (when that
  // runs on another stream), before the slot is rewritten or freed.
  void fence_post_copy_locked(int slot);
  void release_prefetched_locked(int slot);
  Lease make_lease_locked(int layer, int slot, bool hit) const;
  Lease acquire_impl(int layer, Stream compute, Phase phase, const PartialCopy* partial);
  void issue_partial_copy_locked(int layer, int slot, const PartialCopy& copy);
  // Where a layer's part i is copied from: its host buffer, or (staged) the
  // staging entry, whose read `transfer_` is made to wait for.
  const BufferRef& copy_source_locked(int layer, std::vector<uint64_t>* src_offsets);
  void copies_issued_locked(int layer);
  // Cyclic distance in the trace from the current position to the layer's
  // next use (-1: not in the trace, or no trace yet).
  int64_t next_use_cyclic_locked(int layer);
  // `layer`'s indices in trace_, ascending (rebuilt when the trace changed).
  const std::vector<uint32_t>& positions_locked(int layer);
  void read_ahead_locked();
  void check_staging_locked();

  Backend& backend_;
  Stream transfer_;
  Stream post_;  // where post-copy work runs (transfer_ unless given)
  std::vector<Layer> layers_;
  SchedulerOptions opts_;
  std::unique_ptr<SlotPool> pool_;
  std::vector<SlotState> slots_;
  std::vector<int> loaded_;  // layer -> slot holding (or loading) it, -1 if none
  std::vector<uint64_t> copied_version_;  // layer -> content version of its last copy
  std::vector<uint64_t> staged_version_;  // layer -> version when last copied from its staging entry
  bool loaded_valid_locked(int layer);
  // The staging cache's view of the trace (Note [Staging skips what a slot
  // serves], scheduler.cpp): how many trace entries from pos_ the device
  // prefetch covers (`span`), and whether `layer`, `d` entries ahead, is served by the
  // device slot it is already in (so its staging entry is not needed for it).
  size_t prefetch_span_locked();
  bool served_from_slot_locked(int layer, size_t d, size_t span);

  mutable std::mutex mu_;
  std::vector<int> trace_;
  std::vector<int> observed_;  // this step's actual order (replay only)
  std::vector<bool> trace_fwd_, observed_fwd_;  // per entry of trace_ / observed_: a forward fetch
  uint64_t step_deviations_ = 0;
  int deviating_steps_ = 0;    // consecutive steps with deviations
  bool recording_ = true;
  size_t pos_ = 0;  // next expected trace index
  uint64_t acquires_in_step_ = 0;
  bool boundary_due_ = false;           // backward_ended() or begin_call() since the step began
  bool backward_in_step_ = false;       // a backward fetch in this step
  uint64_t step_serial_ = 1;            // bumped at every begin_step_locked()
  std::vector<uint64_t> fetched_in_;    // layer -> step_serial_ of its last fetch
  Phase last_phase_ = Phase::Forward;
  SchedulerStats stats_;
  StepStats cur_step_;
  std::deque<StepStats> steps_;  // bounded: oldest dropped in O(1)
  std::shared_ptr<TraceRecorder> tracer_;
  std::unique_ptr<Stager> stager_;  // null without staged layers
  uint64_t trace_gen_ = 0;           // bumped whenever trace_ changes
  uint64_t positions_gen_ = ~uint64_t(0);
  std::vector<std::vector<uint32_t>> positions_;  // layer -> its indices in trace_
};

}  // namespace layerstream
