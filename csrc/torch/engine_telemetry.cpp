// layerstream — LibTorch glue: statistics, the timeline and per-step counters
// (the engine's rooms: engine_impl.h).
#include "engine_impl.h"

#include <algorithm>
#include <cstring>

#include "core/log.h"

namespace layerstream {

EngineStats EngineImpl::stats() const {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  EngineStats m;
  const SchedulerStats st = sched_ ? sched_->stats() : SchedulerStats{};
  m.steps = st.steps + carried_.steps;
  m.acquires = st.acquires + carried_.acquires;
  m.hits = st.hits + carried_.hits;
  m.misses = st.misses + carried_.misses;
  m.deviations = st.deviations + carried_.deviations;
  m.retraces = st.retraces + carried_.retraces;
  m.failed_backwards = failed_backwards_;
  m.gathered_bytes = gathered_bytes_.load();
  m.h2d_bytes = st.h2d_bytes + carried_.h2d_bytes + m.gathered_bytes;
  m.d2h_bytes = d2h_bytes_;
  m.stall_seconds = st.host_wait_seconds + carried_.host_wait_seconds;
  m.slots = static_cast<uint64_t>(st.num_slots);
  m.slot_bytes = st.slot_bytes;
  m.max_slots_held = static_cast<uint64_t>(std::max(st.max_slots_held, carried_.max_slots_held));
  m.budget_bytes = opts_.budget_bytes;
  m.layers = layers_.size();
  for (const auto& l : layers_) {
    bool packed = l->qformat != quant::Format::None;
    for (const auto& e : l->parts()) packed = packed || e.qformat != quant::Format::None;
    m.quantized_layers += packed ? 1 : 0;
    bool coded = false;
    for_each_coded(*l, [&](const CodedTensor&) { coded = true; });
    m.coded_layers += coded ? 1 : 0;
    m.embedding_layers += l->is_table() ? 1 : 0;
    m.group_layers += l->is_group() ? 1 : 0;
  }
  m.routed_fetches = routed_fetches_.load();
  m.activation_d2h_bytes = act_d2h_bytes_;
  m.activation_h2d_bytes = act_h2d_bytes_;
  int64_t released = 0;  // copies back autograd let go of since the last prune (prune_handed_out_locked)
  for (const auto& h : handed_out_)
    if (h.storage.expired()) released += static_cast<int64_t>(h.bytes);
  m.activation_device_bytes = static_cast<uint64_t>(act_device_bytes_ - released);
  m.peak_activation_device_bytes = static_cast<uint64_t>(act_peak_device_bytes_);
  m.activation_host_bytes = act_host_bytes_;
  m.grad_staging_pinned_bytes = grad_pinned_bytes_;
  m.recoded_bytes = recoded_bytes_.load();
  m.recode_seconds = static_cast<double>(recode_ns_.load()) * 1e-9;
  m.grad_staging_pageable_bytes = grad_pageable_bytes_;
  const HostStoreStats hs = store_->stats();
  m.pinned_bytes = hs.pinned_bytes;
  m.pageable_bytes = hs.pageable_bytes;
  m.shared_bytes = hs.shared_bytes;
  m.averaged_bytes = averaged_bytes_.load();
  for (const auto& l : layers_) m.disk_layers += l->on_disk() ? 1 : 0;
  m.disk_read_bytes = st.staging.file_bytes + carried_.staging.file_bytes;
  m.staged_read_bytes = st.staging.read_bytes + carried_.staging.read_bytes;
  m.staging_hits = st.staging.hits + carried_.staging.hits;
  m.staging_entries = st.staging.entries;
  m.staging_entry_bytes = st.staging.entry_bytes;
  m.peak_device_bytes = backend_->memory_stats().device_bytes_peak;
  m.device_bytes = backend_->memory_stats().device_bytes_in_use;
  m.ordering_errors = backend_->ordering_errors().size();
  m.trace_dropped_slices = tracer_ ? tracer_->dropped() : 0;
  return m;
}

std::vector<std::string> EngineImpl::ordering_errors() const { return backend_->ordering_errors(); }

std::shared_ptr<double> EngineImpl::trace_begin(Stream s) {
  return trace_stream_begin(tracer_, *backend_, s);
}

void EngineImpl::trace_end(Stream s, const std::shared_ptr<double>& start, const std::string& lane,
                       const std::string& name, uint64_t bytes) {
  if (start) trace_stream_end(tracer_, *backend_, s, start, {lane, name, 0, 0, bytes});
}

std::vector<std::pair<StepStats, double>> EngineImpl::step_stats() const {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  std::vector<StepStats> steps(carried_steps_.begin(), carried_steps_.end());  // schedulers before this one
  if (sched_)                                                                  // (suspend(), new layers)
    for (StepStats st : sched_->step_stats()) {
      st.step += carried_.steps;
      steps.push_back(st);
    }
  if (steps.size() > 4096) steps.erase(steps.begin(), steps.end() - 4096);
  std::vector<double> overlap(steps.size(), std::numeric_limits<double>::quiet_NaN());
  if (tracer_) {
    std::vector<std::pair<double, double>> windows;
    windows.reserve(steps.size());
    for (const StepStats& st : steps) windows.emplace_back(st.start_us, st.end_us);
    overlap = tracer_->overlap_fractions("transfer", "compute", windows);
  }
  std::vector<std::pair<StepStats, double>> out;
  out.reserve(steps.size());
  for (size_t i = 0; i < steps.size(); ++i) out.emplace_back(steps[i], overlap[i]);
  return out;
}

std::string EngineImpl::trace_json() const { return tracer_ ? tracer_->to_chrome_json() : ""; }

void EngineImpl::count_d2h(uint64_t bytes) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  d2h_bytes_ += bytes;
}

}  // namespace layerstream
