// layerstream — LibTorch glue: construction, devices, the scheduler and the budget, synchronize/detach
// (the engine's rooms: engine_impl.h).
#include "engine_impl.h"

#include <pthread.h>

#include <algorithm>
#include <mutex>
#include <utility>

#include "backends/sim/sim_backend.h"
#include "core/log.h"
#include "core/options.h"

namespace layerstream {

namespace {

std::mutex g_registry_mu;
std::map<uint64_t, std::weak_ptr<EngineImpl>>& registry() {
  static std::map<uint64_t, std::weak_ptr<EngineImpl>> r;
  return r;
}
std::atomic<uint64_t> g_next_id{1};

// Note [An engine belongs to the process that made it]
// fork() copies a process's memory but only the thread that called it. An engine's
// streams (the sim device's worker threads, the gradient-ready thread), its CUDA
// context and its pinned buffers stay behind in the parent, so a forked child (a
// DataLoader worker, multiprocessing's "fork" start method, os.fork()) that called an
// offloaded model waited forever on copies no thread would make. So fork() is counted
// (pthread_atfork), each engine remembers the count it was made at, and the entry
// points that stream or touch the device (EngineImpl::device_scope, begin_call) of an
// engine made before the fork throw in the child, before taking any of its locks (a
// parent's thread may have held them at the fork). In the child the engines are kept
// alive for good: their destruction would join threads that are not there (and free the
// parent's device memory). The registry's lock is held across fork() so the child finds
// it free.
std::atomic<uint64_t> g_forks{0};
std::once_flag g_fork_handlers;

void registry_lock_before_fork() { g_registry_mu.lock(); }
void registry_unlock_in_parent() { g_registry_mu.unlock(); }
void forked_child() {
  g_forks.fetch_add(1);
  for (auto& entry : registry()) {
    if (auto e = entry.second.lock()) new std::shared_ptr<EngineImpl>(std::move(e));  // never freed, on purpose
  }
  g_registry_mu.unlock();
}

// What a parameter's data needs alive after the Engine is gone: the host
// store and the backend that frees its buffers, released in that order.
struct HostKeepAlive {
  std::shared_ptr<Backend> backend;
  std::shared_ptr<HostStore> store;
  ~HostKeepAlive() { store.reset(); }  // buffers go back to a live backend
};
}  // namespace

namespace {
// How `spelling`'s caller chooses the simulated device, and how it asks
// whether a CUDA GPU is visible: resolve_device's advice in its words.
struct DeviceAdvice {
  const char* sim;        // how to pick the sim device
  const char* no_cuda;    // why "cuda" is unavailable
};
DeviceAdvice device_advice(DeviceSpelling spelling) {
  switch (spelling) {
    case DeviceSpelling::Python:
      return {"device='sim'", "no CUDA GPU is visible to PyTorch (torch.cuda.is_available() is False, or this "
                              "layerstream build has no CUDA support)"};
    case DeviceSpelling::Cli:
      return {"--device sim", "no CUDA GPU is visible to LibTorch (no GPU, a driver that does not load, or a "
                              "CPU-only LibTorch), or this layerstream build has no CUDA support"};
    case DeviceSpelling::Cpp:
      break;
  }
  return {"OffloadOptions::device = \"sim\" (EngineOptions::device for an Engine)",
          "no CUDA GPU is visible to LibTorch (torch::cuda::is_available() is false, or this layerstream "
          "build has no CUDA support)"};
}
}  // namespace

std::string resolve_device(const std::string& device, DeviceSpelling spelling) {
  if (device == "sim") return "sim";
  // "auto" and "cuda" name the current CUDA device, as in PyTorch (under torchrun,
  // torch.cuda.set_device(local_rank) makes each rank's its own GPU).
  if (device == "auto") return cuda_glue::available() ? "cuda:" + std::to_string(cuda_glue::current_device()) : "sim";
  const DeviceAdvice advice = device_advice(spelling);
  if (device == "cpu")
    LS_FAIL("device 'cpu' cannot be a streaming target: weights already live on the CPU. Use ", advice.sim,
            " for the simulated GPU, or 'cuda'.");
  if (device.rfind("cuda", 0) == 0) {
    int index = -1;
    if (device.size() > 4) {
      LS_CHECK(device[4] == ':' && device.size() > 5, "bad device '", device,
               "': use 'cuda' or 'cuda:N'");
      try {
        index = std::stoi(device.substr(5));
      } catch (...) {
        LS_FAIL("bad device '", device, "': use 'cuda' or 'cuda:N'");
      }
    }
    LS_CHECK(cuda_glue::available(), "device '", device, "' was requested but ", advice.no_cuda, "; use ",
             advice.sim, " to run on the simulated device.");
    if (index < 0 && device.size() == 4) index = cuda_glue::current_device();
    LS_CHECK(index >= 0 && index < cuda_glue::device_count(), "device '", device,
             "' does not exist: PyTorch sees ", cuda_glue::device_count(), " CUDA device(s)");
    return "cuda:" + std::to_string(index);
  }
  LS_FAIL("unknown device '", device, "': use 'auto', 'sim', 'cuda' or 'cuda:N'");
}

std::shared_ptr<Engine> Engine::create(const EngineOptions& options) {
  ops_library_linked();
  std::call_once(g_fork_handlers, [] {
    pthread_atfork(registry_lock_before_fork, registry_unlock_in_parent, forked_child);
  });
  std::shared_ptr<EngineImpl> e(new EngineImpl(options));
  std::lock_guard<std::mutex> lock(g_registry_mu);
  registry()[e->id_] = e;
  return e;
}

std::shared_ptr<EngineImpl> EngineImpl::lookup(uint64_t id) {
  std::lock_guard<std::mutex> lock(g_registry_mu);
  auto it = registry().find(id);
  return it == registry().end() ? nullptr : it->second.lock();
}

EngineImpl::EngineImpl(const EngineOptions& options)
    : opts_(options), id_(g_next_id++), forks_at_creation_(g_forks.load()) {
  options::check_prefetch(opts_.prefetch);
  options::check_slots(opts_.slots);
  options::check_budget_bytes(opts_.budget_bytes);
  options::check_link_gbps(opts_.sim_h2d_gbps, "sim_h2d_gbps");
  options::check_link_gbps(opts_.sim_d2h_gbps, "sim_d2h_gbps");
  options::check_latency_us(opts_.sim_latency_us);
  options::check_activation_min_bytes(opts_.activation_min_bytes);
  options::check_byte_cap(opts_.activation_host_cap, "activation_host_cap");
  options::check_byte_cap(opts_.activation_pinned_cap, "activation_pinned_cap");
  options::check_byte_cap(opts_.grad_staging_pinned_cap, "grad_staging_pinned_cap");
  options::check_byte_cap(opts_.store_pinned_cap, "store_pinned_cap");
  options::check_staging_bytes(opts_.staging_bytes);
  options::check_reader_threads(opts_.reader_threads);
  const options::Dtypes dtypes = options::check_dtypes(opts_.dequant_dtype, opts_.compute_dtype);
  dequant_dtype_ = scalar_type_of(dtypes.dequant);
  compute_dtype_ = scalar_type_of(dtypes.compute);
  device_name_ = resolve_device(opts_.device);
  if (opts_.device == "auto" && device_name_ == "sim")
    warn_once("auto-device-sim",
              "device \"auto\": LibTorch sees no CUDA device (torch::cuda::is_available() is false: no GPU, "
              "a driver that does not load, or a CPU-only LibTorch), so layerstream runs on the simulated "
              "device, on the CPU. Pass device \"sim\" to choose it without this warning, or fix the CUDA "
              "setup.");
  if (device_name_ == "sim") {
    SimOptions so;
    so.h2d_gbps = opts_.sim_h2d_gbps;
    so.d2h_gbps = opts_.sim_d2h_gbps;
    so.latency_us = opts_.sim_latency_us;
    so.checker = opts_.checker;
    so.abort_on_ordering_error = opts_.abort_on_ordering_error;
    backend_ = make_sim_backend(so);
    compute_device_ = torch::Device(torch::kCPU);
    inline_compute_ = backend_->create_inline_stream("compute");
  } else {
    cuda_index_ = std::stoi(device_name_.substr(5));
    compute_device_ = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(cuda_index_));
  }
  auto scope = device_scope();
  if (!backend_) backend_ = cuda_glue::make_backend(cuda_index_);
  store_ = std::make_shared<HostStore>(*backend_, opts_.pin_memory, opts_.store_pinned_cap);
  {
    auto keep = std::make_shared<HostKeepAlive>();
    keep->backend = backend_;
    keep->store = store_;
    keepalive_ = keep;
  }
  if (opts_.trace) tracer_ = std::make_shared<TraceRecorder>();
  transfer_ = backend_->create_stream("transfer");
  grad_stream_ = backend_->create_stream("grad");
  dequant_stream_ = backend_->create_stream("dequant");
  act_stream_ = backend_->create_stream("activations");
}

EngineImpl::~EngineImpl() {
  std::optional<cuda_glue::DeviceScope> scope;
  try {
    scope.emplace(cuda_index_);
  } catch (...) {
  }
  stop_grad_ready();  // the gradient-ready hook's thread (engine_grad_ready.cpp)
  try {
    drain_grads(kAnyTask);  // no callback can reach this engine any more
  } catch (...) {
  }
  sched_.reset();
  try {
    wait_lookups_locked();  // no lookup may still read the host store
  } catch (...) {
  }
  for (auto& l : layers_) {
    l->grad_done = Event();
    if (l->is_table()) l->table().last_read = Event();
    for (auto& b : l->grad_staging) b.reset();
  }
  try {
    backend_->synchronize(grad_stream_);
    backend_->synchronize(act_stream_);  // saved activations' copies (their host buffers go below)
    backend_->synchronize(transfer_);
    backend_->destroy_stream(act_stream_);
    backend_->destroy_stream(transfer_);
    backend_->destroy_stream(dequant_stream_);
    backend_->destroy_stream(grad_stream_);
    if (inline_compute_) backend_->destroy_stream(inline_compute_);
  } catch (...) {
  }
  std::lock_guard<std::mutex> lock(g_registry_mu);
  registry().erase(id_);
}

int EngineImpl::num_layers() const {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  return static_cast<int>(layers_.size());
}

std::string EngineImpl::layer_name(int i) const {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  return layer(i).name;
}

int64_t EngineImpl::layer_bytes(int i) const {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  const LayerInfo& l = layer(i);
  size_t bytes = l.w_bytes + l.b_bytes;
  for (const auto& e : l.parts()) bytes += e.bytes;
  return static_cast<int64_t>(bytes);
}

EngineImpl::LayerInfo& EngineImpl::layer(int i) {
  return const_cast<LayerInfo&>(std::as_const(*this).layer(i));
}

const EngineImpl::LayerInfo& EngineImpl::layer(int i) const {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  LS_CHECK(i >= 0 && i < static_cast<int>(layers_.size()), "no streamed layer #", i);
  return *layers_[static_cast<size_t>(i)];
}

size_t EngineImpl::grad_bytes(const LayerInfo& l) const {
  if (l.is_group()) return 0;  // its gradients are the caller's
  return slot_layout::gradient_bytes(l.w_bytes, l.b_bytes);
}

// Note [Writes through .data between steps]
// With cache_across_steps a weight stays in its slot while its parameter's
// version counter stands still, and a write through `.data` moves no counter:
// peft's merge_adapter() and diffusers' fuse_lora() add the LoRA product to
// the base weight that way (`weight.data += delta`), and the next calls ran
// with the unmerged weight still in the slot. So when a step begins
// (SchedulerOptions::step_begins: a call of the model, a forward after a
// backward, an inner module called again; before the step's first fetch
// looks for cached content), the dense host bytes of each layer a slot still
// holds are sampled (lossless::sample_fingerprint, 64 words spread over each
// tensor: a bulk write changes them; the other layers are copied afresh
// anyway), and a sample that changed since the last look counts as a write,
// which the content version folds in: the next use copies the layer again.
// The first look is when the scheduler is built, before its first copy; a
// layer that was not in a slot at a look may count a write at the next one
// that its copy already had (one copy too many). Cost: 64 reads of memory
// no CPU cache holds, per cached tensor per step, under the scheduler's lock
// (the loads are independent: they overlap). Not seen: a write that misses
// every sampled word (a few elements), or one between two fetches of a step;
// handle.synchronize() forgets every cached weight. Quantized, disk-tier and
// GGUF weights have no dense host bytes here (their stand-ins refuse such
// writes); a trainable lossless weight's dense copy is sampled (re-coded:
// Note [Trainable coded weights]).
void EngineImpl::DataSample::look() {
  constexpr size_t kWords = 64;
  uint64_t now = 0;
  for (const auto& [host, bytes] : sources)
    now = now * 1000003u + lossless::sample_fingerprint(host, bytes, kWords);
  if (now != print) {
    print = now;
    ++writes;
  }
}

std::vector<EngineImpl::DataSample> EngineImpl::data_samples_locked() const {
  std::vector<DataSample> out(layers_.size());
  for (size_t i = 0; i < layers_.size(); ++i) {
    const LayerInfo& l = *layers_[i];
    auto& src = out[i].sources;
    if (l.qformat == quant::Format::None && !l.on_disk() && l.w_host != nullptr && l.w_bytes > 0)
      src.emplace_back(l.w_host, l.w_bytes);
    if (!l.b_file && l.b_host != nullptr && l.b_bytes > 0) src.emplace_back(l.b_host, l.b_bytes);
    for (const auto& e : l.parts())
      if (e.qformat == quant::Format::None && e.host != nullptr && e.bytes > 0) src.emplace_back(e.host, e.bytes);
    out[i].look();
    out[i].writes = 0;
  }
  return out;
}

void EngineImpl::build_scheduler_locked() {
  std::vector<LayerSpec> specs;
  size_t largest = 0, largest_grad = 0;
  int largest_i = 0;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const LayerInfo& l = *layers_[i];
    LayerSpec s;
    s.name = l.name;
    if (l.is_table()) {  // looked up in place, never fetched: an empty spec keeps the indices
      specs.push_back(std::move(s));
      continue;
    }
    if (l.is_group()) {
      for (const auto& e : l.parts()) s.parts.push_back(store_->buffer(e.coded ? e.coded->index : e.index));
    } else if (!l.on_disk()) {
      s.parts.push_back(store_->buffer(l.coded ? l.coded->index : l.w_index));
      if (l.bias.defined()) s.parts.push_back(store_->buffer(l.b_index));
    }
    staged_sources_locked(l, s);
    const slot_layout::Layout layout = layout_of(l);
    s.workspace_bytes = layout.workspace_bytes;
    if (s.workspace_bytes) {
      s.post_copy = l.is_group() ? make_group_post_copy(l, s.parts.size()) : make_post_copy(l, s.parts.size());
      s.post_copy_label = l.is_group() || l.qformat != quant::Format::None || l.coded ? "dequant" : "cast";
    }
    const size_t bytes = layout.slot_bytes();
    if (bytes > largest) {
      largest = bytes;
      largest_i = static_cast<int>(i);
    }
    largest_grad = std::max(largest_grad, grad_bytes(l));
    specs.push_back(std::move(s));
  }
  const size_t slot_bytes = std::max(largest, largest_grad);
  SchedulerOptions so;
  so.slot_bytes = slot_bytes;
  bool any_coded = false;
  for (const auto& l : layers_)
    for_each_coded(*l, [&](const CodedTensor& t) {
      any_coded = true;
      std::lock_guard<std::mutex> g(t.c.mu);
      t.c.announced = false;  // this scheduler starts from the slot's size
    });
  if (any_coded) {  // Note [Trainable coded weights] (engine_coded.cpp)
    so.parts_stale = [this](int layer) { return coded_stale(layer); };
    so.refresh_parts = [this](int layer, std::vector<size_t>& bytes) { refresh_coded(layer, bytes); };
  }
  so.post_copy_stream = dequant_stream_;
  so.prefetch_depth = opts_.prefetch;
  so.staging.cache_bytes = opts_.staging_bytes > 0 ? static_cast<uint64_t>(opts_.staging_bytes)
                                                   : staging_needed_locked(specs);
  so.staging.pinned = opts_.pin_memory && opts_.staging_pinned;
  so.staging.reader_threads = opts_.reader_threads;
  {
    // The parameters' version counters (bumped by in-place writes on the
    // parameters: optimizers, load_state_dict, copy_) check every reuse of a
    // slot's content within a step (Note [When a step begins] in
    // core/scheduler.cpp). Opt-in (cache_across_steps): content stays valid
    // across steps too, and prefetching runs across step boundaries. Writes
    // through `.data` do not bump the counter: a torch optimizer's step
    // moves the counters of what it wrote (Note [An optimizer step is a
    // write] in python/layerstream/_handle.py), a step that begins samples
    // the host bytes (Note [Writes through .data between steps]); what both
    // miss would go unnoticed across steps: that is why this is not the
    // default.
    std::vector<std::vector<torch::Tensor>> params;
    for (const auto& l : layers_) {
      params.push_back({l->weight, l->bias});
      for (const auto& e : l->parts()) params.back().push_back(e.param);
    }
    auto samples = std::make_shared<std::vector<DataSample>>();
    if (opts_.cache_across_steps) *samples = data_samples_locked();
    auto version = [params = std::move(params), samples](int layer) -> uint64_t {
      // Any in-place write bumps one of the counters, which only grow; so
      // does a change of the sampled bytes (`writes`, content_version only).
      uint64_t v = samples->empty() ? 0 : (*samples)[static_cast<size_t>(layer)].writes;
      for (const auto& t : params[static_cast<size_t>(layer)])
        if (t.defined()) v = v * 1000003u + static_cast<uint64_t>(t._version());
      return v;
    };
    if (opts_.cache_across_steps) {
      so.content_version = std::move(version);
      so.step_begins = [samples](int layer) { (*samples)[static_cast<size_t>(layer)].look(); };
    } else {
      so.write_version = std::move(version);
    }
  }
  int slots = opts_.slots > 0 ? opts_.slots : options::default_slots(opts_.prefetch);
  if (opts_.budget_bytes >= 0) {
    const size_t budget = static_cast<size_t>(opts_.budget_bytes);
    LS_CHECK(budget >= 2 * slot_bytes, "budget of ", budget, " bytes is smaller than what the "
             "largest streamed layer '", layers_[static_cast<size_t>(largest_i)]->name,
             "' needs: 2 slots of ", slot_bytes, " bytes (", 2 * slot_bytes, " bytes; the layer takes ",
             largest, " bytes in a slot",
             layers_[static_cast<size_t>(largest_i)]->qformat != quant::Format::None
                 ? ": its packed weight and the weight dequantized on the device"
                 : layers_[static_cast<size_t>(largest_i)]->cast_w
                       ? ": its weight and the copy cast to compute_dtype '" + opts_.compute_dtype + "'"
                       : std::string(),
             "). Raise the budget to at least ", 2 * slot_bytes,
             " bytes or exclude that layer from streaming.");
    const int fit = static_cast<int>(std::min<size_t>(budget / slot_bytes, 1 << 20));
    if (opts_.slots > 0) {
      LS_CHECK(opts_.slots <= fit, "slots=", opts_.slots, " slots of ", slot_bytes,
               " bytes do not fit in the budget of ", budget, " bytes (at most ", fit, ")");
    } else {
      slots = std::min(slots, fit);
    }
    so.budget_bytes = budget;
  }
  slots = std::max(slots, 2);
  so.num_slots = slots;
  so.prefetch_depth = std::min(opts_.prefetch, slots - 1);
  so.trace = suspended_trace_;  // resume(): the order learnt before suspend()
  so.trace_forward = suspended_trace_forward_;
  sched_ = std::make_unique<Scheduler>(*backend_, transfer_, std::move(specs), so);
  suspended_trace_.clear();
  suspended_trace_forward_.clear();
  if (tracer_) sched_->set_trace(tracer_);
}

void EngineImpl::retire_scheduler_locked(std::vector<int>* trace, std::vector<bool>* trace_forward) {
  if (!sched_) return;
  sched_->quiesce();
  sched_->begin_step();  // the step under way ends here: its counters join the history
  for (StepStats s : sched_->step_stats()) {
    s.step += carried_.steps;  // numbered on from the schedulers before
    carried_steps_.push_back(s);
  }
  while (carried_steps_.size() > 4096) carried_steps_.pop_front();  // as the scheduler's own
  if (trace) *trace = sched_->trace();
  if (trace_forward) *trace_forward = sched_->trace_forward();
  const SchedulerStats st = sched_->stats();
  carried_.steps += st.steps;
  carried_.acquires += st.acquires;
  carried_.hits += st.hits;
  carried_.misses += st.misses;
  carried_.deviations += st.deviations;
  carried_.retraces += st.retraces;
  carried_.h2d_bytes += st.h2d_bytes;
  carried_.host_wait_seconds += st.host_wait_seconds;
  carried_.staging.read_bytes += st.staging.read_bytes;
  carried_.staging.file_bytes += st.staging.file_bytes;
  carried_.staging.hits += st.staging.hits;
  carried_.max_slots_held = std::max(carried_.max_slots_held, st.max_slots_held);  // a peak, not a sum
  sched_.reset();
}

void EngineImpl::ensure_scheduler() {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  LS_CHECK(!detached_, "this layerstream handle was detached; its layers run their original "
           "forward now. Call offload() again to stream them (a graph recorded before detach(), such as "
           "a backward not run yet, cannot run on either: run it before detach(), or run the forward again).");
  LS_CHECK(!suspended_, "this layerstream handle is suspended: its device memory was freed (handle.suspend(), "
           "or model.to('cpu') of a model streamed to a GPU); resume it (handle.resume(), or model.to(<compute "
           "device>); C++: OffloadHandle::resume()) before running the model. A backward of a graph recorded "
           "before the suspension needs it too: resume before that backward (one refused here has freed its graph, "
           "unless retain_graph=True: run the forward again).");
  if (!sched_) build_scheduler_locked();
}

// Note [Suspend] (docs/design/streaming-core.md, "Suspend"): the slot arena is
// the engine's only device memory (everything else it computes with comes from
// the framework's allocator), and the scheduler owns it, so suspending is
// retiring the scheduler as a new layer does, keeping its trace for the next one.
void EngineImpl::suspend() {
  auto scope = device_scope();
  LetGoAfterUnlock let_go;  // Note [Saved tensors are let go after the lock]
  std::lock_guard<std::recursive_mutex> lock(mu_);
  LS_CHECK(!detached_, "this layerstream handle was detached; there is nothing to suspend");
  if (suspended_) return;
  LS_CHECK(fetched_.empty(), "suspend(): ", fetched_.size(), " fetch() token(s) of streamed layers are "
           "not released yet; release them first (their views would point into freed memory)");
  wait_all_locked();  // gradients accumulated, copies done, cached content dropped
  if (sched_) {
    const SlotPool& pool = sched_->pool();
    LS_CHECK(pool.num_free() == pool.num_slots(), "suspend(): ", pool.num_slots() - pool.num_free(),
             " device slot(s) are in use: a streamed layer is computing (on another thread?); suspend "
             "after the forward or backward that uses them returns");
  }
  retire_scheduler_locked(&suspended_trace_, &suspended_trace_forward_);
  suspended_ = true;
}

void EngineImpl::resume() {
  auto scope = device_scope();
  std::lock_guard<std::recursive_mutex> lock(mu_);
  LS_CHECK(!detached_, "this layerstream handle was detached; call offload() again to stream the model");
  if (!suspended_) return;
  suspended_ = false;
  if (layers_.empty()) return;
  try {
    build_scheduler_locked();  // now, so that a device without room says so here
  } catch (...) {
    suspended_ = true;
    throw;
  }
}

bool EngineImpl::suspended() const {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  return suspended_;
}

Scheduler& EngineImpl::scheduler() {
  ensure_scheduler();
  return *sched_;
}

Stream EngineImpl::compute_stream() {
  if (inline_compute_) return inline_compute_;
  void* native = cuda_glue::current_stream(compute_device_.index());
  std::lock_guard<std::recursive_mutex> lock(mu_);
  auto it = wrapped_streams_.find(native);
  if (it != wrapped_streams_.end()) return it->second;
  Stream s = backend_->wrap_stream(native, "compute");
  wrapped_streams_[native] = s;
  return s;
}

Phase EngineImpl::current_phase() const {
  return torch::autograd::get_current_graph_task_id() == -1 ? Phase::Forward : Phase::Backward;
}

void EngineImpl::check_host_alias(const LayerInfo& l) const {
  if (store_->shared() && !store_->shares(/*trainable=*/true)) {
    // Frozen at offload(), now trainable: every rank's optimizer would step the
    // same shared values (docs/design/distributed.md, "One host copy per node").
    const auto check = [&](const torch::Tensor& t, const void* host, const char* what) {
      LS_CHECK(!(t.defined() && t.requires_grad() && store_->in_shared(host)), "the ", what, " of streamed layer '",
               l.name, "' requires grad, but it was frozen at offload() and sits in the host store this node's "
               "ranks share, where every rank's optimizer would write the same memory. Set requires_grad before "
               "offload() (trainable tensors get one copy per process), or offload with share_host_store=False.");
    };
    if (l.is_group()) {
      for (const auto& e : l.parts()) check(e.param, e.host, "tensor");
    } else {
      check(l.weight, l.w_host, "weight");
      check(l.bias, l.b_host, "bias");
    }
  }
  if (l.is_group()) {
    for (const auto& e : l.parts())
      LS_CHECK(e.qformat != quant::Format::None || (e.param.device().is_cpu() && e.param.data_ptr() == e.host),
               "a tensor of streamed layer '", l.name, "' was replaced or moved after offload(); "
               "detach() the offload handle first, or copy new values in place.");
    return;
  }
  if (l.watched)
    LS_CHECK(l.watched->current_version() == l.watched_version, "the weight of quantized layer '",
             l.name, "' was written in place after offload() (copy_, an in-place op or "
             "load_state_dict into the parameter); layerstream holds it packed on the host and "
             "that write did not reach it. Load new values with load_state_dict() on the offloaded "
             "model (it re-quantizes them; C++: torch::load() into the module, or Engine::requantize()), "
             "or detach(), write the "
             "weight, and offload() again.");
  if (l.qformat != quant::Format::None) {
    if (auto p = l.watched_param.lock())
      LS_CHECK(!p->requires_grad(), "the weight of quantized layer '", l.name, "' was set to require "
               "grad after offload(); a quantized weight is frozen (no gradient is computed for it). "
               "Train an adapter beside it (LoRA) or do not quantize this layer.");
  }
  if (l.qformat == quant::Format::None && !l.on_disk() &&
      !(l.weight.device().is_cpu() && l.weight.data_ptr() == l.w_host)) {
    const bool resized = l.weight.sizes().vec() != l.w_shape;
    LS_FAIL("the weight of streamed layer '", l.name, "' was ",
            resized ? "resized after offload() (from " + shape_str(l.w_shape) + " to " +
                          shape_str(l.weight.sizes().vec()) + ": e.g. transformers' resize_token_embeddings())"
                    : std::string("replaced or moved after offload() (e.g. by module.to(), .cuda(), `param.data = "
                                  "...` or load_state_dict(assign=True); in C++ set_data() or set_()). peft's "
                                  "merge_and_unload() assigns .data with safe_merge=True, and for DoRA, IA3, HRA, "
                                  "BOFT and trainable tokens always (only plain LoRA merges in place); so does "
                                  "prepare_model_for_kbit_training() when it casts weights to float32"),
            "; layerstream keeps streamed weights in host memory. detach() the offload handle before changing "
            "the model's weights this way (and offload() again after), or copy new values in place.");
  }
  if (l.bias.defined() && !l.b_file)
    LS_CHECK(l.bias.device().is_cpu() && l.bias.data_ptr() == l.b_host, "the bias of streamed "
             "layer '", l.name, "' was replaced or moved after offload(); detach() the offload "
             "handle first, or copy new values in place.");
}

void EngineImpl::check_process() const {
  if (g_forks.load(std::memory_order_relaxed) == forks_at_creation_) return;
  LS_FAIL("this process was forked from the one that offloaded the model (os.fork(), a DataLoader "
          "worker, multiprocessing's 'fork' start method): the engine's threads, streams and device "
          "memory stayed in the parent, so the model cannot run here. Offload it in this process: call "
          "offload() on a model the child builds or loads (e.g. in a DataLoader's worker_init_fn), "
          "whatever the start method ('spawn' does not carry an offloaded model either: it cannot be "
          "pickled); or keep the model out of the worker (DataLoader workers that only load data).");
}

void EngineImpl::begin_call() {
  check_process();
  if (torch::autograd::get_current_graph_task_id() != -1) return;  // a recompute in a backward
  std::lock_guard<std::recursive_mutex> lock(mu_);
  if (sched_) sched_->begin_call();  // none yet (or suspended): the next one starts a step anyway
}

void EngineImpl::synchronize() {
  auto scope = device_scope();
  LetGoAfterUnlock let_go;  // Note [Saved tensors are let go after the lock]
  std::lock_guard<std::recursive_mutex> lock(mu_);
  wait_all_locked();
  force_recode_locked();  // trainable lossless weights: a `.data` write the sample missed
}

void EngineImpl::wait_all_locked() {
  drain_grads(-1);
  backend_->synchronize(grad_stream_);
  backend_->synchronize(act_stream_);  // saved activations on their way to the host...
  backend_->synchronize(transfer_);    // ...and back
  release_copied_locked();
  if (sched_) sched_->quiesce();
  wait_lookups_locked();
}

void EngineImpl::wait_lookups_locked() {
  for (const auto& l : layers_)
    if (l->is_table() && l->table().last_read) backend_->synchronize(l->table().last_read);
}

void EngineImpl::detach(const std::vector<torch::Device>& devices) {
  auto scope = device_scope();
  LetGoAfterUnlock let_go;  // Note [Saved tensors are let go after the lock]
  std::lock_guard<std::recursive_mutex> lock(mu_);
  LS_CHECK(!detached_, "this layerstream handle was already detached");
  LS_CHECK(devices.empty() || devices.size() == layers_.size(), "detach needs one device per layer");
  // As suspend(): a layer computing (a forward or backward on another thread)
  // holds a slot of the scheduler detach() frees; nothing changes.
  LS_CHECK(fetched_.empty(), "detach(): ", fetched_.size(), " fetch() token(s) of streamed layers are not "
           "released yet (a forward or backward under way, on another thread?); detach after it returns");
  wait_all_locked();
  if (sched_) {
    const SlotPool& pool = sched_->pool();
    LS_CHECK(pool.num_free() == pool.num_slots(), "detach(): ", pool.num_slots() - pool.num_free(),
             " device slot(s) are in use: a streamed layer is computing (a forward or backward on another "
             "thread?); detach after it returns. Nothing was changed");
  }
  torch::NoGradGuard ng;
  for (size_t i = 0; i < layers_.size(); ++i) {
    LayerInfo& l = *layers_[i];
    const torch::Device dev = devices.empty() ? torch::Device(torch::kCPU) : devices[i];
    if (l.is_group()) {
      // Its tensors are its parts (below).
    } else if (l.qformat != quant::Format::None || l.on_disk()) {
      // Python restores quantized weights from dequantized_weight(), and
      // weights on disk as the stand-ins they were. A plain (C++) parameter
      // keeps its values, but one freed is filled from the packed copy (Note
      // [The dense parameter of a quantized layer], engine_register.cpp).
      torch::Tensor param = l.on_disk() ? torch::Tensor() : l.plain_dense_param();
      if (param.defined() && param.sizes().vec() != l.w_shape) param.set_data(dequantized_weight(int(i)).to(dev));
    } else if (l.shared_weight && l.weight.data_ptr() != l.w_host) {
      // Tied: already restored by the first layer that shares it (the one that
      // adopted it, registered first), to that layer's device.
    } else {
      l.weight.set_data(l.weight.detach().clone().to(dev));
    }
    if (l.bias.defined() && !l.b_file) l.bias.set_data(l.bias.detach().clone().to(dev));
    for (const auto& e : l.parts())  // quantized parts: the caller restores them from dequantized_part()
      if (e.qformat == quant::Format::None) e.param.set_data(e.param.detach().clone().to(dev));
  }
  sched_.reset();
  fetched_.clear();
  detached_ = true;
}

}  // namespace layerstream
