// layerstream — LibTorch glue: trainable weights that cross the bus
// lossless-coded (the engine's rooms: engine_impl.h).
//
// Note [Trainable coded weights]
// A weight offloaded with quantize="lossless" that requires grad stays a
// dense parameter in the host store: backward adds its gradient to .grad
// and the optimizer (torch's or layerstream.optim) writes it in place, as
// for any dense streamed weight. Only its copy to the device is coded: a
// second store entry holds the weight coded (core/lossless.h), and the
// slot's post-copy step decodes it into the workspace, where the layer's
// device weight lives (and gradients flow as for a dense weight).
//
// When: the first coding is made before the layer's first copy, not at
// offload(): in a store the node's ranks share, another rank may still be
// writing the dense bytes then (it is done before any forward). The coded
// copy is remade before the layer's next copy once the
// parameter changed since it was coded, i.e. its version counter moved (every
// in-place write through the parameter: optimizers, load_state_dict, copy_)
// or a sample of its bytes differs (lossless::sample_fingerprint: 1024 words,
// which catches a bulk write through `.data`, which bumps no counter; a
// `.data` write that touches few elements can go unseen). The scheduler asks
// before every copy (SchedulerOptions::parts_stale) and, for a stale layer,
// waits until its earlier copies have read the old bytes before
// refresh_parts re-codes them, so no copy reads a half-written buffer.
//
// Ahead: when the gradient-ready hook (engine_grad_ready.cpp: the
// layerstream.optim step of a layer during the backward) changed the weight,
// the hook's thread re-codes it right after the step (recode_ahead), so the
// work hides behind the rest of the backward instead of delaying the next
// forward. It first waits for the copies of the layer already issued (a
// prefetch that wrapped into the next step may be reading the old bytes);
// a copy issued after that finds the weight changed and re-codes it itself,
// or waits on CodedWeight::mu and finds it current (then only learns the new
// size: `announced`). A speculative step that is undone later leaves the
// weight changed again: the next copy re-codes it. Not in a host store the
// node's ranks share (share_host_store="all"): there the other ranks write
// their shards of the same weight until step()'s barrier, so the next copy
// re-codes it.
//
// Cost: one analysis + encode of the weight per change (the dense bytes at
// the encoder's speed, docs/design/quant-formats.md: ~1.2 GB/s per thread
// for bf16, on every hardware thread), on the gradient-ready thread (Ahead)
// or else on the thread that issues the copy (the forward's, for the first
// layers of a step); stats recoded_bytes and recode_seconds count both.
// Memory: the store holds the dense weight and the coded buffer at its
// largest possible size (max_encoded_bytes: a little over the raw size, so
// that any new values fit), and the slot's part is that size too, next to
// the decoded weight. What crosses the bus is the coded size.
#include "engine_impl.h"

#include <chrono>

#include "core/lossless.h"

namespace layerstream {

void EngineImpl::make_coded_locked(LayerInfo& info) {
  const quant::SrcDtype dtype = src_dtype_of(info.w_dtype, info.name);
  const int64_t numel = numel_of(info.w_shape);
  LS_CHECK(static_cast<size_t>(numel) * lossless::element_bytes(dtype) == info.w_bytes, "layer '", info.name,
           "': its weight (", shape_str(info.w_shape), ") does not fill its host buffer of ", info.w_bytes,
           " bytes (a view with gaps), so it cannot be coded; make it contiguous or do not quantize this layer");
  auto c = std::make_shared<CodedWeight>();
  c->capacity = lossless::max_encoded_bytes(dtype, numel);
  // Private to this process in a shared store: each rank codes its own copy.
  c->index = store_->add(c->capacity, nullptr, info.name + ".weight[lossless]", /*shareable=*/false);
  c->buffer = store_->buffer(c->index).ptr;
  info.coded = std::move(c);  // coded before the first copy (refresh_coded), not now: see the note
}

bool EngineImpl::coded_stale(int layer) const {
  const LayerInfo& l = *layers_[static_cast<size_t>(layer)];
  if (!l.coded) return false;
  CodedWeight& c = *l.coded;
  std::lock_guard<std::mutex> g(c.mu);
  // A new scheduler starts from the slot's size: tell it the coded size.
  return !c.announced || !c.coded || l.weight._version() != c.version ||
         lossless::sample_fingerprint(l.w_host, l.w_bytes) != c.sample;
}

bool EngineImpl::code_if_changed(const LayerInfo& l, CodedWeight& c) {
  const uint32_t version = l.weight._version();  // read before the values
  const uint64_t sample = lossless::sample_fingerprint(l.w_host, l.w_bytes);
  if (c.coded && version == c.version && sample == c.sample) return false;
  const bool first = !c.coded;
  const auto t0 = std::chrono::steady_clock::now();
  backend_->declare_host_access(store_->buffer(c.index), Access::Write, "re-code '" + l.name + "'");
  const quant::SrcDtype dtype = src_dtype_of(l.w_dtype, l.name);
  const int64_t numel = numel_of(l.w_shape);
  const lossless::Analysis a = lossless::analyze(dtype, l.w_host, numel);
  LS_INTERNAL_CHECK(a.total_bytes() <= c.capacity, "coded size over max_encoded_bytes");
  lossless::encode(a, l.w_host, c.buffer, c.capacity);
  c.header = lossless::read_header(c.buffer, c.capacity);
  c.coded = true;
  c.version = version;
  c.sample = sample;
  if (!first) {  // the stats count re-codes: changes after offload()
    recoded_bytes_ += l.w_bytes;
    recode_ns_ += static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count());
  }
  return true;
}

void EngineImpl::refresh_coded(int layer, std::vector<size_t>& copy_bytes) {
  const LayerInfo& l = *layers_[static_cast<size_t>(layer)];
  CodedWeight& c = *l.coded;
  std::lock_guard<std::mutex> g(c.mu);
  code_if_changed(l, c);
  c.announced = true;
  copy_bytes.at(0) = c.header.layout.total_bytes();
}

void EngineImpl::recode_ahead(int layer) {
  std::shared_ptr<CodedWeight> coded;
  const LayerInfo* l = nullptr;
  {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    l = layers_.at(static_cast<size_t>(layer)).get();
    if (!l->coded || !sched_) return;  // no scheduler yet: nothing was copied, nothing coded
    // In a host copy the node's ranks share, the other ranks may still be
    // writing their shards of this weight: its next copy, after step()'s
    // barrier, re-codes it.
    if (store_->in_shared(l->w_host)) return;
    coded = l->coded;
    // Copies issued from now on find the weight changed (parts_stale) and
    // re-code it themselves, or wait on `mu` below and find it coded.
    sched_->wait_copies_read(layer);
  }
  CodedWeight& c = *coded;
  std::lock_guard<std::mutex> g(c.mu);
  if (!c.coded) return;  // the first coding waits for the first copy (see the note)
  if (code_if_changed(*l, c)) c.announced = false;  // the next copy moves the new size
}

}  // namespace layerstream
