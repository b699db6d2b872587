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
// `.data` write that touches few elements can go unseen, and synchronize(),
// the call for writes no counter sees, makes the next copy re-code it: see
// force_recode_locked()). The scheduler asks
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
//
// Group tensors (add_group with Format::Lossless, a tensor that requires
// grad): the same, in pieces (one per expert when indexed by expert;
// CodedWeight::piece_count), the buffer sized max_pieces_bytes, the pieces of
// a coding back to back from its start (their offsets move when it is
// remade). A whole copy refreshes through the scheduler's hooks as above; a
// routed fetch copies byte ranges of the current pieces, so it re-codes first
// (recode_for_fetch: after the layer's copies so far, routed ones included,
// have read the old bytes), and its post-copy step, like the whole copy's,
// takes the pieces' places when it is issued. Groups are stepped in step(),
// never during the backward: no re-code ahead.
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

void EngineImpl::for_each_coded(const LayerInfo& l, const std::function<void(const CodedTensor&)>& f) {
  if (l.coded) f({l.weight, l.w_host, 0, *l.coded});
  const auto& parts = l.parts();
  for (size_t k = 0; k < parts.size(); ++k)
    if (parts[k].coded) f({parts[k].param, parts[k].host, k, *parts[k].coded});
}

namespace {
// The tensor changed since it was coded (or was never coded); the caller holds c.mu.
bool changed(const torch::Tensor& param, const void* host, const EngineImpl::CodedWeight& c) {
  return !c.coded || c.forced || param._version() != c.version ||
         lossless::sample_fingerprint(host, param.nbytes()) != c.sample;
}
}  // namespace

bool EngineImpl::coded_stale(int layer) const {
  bool stale = false;
  // A new scheduler starts from the slot's size: tell it the coded size.
  for_each_coded(*layers_[static_cast<size_t>(layer)], [&](const CodedTensor& t) {
    std::lock_guard<std::mutex> g(t.c.mu);
    stale = stale || !t.c.announced || changed(t.param, t.host, t.c);
  });
  return stale;
}

bool EngineImpl::code_if_changed(const std::string& name, const CodedTensor& t) {
  CodedWeight& c = t.c;
  const uint32_t version = t.param._version();  // read before the values
  const size_t dense = t.param.nbytes();
  const uint64_t sample = lossless::sample_fingerprint(t.host, dense);
  if (c.coded && !c.forced && version == c.version && sample == c.sample) return false;
  const bool first = !c.coded;
  const auto t0 = std::chrono::steady_clock::now();
  backend_->declare_host_access(store_->buffer(c.index), Access::Write, "re-code '" + name + "'");
  const quant::SrcDtype dtype = src_dtype_of(t.param.scalar_type(), name);
  const int64_t numel = t.param.numel();
  if (c.piece_count) {  // a group tensor: a piece per expert
    const lossless::PiecesAnalysis P = lossless::analyze_pieces(dtype, t.host, numel, c.piece_count);
    LS_INTERNAL_CHECK(P.total_bytes() <= c.capacity, "coded pieces over max_pieces_bytes");
    lossless::encode_pieces(P, t.host, c.buffer, c.capacity);
    c.pieces.clear();
    for (size_t p = 0; p < P.pieces.size(); ++p) c.pieces.push_back({P.offsets[p], P.pieces[p].total_bytes()});
    c.piece_layout = P.pieces.front().layout;
  } else {
    const lossless::Analysis a = lossless::analyze(dtype, t.host, numel);
    LS_INTERNAL_CHECK(a.total_bytes() <= c.capacity, "coded size over max_encoded_bytes");
    lossless::encode(a, t.host, c.buffer, c.capacity);
    c.header = lossless::read_header(c.buffer, c.capacity);
  }
  c.coded = true;
  c.forced = false;
  c.version = version;
  c.sample = sample;
  if (!first) {  // the stats count re-codes: changes after offload()
    recoded_bytes_ += dense;
    recode_ns_ += static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count());
  }
  return true;
}

void EngineImpl::refresh_coded(int layer, std::vector<size_t>& copy_bytes) {
  const LayerInfo& l = *layers_[static_cast<size_t>(layer)];
  for_each_coded(l, [&](const CodedTensor& t) {
    std::lock_guard<std::mutex> g(t.c.mu);
    code_if_changed(l.name, t);
    t.c.announced = true;
    copy_bytes.at(t.part) = t.c.coded_bytes();
  });
}

void EngineImpl::force_recode_locked() {
  for (const auto& l : layers_)
    for_each_coded(*l, [](const CodedTensor& t) {
      std::lock_guard<std::mutex> g(t.c.mu);
      if (t.c.coded) t.c.forced = true;
    });
}

void EngineImpl::recode_for_fetch(int layer) {
  const LayerInfo& l = *layers_[static_cast<size_t>(layer)];
  bool any = false;
  for_each_coded(l, [&](const CodedTensor& t) {
    std::lock_guard<std::mutex> g(t.c.mu);
    any = any || changed(t.param, t.host, t.c);
  });
  if (!any) return;  // decoding (frozen values): no wait
  scheduler().wait_copies_read(layer);  // whole and routed copies that read the old bytes
  for_each_coded(l, [&](const CodedTensor& t) {
    std::lock_guard<std::mutex> g(t.c.mu);
    if (code_if_changed(l.name, t)) t.c.announced = false;  // the next whole copy moves the new size
  });
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
  if (code_if_changed(l->name, {l->weight, l->w_host, 0, c})) c.announced = false;  // the next copy moves the new size
}

}  // namespace layerstream
