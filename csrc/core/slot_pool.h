// layerstream — device slot pool.
//
// One device arena, allocated once, carved into `num_slots` equal slots of
// `slot_bytes` (rounded up to slot_layout::kAlign). The arena never grows, so the
// pool's device footprint is constant and checked against the budget at
// construction: num_slots * slot_bytes <= budget_bytes, or a clear error.
// (A fixed-size-slot design rather than a ring allocator: streamed layers of
// a model are few distinct sizes, slots make reuse and the budget trivially
// checkable; see docs/design/streaming-core.md.)
//
// Slot lifecycle: free --acquire(writer)--> held --release(s)--> free.
// acquire() makes the writer stream wait for the slot's free event (recorded
// by the last release), so a slot is only ever reused after the work that
// read it completed, without blocking the host. Each free slot remembers a
// `tag` (what it holds: e.g. a layer index) so a caller can find still-valid
// content; acquire() picks the free slot with the lowest cost(tag, busy).
//
// Thread safety: NOT internally synchronised; the owner (the Scheduler)
// serialises calls.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "runtime.h"

namespace layerstream {

class SlotPool {
 public:
  static constexpr int64_t kNoTag = -1;

  SlotPool(Backend& backend, size_t slot_bytes, int num_slots, size_t budget_bytes);
  ~SlotPool();
  SlotPool(const SlotPool&) = delete;
  SlotPool& operator=(const SlotPool&) = delete;

  int num_slots() const { return static_cast<int>(slots_.size()); }
  size_t slot_bytes() const { return slot_bytes_; }
  // Device bytes held by the pool (the arena): constant, <= budget.
  size_t device_bytes() const { return arena_.bytes; }
  const BufferRef& slot(int i) const { return slots_.at(i).buf; }

  bool is_free(int i) const { return !slots_.at(i).held; }
  int64_t tag(int i) const { return slots_.at(i).tag; }
  int num_free() const;

  // Takes the free slot with the lowest cost(tag, busy) (cost < 0 = not
  // eligible; `busy`: the work before its last release has not completed,
  // so `writer` would wait for it) and makes `writer` wait for its free
  // event. nullopt if none is eligible.
  std::optional<int> acquire(Stream writer, const std::function<int64_t(int64_t tag, bool busy)>& cost);
  // Whether the work before slot i's last release is still running (a
  // query, never blocks).
  bool busy(int i) const;
  // Takes a specific free slot (e.g. to reuse its content).
  void acquire_slot(int i, Stream writer);
  // Marks a held slot as holding `tag` (content description) while held.
  void set_tag(int i, int64_t tag);
  // Returns slot i; `last_user` is the stream of the last work that touches
  // it: the free event is recorded there.
  void release(int i, Stream last_user);
  // Blocks until every slot's free event has completed (for shutdown).
  void synchronize();

 private:
  struct Slot {
    BufferRef buf;
    Event free_event;
    bool recorded = false;
    bool held = false;
    int64_t tag = kNoTag;
  };
  Backend& backend_;
  size_t slot_bytes_;
  BufferRef arena_;
  std::vector<Slot> slots_;
};

}  // namespace layerstream
