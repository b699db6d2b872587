#include "slot_pool.h"

#include "slot_layout.h"

namespace layerstream {

SlotPool::SlotPool(Backend& backend, size_t slot_bytes, int num_slots, size_t budget_bytes)
    : backend_(backend), slot_bytes_(slot_layout::align(slot_bytes == 0 ? 1 : slot_bytes)) {
  LS_CHECK(num_slots >= 1, "slot pool needs at least 1 slot, got ", num_slots);
  const size_t need = slot_bytes_ * static_cast<size_t>(num_slots);
  LS_CHECK(need <= budget_bytes, "device budget of ", budget_bytes, " bytes cannot hold ", num_slots,
           " slots of ", slot_bytes_, " bytes (", need,
           " bytes needed): raise the budget or use fewer slots");
  arena_ = backend_.alloc_device(need, "slot-arena");
  slots_.resize(static_cast<size_t>(num_slots));
  for (int i = 0; i < num_slots; ++i) {
    Slot& s = slots_[static_cast<size_t>(i)];
    s.buf = backend_.subregion(arena_, slot_bytes_ * static_cast<size_t>(i), slot_bytes_,
                               "slot[" + std::to_string(i) + "]");
    s.free_event = backend_.create_event();
  }
}

SlotPool::~SlotPool() {
  try {
    synchronize();
  } catch (...) {
    // Never throw from a destructor; the arena is freed regardless.
  }
  slots_.clear();
  if (arena_.ptr) backend_.free(arena_);
}

int SlotPool::num_free() const {
  int n = 0;
  for (const Slot& s : slots_) n += s.held ? 0 : 1;
  return n;
}

bool SlotPool::busy(int i) const {
  const Slot& s = slots_.at(static_cast<size_t>(i));
  return s.recorded && !backend_.query(s.free_event);
}

std::optional<int> SlotPool::acquire(Stream writer,
                                     const std::function<int64_t(int64_t tag, bool busy)>& cost) {
  int best = -1;
  int64_t best_cost = 0;
  for (int i = 0; i < num_slots(); ++i) {
    const Slot& s = slots_[static_cast<size_t>(i)];
    if (s.held) continue;
    const int64_t c = cost ? cost(s.tag, busy(i)) : 0;
    if (c < 0) continue;
    if (best < 0 || c < best_cost) {
      best = i;
      best_cost = c;
    }
  }
  if (best < 0) return std::nullopt;
  acquire_slot(best, writer);
  return best;
}

void SlotPool::acquire_slot(int i, Stream writer) {
  Slot& s = slots_.at(static_cast<size_t>(i));
  LS_INTERNAL_CHECK(!s.held, "slot ", i, " acquired twice");
  s.held = true;
  if (s.recorded) backend_.wait(writer, s.free_event);
}

void SlotPool::set_tag(int i, int64_t tag) { slots_.at(static_cast<size_t>(i)).tag = tag; }

void SlotPool::release(int i, Stream last_user) {
  Slot& s = slots_.at(static_cast<size_t>(i));
  LS_INTERNAL_CHECK(s.held, "slot ", i, " released while free");
  backend_.record(s.free_event, last_user);
  s.recorded = true;
  s.held = false;
}

void SlotPool::synchronize() {
  for (Slot& s : slots_)
    if (s.recorded) backend_.synchronize(s.free_event);
}

}  // namespace layerstream
