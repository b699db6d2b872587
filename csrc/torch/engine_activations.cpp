// layerstream — LibTorch glue: activation offload (docs/design/activations.md): tensors autograd saves go
// to pinned host memory on the activation stream and come back on the transfer stream ahead of the
// backward that unpacks them (the engine's rooms: engine_impl.h).
#include "engine_impl.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>

#include <algorithm>
#include <iterator>

#include "core/planner.h"  // format_bytes

namespace layerstream {

namespace {
// The storages of the device weights the streamed layers computing on this
// thread use (WeightsNotActivations): saved by their recorded graphs, never
// activations.
thread_local std::vector<const c10::StorageImpl*> t_weights;

const c10::StorageImpl* storage_of(const torch::Tensor& t) {
  return t.defined() && t.has_storage() ? t.storage().unsafeGetStorageImpl() : nullptr;
}

// Note [Saved tensors are let go after the lock]
// A saved tensor can be the last owner of a storage that a Python object
// shares (the pack hook read its untyped_storage()): destroying it takes the
// GIL. Under mu_ that deadlocked (tests/python/test_threads.py): a thread in
// stash_activation (the GIL released, for its wait) held mu_ and waited for
// the GIL in the tensor's destructor, while another thread, in a Python
// unpack or __del__ (the GIL held), waited for mu_. So tensors are let go
// into this thread's list under the lock and destroyed after it, at the
// outermost entry point of this thread (mu_ is recursive: depth counts them).
thread_local std::vector<torch::Tensor> t_let_go;
thread_local int t_let_go_depth = 0;

bool inside(const void* p, const BufferRef& b) {
  const char* c = static_cast<const char*>(p);
  const char* lo = static_cast<const char*>(b.ptr);
  return b.ptr != nullptr && c >= lo && c < lo + b.bytes;
}
}  // namespace

EngineImpl::WeightsNotActivations::WeightsNotActivations(const DeviceParams& p) {
  for (const torch::Tensor* t : {&p.w_leaf, &p.w, &p.b_leaf, &p.b}) t_weights.push_back(storage_of(*t));
}

EngineImpl::WeightsNotActivations::~WeightsNotActivations() { t_weights.resize(t_weights.size() - 4); }

void EngineImpl::let_go_locked(torch::Tensor& t) {
  if (t.defined()) t_let_go.push_back(std::move(t));
  t = torch::Tensor();
}

EngineImpl::LetGoAfterUnlock::LetGoAfterUnlock() { ++t_let_go_depth; }

EngineImpl::LetGoAfterUnlock::~LetGoAfterUnlock() {
  if (--t_let_go_depth > 0) return;
  std::vector<torch::Tensor> gone;
  gone.swap(t_let_go);  // destroyed here, without the engine's lock
}

void EngineImpl::note_activation_bytes_locked(int64_t delta) {
  act_device_bytes_ += delta;
  act_peak_device_bytes_ = std::max(act_peak_device_bytes_, act_device_bytes_);
}

void EngineImpl::release_copied_locked() {
  while (!awaiting_copy_.empty()) {
    auto it = stashed_.find(awaiting_copy_.front());
    if (it != stashed_.end() && it->second.device.defined()) {
      if (!backend_->query(it->second.to_host)) return;  // in saving order: the later ones are later
      let_go_locked(it->second.device);
      backend_->unwrap(it->second.device_ref);  // torch's memory again (the checker forgets it)
      it->second.device_ref = BufferRef();
      note_activation_bytes_locked(-static_cast<int64_t>(it->second.bytes));
    }
    awaiting_copy_.pop_front();
  }
}

uint64_t EngineImpl::prune_handed_out_locked(int64_t token) {
  uint64_t dropped = 0;
  auto keep = std::remove_if(handed_out_.begin(), handed_out_.end(), [&](const HandedOut& h) {
    const bool gone = h.storage.expired();
    if (!gone && h.token != token) return false;
    if (gone) note_activation_bytes_locked(-static_cast<int64_t>(h.bytes));
    else dropped += h.bytes;
    return true;
  });
  handed_out_.erase(keep, handed_out_.end());
  return dropped;
}

void EngineImpl::begin_activations(uint64_t device_budget) {
  auto scope = device_scope();
  LetGoAfterUnlock let_go;
  std::lock_guard<std::recursive_mutex> lock(mu_);
  act_budget_ = device_budget;
  release_copied_locked();
}

std::optional<c10::VariableVersion> version_of(const torch::Tensor& t) {
  const c10::VariableVersion& v = t.unsafeGetTensorImpl()->version_counter();
  if (!v.enabled()) return std::nullopt;
  return v;
}

void check_saved_version(const std::optional<c10::VariableVersion>& version, uint32_t saved,
                         c10::IntArrayRef sizes) {
  if (!version || version->current_version() == saved) return;
  LS_FAIL("one of the variables needed for gradient computation has been modified by an inplace operation: "
          "a saved tensor of shape ", sizes, " is at version ", version->current_version(), "; expected version ",
          saved, " instead (autograd's check, which offload(activations=...) keeps: write it after backward, "
          "or clone it before the in-place write)");
}

int64_t EngineImpl::stash_activation(const torch::Tensor& t) {
  if (!t.defined() || t.device() != compute_device_ || !t.has_storage()) return -1;
  // Not bytes alone: a conjugate or negative view's bit, or a zero tensor, would be
  // lost in the copy (the copy back is an empty_strided of its sizes and strides).
  if (t.layout() != torch::kStrided || t.is_conj() || t.is_neg() || t._is_zerotensor()) return -1;
  const c10::StorageImpl* st = storage_of(t);
  if (std::find(t_weights.begin(), t_weights.end(), st) != t_weights.end()) return -1;
  auto scope = device_scope();
  Event wait;  // Note [Copies in flight]: waited for after the lock is released
  int64_t token;
  LetGoAfterUnlock let_go;
  {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    token = stash_locked(t, &wait);
  }
  if (wait) backend_->synchronize(wait);
  return token;
}

// Note [A tensor saved by several ops]
// The normed input of a block's q, k and v projections is saved by each of
// them (a Llama block saves its attention input three times and its MLP input
// twice). Stashed once per save, each save took its own host buffer and its
// own copies each way. Now a later save of the same data, unchanged since the
// first (the same storage, address, sizes, strides and dtype, and the version
// it was saved at: an op may save its own view of the tensor, as a Linear's
// reshape), is an alias of the first one's entry (the primary), which holds the data for all:
// one host copy, one copy back. Backward unpacks them in reverse saving order,
// so an alias is usually unpacked first: the primary is copied back then, and
// its copy is kept (`shared`) for the others' unpacks while any other token of
// the tensor lives, until the last of them unpacks it or this backward ends
// (its final callback, as for Note [Copies back that no backward reads]). The
// device holds it from its first unpack to its last, as without offload it
// would all along. The entry goes when every token of it was dropped.
bool EngineImpl::holds_unchanged(const Stashed& s, const torch::Tensor& t) {
  if (s.primary >= 0 || !s.storage || s.storage->expired() || s.data != t.data_ptr()) return false;
  if (s.sizes != t.sizes() || s.strides != t.strides() || s.options.dtype() != t.dtype()) return false;
  const auto now = version_of(t);
  if (now.has_value() != s.version.has_value()) return false;
  return !now || (now->current_version() == s.saved_version && s.version->current_version() == s.saved_version);
}

std::pair<EngineImpl::Stashed*, int64_t> EngineImpl::primary_of(std::map<int64_t, Stashed>::iterator it) {
  if (it->second.primary < 0) return {&it->second, it->first};
  auto p = stashed_.find(it->second.primary);
  LS_CHECK(p != stashed_.end(), "saved activation ", it->first, ": the entry it shares (", it->second.primary,
           ") is gone while it lives (an internal error; please report it)");
  return {&p->second, p->first};
}

void EngineImpl::release_at_end_of_locked(int task) {
  if (task == -1 || act_callback_task_ == task) return;
  act_callback_task_ = task;
  torch::autograd::Engine::get_default_engine().queue_callback([weak = weak_from_this(), task] {
    if (auto self = weak.lock()) {
      LetGoAfterUnlock let_go_after;
      std::lock_guard<std::recursive_mutex> lock(self->mu_);
      self->release_unserved_locked(task);
    }
  });
}

int64_t EngineImpl::stash_locked(const torch::Tensor& t, Event* wait) {
  LS_CHECK(!detached_, "this layerstream handle was detached; its activation offload is off");
  const void* p = t.data_ptr();
  if (sched_)
    for (int i = 0; i < sched_->pool().num_slots(); ++i)
      if (inside(p, sched_->pool().slot(i))) return -1;  // a view of a slot (weights)
  release_copied_locked();
  for (auto [seen, end] = saved_by_storage_.equal_range(storage_of(t)); seen != end; ++seen) {
    auto p = stashed_.find(seen->second);
    if (p != stashed_.end() && holds_unchanged(p->second, t)) {  // Note [A tensor saved by several ops]
      Stashed alias;
      alias.primary = seen->second;
      alias.sizes = p->second.sizes;
      alias.version = version_of(t);  // its own counter (an op's view of it may have another)
      alias.saved_version = p->second.saved_version;
      ++p->second.sharers;
      const int64_t token = next_stash_++;
      stashed_.emplace(token, std::move(alias));
      return token;
    }
  }
  Stashed s;
  s.bytes = static_cast<size_t>(t.numel()) * t.element_size();
  s.sizes = t.sizes().vec();
  s.strides = t.strides().vec();
  s.options = t.options();
  // Without its autograd history: unpacking takes only the data (the saved
  // variable restores the rest), and a tensor that is its own node's output
  // would otherwise hold that node, whose saved variables hold the token:
  // a cycle through this map that a forward without backward never frees.
  s.device = t.detach();
  s.version = version_of(t);
  if (s.version) s.saved_version = s.version->current_version();
  s.storage = c10::weak_intrusive_ptr<c10::StorageImpl>(
      c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(t.storage().unsafeGetStorageImpl()));
  s.data = p;
  const int64_t token = next_stash_++;
  saved_by_storage_.emplace(storage_of(t), token);
  // Held here as autograd would hold it; a large dense one enters the device
  // budget's window, and the oldest ones beyond the budget leave it for the
  // host (docs/design/activations.md, "The device budget keeps the newest").
  const bool movable = static_cast<int64_t>(s.bytes) >= opts_.activation_min_bytes && t.is_non_overlapping_and_dense();
  s.in_window = movable;
  note_activation_bytes_locked(static_cast<int64_t>(s.bytes));
  Stashed& entry = stashed_.emplace(token, std::move(s)).first->second;
  if (movable) {
    act_kept_ += entry.bytes;
    window_.push_back(token);
  }
  while (act_kept_ > act_budget_ && !window_.empty()) {
    const int64_t oldest = window_.front();
    window_.pop_front();
    auto it = stashed_.find(oldest);
    if (it == stashed_.end() || !it->second.in_window) continue;
    it->second.in_window = false;
    act_kept_ -= it->second.bytes;
    offload_locked(oldest, it->second);
  }
  limit_in_flight_locked(wait);
  return token;
}

// Note [Copies in flight]
// The copies to the host run on the activation stream while the forward goes
// on; on a GPU the forward is enqueued far ahead of the device, so without a
// bound every offloaded tensor would still be waiting for its copy when the
// last one is saved, and the device would hold them all (torch's allocator
// reuses a block only after its copy ran: "Streams" in
// docs/design/activations.md). So at most prefetch + 1 times the largest
// tensor offloaded so far is in flight (always the newest copy): past that, the
// forward waits for the oldest copies to finish, as the weights' prefetch
// depth bounds their slots. The device is not starved by the wait: what the
// forward enqueued after those copies' tensors is still queued ahead of it.
void EngineImpl::limit_in_flight_locked(Event* wait) {
  while (!in_flight_.empty() && backend_->query(in_flight_.front().first)) {
    in_flight_bytes_ -= in_flight_.front().second;
    in_flight_.pop_front();
  }
  const uint64_t cap = static_cast<uint64_t>(std::max(opts_.prefetch, 0) + 1) * act_largest_;
  while (in_flight_.size() > 1 && in_flight_bytes_ > cap) {
    *wait = std::move(in_flight_.front().first);  // in stream order: the newest one waited for covers the rest
    in_flight_bytes_ -= in_flight_.front().second;
    in_flight_.pop_front();
  }
}

// Note [The activation host pool]
// Host copies are pooled across steps (a step repeats its sizes), by their
// allocated size, which is the tensor's rounded up to a size class (four per
// power of two, at least 256 bytes: at most a quarter more). A stash takes the
// smallest free buffer that holds it and is at most twice its size, else
// allocates one of its class. Shapes that change every step (dynamic padding)
// asked for an exact size before: the pool kept every size ever seen and grew
// without bound, and once it filled the host budget every later tensor stayed
// on the device (an out-of-memory on a GPU some steps later). Now a new buffer
// first evicts free ones while the pool and the buffers in use would exceed
// twice the most ever in use at once (so the pool stays about one step's worth)
// or the host budget; what is evicted has finished its copies (its event).
size_t EngineImpl::host_class_bytes(size_t bytes) {
  size_t k = 256;
  while (k * 2 <= bytes) k *= 2;
  const size_t step = std::max<size_t>(k / 4, 256);
  return (bytes + step - 1) / step * step;
}

void EngineImpl::evict_host_pool_locked(uint64_t need) {
  auto over = [&] {
    const uint64_t in_use = act_host_bytes_ - pool_bytes_;
    const bool cap = opts_.activation_host_cap >= 0 &&
                     act_host_bytes_ + grad_extra_bytes_ + need > static_cast<uint64_t>(opts_.activation_host_cap);
    return cap || act_host_bytes_ + need > 2 * std::max<uint64_t>(act_host_peak_in_use_, in_use + need);
  };
  while (!host_pool_.empty() && over()) {
    auto largest = std::prev(host_pool_.end());
    backend_->synchronize(largest->second.second);  // its last copy has finished (long since, as a rule)
    const uint64_t b = largest->second.first.bytes();
    if (largest->second.first.kind() == MemoryKind::HostPinned) act_pinned_bytes_ -= b;
    act_host_bytes_ -= b;
    pool_bytes_ -= b;
    host_pool_.erase(largest);
  }
}

bool EngineImpl::offload_locked(int64_t token, Stashed& s) {
  auto pooled = host_pool_.lower_bound(s.bytes);
  if (pooled != host_pool_.end() && pooled->first > 2 * host_class_bytes(s.bytes)) pooled = host_pool_.end();
  const size_t alloc = host_class_bytes(s.bytes);
  if (pooled == host_pool_.end()) evict_host_pool_locked(alloc);
  if (pooled == host_pool_.end() && opts_.activation_host_cap >= 0 &&
      act_host_bytes_ + grad_extra_bytes_ + alloc > static_cast<uint64_t>(opts_.activation_host_cap)) {
    warn_once("activation-host-cap-" + std::to_string(id_),
              "saved activations: the host budget leaves " + format_bytes(opts_.activation_host_cap) +
                  " for their host copies and they need more; the rest stay on the device (raise host_budget, "
                  "or keep fewer on the host with activations=<device budget>)");
    return false;
  }
  Stream cs = compute_stream();
  s.device_ref = backend_->wrap(const_cast<void*>(s.device.data_ptr()), s.bytes, MemoryKind::Device, "activation");
  backend_->declare_access(s.device_ref, Access::Write, cs, "the computation of a saved activation");
  Event ready = backend_->create_event();
  backend_->record(ready, cs);
  backend_->wait(act_stream_, ready);
  if (pooled != host_pool_.end()) {
    s.host = std::move(pooled->second.first);
    backend_->wait(act_stream_, pooled->second.second);  // its last copy back has read it
    host_pool_.erase(pooled);
    pool_bytes_ -= s.host.bytes();
  } else {
    const bool pin = opts_.pin_memory && (opts_.activation_pinned_cap < 0 ||
                                          act_pinned_bytes_ + alloc <=
                                              static_cast<uint64_t>(opts_.activation_pinned_cap));
    if (opts_.pin_memory && !pin)
      warn_once("activation-pinned-cap-" + std::to_string(id_),
                "saved activations: the pinned budget leaves " + format_bytes(opts_.activation_pinned_cap) +
                    " for their host copies and they need more; the rest use pageable memory (slower copies; "
                    "raise pinned_budget)");
    bool fell_back = false;
    s.host = HostBuffer::allocate(*backend_, alloc, pin, "saved activation", &fell_back);
    if (fell_back)
      warn_once("activation-pageable", "could not pin a host buffer for saved activations; using pageable "
                                       "memory (slower copies)");
    act_host_bytes_ += alloc;
    if (s.host.kind() == MemoryKind::HostPinned) act_pinned_bytes_ += alloc;
  }
  act_host_peak_in_use_ = std::max<uint64_t>(act_host_peak_in_use_, act_host_bytes_ - pool_bytes_);
  s.offloaded = true;
  auto span = trace_begin(act_stream_);
  backend_->copy_async(s.host.ref(), 0, s.device_ref, 0, s.bytes, act_stream_);
  trace_end(act_stream_, span, "act d2h", "activation to host", s.bytes);
  s.to_host = backend_->create_event();
  backend_->record(s.to_host, act_stream_);
  act_d2h_bytes_ += s.bytes;
  Event copied = backend_->create_event();  // Note [Copies in flight]
  backend_->record(copied, act_stream_);
  in_flight_.emplace_back(std::move(copied), s.bytes);
  in_flight_bytes_ += s.bytes;
  act_largest_ = std::max<uint64_t>(act_largest_, s.bytes);
  // On a GPU the forward runs ahead of the device: a check at the next stash
  // would find no copy finished, and every tensor would stay until backward.
  // torch's allocator orders the reuse after the copy instead, and the
  // tensor goes now (docs/design/activations.md, "Streams").
  if (cuda_index_ >= 0 && cuda_glue::record_stream(s.device, cuda_index_, act_stream_.native())) {
    let_go_locked(s.device);
    note_activation_bytes_locked(-static_cast<int64_t>(s.bytes));
  } else {
    awaiting_copy_.push_back(token);  // let go by release_copied_locked once its copy finished
  }
  return true;
}

void EngineImpl::copy_back_locked(Stashed& s) {
  s.restored = at::empty_strided(s.sizes, s.strides, s.options);
  s.restored_ref = backend_->wrap(s.restored.data_ptr(), s.bytes, MemoryKind::Device, "restored activation");
  // The framework's allocator hands out memory that work already enqueued on
  // the compute stream may still use (its own stream's order makes that safe
  // for compute, not for the transfer stream): the copy waits for that work.
  Event allocated = backend_->create_event();
  backend_->record(allocated, compute_stream());
  backend_->wait(transfer_, allocated);
  backend_->wait(transfer_, s.to_host);  // the host copy is complete
  auto span = trace_begin(transfer_);
  backend_->copy_async(s.restored_ref, 0, s.host.ref(), 0, s.bytes, transfer_);
  trace_end(transfer_, span, "act h2d", "activation back", s.bytes);
  if (!s.to_device) s.to_device = backend_->create_event();
  backend_->record(s.to_device, transfer_);
  s.copying_back = true;
  act_h2d_bytes_ += s.bytes;
  note_activation_bytes_locked(static_cast<int64_t>(s.bytes));
}

torch::Tensor EngineImpl::restore_activation(int64_t token, bool order_compute) {
  auto scope = device_scope();
  LetGoAfterUnlock let_go;
  std::lock_guard<std::recursive_mutex> lock(mu_);
  auto it = stashed_.find(token);
  LS_CHECK(it != stashed_.end(), "saved activation ", token, " was already released (its graph was freed); "
           "backward through it twice needs retain_graph=True");
  check_saved_version(it->second.version, it->second.saved_version, it->second.sizes);
  auto [sp, held_by] = primary_of(it);  // Note [A tensor saved by several ops]
  Stashed& s = *sp;
  if (!s.offloaded) return s.device;
  release_copied_locked();
  prune_handed_out_locked();
  // Its copy to the host has not finished and the tensor is still here:
  // handed back as it is (kept_until_copied). The sim copies it back, so that
  // the checker sees that path's order: the copy back after the copy to the
  // host (copy_back_locked).
  if (kept_until_copied(s)) return s.device;
  const bool again = s.handed_out;  // a retained graph's backward after the first
  const int task = torch::autograd::get_current_graph_task_id();
  torch::Tensor out;
  if (s.shared.defined()) {  // another sharer's unpack copied it back
    out = s.shared;
    if (s.sharers <= 1) let_go_locked(s.shared);
  } else {
    if (!s.copying_back) copy_back_locked(s);
    Stream cs = compute_stream();
    if (order_compute) backend_->wait(cs, s.to_device);
    backend_->declare_access(s.restored_ref, Access::Read, cs, "the backward's read of a saved activation");
    backend_->unwrap(s.restored_ref);  // handed to autograd: the engine never touches it again
    s.restored_ref = BufferRef();
    out = std::move(s.restored);
    s.restored = torch::Tensor();
    s.copying_back = false;
    s.handed_out = true;
    s.handed_task = task;
    handed_out_.push_back({held_by,
                           c10::weak_intrusive_ptr<c10::StorageImpl>(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(
                               out.storage().unsafeGetStorageImpl())),
                           s.bytes});
    if (s.sharers > 1) {
      s.shared = out;
      s.shared_task = task;
      release_at_end_of_locked(task);
    }
  }
  // The next `prefetch` offloaded stashes backward will unpack (saved
  // earlier) are coming back from now on; those already coming back count,
  // so that the copies back stay `prefetch` ahead and do not run further.
  // Entries handed out already count as served (another graph's, or unpacked
  // out of order) -- unless this backward is a retained graph's again and they
  // were handed to an earlier one: then they come next, as the first time.
  // (Skipped uncounted before, a second backward walked every entry at each
  // restore and started no copy early: quadratic in the saved tensors.) An
  // alias stands for its primary, at the alias's place in the order.
  int ahead = opts_.prefetch;
  for (auto prev = std::make_reverse_iterator(it); prev != stashed_.rend() && ahead > 0; ++prev) {
    Stashed& q = *primary_of(std::prev(prev.base())).first;
    if (!q.offloaded || kept_until_copied(q)) continue;
    const bool served =
        q.shared.defined() || (q.handed_out && (!again || (task != -1 && q.handed_task == task)));
    if (!served && !q.copying_back) {
      copy_back_locked(q);
      q.prefetch_task = task;
      release_at_end_of_locked(task);
    }
    --ahead;
  }
  return out;
}

// Note [Copies back that no backward reads]: the prefetch above copies back the
// entries saved before the one unpacked, which may be another graph's (a
// validation loss kept with its graph, never backpropagated) or ones this
// backward does not reach (torch.autograd.grad of part of a graph). Kept, they
// held device memory until their graph was freed. At the end of the backward
// (its final callback; one that raised keeps them until their graph goes) the
// device copies it did not hand out are freed; their host copies stay, and a
// later backward copies them back again.
void EngineImpl::release_unserved_locked(int task) {
  for (auto& entry : stashed_) {
    Stashed& s = entry.second;
    if (s.shared.defined() && s.shared_task == task) let_go_locked(s.shared);  // Note [A tensor saved by several ops]
    if (!s.copying_back || s.prefetch_task != task) continue;
    backend_->synchronize(s.to_device);  // the copy into it has finished
    if (s.restored_ref.id) backend_->unwrap(s.restored_ref);
    s.restored_ref = BufferRef();
    let_go_locked(s.restored);
    s.copying_back = false;
    s.prefetch_task = -1;
    note_activation_bytes_locked(-static_cast<int64_t>(s.bytes));
  }
}

void EngineImpl::drop_activation(int64_t token, bool order_reuse) {
  LetGoAfterUnlock let_go;
  std::lock_guard<std::recursive_mutex> lock(mu_);
  auto it = stashed_.find(token);
  if (it == stashed_.end()) return;
  if (it->second.primary >= 0) {  // Note [A tensor saved by several ops]: the primary holds the data
    const int64_t primary = it->second.primary;
    stashed_.erase(it);
    it = stashed_.find(primary);
    if (it == stashed_.end()) return;
    token = primary;
  }
  Stashed& s = it->second;
  if (--s.sharers > 0) return;  // another token of the tensor lives
  if (s.storage)
    for (auto [at, end] = saved_by_storage_.equal_range(s.storage->_unsafe_get_target()); at != end; ++at)
      if (at->second == token) {
        saved_by_storage_.erase(at);
        break;
      }
  const uint64_t handed = s.handed_out ? prune_handed_out_locked(token) : 0;  // the copies autograd still holds
  int64_t held = static_cast<int64_t>(handed) + (s.device.defined() ? static_cast<int64_t>(s.bytes) : 0) +
                 (s.copying_back ? static_cast<int64_t>(s.bytes) : 0);
  note_activation_bytes_locked(-held);
  if (s.in_window) {
    act_kept_ -= s.bytes;
    // Backward frees the newest first: the token is usually at the back.
    auto w = std::find(window_.rbegin(), window_.rend(), token);
    if (w != window_.rend()) window_.erase(std::next(w).base());
  }
  if (s.offloaded) {
    // Reusable once every copy that reads or writes it has finished: the
    // next stash into it waits for this event on the activation stream.
    Event done = backend_->create_event();
    if ((s.copying_back || s.handed_out) && order_reuse) {
      backend_->record(done, transfer_);
    } else {
      backend_->record(done, act_stream_);
    }
    // The device tensors this entry holds go with it: not before the copies
    // that read or write them have finished.
    if (s.device.defined()) backend_->synchronize(s.to_host);
    if (s.copying_back) backend_->synchronize(s.to_device);
    pool_bytes_ += s.host.bytes();
    const size_t size = s.host.bytes();
    host_pool_.emplace(size, std::make_pair(std::move(s.host), std::move(done)));
  }
  // What the checker still knows of this entry's device memory (wrapped): torch's again.
  if (s.device_ref.id) backend_->unwrap(s.device_ref);
  if (s.restored_ref.id) backend_->unwrap(s.restored_ref);
  let_go_locked(s.device);
  let_go_locked(s.restored);
  let_go_locked(s.shared);
  stashed_.erase(it);
}

}  // namespace layerstream
