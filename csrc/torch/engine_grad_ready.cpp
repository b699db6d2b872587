// layerstream — LibTorch glue: the gradient-ready hook (issue 21): a layer's
// staged weight gradients applied to .grad as soon as they land, then a
// caller's hook (an optimizer step) on the engine's host thread, during the
// rest of the backward (engine.h; docs/design/optim.md, "Overlap";
// docs/design/gradients.md for the staging it builds on).
// (the engine's rooms: engine_impl.h).
#include "engine_impl.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>

#include <algorithm>

namespace layerstream {

void EngineImpl::note_forward_use(LayerInfo& l) {
  // A forward run inside a backward (a checkpoint's recomputation) is not a
  // use of its own: its gradient is the one the original call's node gets.
  if (torch::autograd::get_current_graph_task_id() != -1) return;
  std::lock_guard<std::recursive_mutex> lock(mu_);
  ++l.forward_uses;
}

void EngineImpl::reset_forward_uses_locked(int task) {
  // Only the layers this backward staged: an inner backward (a reentrant
  // checkpoint's) ends before the outer one reaches the layers before it.
  for (auto& l : layers_)
    if (l->last_grad_task == task) l->forward_uses = 0;
}

void EngineImpl::queue_if_ready_locked(int layer_index, LayerInfo& l) {
  const int task = torch::autograd::get_current_graph_task_id();
  l.last_grad_task = task;
  if (task == -1 || l.forward_uses == 0) return;
  // A gradient that is not averaged yet (no_sync(), or one averaged whole
  // when the backward ends) is no step's business until then.
  if (grad_group_ && (!grad_sync_ || l.grad_local)) return;
  int uses = 0;
  for (const auto& u : l.pending) uses += u.task == task;
  if (uses != l.forward_uses) return;  // more uses of this backward to come, or unknown
  GradConsumeHook hook;
  bool consume = false;
  {
    std::lock_guard<std::mutex> lock(gr_mu_);
    if (!gr_hook_) return;
    hook = gr_hook_;  // the job belongs to the hook set now
    consume = gr_consume_;
  }
  // A consuming hook takes a single use (engine_gradients.cpp): claimed now,
  // so that the end of backward, which may come first, leaves it to the job.
  if (consume && uses == 1 && consumable(l))
    for (auto& u : l.pending)
      if (u.task == task) u.claimed = true;
  // Marks the end of this layer's copy on the gradient stream (push_grads
  // just enqueued it): the hook's thread waits for this, not for later copies.
  auto done = std::make_shared<Event>(backend_->create_event());
  backend_->record(*done, grad_stream_);
  std::lock_guard<std::mutex> lock(gr_mu_);
  gr_queue_.push_back(GradReadyJob{layer_index, task, std::move(done), std::move(hook), consume});
  gr_jobs_.fetch_add(1, std::memory_order_relaxed);
  gr_cv_.notify_one();
}

// Note [No call between an overlapped backward and its step]: once a backward
// handed layers to the hook, their host weights may be written on the hook's
// thread. A consuming hook is an overlapped optimizer step (AdamWOverlap,
// AdafactorOverlap): a call of any layer of this engine before its scope ends
// (a second forward inside the overlap block, a validation pass under
// no_grad) would copy weights some of which are stepped, some half-stepped
// and some not (resident parameters are stepped only by step()): numbers no
// resident model computes, and a copy racing a write. Refused at the call,
// before anything is read. A plain ready hook (C++ only: a monitor, or a step
// of the caller's own) is waited for instead: the call reads what its jobs
// left. Calls inside a backward (a checkpoint's recomputation) run before
// their layers' own gradients land, and are the backward's business.
// After the block and before step() (set_unsettled_step) the same holds: the
// layers stepped during the backward are a step ahead of the resident ones
// (and, with clipping, stepped without it until step() settles): a call, a
// torch::save() or Python's model.state_dict() there gave those numbers, a
// checkpoint no run ever had. Refused too.
void EngineImpl::check_no_step_in_flight(const LayerInfo& l) {
  if (gr_unsettled_.load(std::memory_order_relaxed) && torch::autograd::get_current_graph_task_id() == -1)
    LS_FAIL("layer '", l.name, "' was called between an overlapped backward (opt.overlap(handle)) and step(): the "
            "layers stepped during the backward are a step ahead of the others (and not yet clipped), so the call "
            "would compute with weights no run holds. Call step() first, or the model before the backward.");
  if (gr_jobs_.load(std::memory_order_relaxed) == 0 || torch::autograd::get_current_graph_task_id() != -1) return;
  std::unique_lock<std::mutex> lock(gr_mu_);
  if (!gr_hook_) return;
  LS_CHECK(!gr_consume_, "layer '", l.name, "' was called after a backward inside an overlapped optimizer step's "
           "block (opt.overlap(handle)): that backward's layers are being stepped meanwhile, so the call would read "
           "weights partly updated. Call the model before the backward or after the block (and step()); with "
           "gradient accumulation, run the earlier micro-batches' forward and backward before the block.");
  gr_idle_cv_.wait(lock, [&] { return gr_queue_.empty() && !gr_busy_; });  // errors stay for wait_grad_ready()
}

void EngineImpl::set_grad_ready_hook(GradReadyHook hook) {
  GradConsumeHook h;
  if (hook) h = [hook = std::move(hook)](int layer, const LandedGradients*) { hook(layer); };
  std::lock_guard<std::mutex> lock(gr_mu_);
  check_one_hook_locked(static_cast<bool>(h));
  gr_hook_ = std::move(h);
  gr_consume_ = false;
  gr_jobs_.store(0, std::memory_order_relaxed);
  if (gr_hook_ && !gr_thread_.joinable()) gr_thread_ = std::thread([this] { grad_ready_loop(); });
}

void EngineImpl::check_one_hook_locked(bool setting) const {
  LS_CHECK(!setting || !gr_hook_, "an overlapped optimizer step (opt.overlap(handle)) is already active on this "
           "offload() handle: one optimizer's overlap() per backward. Step the other optimizers after the "
           "backward (the gradients of the layers the overlapping one does not step are left in .grad)");
}

void EngineImpl::set_grad_consume_hook(GradConsumeHook hook) {
  std::lock_guard<std::mutex> lock(gr_mu_);
  check_one_hook_locked(static_cast<bool>(hook));
  gr_hook_ = std::move(hook);
  gr_consume_ = static_cast<bool>(gr_hook_);
  gr_jobs_.store(0, std::memory_order_relaxed);
  if (gr_hook_ && !gr_thread_.joinable()) gr_thread_ = std::thread([this] { grad_ready_loop(); });
}

void EngineImpl::wait_grad_ready() {
  std::unique_lock<std::mutex> lock(gr_mu_);
  gr_idle_cv_.wait(lock, [&] { return gr_queue_.empty() && !gr_busy_; });
  if (gr_error_) {
    std::exception_ptr e = gr_error_;
    gr_error_ = nullptr;
    std::rethrow_exception(e);
  }
}

std::pair<torch::Tensor, torch::Tensor> EngineImpl::layer_parameters(int layer_index) const {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  const LayerInfo& l = *layers_.at(static_cast<size_t>(layer_index));
  if (l.is_table() || l.is_group()) return {};
  return {l.weight, l.bias};
}

// Note [No copy in flight at a step's end] (core/scheduler.cpp), for a hook
// that steps the layer during the backward: a copy of it still in flight must
// have read its host weights first. Defensive: while recording (where guesses
// go unused) the hook does not run during the backward, and in the steps tried
// (tests/python/test_optim.py) a replayed prefetch of the layer was either
// taken or its slot handed to the layer's gradient, which waits for it; the
// declared write lets the checker say so. With cache_across_steps such a copy
// is checked by version instead, as for any host write.
void EngineImpl::wait_copies_before_host_write(int layer) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  if (sched_ && !sched_->options().content_version) sched_->wait_copies_read(layer);
  declare_weight_writes_locked(*layers_.at(static_cast<size_t>(layer)), "during the backward");
}

void EngineImpl::grad_ready_loop() {
  for (;;) {
    GradReadyJob job;
    {
      std::unique_lock<std::mutex> lock(gr_mu_);
      gr_cv_.wait(lock, [&] { return gr_stop_ || !gr_queue_.empty(); });
      if (gr_queue_.empty()) return;  // stopping
      job = gr_queue_.front();
      gr_queue_.pop_front();
      gr_busy_ = true;
    }
    bool stepped = false;
    try {
      auto scope = device_scope();
      // Wait for the copy without the engine's lock: the backward goes on
      // staging other layers meanwhile.
      backend_->synchronize(*job.done);
      LandedGradients landed;
      HostBuffer held;  // the staging buffer a consuming hook reads, out of reuse meanwhile
      bool taken = false, dropped = false;
      {
        std::lock_guard<std::recursive_mutex> lock(mu_);
        LayerInfo& l = *layers_.at(static_cast<size_t>(job.layer));
        // The backward failed and its gradients were dropped before this job ran:
        // nothing of it is stepped (.grad may hold earlier micro-batches only).
        dropped = l.dropped_task == job.task;
        // (Both are no-ops when the end of backward or synchronize() applied it first.)
        taken = job.consume && take_staged_locked(l, job.task, &landed, &held);
        if (!taken) accumulate_locked(l, job.task);
        if (l.pending.empty()) pending_.erase(std::remove(pending_.begin(), pending_.end(), job.layer), pending_.end());
      }
      struct GiveBack {  // also when the hook throws
        EngineImpl* self;
        int layer;
        LandedGradients* landed;
        HostBuffer* held;
        ~GiveBack() {
          if (!held->data()) return;
          *landed = LandedGradients{};
          std::lock_guard<std::recursive_mutex> lock(self->mu_);
          self->return_staging_locked(*self->layers_.at(static_cast<size_t>(layer)), std::move(*held));
        }
      } give_back{this, job.layer, &landed, &held};
      if (job.hook && !dropped) {
        wait_copies_before_host_write(job.layer);  // the hook may step the layer's host weights
        job.hook(job.layer, taken ? &landed : nullptr);
        stepped = true;
      }
    } catch (...) {
      std::lock_guard<std::mutex> lock(gr_mu_);
      if (!gr_error_) gr_error_ = std::current_exception();
    }
    // A coded weight the step changed, re-coded now (engine_coded.cpp), once
    // the staging buffer went back to the backward.
    if (stepped) {
      try {
        auto scope = device_scope();
        recode_ahead(job.layer);
      } catch (...) {
        std::lock_guard<std::mutex> lock(gr_mu_);
        if (!gr_error_) gr_error_ = std::current_exception();
      }
    }
    {
      std::lock_guard<std::mutex> lock(gr_mu_);
      gr_busy_ = false;
      if (gr_queue_.empty()) gr_idle_cv_.notify_all();
    }
  }
}

void EngineImpl::stop_grad_ready() {
  {
    std::lock_guard<std::mutex> lock(gr_mu_);
    gr_stop_ = true;
    gr_hook_ = nullptr;
  }
  gr_cv_.notify_all();
  if (gr_thread_.joinable()) gr_thread_.join();
}

}  // namespace layerstream
