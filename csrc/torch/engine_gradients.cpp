// layerstream — LibTorch glue: weight gradients: staging on the host, accumulation into .grad, end-of-backward callbacks (docs/design/gradients.md)
// (the engine's rooms: engine_impl.h).
#include "engine_impl.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>

#include <algorithm>
#include <cstring>

#include "core/log.h"
#include "core/planner.h"  // format_bytes

namespace layerstream {

void EngineImpl::push_grads(int layer_index, Lease& scratch, bool has_w, bool has_b) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  LayerInfo& l = *layers_.at(static_cast<size_t>(layer_index));
  Stream cs = compute_stream();
  if (backend_->caps().ordering_checker)
    backend_->declare_access(scratch.slot_buf, Access::Write, cs,
                             "compute writes gradients of '" + l.name + "'");
  // A layer used more than once in one backward: each use gets its own
  // staging buffer; accumulate_locked() sums them before touching .grad.
  // Uses are tagged with the graph task, which applies them when it ends.
  const size_t use = l.pending.size();
  if (l.grad_staging.size() <= use) l.grad_staging.resize(use + 1);
  HostBuffer& staging = l.grad_staging[use];
  if (!staging.data()) {
    const uint64_t bytes = grad_bytes(l);
    // Pinned within the pinned budget's share for them (EngineOptions::grad_staging_pinned_cap).
    const int64_t cap = opts_.grad_staging_pinned_cap;
    const bool pin = opts_.pin_memory && (cap < 0 || grad_pinned_bytes_ + bytes <= static_cast<uint64_t>(cap));
    if (opts_.pin_memory && !pin)
      warn_once("grad-staging-pinned-cap-" + std::to_string(id_),
                "gradients: the pinned budget leaves " + format_bytes(static_cast<uint64_t>(cap)) +
                    " for their host staging buffers and they need more; the rest use pageable memory (on CUDA "
                    "their copies block the backward's thread; raise pinned_budget)");
    bool fell_back = false;
    staging = HostBuffer::allocate(*backend_, bytes, pin,
                                   l.name + ".grad-staging" + (use ? "." + std::to_string(use) : ""),
                                   &fell_back);
    l.grad_b_offset = slot_layout::gradient_bias_offset(l.w_bytes);
    if (fell_back)
      warn_once("grad-staging-pageable", "could not pin the gradient staging buffer of '" + l.name +
                                             "'; using pageable memory (slower gradient copies)");
    (staging.kind() == MemoryKind::HostPinned ? grad_pinned_bytes_ : grad_pageable_bytes_) += bytes;
    if (use > 0) {
      // The plan counts one buffer per layer; another takes what the host
      // budget leaves, shared with saved activations' buffers.
      grad_extra_bytes_ += bytes;
      const int64_t spare = opts_.activation_host_cap;
      if (spare >= 0 && act_host_bytes_ + grad_extra_bytes_ > static_cast<uint64_t>(spare))
        warn_once("grad-staging-extra-" + std::to_string(id_),
                  "gradients: layer '" + l.name + "' is used more than once in one backward, and its extra "
                  "host staging buffer (" + format_bytes(bytes) + ") does not fit in what the host budget leaves (" +
                  format_bytes(static_cast<uint64_t>(spare)) + "): host memory goes over host_budget by " +
                  format_bytes(act_host_bytes_ + grad_extra_bytes_ - static_cast<uint64_t>(spare)) +
                  " (raise host_budget by that much)");
    }
  }
  Event computed = backend_->create_event();
  backend_->record(computed, cs);
  backend_->wait(grad_stream_, computed);
  auto span = trace_begin(grad_stream_);
  if (has_w) {
    backend_->copy_async(staging.ref(), 0, scratch.slot_buf, 0, l.w_bytes, grad_stream_);
    d2h_bytes_ += l.w_bytes;
  }
  if (has_b) {
    backend_->copy_async(staging.ref(), l.grad_b_offset, scratch.slot_buf, l.grad_b_offset,
                         l.b_bytes, grad_stream_);
    d2h_bytes_ += l.b_bytes;
  }
  trace_end(grad_stream_, span, "grad", "D2H grad " + l.name,
            (has_w ? l.w_bytes : 0) + (has_b ? l.b_bytes : 0));
  scheduler().note_d2h((has_w ? l.w_bytes : 0) + (has_b ? l.b_bytes : 0));
  backend_->record(l.grad_done, grad_stream_);
  scheduler().release(scratch, grad_stream_);
  l.pending.push_back({has_w, has_b, torch::autograd::get_current_graph_task_id()});
  if (use == 0) pending_.push_back(layer_index);
  queue_if_ready_locked(layer_index, l);  // the gradient-ready hook (engine_grad_ready.cpp)
}

namespace {
// Moves the staged uses of `l` (and their staging buffers, which keep their
// pairing) that `pick` selects to the front, in arrival order; returns how
// many. The rest keep their relative order behind them.
template <typename Pick>
size_t partition_uses(EngineImpl::LayerInfo& l, Pick pick) {
  size_t n = 0;
  for (size_t u = 0; u < l.pending.size(); ++u) {
    if (!pick(l.pending[u])) continue;
    if (u != n) {
      std::rotate(l.pending.begin() + static_cast<std::ptrdiff_t>(n),
                  l.pending.begin() + static_cast<std::ptrdiff_t>(u),
                  l.pending.begin() + static_cast<std::ptrdiff_t>(u) + 1);
      std::rotate(l.grad_staging.begin() + static_cast<std::ptrdiff_t>(n),
                  l.grad_staging.begin() + static_cast<std::ptrdiff_t>(u),
                  l.grad_staging.begin() + static_cast<std::ptrdiff_t>(u) + 1);
    }
    ++n;
  }
  return n;
}

// Drops the first `n` staged uses; their buffers go to the back for reuse
// (a later copy into one is ordered after the earlier copy on the gradient
// stream, and the host reads it only after waiting for the later one).
void drop_front_uses(EngineImpl::LayerInfo& l, size_t n) {
  l.pending.erase(l.pending.begin(), l.pending.begin() + static_cast<std::ptrdiff_t>(n));
  std::rotate(l.grad_staging.begin(), l.grad_staging.begin() + static_cast<std::ptrdiff_t>(n),
              l.grad_staging.end());
}
}  // namespace

void EngineImpl::accumulate_locked(LayerInfo& l, int task) {
  const size_t n = partition_uses(l, [task](const LayerInfo::StagedUse& u) {
    // A use claimed by a consuming hook's job is that job's (unless nothing can run it any more).
    return task == kAnyTask || ((u.task == task || u.task == -1) && !u.claimed);
  });
  if (n == 0) return;
  backend_->synchronize(l.grad_done);
  if (backend_->caps().ordering_checker)
    for (size_t u = 0; u < n; ++u)
      backend_->declare_host_access(l.grad_staging[u].ref(), Access::Read,
                                    "host accumulates gradients of '" + l.name + "'");
  torch::NoGradGuard ng;
  // Sum this backward's gradients of the weight (or bias) in arrival order,
  // then add the sum to .grad once: the order autograd uses for a leaf that
  // gets several gradients, so the result is bit-identical.
  auto acc = [&](torch::Tensor& param, bool weight, size_t offset, const std::vector<int64_t>& shape,
                 torch::ScalarType dt) {
    torch::Tensor sum;
    bool owned = false;
    for (size_t u = 0; u < n; ++u) {
      if (!(weight ? l.pending[u].w : l.pending[u].b)) continue;
      torch::Tensor g = torch::from_blob(static_cast<char*>(l.grad_staging[u].data()) + offset, shape,
                                         torch::TensorOptions().dtype(dt));
      if (!sum.defined()) {
        sum = g;
      } else {
        if (!owned) sum = sum.clone();
        owned = true;
        sum.add_(g);
      }
    }
    if (!sum.defined()) return;
    torch::Tensor& grad = param.mutable_grad();
    if (!grad.defined()) {
      if (param.is_contiguous()) {
        grad = owned ? sum : sum.clone();
      } else {
        // The parameter's layout (channels_last, transposed), as autograd
        // lays out a new .grad.
        grad = torch::empty_like(param);
        grad.copy_(sum);
      }
    } else {
      grad.add_(sum);
    }
  };
  acc(l.weight, true, 0, l.w_shape, l.w_dtype);
  if (l.bias.defined()) acc(l.bias, false, l.grad_b_offset, l.b_shape, l.b_dtype);
  drop_front_uses(l, n);
}

bool EngineImpl::consumable(const LayerInfo& l) {
  return !l.is_table() && !l.is_group() && l.weight.is_contiguous() && (!l.bias.defined() || l.bias.is_contiguous());
}

bool EngineImpl::take_staged_locked(LayerInfo& l, int task, LandedGradients* landed, HostBuffer* held) {
  if (!consumable(l)) return false;
  const size_t n = partition_uses(l, [task](const LayerInfo::StagedUse& u) { return u.task == task || u.task == -1; });
  if (n != 1) {  // uses of no graph task besides: all are summed into .grad first
    for (size_t u = 0; u < n; ++u) l.pending[u].claimed = false;
    return false;
  }
  backend_->synchronize(l.grad_done);
  HostBuffer& staging = l.grad_staging[0];
  if (backend_->caps().ordering_checker)
    backend_->declare_host_access(staging.ref(), Access::Read, "host optimizer reads gradients of '" + l.name + "'");
  char* base = static_cast<char*>(staging.data());
  const LayerInfo::StagedUse use = l.pending[0];
  *landed = LandedGradients{};
  if (use.w) landed->weight = torch::from_blob(base, l.w_shape, torch::TensorOptions().dtype(l.w_dtype));
  if (use.b && l.bias.defined())
    landed->bias = torch::from_blob(base + l.grad_b_offset, l.b_shape, torch::TensorOptions().dtype(l.b_dtype));
  drop_front_uses(l, 1);  // its buffer goes to the back: take it from there
  *held = std::move(l.grad_staging.back());
  return true;
}

void EngineImpl::return_staging_locked(LayerInfo& l, HostBuffer held) {
  // Its empty entry, unless push_grads filled it with a new buffer meanwhile
  // (then `held` is not needed and is freed).
  for (HostBuffer& b : l.grad_staging)
    if (!b.data()) {
      b = std::move(held);
      return;
    }
}

void EngineImpl::drain_grads(int task) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  std::vector<int> still;
  for (int i : pending_) {
    LayerInfo& l = *layers_.at(static_cast<size_t>(i));
    accumulate_locked(l, task);
    if (!l.pending.empty()) still.push_back(i);
  }
  pending_ = std::move(still);
}

void EngineImpl::discard_task(int task) noexcept {
  try {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    auto& t = callback_tasks_;
    t.erase(std::remove(t.begin(), t.end(), task), t.end());
    bool dropped = false;
    std::vector<int> still;
    for (int i : pending_) {
      LayerInfo& l = *layers_.at(static_cast<size_t>(i));
      const size_t n = partition_uses(l, [task](const LayerInfo::StagedUse& u) { return u.task == task; });
      drop_front_uses(l, n);
      if (n > 0) l.dropped_task = task;
      dropped = dropped || n > 0;
      if (!l.pending.empty()) still.push_back(i);
    }
    pending_ = std::move(still);
    reset_forward_uses_locked(task);  // the gradient-ready hook counts from here
    // Every failed backward that reached a streamed layer counts, also one whose
    // gradients an overlapped step had all consumed already (nothing left to
    // drop: the layers it stepped stay stepped); the warning is for dropped ones.
    ++failed_backwards_;
    if (dropped) failed_backward_unreported_ = true;
  } catch (...) {
    // Runs from a destructor inside the autograd engine: never throw there.
  }
}

void EngineImpl::declare_weight_writes_locked(const LayerInfo& l, const std::string& when) {
  // With cache_across_steps a copy may read the weights while they change, by
  // design: its content is checked by version (scheduler.h, content_version).
  if (!backend_->caps().ordering_checker || opts_.cache_across_steps || l.is_table()) return;
  const std::string what = "the host may write the weights of '" + l.name + "' " + when + " (an optimizer step)";
  if (l.weight.defined() && l.weight.requires_grad() && !l.on_disk() && l.qformat == quant::Format::None)
    backend_->declare_host_access(store_->buffer(l.w_index), Access::Write, what);
  if (l.bias.defined() && l.bias.requires_grad() && !l.b_file)
    backend_->declare_host_access(store_->buffer(l.b_index), Access::Write, what);
  for (const auto& p : l.parts())
    if (p.param.requires_grad() && p.qformat == quant::Format::None)
      backend_->declare_host_access(store_->buffer(p.index), Access::Write, what);
}

void EngineImpl::ensure_backward_callback() {
  const int task = torch::autograd::get_current_graph_task_id();
  if (task == -1) return;
  {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    if (std::find(callback_tasks_.begin(), callback_tasks_.end(), task) != callback_tasks_.end())
      return;
    callback_tasks_.push_back(task);
  }
  // The callback runs only when the backward succeeds. When it fails, the
  // graph task is destroyed with the callback unrun, and so is `guard`:
  // its destructor drops what this backward staged (see discard_task()).
  struct TaskGuard {
    std::weak_ptr<EngineImpl> engine;
    int task;
    std::atomic<bool> ran{false};
    ~TaskGuard() {
      if (ran.load()) return;
      if (auto self = engine.lock()) self->discard_task(task);
    }
  };
  auto guard = std::make_shared<TaskGuard>();
  guard->engine = shared_from_this();
  guard->task = task;
  torch::autograd::Engine::get_default_engine().queue_callback([guard] {
    guard->ran = true;
    auto self = guard->engine.lock();
    if (!self) return;
    {
      std::lock_guard<std::recursive_mutex> lock(self->mu_);
      auto& t = self->callback_tasks_;
      t.erase(std::remove(t.begin(), t.end(), guard->task), t.end());
      self->reset_forward_uses_locked(guard->task);  // the gradient-ready hook counts from here
    }
    auto scope = self->device_scope();
    self->drain_grads(guard->task);
    std::lock_guard<std::recursive_mutex> lock(self->mu_);
    // Before an optimizer may write weights: Note [No copy in flight at a
    // step's end]; the next forward begins a step: Note [When a step begins]
    // (core/scheduler.cpp).
    if (self->sched_) self->sched_->backward_ended();
    for (const auto& l : self->layers_) self->declare_weight_writes_locked(*l, "after the backward");
    self->average_local_grads_locked();  // after no_sync() backwards (engine_distributed.cpp)
  });
}

void EngineImpl::report_failed_backward() {
  // On every call: a plain load, no lock, in the common case.
  if (!failed_backward_unreported_.load(std::memory_order_relaxed) || !failed_backward_unreported_.exchange(false))
    return;
  warn_once("failed-backward-" + std::to_string(id_),
            "a backward pass through streamed layers raised an exception; the weight gradients it had "
            "already computed for streamed layers were dropped, not added to .grad (plain autograd "
            "would have added them). Zero the gradients (optimizer.zero_grad()) before the next "
            "step, as after any failed backward; stats()['failed_backwards'] counts these.");
}

torch::Tensor EngineImpl::grad_to_host(const torch::Tensor& g, torch::ScalarType dtype) {
  // An optimizer may write the weight once this backward ends: its end is a
  // step's (Note [No copy in flight at a step's end], core/scheduler.cpp), as
  // for staged gradients.
  ensure_backward_callback();
  torch::Tensor h = g.to(dtype).to(torch::kCPU);  // synchronous on CUDA
  const uint64_t bytes = static_cast<uint64_t>(h.numel()) * h.element_size();
  {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    d2h_bytes_ += bytes;
  }
  scheduler().note_d2h(bytes);
  return h;
}

}  // namespace layerstream
