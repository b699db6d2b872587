// layerstream — LibTorch glue, internal: the engine's implementation.
//
// Included by the engine's .cpp files and the autograd functions only
// (csrc/torch/engine_*.cpp, ops_*.cpp); callers use engine.h. One file per
// concern implements the members declared here (docs/design/README.md):
//   engine.cpp            construction, devices, the scheduler and budget,
//                         synchronize/detach
//   engine_register.cpp   layer registration, host adoption, ties, requantize
//   engine_coded.cpp      trainable weights coded on the bus (re-coding)
//   engine_groups.cpp     tensor groups, expert-routed fetch
//   engine_device.cpp     the slot's post-copy step (dequant/cast) and the
//                         device views of parameters (parking)
//   engine_gradients.cpp  weight gradients: staging, accumulation, callbacks
//   engine_telemetry.cpp  stats, timeline, per-step counters
//   engine_host_tier.cpp  layers on disk, reads into the store, staged sources
//   ops_streamed.cpp      Linear/conv: the autograd function (StreamedFn) and
//                         what the autograd functions share
//   ops_compiled.cpp      Linear/conv: the operators' kernels (op_forward,
//                         op_backward) and where their weight gradients go
//   ops_embedding.cpp     embedding tables: lookup and its autograd function
//   ops_library.cpp       the layerstream:: operators (torch.compile/export)
//   ops_spec.cpp          what an operator call names of its layer's layout (op_spec)
//   engine_activations.cpp activation offload: stash/restore saved tensors
//   engine_distributed.cpp gradient averaging over a process group, the
//                         shared host store
// Thread safety: every member takes mu_ (recursive) unless it says _locked
// (the caller holds it); coded_stale/refresh_coded are called by the
// scheduler under its lock and take only CodedWeight::mu; recode_ahead
// (the gradient-ready thread) takes mu_ and the scheduler's lock, releases
// them, then takes only CodedWeight::mu; recode_for_fetch (a routed fetch)
// takes the scheduler's lock briefly, then CodedWeight::mu.
#pragma once

#include "layerstream/engine.h"

#include <torch/csrc/autograd/custom_function.h>

#include <array>
#include <atomic>
#include <climits>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <utility>
#include <variant>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "core/host_store.h"
#include "stashed_activation.h"
#include "core/lossless.h"
#include "core/io/checksum.h"
#include "dtype_name.h"
#include "core/io/source_file.h"
#include "core/runtime.h"
#include "core/scheduler.h"
#include "core/slot_layout.h"
#include "core/log.h"
#include "cuda_glue.h"

namespace layerstream {

class EngineImpl final : public Engine, public std::enable_shared_from_this<EngineImpl> {
 public:
  ~EngineImpl() override;

  // ---- the public interface (documented in engine.h) ----
  int add_linear(const std::string& name, torch::Tensor weight, torch::Tensor bias, quant::Format format) override;
  int add_conv(const std::string& name, torch::Tensor weight, torch::Tensor bias, const ConvSpec& spec, quant::Format format) override;
  int add_linear_int8(const std::string& name, torch::Tensor int8_data, torch::Tensor scales, torch::Tensor bias, torch::ScalarType dense_dtype) override;
  int add_linear_packed(const std::string& name, quant::Format format, torch::Tensor codes, torch::Tensor scales, torch::Tensor bias, int64_t rows, int64_t cols, torch::ScalarType dense_dtype) override;
  int add_embedding(const std::string& name, torch::Tensor weight, int64_t padding_idx, bool scale_grad_by_freq, bool sparse) override;
  int add_group(const std::string& name, const std::vector<torch::Tensor>& tensors, quant::Format format, int64_t experts, const std::vector<PrepackedPart>& prepacked) override;
  torch::Tensor read_file(const FileRange& src, const std::vector<int64_t>& shape, torch::ScalarType dtype,
                          std::optional<torch::ScalarType> file_dtype = std::nullopt) override;
  int add_linear_on_disk(const std::string& name, const torch::Tensor& weight, const FileRange& w, torch::Tensor bias, const std::optional<FileRange>& b, quant::Format format) override;
  torch::Tensor dequantized_part(int layer, int part) override;
  void requantize_part(int layer, int part, const torch::Tensor& dense) override;
  std::pair<int64_t, std::vector<torch::Tensor>> fetch(int layer, const std::vector<int64_t>& experts) override;
  void release(int64_t token) override;
  torch::Tensor linear(int layer, const torch::Tensor& x, bool grads_via_autograd) override;
  torch::Tensor conv(int layer, const torch::Tensor& x, bool grads_via_autograd) override;
  torch::Tensor embedding(int layer, const torch::Tensor& ids) override;
  void begin_activations(uint64_t device_budget) override;
  int64_t stash_activation(const torch::Tensor& t) override;
  torch::Tensor restore_activation(int64_t token, bool order_compute) override;
  void drop_activation(int64_t token, bool order_reuse) override;
  void set_gradient_group(c10::intrusive_ptr<c10d::ProcessGroup> group) override;
  void set_gradient_sync(bool sync) override { grad_sync_ = sync; }
  void average_gradient(int layer, torch::Tensor& grad) override;
  void share_host_store(std::shared_ptr<SharedRegion> region, bool writer, bool trainable) override;
  uint64_t host_store_digest() const override { return store_->layout_digest(); }
  bool host_store_shared(bool trainable) const override { return store_->shares(trainable); }
  void synchronize() override;
  void begin_call() override;
  void detach(const std::vector<torch::Device>& devices) override;
  bool detached() const override { return detached_; }
  void suspend() override;
  void resume() override;
  bool suspended() const override;
  EngineStats stats() const override;
  std::vector<std::string> ordering_errors() const override;
  std::vector<std::pair<StepStats, double>> step_stats() const override;
  std::string trace_json() const override;
  void watch_weight(int layer, const torch::Tensor& param) override;
  void requantize(int layer, const torch::Tensor& dense) override;
  std::string requantize_refusal(int layer, int part) override;
  torch::Tensor dequantized_weight(int layer) override;
  torch::Tensor packed_codes(int layer) override;
  std::string layer_format(int layer) const override;
  void set_grad_ready_hook(GradReadyHook hook) override;
  void set_grad_consume_hook(GradConsumeHook hook) override;
  // Setting a hook while one is set throws (one overlapped optimizer at a time).
  void check_one_hook_locked(bool setting) const;
  void wait_grad_ready() override;
  void set_unsettled_step(bool unsettled) override { gr_unsettled_.store(unsettled, std::memory_order_relaxed); }
  bool unsettled_step() const override { return gr_unsettled_.load(std::memory_order_relaxed); }
  std::pair<torch::Tensor, torch::Tensor> layer_parameters(int layer) const override;
  torch::Device compute_device() const override { return compute_device_; }
  const std::string& device_name() const override { return device_name_; }
  int num_layers() const override;
  std::string layer_name(int layer) const override;
  int64_t layer_bytes(int layer) const override;
  const EngineOptions& options() const override { return opts_; }

  // Marks the start/end of a layer computation on `s` in the timeline.
  std::shared_ptr<double> trace_begin(Stream s);
  void trace_end(Stream s, const std::shared_ptr<double>& start, const std::string& lane,
                 const std::string& name, uint64_t bytes = 0);
  // ---- used by the autograd functions ----
  // Makes the engine's CUDA device current for the calling thread (torch's way;
  // a no-op on sim) for the returned scope's lifetime. See cuda_glue.h. The entry
  // points that stream or touch the device begin here, so here a forked child is
  // refused (check_process).
  cuda_glue::DeviceScope device_scope() const {
    check_process();
    return cuda_glue::DeviceScope(cuda_index_);
  }
  // Throws in a process forked after this engine was made (Note [An engine belongs
  // to the process that made it], engine.cpp). Cheap: one atomic load.
  void check_process() const;
  struct LayerInfo;
  // Layer `i`, or an error naming the index.
  LayerInfo& layer(int i);
  const LayerInfo& layer(int i) const;
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
  // (Note [Same calls as the resident module] in ops_streamed.cpp); w/b are the
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
  // Gradient averaging over the process group (engine_distributed.cpp).
  // Averages `t` over grad_group_ in place (a device or host tensor).
  void all_reduce_mean(torch::Tensor& t);
  // Whether a gradient of layer `index` computed now is averaged at once: not
  // under no_sync(), nor when .grad already holds local sums (then marks the
  // layer average_at_end). Takes mu_.
  bool averages_now(int index);
  // Averages the parts of a plain backward's gradients (views of the scratch
  // slot, contiguous, on the compute device) over grad_group_, overlapped
  // with the rest of the backward: the gradient stream waits for the
  // collectives; call it just before push_grads(). Without mu_ (Note
  // [Averaging overlapped with the backward], engine_distributed.cpp).
  void average_before_copy(const std::vector<torch::Tensor>& parts);
  // A layer's weight and bias gradients (either may be undefined), computed
  // on the device: averaged over the process group, if any, copied into a
  // scratch slot in the parameters' dtypes and from there to the host on the
  // gradient stream (push_grads); applied to .grad when this backward ends.
  void stage_grads(int layer, const torch::Tensor& gw, const torch::Tensor& gb);
  // Whether this layer's weight gradients may be staged instead of returned
  // to autograd, eagerly (StreamedFn) or compiled (Note [Compiled weight
  // gradients are staged], ops_compiled.cpp): not for a weight another layer
  // shares (autograd sums the uses), nor for parameters with gradient hooks
  // (they fire only when autograd accumulates). ops_streamed.cpp.
  bool stages_grads(int layer) const;
  // A gradient computed on the device, as a host tensor of `dtype` (blocking),
  // for autograd; queues the end-of-backward callback as stage_grads does.
  torch::Tensor grad_to_host(const torch::Tensor& g, torch::ScalarType dtype);
  // Makes sure pending gradients are accumulated at the end of this backward.
  void ensure_backward_callback();
  // ---- the custom ops' kernels (ops_library.cpp registers them; Note
  // [Streamed layers as custom ops], ops_compiled.cpp) ----
  // A Linear's or convolution's output without an autograd node: fetch,
  // compute, release. With shape_only, the same call on stand-in weights of
  // x's device and dtype (no slot, no copy): what a fake kernel returns
  // (x may be a FakeTensor with symbolic sizes).
  // `trained`: the call was given parameters to differentiate (a compiled
  // training step), so its backward will follow (counted for the
  // gradient-ready hook).
  torch::Tensor op_forward(int layer, const torch::Tensor& x, const char* kind, bool trained, bool shape_only);
  // The gradients `mask` asks for (input, weight, bias; in that order, the
  // ones asked for only) from the output gradient and the saved input; the
  // weight's and bias's on the host in their dtypes. Fetches the weights
  // only when they are read (the input gradient, or any conv gradient). With
  // `stage`, the weight's and bias's are staged (stage_grads) and only the
  // input's is returned.
  std::vector<torch::Tensor> op_backward(int layer, const torch::Tensor& grad, const torch::Tensor& x,
                                         std::array<bool, 3> mask, bool stage, bool shape_only);
  // An embedding's lookup and its weight gradient (on the host).
  torch::Tensor op_lookup(int layer, const torch::Tensor& ids, bool shape_only);
  torch::Tensor op_lookup_backward(int layer, const torch::Tensor& grad, const torch::Tensor& ids,
                                   bool shape_only);
  // ---- activation offload (engine_activations.cpp) ----
  // While it lives, on this thread, stash_activation() leaves these tensors'
  // storages alone: a streamed layer's device weights (slot views and their
  // cast copies), which its recorded graph saves and parking frees.
  class WeightsNotActivations {
   public:
    explicit WeightsNotActivations(const DeviceParams& p);
    ~WeightsNotActivations();
    WeightsNotActivations(const WeightsNotActivations&) = delete;
    WeightsNotActivations& operator=(const WeightsNotActivations&) = delete;
  };
  // ---- gradient-ready hook (engine_grad_ready.cpp; engine.h) ----
  // A forward call of `l` that records an autograd node, outside any backward.
  void note_forward_use(LayerInfo& l);
  // After push_grads(): queues the early application of `l`'s gradients
  // when a hook is set and this backward's uses of it are complete.
  void queue_if_ready_locked(int layer_index, LayerInfo& l);
  // At the end of backward `task`: the forward uses of the layers it staged
  // count from zero again.
  void reset_forward_uses_locked(int task);
  // A call of `l` outside any backward after a backward queued layers for the
  // hook set now: refused under a consuming hook (an overlapped step), else
  // waits for the queued jobs (Note [No call between an overlapped backward
  // and its step], engine_grad_ready.cpp).
  void check_no_step_in_flight(const LayerInfo& l);
  // Stops the hook's thread (destructor).
  void stop_grad_ready();
  uint64_t id() const override { return id_; }
  std::string op_spec(int layer) const override;  // ops_spec.cpp
  // Raises unless `spec` names this layer's layout (Note [An operator call
  // names its layer's layout]); where the gradients go may be either.
  void check_op_spec(int layer, std::string_view spec) const;
  // Whether a Linear's or convolution's `spec` (op_spec) was traced to
  // return its weight gradients to autograd rather than stage them.
  static bool grads_to_autograd(std::string_view spec);
  static std::shared_ptr<EngineImpl> lookup(uint64_t id);

  // Note [Layer kinds]: what a layer is decides how it is fetched and
  // computed, one alternative of LayerInfo::kind each. Whether a weight is
  // packed is not a kind: it is the weight's format (qformat), which a
  // Linear, a conv and a group's tensors alike may have.
  struct LinearKind {};
  struct ConvKind {
    ConvSpec spec;
  };
  // add_embedding(): looked up in host memory, never in a slot.
  struct TableKind {
    Event last_read;                // after the newest lookup on the device
    void* w_host_mapped = nullptr;  // the store's device mapping (nullptr: none)
    int64_t padding_idx = -1;       // as nn.Embedding (its row gets no gradient)
    bool scale_grad_by_freq = false, sparse = false;  // as nn.Embedding
  };
  // Where a coded piece lies in a buffer of pieces (lossless::analyze_pieces).
  struct CodedPiece {
    size_t offset = 0, bytes = 0;
  };
  // A trainable tensor that crosses the bus lossless-coded (quantize=
  // "lossless" on a weight or a group tensor that requires grad; Note
  // [Trainable coded weights] in engine_coded.cpp). The parameter stays dense
  // in the host store, where backward and the optimizer write it (the layer
  // or part is a dense one, qformat None); `buffer` (a store entry of
  // `capacity` = lossless::max_encoded_bytes, or max_pieces_bytes, so any
  // values fit) holds its coded copy, remade before the next copy once the
  // parameter changed. Shared by the scheduler's hooks and the post-copy
  // step, which may run on another thread than the one holding the engine's
  // lock: `mu` guards the fields.
  struct CodedWeight {
    std::mutex mu;
    size_t index = 0;  // host store index of the coded buffer
    void* buffer = nullptr;
    size_t capacity = 0;
    lossless::Header header;  // of the bytes in `buffer` (a weight: one piece)
    // A group tensor (piece_count >= 1): coded in pieces, one per expert when
    // by expert, back to back from the buffer's start; `pieces` and their
    // shared layout are the current coding's (their offsets move when it is
    // remade).
    int64_t piece_count = 0;
    std::vector<CodedPiece> pieces;
    lossless::Layout piece_layout;
    bool coded = false;       // `buffer` holds a coding (the first is made before the first copy)
    uint32_t version = 0;     // the parameter's version counter when coded
    uint64_t sample = 0;      // lossless::sample_fingerprint() of the dense bytes when coded
    bool announced = false;   // the current scheduler was told the coded size
    bool forced = false;      // synchronize(): re-code before the next copy whatever the checks say
    size_t coded_bytes() const {  // up to the end of the current coding
      if (!piece_count) return header.layout.total_bytes();
      return pieces.empty() ? 0 : pieces.back().offset + pieces.back().bytes;
    }
  };

  // add_group(): all its tensors are `parts` (the layer's `weight` and `bias`
  // stay undefined); fetched whole into one slot by fetch(), computed by the
  // caller. A quantized part crosses the bus packed and is dequantized into
  // the slot's workspace at `ws_offset` (after the copied parts).
  struct GroupPart {
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
    // Lossless (qformat Lossless): the host bytes are coded pieces
    // (lossless::analyze_pieces), one per expert when by_expert, else one;
    // piece k decodes to elements [k * numel / count, (k + 1) * numel / count).
    // All share `piece_layout` (taken from the analysis: in a store the node's
    // ranks share, the bytes are not read before the final all-gather).
    using Piece = CodedPiece;  // in the part's buffer
    std::vector<Piece> pieces;
    lossless::Layout piece_layout;
    // A trainable tensor coded on the bus (qformat None: `param`, `host`,
    // `index` and `bytes` are its dense copy's): copied from coded->buffer,
    // decoded into the workspace at `ws_offset`.
    std::shared_ptr<CodedWeight> coded;
  };
  struct GroupKind {
    std::vector<GroupPart> parts;
    int64_t experts = 0;        // add_group(experts): dim 0 of the expert-indexed parts
    size_t workspace_bytes = 0; // the dequantized parts, in the workspace
  };

  struct LayerInfo {
    std::string name;
    std::variant<LinearKind, ConvKind, TableKind, GroupKind> kind;
    using Part = GroupPart;
    bool is_conv() const { return std::holds_alternative<ConvKind>(kind); }
    bool is_table() const { return std::holds_alternative<TableKind>(kind); }
    bool is_group() const { return std::holds_alternative<GroupKind>(kind); }
    const ConvSpec& conv() const { return std::get<ConvKind>(kind).spec; }
    TableKind& table() { return std::get<TableKind>(kind); }
    const TableKind& table() const { return std::get<TableKind>(kind); }
    GroupKind& group() { return std::get<GroupKind>(kind); }
    const GroupKind& group() const { return std::get<GroupKind>(kind); }
    // A group's parts; none for the other kinds.
    const std::vector<GroupPart>& parts() const {
      static const std::vector<GroupPart> none;
      return is_group() ? group().parts : none;
    }
    // Tied weights: the weight (its host copy, w_index/w_host) is also
    // another layer's; its gradients go through autograd (see add_linear).
    bool shared_weight = false;
    torch::Tensor weight;  // the parameter (data aliases the host store); a meta stand-in if quantized
    torch::Tensor bias;    // may be undefined
    std::vector<int64_t> w_shape, b_shape;
    // A dense or lossless-coded weight's strides when they are not the
    // row-major ones (channels_last, transposed): kept in the host store (a
    // coded one codes its bytes in that order), the slot and on the device.
    // Empty: row-major (always for the other quantized formats).
    std::vector<int64_t> w_strides;
    // op_layout(), built at its first call: nothing it names changes after add_*().
    mutable std::string spec;
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
    // Trainable and lossless-coded on the bus (engine_coded.cpp); null otherwise.
    std::shared_ptr<CodedWeight> coded;
    // The disk tier (add_linear_on_disk): the weight (and bias) read from
    // their file on every use; the weight is then a meta stand-in.
    std::optional<FileRange> w_file, b_file;
    // w_file's checksum (a quantization cache file's weight): checked at its
    // first read, shared by every schedule's staged parts.
    std::shared_ptr<ReadCheck> w_check;
    bool on_disk() const { return w_file.has_value(); }
    // watch_weight(): the module parameter's version counter and its value then.
    std::optional<c10::VariableVersion> watched;
    // ...and the parameter itself, weakly (the engine must not keep a dense
    // weight alive): a quantized weight is frozen, so requires_grad set on it
    // later is refused at the next call (C++; Python's _PackedWeight refuses it
    // at once).
    c10::weak_intrusive_ptr<c10::TensorImpl> watched_param{c10::intrusive_ptr<c10::TensorImpl>()};
    uint32_t watched_version = 0;
    // The watched parameter when C++ code holds it as a plain tensor (not
    // Python's stand-in, which Python keeps and restores): requantize() writes
    // the new values into it, and detach() fills it from the packed copy when
    // it was freed (Note [The dense parameter of a quantized layer],
    // engine_register.cpp). Undefined otherwise.
    torch::Tensor plain_dense_param() const;
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
      // A consuming gradient-ready hook's job will take it
      // (engine_grad_ready.cpp): the end of backward leaves it to the job.
      bool claimed = false;
    };
    std::vector<StagedUse> pending;
    // Gradient averaging (engine_distributed.cpp): .grad holds gradients of
    // no_sync() backwards (local sums); averaged whole at the end of the next
    // synchronised backward (average_at_end).
    bool grad_local = false;
    bool average_at_end = false;
    // Gradient-ready hook (engine_grad_ready.cpp): forward calls with an
    // autograd node since the backward that last staged this layer's
    // gradients ended, and that backward's graph task.
    int forward_uses = 0;
    int last_grad_task = INT_MIN;
    // The last graph task whose staged uses of this layer discard_task()
    // dropped: a hook job of that task finds no gradient and is skipped.
    int dropped_task = INT_MIN;
  };

 private:
  explicit EngineImpl(const EngineOptions& options);
  friend std::shared_ptr<Engine> Engine::create(const EngineOptions&);
  int add_layer(LayerInfo info, quant::Format format);
  int register_layer_locked(LayerInfo info);
  // Tied weights: when `info.weight` is already streamed by another layer,
  // points `info` at that layer's host copy and returns true (false: not
  // shared; the caller adopts it). Refuses shared biases and quantizing a
  // shared weight (`format`), naming both layers.
  bool share_weight_locked(LayerInfo& info, quant::Format format);
  void build_scheduler_locked();
  // Quiesces and drops the scheduler (its slot arena), carrying its counters
  // and per-step history over (the step under way ends); the next
  // ensure_scheduler() builds a new one. `trace`: receives its fetch order.
  void retire_scheduler_locked(std::vector<int>* trace = nullptr, std::vector<bool>* trace_forward = nullptr);
  // The host tier (engine_host_tier.cpp): fills `s.staged` (and size-only
  // parts) when the layer is on disk or a part of it is pageable in the store.
  void staged_sources_locked(const LayerInfo& l, LayerSpec& s);
  // The file `r` names, opened once and kept while the engine lives (the disk
  // tier reads it on every use); open_file_locked(): the one already kept, or null.
  std::shared_ptr<SourceFile> file_locked(const FileRange& r);
  std::shared_ptr<SourceFile> open_file_locked(const FileRange& r) const;
  // Host bytes the staging entries need at least (0: no layer is staged).
  uint64_t staging_needed_locked(const std::vector<LayerSpec>& specs) const;
  void ensure_scheduler();
  void check_host_alias(const LayerInfo& l) const;
  // What op_spec() names of `l`'s layout (ops_spec.cpp); mu_ held.
  const std::string& op_layout(const LayerInfo& l) const;
  // Adds the staged uses of `l` that `task` may apply (its own and those of
  // no graph task; every use for kAnyTask) to .grad; the others stay staged.
  static constexpr int kAnyTask = INT_MIN;
  void accumulate_locked(LayerInfo& l, int task);
  // The consuming gradient-ready hook (engine_grad_ready.cpp): when `task`'s
  // staged gradient of `l` is a single use and its parameters are
  // contiguous, hands it over instead of adding it to .grad: views of its
  // staging buffer in *landed, the buffer itself moved to *held (out of
  // reuse until return_staging_locked), the use dropped. False: nothing taken.
  bool take_staged_locked(LayerInfo& l, int task, LandedGradients* landed, HostBuffer* held);
  // Whether a consuming hook may take `l`'s staged gradients (its
  // parameters are contiguous: the staging buffer has their layout).
  static bool consumable(const LayerInfo& l);
  void return_staging_locked(LayerInfo& l, HostBuffer held);
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
  // refuses tracing and a call while an overlapped step runs, and checks that layer `index` is of `kind` ("a Linear",
  // "a convolution", "an embedding").
  LayerInfo& call_layer(int index, const char* kind);
  // Refuses a call inside a CUDA graph capture, naming `l` (ops_streamed.cpp).
  void check_not_capturing(const LayerInfo& l) const;
  // Refuses ids that are not integers on the compute device, naming `l`.
  void check_ids(const LayerInfo& l, const torch::Tensor& ids) const;
  // Waits until no embedding lookup enqueued so far still reads the host store.
  void wait_lookups_locked();
  size_t grad_bytes(const LayerInfo& l) const;
  // Bytes of the weight as the workspace holds it (dequantized, or cast to
  // compute_dtype).
  static size_t dense_weight_bytes(const LayerInfo& l);
  // The layer's parts in a slot (core/slot_layout.h); workspace_bytes 0: no
  // post-copy step.
  static slot_layout::Layout layout_of(const LayerInfo& l);
  PostCopyFn make_post_copy(const LayerInfo& l, size_t workspace_part);
  // Trainable coded weights (engine_coded.cpp): codes `info`'s adopted dense
  // weight into a new store entry; the scheduler's hooks.
  void make_coded_locked(LayerInfo& info);
  bool coded_stale(int layer) const;
  void refresh_coded(int layer, std::vector<size_t>& copy_bytes);
  // After `layer`'s gradient-ready hook (an optimizer step during the
  // backward): re-codes its weight now if the hook changed it (Note
  // [Trainable coded weights], "Ahead"). Takes mu_ (and the scheduler's lock)
  // briefly, then codes holding only CodedWeight::mu.
  void recode_ahead(int layer);
  // Blocks until the copies of `layer` issued so far have read its host
  // weights, unless cache_across_steps (engine_grad_ready.cpp). Takes mu_.
  void wait_copies_before_host_write(int layer);
  // The sim device's checker: declares host writes of `l`'s trainable weights
  // (what an optimizer step does), so a copy still reading them is an
  // ordering error. Not with cache_across_steps (copies are checked by
  // version there) nor for tables. `when` ends the message. Holds mu_.
  void declare_weight_writes_locked(const LayerInfo& l, const std::string& when);
  // A trainable coded tensor of a layer: its weight, or a group tensor
  // (`part` its index; 0 for a weight).
  struct CodedTensor {
    const torch::Tensor& param;
    const void* host;  // the dense copy
    size_t part;
    CodedWeight& c;
  };
  // Calls f for each of l's trainable coded tensors.
  static void for_each_coded(const LayerInfo& l, const std::function<void(const CodedTensor&)>& f);
  // Codes t into t.c unless it holds its current coding (the caller holds
  // t.c.mu); true if it coded.
  bool code_if_changed(const std::string& name, const CodedTensor& t);
  // Before a routed fetch of group `layer` (engine_groups.cpp): its coded
  // tensors whose values changed are re-coded once the copies that read
  // their old bytes are done (whole copies re-code in refresh_coded). Takes
  // the scheduler's lock briefly, then CodedWeight::mu.
  void recode_for_fetch(int layer);
  // synchronize(): every trainable coded tensor is re-coded before its next
  // copy (a write through `.data` to a few elements escapes the sample).
  void force_recode_locked();
  // Note [Writes through .data between steps] (engine.cpp): one layer's
  // sampled host bytes (`sources`), their fingerprint at the last look, and
  // how many looks found it changed (folded into the content version).
  struct DataSample {
    std::vector<std::pair<const void*, size_t>> sources;
    uint64_t print = 0, writes = 0;
    void look();
  };
  // A DataSample per layer, looked at once (cache_across_steps).
  std::vector<DataSample> data_samples_locked() const;
  // synchronize() without that: gradients drained, every copy done, cached
  // slots forgotten (suspend(), detach() and the engine's own host writes).
  void wait_all_locked();
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
  uint64_t forks_at_creation_;  // the process's fork count when this engine was made (check_process)
  std::string device_name_;
  torch::Device compute_device_{torch::kCPU};
  int cuda_index_ = -1;  // compute_device_'s index on CUDA, -1 on sim
  std::shared_ptr<Backend> backend_;
  std::shared_ptr<HostStore> store_;
  std::shared_ptr<void> keepalive_;  // held by parameters' data: store + backend
  Stream transfer_, grad_stream_, dequant_stream_, inline_compute_;
  std::map<void*, Stream> wrapped_streams_;
  std::map<std::string, std::shared_ptr<SourceFile>> files_;  // the disk tier's, by path (file_locked)

  mutable std::recursive_mutex mu_;
  std::vector<std::unique_ptr<LayerInfo>> layers_;
  std::unique_ptr<Scheduler> sched_;
  std::vector<int> pending_;  // layers with gradients in flight
  std::vector<int> callback_tasks_;  // graph tasks whose end-of-backward callback is queued
  uint64_t failed_backwards_ = 0;      // backwards whose staged gradients were dropped
  // Gradient averaging (engine_distributed.cpp).
  struct GradientGroup;  // the process group, held where its header is included
  std::shared_ptr<GradientGroup> grad_group_;
  std::atomic<bool> grad_sync_{true};
  std::atomic<uint64_t> averaged_bytes_{0};
  // End of a backward: averages the .grad of layers marked average_at_end.
  void average_local_grads_locked();
  std::atomic<bool> failed_backward_unreported_{false};  // warned at the next linear()/conv()
  uint64_t d2h_bytes_ = 0;
  std::map<int64_t, Lease> fetched_;  // fetch() tokens not yet released
  int64_t next_token_ = 1;
  std::atomic<uint64_t> gathered_bytes_{0};  // embedding rows read from the host store
  std::atomic<uint64_t> routed_fetches_{0};  // group fetches that copied some experts only
  std::atomic<bool> cast_warned_{false};
  bool detached_ = false;
  std::shared_ptr<TraceRecorder> tracer_;
  // counters and completed steps carried over scheduler rebuilds
  SchedulerStats carried_;
  std::deque<StepStats> carried_steps_;
  // suspend(): no scheduler until resume(), which replays this fetch order.
  bool suspended_ = false;
  std::vector<int> suspended_trace_;
  std::vector<bool> suspended_trace_forward_;  // its entries' phases (Scheduler::trace_forward)
  // register_storages() / unpark() / park(): per layer.
  struct ParkedStorage {
    int role;                 // 0 weight leaf, 1 its cast, 2 bias leaf, 3 its cast
    torch::ScalarType dtype;  // the activations' (device_params)
    c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  };
  std::map<int, std::vector<ParkedStorage>> parked_;
  std::map<int, std::vector<std::pair<torch::ScalarType, DeviceParams>>> active_;
  // Activation offload (engine_activations.cpp): one entry per token.
  using Stashed = StashedActivation;
  // The primary entries, by the storage their tensor's data is in (which each
  // entry's `storage` keeps allocated: no other storage can take its address).
  std::unordered_multimap<const c10::StorageImpl*, int64_t> saved_by_storage_;
  // Whether `s` (a primary) holds `t` as it is now: the same data (storage,
  // address, sizes, strides, dtype), not written since it was saved.
  static bool holds_unchanged(const Stashed& s, const torch::Tensor& t);
  // An entry and its alias resolved: the primary, and its token.
  std::pair<Stashed*, int64_t> primary_of(std::map<int64_t, Stashed>::iterator it);
  // Queues release_unserved_locked(task) at the end of graph task `task`
  // (once per task).
  void release_at_end_of_locked(int task);
  // Releases the device tensors whose copy to the host has finished.
  void release_copied_locked();
  // Note [Saved tensors are let go after the lock]: a saved activation's
  // tensor is never destroyed under mu_. let_go_locked() moves it to a list
  // of this thread's; a LetGoAfterUnlock, declared before the lock_guard of a
  // public entry point, destroys that list once the thread's outermost such
  // entry point has released mu_.
  static void let_go_locked(torch::Tensor& t);
  struct LetGoAfterUnlock {
    LetGoAfterUnlock();
    ~LetGoAfterUnlock();
    LetGoAfterUnlock(const LetGoAfterUnlock&) = delete;
    LetGoAfterUnlock& operator=(const LetGoAfterUnlock&) = delete;
  };
  // Starts copying a kept entry to the host (it leaves the device budget's
  // window); false when the host cap leaves no room (it stays kept).
  bool offload_locked(int64_t token, Stashed& s);
  // Starts copying `s` back on the transfer stream (into s.restored).
  void copy_back_locked(Stashed& s);
  // Note [Copies back that no backward reads]: at the end of graph task
  // `task`, the entries its prefetch copied back and it did not hand out
  // free their device copies (host-only again). act_callback_task_: the task
  // that has the callback queued.
  void release_unserved_locked(int task);
  int act_callback_task_ = -1;
  // On a GPU, an entry whose copy to the host has not finished still holds its
  // tensor (memory not torch's allocator's): restore hands that back as it is,
  // and prefetch skips it. The sim copies it back, as a GPU must for the
  // allocator's memory, so that its checker sees that order (restore_activation).
  bool kept_until_copied(const Stashed& s) const { return s.device.defined() && cuda_index_ >= 0; }
  void note_activation_bytes_locked(int64_t delta);
  // Copies back handed to autograd, counted in the activation bytes while their
  // storage lives (autograd lets go once the node ran, or when the graph is
  // freed; a retain_graph backward restores again: one entry per restore).
  struct HandedOut {
    int64_t token;
    c10::weak_intrusive_ptr<c10::StorageImpl> storage;
    uint64_t bytes;
  };
  std::deque<HandedOut> handed_out_;
  // Drops the entries whose storage is gone (their bytes leave the count); with
  // `token`, that entry's live ones too (its graph was freed). Returns the live
  // bytes of `token` it dropped.
  uint64_t prune_handed_out_locked(int64_t token = -1);
  std::map<int64_t, Stashed> stashed_;
  std::deque<int64_t> awaiting_copy_;  // offloaded tokens still holding their device tensor
  // Copies to the host not seen finished (an event after each, its bytes),
  // oldest first, and the largest tensor offloaded: Note [Copies in flight].
  std::deque<std::pair<Event, uint64_t>> in_flight_;
  uint64_t in_flight_bytes_ = 0, act_largest_ = 0;
  // Drops the finished copies from in_flight_; while more than the cap is in
  // flight, moves out the oldest copies' events, the newest of them into
  // *wait, which the caller waits for once it let go of the lock.
  void limit_in_flight_locked(Event* wait);
  // stash_activation() under the lock; *wait: limit_in_flight_locked's.
  int64_t stash_locked(const torch::Tensor& t, Event* wait);
  std::deque<int64_t> window_;         // kept tokens within the device budget, oldest first
  // Free host copies, by allocated size (Note [The activation host pool]), and their bytes.
  std::multimap<size_t, std::pair<HostBuffer, Event>> host_pool_;
  uint64_t pool_bytes_ = 0;
  uint64_t act_host_peak_in_use_ = 0;  // the most host copy bytes ever in use at once
  // A host copy's allocated size: `bytes` rounded up to its size class.
  static size_t host_class_bytes(size_t bytes);
  // Frees pooled buffers (largest first) while a new one of `need` bytes would
  // pass the host cap or twice the peak in use.
  void evict_host_pool_locked(uint64_t need);
  Stream act_stream_;                  // device-to-host copies of activations
  int64_t next_stash_ = 1;
  uint64_t act_budget_ = 0, act_kept_ = 0;  // act_kept_: bytes of the window's entries
  uint64_t act_host_bytes_ = 0, act_pinned_bytes_ = 0;  // host buffers allocated (pooled or in use)
  // Gradient staging buffers beyond one per layer (a layer used more than once
  // in a backward): they take what the host budget leaves, with the saved
  // activations' buffers (EngineOptions::activation_host_cap).
  uint64_t grad_extra_bytes_ = 0;
  // The gradients' staging buffers allocated (engine_gradients.cpp), by kind.
  uint64_t grad_pinned_bytes_ = 0, grad_pageable_bytes_ = 0;
  std::atomic<uint64_t> recoded_bytes_{0};  // dense bytes re-coded (engine_coded.cpp)
  std::atomic<uint64_t> recode_ns_{0};
  uint64_t act_d2h_bytes_ = 0, act_h2d_bytes_ = 0;
  int64_t act_device_bytes_ = 0, act_peak_device_bytes_ = 0;
  // Gradient-ready hook (engine_grad_ready.cpp): its thread, queue of
  // (layer, graph task, copy done), and the first exception a hook threw.
  void grad_ready_loop();
  std::mutex gr_mu_;
  std::condition_variable gr_cv_, gr_idle_cv_;
  GradConsumeHook gr_hook_;
  bool gr_consume_ = false;  // gr_hook_ takes single-use layers' staged gradients
  std::atomic<bool> gr_unsettled_{false};  // set_unsettled_step()
  std::thread gr_thread_;
  struct GradReadyJob {
    int layer = -1, task = -1;
    std::shared_ptr<Event> done;  // after the layer's copy on the gradient stream
    GradConsumeHook hook;         // the hook set when the job was queued
    bool consume = false;
  };
  std::deque<GradReadyJob> gr_queue_;
  bool gr_busy_ = false, gr_stop_ = false;
  std::exception_ptr gr_error_;
  // Jobs queued for the hook set now (0 again when a hook is set or cleared):
  // read without gr_mu_ by check_no_step_in_flight().
  std::atomic<uint64_t> gr_jobs_{0};
};

// ---- helpers the engine's files share ----
inline int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

inline bool is_float_activation(torch::ScalarType t) {
  return t == torch::kFloat || t == torch::kBFloat16 || t == torch::kHalf;
}

inline std::string shape_str(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

inline quant::SrcDtype src_dtype_of(torch::ScalarType t, const std::string& name) {
  switch (t) {
    case torch::kFloat: return quant::SrcDtype::F32;
    case torch::kBFloat16: return quant::SrcDtype::BF16;
    case torch::kHalf: return quant::SrcDtype::F16;
    default:
      LS_FAIL("layer '", name, "': only float32/bfloat16/float16 weights can be quantized, got ", dtype_name(t));
  }
}

inline std::optional<torch::ScalarType> scalar_type_of(std::optional<quant::OutDtype> d) {
  if (!d) return std::nullopt;
  switch (*d) {
    case quant::OutDtype::F32: return torch::kFloat;
    case quant::OutDtype::BF16: return torch::kBFloat16;
    case quant::OutDtype::F16: return torch::kHalf;
  }
  return std::nullopt;
}

inline quant::OutDtype out_dtype_of(torch::ScalarType t) {
  switch (t) {
    case torch::kFloat: return quant::OutDtype::F32;
    case torch::kBFloat16: return quant::OutDtype::BF16;
    case torch::kHalf: return quant::OutDtype::F16;
    default: LS_FAIL("cannot dequantize to ", t);
  }
}

// A data-less stand-in (meta tensor) with the weight's shape and dtype: the
// engine must not keep the dense weight alive once it is packed.
inline torch::Tensor meta_like(const std::vector<int64_t>& shape, torch::ScalarType dtype) {
  return torch::empty(shape, torch::TensorOptions().dtype(dtype).device(torch::kMeta));
}

// Moves a parameter's data into the host store; the parameter's data becomes
// a CPU tensor over the store's memory (kept alive by the tensor's deleter).
// A dense, non-overlapping layout other than the contiguous one (a
// channels_last conv weight, a transposed Linear weight) is kept: the store
// holds the bytes in that memory order and `strides` receives them (empty:
// contiguous), so the device copy computes exactly as the original did.
// (engine_register.cpp)
void* adopt(HostStore& store, const std::shared_ptr<void>& keep, torch::Tensor& param,
            const std::string& name, size_t* index, size_t* bytes, std::vector<int64_t>* strides = nullptr);

// ---- shared by the autograd functions (ops_*.cpp; defined in ops_streamed.cpp unless said) ----
// The engine a graph's node belongs to (saved by id: the graph may outlive it).
std::shared_ptr<EngineImpl> engine_from(torch::autograd::AutogradContext* ctx);
// Refuses backward(create_graph=True) through a streamed layer.
void check_no_create_graph(const EngineImpl::LayerInfo& l);
// ctx->get_saved_variables(), naming the layer when a saved tensor was
// modified in place.
torch::autograd::variable_list saved_variables_of(torch::autograd::AutogradContext* ctx,
                                                  const EngineImpl::LayerInfo& l);
// Defined in ops_library.cpp, which registers the layerstream:: operators:
// Engine::create() calls it so that the linker keeps that file.
void ops_library_linked();
// requantize()/requantize_part() into the host store a node's ranks share:
// shared_write_refusal (engine.h) of `what` ("the quantized weight of ...").
std::string shared_requantize_refusal(const std::string& what);
// Under torch.autocast for `device`, a float input cast to the autocast
// dtype, as autocast casts Linear/conv inputs; else x itself.
torch::Tensor autocast_input(const torch::Tensor& x, c10::DeviceType device);
// Refuses an input on another device or of a non-float dtype, naming the layer.
void check_input(EngineImpl& e, const EngineImpl::LayerInfo& l, const torch::Tensor& x);
// Refuses a conv input of the wrong rank (neither batched nor unbatched).
void check_conv_input(const EngineImpl::LayerInfo& l, const torch::Tensor& x);
// "a Linear", "a convolution", "an embedding" or "a tensor group".
const char* kind_of(const EngineImpl::LayerInfo& l);
// Whether the running backward is a plain loss.backward() (no exec_info:
// autograd accumulates every leaf's .grad), not torch.autograd.grad /
// backward(inputs=...).
bool plain_backward();
// Under torch.autograd.grad / backward(inputs=...): whether leaf p's gradient
// was asked for (in a plain backward every leaf's is).
bool asked_for(const torch::Tensor& p);
// Whether p holds gradient hooks (register_hook, register_post_accumulate_grad_hook;
// a hook object emptied by removing its hooks holds none: set_grad_hook_probe, engine.h).
bool has_grad_hooks(const torch::Tensor& p);
// The resident module's own call on weights w, b (Note [Same calls as the
// resident module], ops_streamed.cpp).
torch::Tensor layer_op(const EngineImpl::LayerInfo& l, const torch::Tensor& x, const torch::Tensor& w,
                       const torch::Tensor& b);
// The layer's computation without an autograd node of its own: fetch,
// compute under the caller's grad mode, release (compute stream).
torch::Tensor streamed_forward(EngineImpl* e, EngineImpl::LayerInfo& l, int layer, const torch::Tensor& x);

// A slot held for the compute stream `cs`, released when this goes out of
// scope: after the work that reads it was enqueued, or when that work threw.
class SlotLease {
 public:
  SlotLease(Scheduler& sched, Lease lease, Stream cs) : sched_(sched), lease_(std::move(lease)), cs_(cs) {}
  SlotLease(const SlotLease&) = delete;
  SlotLease& operator=(const SlotLease&) = delete;
  ~SlotLease() {
    try {
      sched_.release(lease_, cs_);
    } catch (const std::exception& err) {  // a destructor must not throw; nothing can be undone here
      warn(std::string("layerstream: releasing a slot failed: ") + err.what());
    }
  }
  const Lease& get() const { return lease_; }

 private:
  Scheduler& sched_;
  Lease lease_;
  Stream cs_;
};

}  // namespace layerstream
