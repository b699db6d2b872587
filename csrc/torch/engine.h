// layerstream — LibTorch glue: the streaming engine behind offload().
//
// An Engine owns one backend (the sim device or CUDA), a host store holding
// every streamed weight (pinned when possible), and a Scheduler that moves
// layer weights into device slots ahead of use. Layers are registered with
// add_linear()/add_conv(): the parameter keeps its identity (same Variable,
// same name, same requires_grad) but its data now aliases the host store, so
// optimizers, load_state_dict() and in-place edits act on the host copy.
//
// Compute: linear()/conv() acquire the layer's slot, run the module's own
// ATen call on views of it (with the parameters' requires_grad) on the
// framework's current stream (CUDA) or the calling thread (sim device:
// tensors are CPU tensors over the simulated device memory), and release the
// slot; with a gradient to come, the autograd graph that call recorded is
// kept, and backward runs it on the weights fetched again (prefetched in the
// traced order; not fetched when no input gradient is needed), so the
// streamed layer issues the resident module's calls (Note [Same calls as the
// resident module] in engine.cpp). Weight/bias gradients are copied into a
// scratch slot, then to a host staging buffer on a separate gradient stream,
// and accumulated into param.grad on the host. Accumulation happens in a callback queued at
// the end of every backward pass (one host wait per backward, none per
// layer), so param.grad is complete when loss.backward() returns; see
// docs/design/gradients.md. synchronize() does the same on demand.
//
// Dtype rule: weights are cast on the device to the activation dtype
// (fp32/bf16/fp16): at use, a temporary from the framework's allocator, or,
// with EngineOptions::compute_dtype equal to the activation dtype, once per
// copy into the slot (inside the budget). Weight gradients are computed in
// the activation dtype and cast to the parameter dtype on the device before
// they are copied back.
//
// Thread safety: an Engine may be used from the autograd engine's threads and
// the Python thread; its methods are internally synchronised. Ownership: the
// Engine is shared (std::shared_ptr); parameters keep the host memory alive
// even after the Engine is gone.
#pragma once

#include <torch/torch.h>

#include <atomic>
#include <climits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "core/host_store.h"
#include "core/quant.h"
#include "cuda_glue.h"
#include "core/runtime.h"
#include "core/scheduler.h"
#include "core/telemetry.h"

namespace layerstream {

struct EngineOptions {
  // "auto" (CUDA when LibTorch sees a GPU, else the sim device), "sim",
  // "cuda" or "cuda:N".
  std::string device = "auto";
  // Hard bound on the device bytes of the slot arena; -1 = no bound (then
  // `slots` or prefetch+2 slots are used).
  int64_t budget_bytes = -1;
  int prefetch = 2;  // layers kept in flight ahead of use
  int slots = 0;     // 0 = prefetch + 2, capped by the budget
  // Simulated link (sim device only): PCIe 4.0 x16-like defaults.
  double sim_h2d_gbps = 25.0;
  double sim_d2h_gbps = 25.0;
  double sim_latency_us = 5.0;
  bool checker = true;                  // sim device: ordering checker on
  bool abort_on_ordering_error = false; // sim device: throw at the racy access
  bool pin_memory = true;
  // Keep slot content and prefetch across step boundaries, trusting the
  // parameters' version counters to detect weight updates. Writes through
  // `.data` (e.g. some LoRA merge code) are not detected, so this is opt-in;
  // safe for inference loops and for optimizers that update parameters in
  // place. Default: content is dropped and prefetching stops at each step
  // boundary (the first layers of every step are fetched on demand).
  bool cache_across_steps = false;
  // Record a timeline (copies, layer computations, stalls) for
  // trace_json() / per-step overlap; small cost per layer call.
  bool trace = false;
  // The dtype quantized weights are dequantized to on the device: "" = each
  // weight's own dtype, or "float32" / "bfloat16" / "float16". Set it to the
  // activation dtype when that differs (e.g. an fp32 model run in bf16): the
  // slot then holds the smaller dense copy and no cast runs at use.
  std::string dequant_dtype;
  // The dtype every streamed weight (and bias) is used in on the device: ""
  // = none (each weight's own dtype, cast at use when the activations
  // differ), or "float32" / "bfloat16" / "float16". A dense weight of another
  // dtype crosses the bus as it is and is cast into the slot's workspace
  // right after the copy, on the dequant stream (so the cast is inside the
  // budget and off the compute stream); quantized weights are dequantized
  // straight to it (it implies dequant_dtype; both given must agree). The
  // cast copy is used when the activations have this dtype; activations of
  // the weight's own dtype use the weight as it is, any other dtype casts at
  // use (as without this option), so results never depend on it.
  std::string compute_dtype;
};

// Conv geometry (1-3 spatial dims). `same` computes padding from the kernel.
struct ConvSpec {
  int dims = 2;
  std::vector<int64_t> stride, padding, dilation;
  int64_t groups = 1;
  bool same = false;
};

class Engine : public std::enable_shared_from_this<Engine> {
 public:
  static std::shared_ptr<Engine> create(const EngineOptions& options);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Registers a streamed layer and moves its parameter data into the host
  // store. weight/bias are the module's parameters (bias may be undefined).
  // Tied weights: a dense weight that an already registered (unquantized)
  // layer streams — the same tensor, as an lm_head tied to the embedding —
  // is not copied again: both layers read one host copy (add_embedding too).
  // Such a shared weight cannot be quantized here, and its gradients always
  // go through autograd (as with grads_via_autograd), which sums the uses
  // into one .grad as it does for a resident tied weight. A bias shared
  // with another layer is refused.
  // With a quantization format the weight is packed on the host (it must be
  // frozen: requires_grad false) and crosses the bus packed; right after the
  // copy, a dequantization on the engine's dequant stream writes the weight
  // in its dense dtype into the same slot (the slot holds both, inside the
  // budget), and compute waits only for that (cast to the activation dtype
  // at use if it differs, like unquantized weights). The engine keeps no
  // reference to the dense weight: callers replace the module's parameter
  // by a data-less (meta) one so the dense copy is freed (the Python layer
  // does). The bias stays float. See docs/design/quant-formats.md.
  int add_linear(const std::string& name, torch::Tensor weight, torch::Tensor bias,
                 quant::Format format = quant::Format::None);
  int add_conv(const std::string& name, torch::Tensor weight, torch::Tensor bias,
               const ConvSpec& spec, quant::Format format = quant::Format::None);
  // A Linear whose weight is already int8 with one fp32 scale per output
  // row (e.g. from torch.quantize_per_channel with zero points 0): stored in
  // the int8 format byte for byte. `dense_dtype` is the dtype it stands for
  // (what detach() restores).
  int add_linear_int8(const std::string& name, torch::Tensor int8_data,
                      torch::Tensor scales, torch::Tensor bias, torch::ScalarType dense_dtype);
  // A Linear [rows, cols] whose weight arrives already packed in `format`
  // (int8 or nf4) as its code bytes and fp32 scales, laid out as in
  // docs/design/quant-formats.md — e.g. bitsandbytes NF4 weights (blocks of
  // 64, high nibble first, absmax per block). Stored byte for byte; the
  // codes and scales are copied (callers may free theirs).
  int add_linear_packed(const std::string& name, quant::Format format, torch::Tensor codes,
                        torch::Tensor scales, torch::Tensor bias, int64_t rows, int64_t cols,
                        torch::ScalarType dense_dtype);

  // An embedding table (nn.Embedding without max_norm): its weight moves
  // into the host store like a Linear's and never occupies device memory.
  // Each lookup reads only the rows its ids name, straight from host memory:
  // on CUDA a gather kernel on the compute stream reads the pinned store
  // through its device mapping (PCIe reads of ids.numel() rows, no slot, no
  // copy of the table); with a pageable store (pinning failed or
  // pin_memory=false) the ids are copied to the host and the rows gathered
  // there, then copied to the device (a host wait per lookup). A trainable
  // table's gradient is computed on the host by torch's own embedding
  // backward (padding_idx: -1 = none, else a row index; scale_grad_by_freq
  // and sparse as the module's)
  // from the output gradient and the ids, copied back synchronously (rows,
  // not the table), and returned to autograd, which accumulates it into
  // .grad (on the host). Not part of the scheduler's trace and not counted in
  // the slots; `layers` in stats() counts it, `embedding_layers` and
  // `gathered_bytes` (rows read, also in h2d_bytes) describe it.
  int add_embedding(const std::string& name, torch::Tensor weight, int64_t padding_idx = -1,
                    bool scale_grad_by_freq = false, bool sparse = false);

  // A group of tensors streamed together in one slot (e.g. a mixture-of-
  // experts module's 3-D expert weights, gate_up_proj and down_proj, and
  // their biases): adopted into the host store like a layer's weight (same
  // aliasing and layout rules), any shape, used in their own dtype (never
  // quantized or cast). The engine runs no computation for it: the caller
  // fetch()es the device views, computes, and release()s them (the Python
  // offload() runs the module's own forward on them and recomputes it in
  // backward; docs/design/torch-glue.md "Tensor groups"). Gradients are the
  // caller's (it returns them to autograd). Tensors already streamed by
  // another layer are refused.
  // With a format, every tensor of 2 or more dimensions is packed on the
  // host as a matrix of its last dimension's columns (it must be frozen;
  // the engine keeps no reference to the dense values, so callers replace
  // the parameters by data-less stand-ins) and dequantized into the slot
  // after the copy, to its dtype or dequant_dtype; fetch() returns the
  // dequantized views. 1-D tensors (biases) stay as they are.
  //
  // experts > 0: the group's tensors are indexed by expert along dim 0 (a
  // mixture-of-experts module's), and fetch() may be given the experts a
  // router chose, to copy only theirs. A tensor whose dim 0 is not `experts`,
  // or whose dim-0 slices are not contiguous in memory (or, quantized, do
  // not start on whole nf4 blocks / 16 bytes of codes), is copied whole.
  //
  // prepacked (empty, or one entry per tensor): a tensor whose entry has a
  // format arrives already packed, e.g. a GGUF file's blocks (load_gguf):
  // `bytes` (CPU uint8, copied; the caller may free it) are the data section
  // of quant::layout_for(format, numel / last dim, last dim), i.e. the file's
  // blocks without padding (layout.data_bytes), GGUF formats only. The group's tensor at that position gives only the shape and the
  // dense dtype (its values are never read; a meta tensor will do). It is
  // dequantized into the slot like a tensor packed by `format`, whatever
  // `format` is, and its dim-0 slices are fetched per expert (GGUF rows are
  // whole blocks).
  struct PrepackedPart {
    quant::Format format = quant::Format::None;
    torch::Tensor bytes;
  };
  int add_group(const std::string& name, const std::vector<torch::Tensor>& tensors,
                quant::Format format = quant::Format::None, int64_t experts = 0,
                const std::vector<PrepackedPart>& prepacked = {});
  // Group layers quantized by add_group: tensor `part` dequantized on the
  // host (what detach() restores; lossy), and new values packed into it in
  // place of the old ones (as requantize() for a layer).
  torch::Tensor dequantized_part(int layer, int part);
  void requantize_part(int layer, int part, const torch::Tensor& dense);
  // Group layers: acquires the layer's slot for the compute stream (waiting
  // for its copy, prefetched in the traced order like any layer; the phase is
  // backward inside an autograd graph task) and returns a token and views of
  // its tensors on the compute device, in add_group() order. The views are
  // valid until release(token); work that reads them must be enqueued on the
  // compute stream (the framework's current stream) before release, which
  // records the slot's reuse after it. Thread-safe; each token is released
  // once.
  //
  // `experts` (a group added with experts > 0): the experts the computation
  // will read (ids in [0, experts), any order, repeats allowed). When they
  // are at most half of them and the group is not already in a slot, only
  // their slices of each expert-indexed tensor cross the bus (and are
  // dequantized), on demand; the other experts' slices in the views hold
  // whatever the slot held before, so the caller must read no other expert.
  // The group is then no longer prefetched whole, until a fetch reads more
  // than half of the experts (or names none) again. Empty: the whole group.
  std::pair<int64_t, std::vector<torch::Tensor>> fetch(int layer,
                                                       const std::vector<int64_t>& experts = {});
  void release(int64_t token);

  // The streamed computations (differentiable). Weight gradients normally
  // go back asynchronously and are accumulated into .grad by the engine; with
  // grads_via_autograd (e.g. the parameter has hooks) — and always under
  // torch.autograd.grad / backward(inputs=...) — they are copied to the host
  // synchronously and returned to autograd, which routes them. Under
  // torch.autocast for the compute device's type, a float input is first
  // cast to the autocast dtype (as autocast casts Linear/conv inputs), so
  // the weight is used in that dtype (compute_dtype's copy when it matches).
  torch::Tensor linear(int layer, const torch::Tensor& x, bool grads_via_autograd = false);
  torch::Tensor conv(int layer, const torch::Tensor& x, bool grads_via_autograd = false);
  // The lookup of an embedding layer: weight[ids] on the compute device, in
  // the weight's dtype, like torch.nn.functional.embedding (ids: an integer
  // tensor on the compute device; out-of-range ids fail as torch's lookup
  // does); differentiable for the weight when it requires grad. Stream
  // semantics: enqueued on the compute stream like the layers; the host
  // rows are read when it runs, so host writes to the table must wait for
  // synchronize() (detach() and the destructor wait for it).
  torch::Tensor embedding(int layer, const torch::Tensor& ids);

  // Waits for every pending transfer and gradient, accumulates gradients
  // staged outside any autograd graph task into param.grad (a backward pass
  // applies its own when it finishes), and forgets the weights cached in device
  // slots (the next fetch reads the host copy: the call to make after host
  // writes the version counters cannot see, with cache_across_steps).
  void synchronize();
  // Restores every layer's parameters to ordinary tensors on `device`
  // (bit-identical data) and disables the engine.
  void detach(const std::vector<torch::Device>& devices);
  bool detached() const { return detached_; }

  // Telemetry: peak_device_bytes, h2d_bytes, d2h_bytes, steps, hits, misses,
  // deviations, retraces, stall_seconds, slots, slot_bytes, budget_bytes,
  // pinned_bytes, pageable_bytes, layers, embedding_layers, gathered_bytes,
  // ordering_errors, failed_backwards (backward passes that raised after
  // staging weight gradients, which were dropped: see discard_task()).
  std::map<std::string, double> stats() const;
  std::vector<std::string> ordering_errors() const;
  // Per-step counters (see StepStats) of completed steps, with the overlap
  // fraction of each step from the timeline when tracing (else NaN).
  std::vector<std::pair<StepStats, double>> step_stats() const;
  // The timeline in Chrome trace / Perfetto JSON ("" when trace is off).
  std::string trace_json() const;
  // Marks the start/end of a layer computation on `s` in the timeline.
  std::shared_ptr<double> trace_begin(Stream s);
  void trace_end(Stream s, const std::shared_ptr<double>& start, const std::string& lane,
                 const std::string& name, uint64_t bytes = 0);
  // Quantized and pre-packed layers hold their weight packed on the host, so
  // an in-place write to the module's parameter does not reach it.
  // watch_weight records `param`'s version counter (without keeping its data
  // alive); after an in-place write to it (copy_, load_state_dict without the
  // re-quantizing hook, an optimizer) the layer's next call fails with an
  // error saying how to load new values, instead of silently computing with
  // the old ones. add_linear/add_conv with a format watch the weight they are
  // given; a caller that replaces the module's parameter (by a meta stand-in)
  // watches the replacement. Unquantized layers need none (their parameter's
  // data is the host copy). Inference tensors (no version counter) are not
  // watched.
  void watch_weight(int layer, const torch::Tensor& param);
  // Layers quantized by add_linear/add_conv: packs `dense` (the weight's
  // shape, any float dtype and device; cast to the weight's dtype first, as
  // load_state_dict's copy would) into the layer's host buffer in place of
  // the old weight. Waits for in-flight copies and forgets weights cached on
  // the device first (like synchronize()); the old packed weight stays if
  // packing fails (e.g. NaN). Not safe concurrently with a forward or
  // backward of this engine.
  void requantize(int layer, const torch::Tensor& dense);
  // Quantized layers: the weight dequantized on the host (CPU, original
  // dtype) — what detach() restores (lossy); "" / format name per layer.
  torch::Tensor dequantized_weight(int layer);
  // Quantized layers: a copy of the packed code bytes (uint8, 1-D).
  torch::Tensor packed_codes(int layer);
  std::string layer_format(int layer) const;

  torch::Device compute_device() const { return compute_device_; }
  const std::string& device_name() const { return device_name_; }
  int num_layers() const;
  std::string layer_name(int layer) const;
  int64_t layer_bytes(int layer) const;
  const EngineOptions& options() const { return opts_; }

  // ---- used by the autograd functions ----
  // Makes the engine's CUDA device current for the calling thread (torch's way;
  // a no-op on sim) for the returned scope's lifetime. See cuda_glue.h.
  cuda_glue::DeviceScope device_scope() const { return cuda_glue::DeviceScope(cuda_index_); }
  struct LayerInfo;
  LayerInfo& layer(int i);
  // An embedding layer's lookup itself (no autograd node), on the compute stream.
  torch::Tensor lookup(LayerInfo& l, const torch::Tensor& ids);
  // Counts device-to-host bytes copied outside the gradient stream (d2h_bytes).
  void count_d2h(uint64_t bytes);
  Stream compute_stream();
  Phase current_phase() const;
  Scheduler& scheduler();
  // The layer's weight and bias as its computation reads them on the device,
  // for activations of `dtype`. The leaves are views of the lease's slot
  // with their parameters' requires_grad, so that the op takes the resident
  // module's path
  // (Note [Same calls as the resident module] in engine.cpp); w/b are the
  // leaves, or their casts to `dtype` (cast at use, recorded by autograd
  // when grad mode is on). Undefined when the layer has no bias.
  struct DeviceParams {
    torch::Tensor w_leaf, b_leaf, w, b;
  };
  DeviceParams device_params(const LayerInfo& l, const Lease& lease, torch::ScalarType dtype);
  // Note [Same calls as the resident module]: the storages of device
  // parameters that a recorded graph may have saved are registered per
  // layer and activation dtype, and *parked* (data pointer null) while the
  // layer is not computing. unpark() points every live one of (layer,
  // dtype) at `fresh` (the parameters the layer's backward fetched) until
  // park(); while unparked, active_params() returns `fresh`, so a forward of
  // the layer run inside that backward (a non-reentrant checkpoint
  // recomputing its region) computes on them. Thread-safe.
  void register_storages(int layer, torch::ScalarType dtype, const DeviceParams& p, bool park_now);
  void unpark(int layer, torch::ScalarType dtype, const DeviceParams& fresh);
  void park(int layer, torch::ScalarType dtype);
  std::optional<DeviceParams> active_params(int layer, torch::ScalarType dtype) const;
  // Copies weight/bias gradients (already computed into `scratch` on the
  // compute stream) to the host and schedules their accumulation.
  void push_grads(int layer, Lease& scratch, bool has_w, bool has_b);
  // A gradient computed on the device, as a host tensor of `dtype` (blocking).
  torch::Tensor grad_to_host(const torch::Tensor& g, torch::ScalarType dtype);
  // Makes sure pending gradients are accumulated at the end of this backward.
  void ensure_backward_callback();
  uint64_t id() const { return id_; }
  static std::shared_ptr<Engine> lookup(uint64_t id);

  struct LayerInfo {
    std::string name;
    bool is_conv = false;
    bool is_embedding = false;  // add_embedding(): looked up, never in a slot
    // Tied weights: the weight (its host copy, w_index/w_host) is also
    // another layer's; its gradients go through autograd (see add_linear).
    bool shared_weight = false;
    // add_group(): all its tensors are `parts` (`weight` and `bias` stay
    // undefined); fetched whole into one slot by fetch(), computed by the
    // caller. A quantized part crosses the bus packed and is dequantized into
    // the slot's workspace at `ws_offset` (after the copied parts).
    bool is_group = false;
    struct Part {
      torch::Tensor param;  // data aliases the host store; a meta stand-in if quantized
      std::vector<int64_t> shape, strides;  // strides empty: contiguous (always when quantized)
      torch::ScalarType dtype = torch::kFloat;
      size_t index = 0;
      void* host = nullptr;
      size_t bytes = 0;  // in the host store (packed if quantized)
      quant::Format qformat = quant::Format::None;
      quant::PackedLayout qlayout;
      torch::ScalarType q_dtype = torch::kFloat;  // dequantized to
      size_t ws_offset = 0;
      // Indexed by expert along dim 0, each expert's slice contiguous (and,
      // when quantized, on whole blocks): fetch(layer, experts) copies only
      // the named experts' slices. expert_bytes: one dense slice's bytes;
      // expert_rows: one expert's rows of the packed matrix.
      bool by_expert = false;
      size_t expert_bytes = 0;
      int64_t expert_rows = 0;
    };
    std::vector<Part> parts;
    int64_t experts = 0;  // add_group(experts): dim 0 of the expert-indexed parts
    size_t group_ws_bytes = 0;  // the dequantized parts, in the workspace
    Event last_read;            // embedding: after the newest lookup on the device
    void* w_host_mapped = nullptr;  // embedding: the store's device mapping (nullptr: none)
    int64_t padding_idx = -1;       // embedding: as nn.Embedding (its row gets no gradient)
    bool scale_grad_by_freq = false, sparse = false;  // embedding: as nn.Embedding
    ConvSpec conv;
    torch::Tensor weight;  // the parameter (data aliases the host store); a meta stand-in if quantized
    torch::Tensor bias;    // may be undefined
    std::vector<int64_t> w_shape, b_shape;
    // A dense weight's strides when its layout is not the contiguous one
    // (channels_last, transposed): kept in the host store, the slot and
    // on the device. Empty: contiguous (always for quantized weights).
    std::vector<int64_t> w_strides;
    torch::ScalarType w_dtype = torch::kFloat, b_dtype = torch::kFloat;
    size_t w_index = 0, b_index = 0;  // host store indices
    void* w_host = nullptr;
    void* b_host = nullptr;
    size_t w_bytes = 0, b_bytes = 0;  // bytes in the host store (packed for quantized)
    quant::Format qformat = quant::Format::None;
    quant::PackedLayout qlayout;
    torch::ScalarType q_dtype = torch::kFloat;  // quantized: dtype of the dequantized weight
    // The slot's workspace (after the copied parts), written by the post-copy
    // step: the weight (dequantized, or cast to compute_dtype: cast_w) at
    // offset 0, then the bias cast to compute_dtype (cast_b) at ws_b_offset.
    bool cast_w = false, cast_b = false;
    torch::ScalarType cast_dtype = torch::kFloat;  // compute_dtype, when cast_w or cast_b
    size_t ws_b_offset = 0;
    bool packed_here = false;  // quantized by add_linear/add_conv (requantize() can repack it)
    // watch_weight(): the module parameter's version counter and its value then.
    std::optional<c10::VariableVersion> watched;
    // ...and the parameter itself, weakly (the engine must not keep a dense
    // weight alive): a quantized weight is frozen, so requires_grad set on it
    // later is refused at the next call (C++; Python's _PackedWeight refuses it
    // at once).
    c10::weak_intrusive_ptr<c10::TensorImpl> watched_param{c10::intrusive_ptr<c10::TensorImpl>()};
    uint32_t watched_version = 0;
    // Gradient staging (host): one buffer per use of the layer in one
    // backward, summed in arrival order and added to .grad once, as autograd
    // sums a leaf's incoming gradients first.
    std::vector<HostBuffer> grad_staging;
    size_t grad_b_offset = 0;
    Event grad_done;
    // Per staged use, in arrival order (pending[u] is in grad_staging[u]):
    // which gradients it holds and the autograd graph task that staged it
    // (-1: none; see drain_grads()).
    struct StagedUse {
      bool w = false, b = false;
      int task = -1;
    };
    std::vector<StagedUse> pending;
  };

 private:
  explicit Engine(const EngineOptions& options);
  int add_layer(LayerInfo info, quant::Format format);
  int register_layer_locked(LayerInfo info);
  // Tied weights: when `info.weight` is already streamed by another layer,
  // points `info` at that layer's host copy and returns true (false: not
  // shared; the caller adopts it). Refuses shared biases and quantizing a
  // shared weight (`format`), naming both layers.
  bool share_weight_locked(LayerInfo& info, quant::Format format);
  void build_scheduler_locked();
  void ensure_scheduler();
  void check_host_alias(const LayerInfo& l) const;
  // Adds the staged uses of `l` that `task` may apply (its own and those of
  // no graph task; every use for kAnyTask) to .grad; the others stay staged.
  static constexpr int kAnyTask = INT_MIN;
  void accumulate_locked(LayerInfo& l, int task);
  // At the end of backward `task` (its final callback): applies that task's
  // staged gradients. synchronize() passes -1: only uses staged outside any
  // graph task, since a running backward applies its own when it finishes.
  void drain_grads(int task);
  // A backward that failed (its graph task ended without running the
  // callback): drops the gradients it staged, which are never added to
  // .grad, so a later backward or zero_grad() cannot be mixed with them.
  void discard_task(int task) noexcept;
  // Warns (once per engine) at the next linear()/conv() after discard_task()
  // dropped gradients: never from inside the autograd engine.
  void report_failed_backward();
  // The common start of linear()/conv()/embedding(): reports a failed backward,
  // refuses tracing, and checks that layer `index` is of `kind` ("a Linear",
  // "a convolution", "an embedding").
  LayerInfo& call_layer(int index, const char* kind);
  // Waits until no embedding lookup enqueued so far still reads the host store.
  void wait_lookups_locked();
  size_t grad_bytes(const LayerInfo& l) const;
  // Bytes of the weight as the workspace holds it (dequantized, or cast to
  // compute_dtype).
  static size_t dense_weight_bytes(const LayerInfo& l);
  // Bytes of the slot's workspace (0: no post-copy step).
  static size_t workspace_bytes(const LayerInfo& l);
  PostCopyFn make_post_copy(const LayerInfo& l, size_t workspace_part);
  // A group's: dequantizes its packed parts into the workspace.
  // With `runs` (half-open ranges of experts), only those experts' rows of
  // the expert-indexed packed parts.
  PostCopyFn make_group_post_copy(const LayerInfo& l, size_t workspace_part,
                                  const std::vector<std::pair<int64_t, int64_t>>* runs = nullptr);
  // Warns once per engine that weights are cast at use (and how to avoid it).
  void note_cast_at_use(const LayerInfo& l, torch::ScalarType from, torch::ScalarType to);

  EngineOptions opts_;
  std::optional<torch::ScalarType> dequant_dtype_;  // from opts_.dequant_dtype (or compute_dtype)
  std::optional<torch::ScalarType> compute_dtype_;  // from opts_.compute_dtype
  uint64_t id_;
  std::string device_name_;
  torch::Device compute_device_{torch::kCPU};
  int cuda_index_ = -1;  // compute_device_'s index on CUDA, -1 on sim
  std::shared_ptr<Backend> backend_;
  std::shared_ptr<HostStore> store_;
  std::shared_ptr<void> keepalive_;  // held by parameters' data: store + backend
  Stream transfer_, grad_stream_, dequant_stream_, inline_compute_;
  std::map<void*, Stream> wrapped_streams_;

  mutable std::recursive_mutex mu_;
  std::vector<std::unique_ptr<LayerInfo>> layers_;
  std::unique_ptr<Scheduler> sched_;
  std::vector<int> pending_;  // layers with gradients in flight
  std::vector<int> callback_tasks_;  // graph tasks whose end-of-backward callback is queued
  uint64_t failed_backwards_ = 0;      // backwards whose staged gradients were dropped
  std::atomic<bool> failed_backward_unreported_{false};  // warned at the next linear()/conv()
  uint64_t d2h_bytes_ = 0;
  std::map<int64_t, Lease> fetched_;  // fetch() tokens not yet released
  int64_t next_token_ = 1;
  std::atomic<uint64_t> gathered_bytes_{0};  // embedding rows read from the host store
  std::atomic<uint64_t> routed_fetches_{0};  // group fetches that copied some experts only
  std::atomic<bool> cast_warned_{false};
  bool detached_ = false;
  std::shared_ptr<TraceRecorder> tracer_;
  // counters carried over scheduler rebuilds
  SchedulerStats carried_;
  // register_storages() / unpark() / park(): per layer.
  struct ParkedStorage {
    int role;                 // 0 weight leaf, 1 its cast, 2 bias leaf, 3 its cast
    torch::ScalarType dtype;  // the activations' (device_params)
    c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  };
  std::map<int, std::vector<ParkedStorage>> parked_;
  std::map<int, std::vector<std::pair<torch::ScalarType, DeviceParams>>> active_;
};

// Resolves a device string for the engine; throws a clear error for unknown
// devices or "cuda" without a visible GPU.
std::string resolve_device(const std::string& device);

}  // namespace layerstream
