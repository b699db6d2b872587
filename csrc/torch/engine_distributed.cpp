// layerstream — LibTorch glue: several processes (torch.distributed):
// streamed weights' gradients averaged over a process group before their copy
// to the host, and the host store shared by the processes of one node
// (docs/design/distributed.md; the engine's rooms: engine_impl.h).
#include "engine_impl.h"

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "core/options.h"

namespace layerstream {

// Held weakly: torch keeps a group alive while it is registered (until
// destroy_process_group()); an engine that held it strongly would keep its
// backend's threads running past destroy_process_group() into the
// interpreter's shutdown, where gloo's worker, releasing a finished
// collective, takes the GIL and aborts the process (the gloo threads are
// joined only when the group's last reference goes).
struct EngineImpl::GradientGroup {
  c10::weak_intrusive_ptr<c10d::ProcessGroup> weak;
  std::string name;

  c10::intrusive_ptr<c10d::ProcessGroup> get() const {
    c10::intrusive_ptr<c10d::ProcessGroup> pg = weak.lock();
    options::check_group_alive(static_cast<bool>(pg), name);
    return pg;
  }
};

void EngineImpl::set_gradient_group(c10::intrusive_ptr<c10d::ProcessGroup> group) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  LS_CHECK(pending_.empty(), "set_gradient_group: a backward's gradients are still in flight; call it "
           "between steps");
  if (!group) {
    grad_group_.reset();
  } else {  // also with one rank: a group given is used (its all-reduce runs over one)
    grad_group_ = std::make_shared<GradientGroup>(
        GradientGroup{c10::weak_intrusive_ptr<c10d::ProcessGroup>(group), group->getGroupName()});
  }
}

void EngineImpl::all_reduce_mean(torch::Tensor& t) {
  const c10::intrusive_ptr<c10d::ProcessGroup> hold = grad_group_->get();
  c10d::ProcessGroup& pg = *hold;
  // A host gradient on a CUDA engine (a table's) goes through the device: the
  // group's backend (NCCL) may have no host path.
  if (t.is_cpu() && compute_device_.is_cuda()) {
    torch::Tensor d = t.to(compute_device_);
    all_reduce_mean(d);
    t.copy_(d);
    return;
  }
  torch::NoGradGuard ng;
  averaged_bytes_ += static_cast<uint64_t>(t.numel()) * t.element_size();
  torch::Tensor c = t.is_contiguous() ? t : t.contiguous();
  // Divided first, as DistributedDataParallel does (no overflow in fp16).
  c.div_(pg.getSize());
  std::vector<at::Tensor> v{c};
  pg.allreduce(v)->wait();
  if (!c.is_same(t)) t.copy_(c);
}

bool EngineImpl::averages_now(int index) {
  if (!grad_group_) return false;
  std::lock_guard<std::recursive_mutex> lock(mu_);
  LayerInfo& l = layer(index);
  if (!grad_sync_) {  // no_sync(): .grad holds local sums from now on
    l.grad_local = true;
    return false;
  }
  if (l.grad_local) {
    // avg(local + this) is taken once .grad holds both: when the backward ends.
    l.average_at_end = true;
    ensure_backward_callback();
    return false;
  }
  return true;
}

void EngineImpl::average_gradient(int index, torch::Tensor& grad) {
  if (!grad.defined() || !averages_now(index)) return;
  // Without the engine's lock: a collective waits for the other ranks.
  all_reduce_mean(grad);
}

void EngineImpl::average_before_copy(const std::vector<torch::Tensor>& parts) {
  // Note [Averaging overlapped with the backward]
  // The collectives are issued here, on the backward's thread, so that every
  // rank issues them in the same order (its backward's), interleaved the same
  // way with the other collectives of that thread (DDP's buckets, a tensor
  // group's average); they run on the group's own stream (NCCL) or threads
  // (gloo) while this thread goes on with the next layers' backward. Only the
  // gradient stream waits for them, before its copy to the host: on CUDA
  // Work::wait() makes the current stream wait, so the gradient stream is made
  // current for it; elsewhere (gloo, the sim device) wait() blocks, so it runs
  // as a host function on the gradient stream. The scratch slot the parts live
  // in goes back after that copy (push_grads), so nothing reuses it while the
  // collective still reads or writes it.
  const c10::intrusive_ptr<c10d::ProcessGroup> hold = grad_group_->get();
  c10d::ProcessGroup& pg = *hold;
  torch::NoGradGuard ng;
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  for (const torch::Tensor& t : parts) {
    averaged_bytes_ += static_cast<uint64_t>(t.numel()) * t.element_size();
    torch::Tensor c = t;
    c.div_(pg.getSize());  // divided first, as DistributedDataParallel does
    std::vector<at::Tensor> v{c};
    works.push_back(pg.allreduce(v));
  }
  if (cuda_index_ >= 0) {
    cuda_glue::with_current_stream(cuda_index_, grad_stream_.native(), [&] {
      for (auto& w : works) w->wait();
    });
  } else {
    backend_->launch_host_func(grad_stream_, [works = std::move(works)] {
      for (const auto& w : works) w->wait();
    });
  }
}

void EngineImpl::average_local_grads_locked() {
  if (!grad_group_) return;
  // Layer order: the same on every rank, so the collectives pair up.
  for (auto& lp : layers_) {
    LayerInfo& l = *lp;
    if (!l.average_at_end) continue;
    for (torch::Tensor* p : {&l.weight, &l.bias}) {
      if (!p->defined()) continue;
      torch::Tensor g = p->mutable_grad();
      if (g.defined()) all_reduce_mean(g);
    }
    if (l.is_group())
      for (auto& part : l.parts()) {
        torch::Tensor g = part.param.mutable_grad();
        if (g.defined()) all_reduce_mean(g);
      }
    l.average_at_end = false;
    l.grad_local = false;
  }
}

void EngineImpl::share_host_store(std::shared_ptr<SharedRegion> region, bool writer, bool trainable) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  LS_CHECK(layers_.empty(), "share_host_store must come before the first layer is added");
  store_->share(std::move(region), writer, trainable);
}

}  // namespace layerstream
