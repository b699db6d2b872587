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
// resident module] in ops_streamed.cpp). Weight/bias gradients are copied into a
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
// the Python thread; its methods are internally synchronised. Processes: an
// Engine belongs to the process that created it; in a child forked after that,
// every method that streams throws (its threads and device memory stayed in
// the parent) and the Engine is never destroyed there. Ownership: the
// Engine is shared (std::shared_ptr); parameters keep the host memory alive
// even after the Engine is gone.
#pragma once

#include <torch/torch.h>
#include <torch/csrc/autograd/function_hook.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/io/source_file.h"  // FileIdentity
#include "core/quant.h"
#include "core/scheduler.h"  // StepStats
#include "core/shared_region.h"

namespace c10d {
class ProcessGroup;  // torch.distributed's (torch/csrc/distributed/c10d/ProcessGroup.hpp)
}  // namespace c10d

namespace layerstream {

struct EngineOptions {
  // "auto" (CUDA when LibTorch sees a GPU, else the sim device), "sim",
  // "cuda" or "cuda:N".
  std::string device = "auto";
  // Hard bound on the device bytes of the slot arena; -1 = no bound (then
  // `slots` or prefetch + 1 slots are used).
  int64_t budget_bytes = -1;
  int prefetch = 2;  // layers kept in flight ahead of use
  int slots = 0;     // 0 = prefetch + 1 (at least 2), capped by the budget (options::default_slots)
  // Simulated link (sim device only): PCIe 4.0 x16-like defaults.
  double sim_h2d_gbps = 25.0;
  double sim_d2h_gbps = 25.0;
  double sim_latency_us = 5.0;
  bool checker = true;                  // sim device: ordering checker on
  bool abort_on_ordering_error = false; // sim device: throw at the racy access
  bool pin_memory = true;
  // Keep slot content and prefetch across step boundaries, trusting the
  // parameters' version counters to detect weight updates, and, when a step
  // begins, a sample of each layer's host bytes (bulk writes through `.data`,
  // e.g. a LoRA merge: Note [Writes through .data between steps] in
  // torch/engine.cpp). A `.data` write to a few elements, or one within a
  // step, is not detected (synchronize() after it), so this is opt-in; safe
  // for inference loops and for optimizers that update parameters in place.
  // Default: content is dropped and prefetching stops at each step
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
  // use (as without this option), so a dense weight's results never depend
  // on it. A quantized weight's do: it is dequantized to this dtype whatever
  // the activations' (bfloat16 weights cast up for float32 activations are
  // rounded through bfloat16).
  std::string compute_dtype;
  // Activation offload: saved tensors smaller than this stay on the device
  // (a copy that small is mostly latency).
  int64_t activation_min_bytes = 64 << 10;
  // Host memory the saved activations' buffers may take (-1: no cap), and how
  // much of it may be pinned (-1: no cap). offload() sets both to what the
  // host and pinned budgets leave after the store and the staging entries
  // (core/host_tier.h Plan::spare_host_bytes); the gradient staging buffers
  // of a layer used more than once in a backward (beyond the one per layer
  // the plan counts) take from the first too. Beyond the first cap a saved
  // tensor stays on the device (an extra gradient buffer is still made, with
  // a warning saying by how much host_budget is exceeded); beyond the second
  // its buffer is pageable (each with one warning).
  int64_t activation_host_cap = -1;
  int64_t activation_pinned_cap = -1;
  // Pinned bytes the gradients' host staging buffers may take (-1: no cap;
  // offload() sets core/host_tier.h Plan::grad_pinned_cap). Buffers beyond it
  // are pageable (one warning): their device-to-host copies still land
  // before the gradient is read, but on CUDA they block the thread that
  // issues them (the backward's) instead of running beside it.
  int64_t grad_staging_pinned_cap = -1;
  // The host tier (core/host_tier.h plans these; docs/design/host-tier.md).
  // Pinned bytes the host store may take (-1: no cap); tensors beyond it are
  // pageable and cross through the pinned staging entries.
  int64_t store_pinned_cap = -1;
  // Host bytes of the staging entries that layers on disk (add_linear_on_disk)
  // and pageable store tensors are read into before each copy; 0: what they
  // need at least (prefetch + 2 of the largest such layer, or all disk layers).
  int64_t staging_bytes = 0;
  bool staging_pinned = true;
  int reader_threads = 4;  // threads reading one layer from disk
};

// A byte range of a file holding a tensor as the device uses it (e.g. a
// tensor of a .safetensors file): the disk tier reads it on every use.
struct FileRange {
  std::string path;
  uint64_t offset = 0;
  uint64_t bytes = 0;
  std::string tensor;  // its name, for error messages
  // The file as its header was read (read_checkpoint; not recorded: as the
  // engine first opens it): every read checks that the file is still that one.
  FileIdentity identity;
  SourceFile::Kind kind = SourceFile::Kind::Checkpoint;  // whose file it is (what errors advise)
  // The bytes' checksum64 (core/io/checksum.h) when layerstream wrote them (a
  // quantization cache file): the disk tier checks it at the range's first read.
  std::optional<uint64_t> checksum;
};

// Counters since the engine was made (Engine::stats(): a snapshot).
struct EngineStats {
  uint64_t steps = 0, acquires = 0, hits = 0, misses = 0;
  uint64_t deviations = 0, retraces = 0;  // the traced fetch order was not followed / re-recorded
  // Backward passes that raised after staging weight gradients, which were
  // dropped (never added to .grad).
  uint64_t failed_backwards = 0;
  uint64_t h2d_bytes = 0;       // host to device, embedding rows included
  uint64_t gathered_bytes = 0;  // embedding rows read from the host store
  uint64_t d2h_bytes = 0;
  double stall_seconds = 0;     // host time the compute stream waited for weights
  // The streaming slots now (0 until the first call builds them, and while
  // suspended), and the most slots held at once since the engine was made.
  uint64_t slots = 0, slot_bytes = 0, max_slots_held = 0;
  int64_t budget_bytes = -1;    // EngineOptions::budget_bytes
  uint64_t layers = 0, quantized_layers = 0, embedding_layers = 0, group_layers = 0;
  uint64_t routed_fetches = 0;  // group fetches that copied some experts only
  uint64_t pinned_bytes = 0, pageable_bytes = 0;  // the host store
  uint64_t shared_bytes = 0;  // of those, in a region shared with this node's other processes
  uint64_t averaged_bytes = 0;  // gradient bytes all-reduced over the process group (set_gradient_group)
  uint64_t peak_device_bytes = 0;
  uint64_t device_bytes = 0;  // the engine's device memory now (0 while suspended)
  uint64_t ordering_errors = 0;  // sim device: races the checker found
  // The host tier: layers read from their files on every use (disk tier),
  // bytes read from files and from pageable memory into the staging entries,
  // copies served by an entry that already held the layer, the entries.
  uint64_t disk_layers = 0, disk_read_bytes = 0, staged_read_bytes = 0, staging_hits = 0;
  uint64_t staging_entries = 0, staging_entry_bytes = 0;
  // Activation offload (stash_activation): bytes copied to the host and
  // back, and the saved-activation bytes on the device that the engine
  // accounts for (kept, in flight to the host, or copied back and not yet
  // released by autograd): now and at the peak.
  uint64_t activation_d2h_bytes = 0, activation_h2d_bytes = 0;
  uint64_t activation_device_bytes = 0, peak_activation_device_bytes = 0;
  // Host bytes of the saved activations' buffers (in use and pooled).
  uint64_t activation_host_bytes = 0;
  // Host bytes of the gradients' staging buffers, pinned and pageable.
  uint64_t grad_staging_pinned_bytes = 0, grad_staging_pageable_bytes = 0;
  // Trainable weights that cross the bus lossless-coded, the dense bytes
  // re-coded after they changed, and the host time that took (on the
  // gradient-ready hook's thread after a step there, else on the thread that
  // issued their copies).
  uint64_t coded_layers = 0, recoded_bytes = 0;
  double recode_seconds = 0;
  // Timeline slices not recorded since the trace reached its capacity (1M
  // slices: trace=True's memory bound); the per-step overlap_fraction of later
  // steps is NaN.
  uint64_t trace_dropped_slices = 0;

  // Calls f(name, value) for every field, in the order above (bindings,
  // printing).
  template <class F>
  void for_each(F&& f) const {
    f("steps", steps), f("acquires", acquires), f("hits", hits), f("misses", misses);
    f("deviations", deviations), f("retraces", retraces), f("failed_backwards", failed_backwards);
    f("h2d_bytes", h2d_bytes), f("gathered_bytes", gathered_bytes), f("d2h_bytes", d2h_bytes);
    f("stall_seconds", stall_seconds), f("slots", slots), f("slot_bytes", slot_bytes);
    f("max_slots_held", max_slots_held), f("budget_bytes", budget_bytes), f("layers", layers);
    f("quantized_layers", quantized_layers), f("embedding_layers", embedding_layers);
    f("group_layers", group_layers), f("routed_fetches", routed_fetches), f("pinned_bytes", pinned_bytes);
    f("pageable_bytes", pageable_bytes), f("shared_bytes", shared_bytes), f("averaged_bytes", averaged_bytes);
    f("peak_device_bytes", peak_device_bytes), f("device_bytes", device_bytes);
    f("ordering_errors", ordering_errors), f("disk_layers", disk_layers), f("disk_read_bytes", disk_read_bytes);
    f("staged_read_bytes", staged_read_bytes), f("staging_hits", staging_hits);
    f("staging_entries", staging_entries), f("staging_entry_bytes", staging_entry_bytes);
    f("activation_d2h_bytes", activation_d2h_bytes), f("activation_h2d_bytes", activation_h2d_bytes);
    f("activation_device_bytes", activation_device_bytes);
    f("peak_activation_device_bytes", peak_activation_device_bytes);
    f("activation_host_bytes", activation_host_bytes);
    f("grad_staging_pinned_bytes", grad_staging_pinned_bytes);
    f("grad_staging_pageable_bytes", grad_staging_pageable_bytes);
    f("coded_layers", coded_layers), f("recoded_bytes", recoded_bytes), f("recode_seconds", recode_seconds);
    f("trace_dropped_slices", trace_dropped_slices);
  }
};

// Conv geometry (1-3 spatial dims). `same` computes padding from the kernel.
struct ConvSpec {
  int dims = 2;
  std::vector<int64_t> stride, padding, dilation;
  int64_t groups = 1;
  bool same = false;
};

// The public interface; the implementation (EngineImpl) and its layer
// records live in the internal engine_impl.h (docs/design/README.md).
class Engine {
 public:
  // Thread-safe. The engine is shared: parameters it adopted keep the host
  // memory alive after the last shared_ptr is gone.
  static std::shared_ptr<Engine> create(const EngineOptions& options);
  virtual ~Engine() = default;
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
  // frozen: requires_grad false; with Format::Lossless a trainable weight is
  // adopted dense and only its copy is coded, re-coded after it changes:
  // Note [Trainable coded weights]) and crosses the bus packed; right after the
  // copy, a dequantization on the engine's dequant stream writes the weight
  // in its dense dtype into the same slot (the slot holds both, inside the
  // budget), and compute waits only for that (cast to the activation dtype
  // at use if it differs, like unquantized weights). The engine keeps no
  // reference to the dense weight: callers replace the module's parameter
  // by a data-less (meta) one so the dense copy is freed (the Python layer
  // does). The bias stays float. See docs/design/quant-formats.md.
  virtual int add_linear(const std::string& name, torch::Tensor weight, torch::Tensor bias,
                         quant::Format format = quant::Format::None) = 0;
  virtual int add_conv(const std::string& name, torch::Tensor weight, torch::Tensor bias,
                       const ConvSpec& spec, quant::Format format = quant::Format::None) = 0;
  // The host tier (docs/design/host-tier.md). read_file() reads a tensor of
  // `shape` and `dtype` (its bytes as the file holds them: contiguous) from
  // `src` straight into the host store (pinned within store_pinned_cap) and
  // returns a CPU tensor over it: a parameter given this tensor's data is
  // adopted by add_linear()/add_conv() without another copy. With a
  // `file_dtype` other than `dtype` (both floating point) the file holds that
  // dtype and each value is cast as it is read (torch's rounding, as
  // Tensor.to(dtype)), through a temporary of at most 64 MiB ("Cast as read"
  // in the design note). The file is checked (size, mtime, inode, against
  // src.identity when recorded) first; errors name the file and the tensor.
  virtual torch::Tensor read_file(const FileRange& src, const std::vector<int64_t>& shape,
                                  torch::ScalarType dtype,
                                  std::optional<torch::ScalarType> file_dtype = std::nullopt) = 0;
  // A Linear whose frozen weight stays in its file (the disk tier): read on
  // every use into a staging entry, then copied to the device. `weight` gives
  // the shape and dtype (a meta tensor is fine; it must not require grad);
  // `w` holds its bytes, contiguous. The bias is read from `b` too when given
  // (frozen), else adopted into the host store like add_linear()'s (a
  // trainable bias makes the layer's entry unkeepable across steps).
  // With a quantization format, `w` holds the weight already packed in it
  // (quant::layout_for(format, rows, cols), as core/io/quant_cache.h writes
  // it): it crosses the bus packed and is dequantized in the slot.
  virtual int add_linear_on_disk(const std::string& name, const torch::Tensor& weight, const FileRange& w,
                                 torch::Tensor bias, const std::optional<FileRange>& b,
                                 quant::Format format = quant::Format::None) = 0;
  // A Linear whose weight is already int8 with one fp32 scale per output
  // row (e.g. from torch.quantize_per_channel with zero points 0): stored in
  // the int8 format byte for byte. `dense_dtype` is the dtype it stands for
  // (what detach() restores).
  virtual int add_linear_int8(const std::string& name, torch::Tensor int8_data,
                              torch::Tensor scales, torch::Tensor bias, torch::ScalarType dense_dtype) = 0;
  // A Linear [rows, cols] whose weight arrives already packed in `format`
  // (int8, fp8, nf4 or a GGUF format) as its code bytes and fp32 scales, laid
  // out as in docs/design/quant-formats.md — e.g. bitsandbytes NF4 weights
  // (blocks of 64, high nibble first, absmax per block), optimum-quanto /
  // torchao int8 and float8_e4m3fn weights (one scale per row). Stored byte for byte; the
  // codes and scales are copied (callers may free theirs).
  virtual int add_linear_packed(const std::string& name, quant::Format format, torch::Tensor codes,
                                torch::Tensor scales, torch::Tensor bias, int64_t rows, int64_t cols,
                                torch::ScalarType dense_dtype) = 0;

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
  virtual int add_embedding(const std::string& name, torch::Tensor weight, int64_t padding_idx = -1,
                            bool scale_grad_by_freq = false, bool sparse = false) = 0;

  // A group of tensors streamed together in one slot (e.g. a mixture-of-
  // experts module's 3-D expert weights, gate_up_proj and down_proj, and
  // their biases): adopted into the host store like a layer's weight (same
  // aliasing and layout rules), any shape, used in their own dtype (never
  // quantized or cast). The engine runs no computation for it: the caller
  // fetch()es the device views, computes, and release()s them (the Python
  // offload() runs the module's own forward on them and recomputes it in
  // backward; docs/design/torch-glue.md "Tensor groups"). Gradients are the
  // caller's (it returns them to autograd). Tensors already streamed by
  // another layer are refused. A tensor that is not floating point (raw
  // bytes a module's forward decodes itself: diffusers' GGUF blocks) must
  // not require grad; it crosses as it is, never quantized or coded.
  // With a format, every floating-point tensor of 2 or more dimensions is packed on the
  // host as a matrix of its last dimension's columns (it must be frozen;
  // the engine keeps no reference to the dense values, so callers replace
  // the parameters by data-less stand-ins) and dequantized into the slot
  // after the copy, to its dtype or dequant_dtype; fetch() returns the
  // dequantized views. 1-D tensors (biases) stay as they are. Lossless
  // (quant::Format::Lossless): coded bit for bit (float32, bfloat16,
  // float16), decoded into its own dtype; an expert-indexed tensor is coded
  // one expert at a time (lossless::analyze_pieces); requantize_part refuses.
  //
  // experts > 0: the group's tensors are indexed by expert along dim 0 (a
  // mixture-of-experts module's), and fetch() may be given the experts a
  // router chose, to copy only theirs. A tensor whose dim 0 is not `experts`,
  // or whose dim-0 slices are not contiguous in memory (or, quantized, do
  // not start on whole nf4 blocks / 16 bytes of codes; lossless: decode to
  // a multiple of 16 bytes, lossless::expert_pieces), is copied whole.
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
  virtual int add_group(const std::string& name, const std::vector<torch::Tensor>& tensors,
                        quant::Format format = quant::Format::None, int64_t experts = 0,
                        const std::vector<PrepackedPart>& prepacked = {}) = 0;
  // Group layers quantized by add_group: tensor `part` dequantized on the
  // host (what detach() restores; lossy, but bit for bit when lossless), and
  // new values packed into it in place of the old ones (as requantize() for
  // a layer; not for lossless, whose coded size depends on the values, nor
  // into a store a node's ranks share).
  virtual torch::Tensor dequantized_part(int layer, int part) = 0;
  virtual void requantize_part(int layer, int part, const torch::Tensor& dense) = 0;
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
  virtual std::pair<int64_t, std::vector<torch::Tensor>> fetch(int layer,
                                                               const std::vector<int64_t>& experts = {}) = 0;
  virtual void release(int64_t token) = 0;

  // The streamed computations (differentiable). Weight gradients normally
  // go back asynchronously and are accumulated into .grad by the engine; with
  // grads_via_autograd — and always for a weight another layer shares, for
  // parameters with gradient hooks (they fire only when autograd
  // accumulates), and under torch.autograd.grad / backward(inputs=...) —
  // they are copied to the host synchronously and returned to autograd,
  // which routes them. Under
  // torch.autocast for the compute device's type, a float input is first
  // cast to the autocast dtype (as autocast casts Linear/conv inputs), so
  // the weight is used in that dtype (compute_dtype's copy when it matches).
  virtual torch::Tensor linear(int layer, const torch::Tensor& x, bool grads_via_autograd = false) = 0;
  virtual torch::Tensor conv(int layer, const torch::Tensor& x, bool grads_via_autograd = false) = 0;
  // The lookup of an embedding layer: weight[ids] on the compute device, in
  // the weight's dtype, like torch.nn.functional.embedding (ids: an integer
  // tensor on the compute device; out-of-range ids fail as torch's lookup
  // does); differentiable for the weight when it requires grad. Stream
  // semantics: enqueued on the compute stream like the layers; the host
  // rows are read when it runs, so host writes to the table must wait for
  // synchronize() (detach() and the destructor wait for it).
  virtual torch::Tensor embedding(int layer, const torch::Tensor& ids) = 0;
  // The same computations as PyTorch operators, for torch.compile and
  // torch.export (docs/design/torch-glue.md, "Streamed layers as custom
  // ops"): layerstream::linear(x, weight?, bias?, engine, layer, spec),
  // layerstream::conv(...) and layerstream::embedding(ids, weight?, engine,
  // layer, spec), registered with the dispatcher when the library is loaded,
  // with autograd and autocast kernels; `engine` is id() below, `layer` an
  // index from add_*(). weight/bias are passed only when they require grad
  // (their gradients then are staged as in eager, or come back through
  // autograd, on the host, as with grads_via_autograd: as op_spec() says).
  // Each call fetches, computes and releases within itself, so any order a
  // compiler chooses keeps the slot protocol.
  // The engine's number in this process (never reused while it runs).
  virtual uint64_t id() const = 0;
  // What each operator call names besides (engine, layer): the facts its
  // outputs' shapes, strides and dtypes follow from (the kind; the weight's
  // and bias's shapes, strides and dtypes; a convolution's stride, padding,
  // dilation and groups; a table's options), e.g. "linear w=64x16 Float
  // b=64 Float", and, for a Linear or convolution whose weight gradients
  // go back to autograd rather than being staged when a graph is traced
  // now (a weight another layer shares, gradient hooks), " grads=autograd".
  // Ask for it when tracing. The kernels refuse a call whose spec names
  // another layout (Note [An operator call names its layer's layout],
  // ops_spec.cpp). Thread-safe.
  virtual std::string op_spec(int layer) const = 0;

  // ---- activation offload (docs/design/activations.md) ----
  // Starts a forward pass whose saved tensors go through stash_activation()
  // and sets the device budget: the newest `device_budget` bytes of saved
  // tensors stay on the device (backward needs the last ones first); each
  // older one goes to the host as newer ones push it out of that window. 0:
  // every one that can goes to the host as it is saved.
  virtual void begin_activations(uint64_t device_budget) = 0;
  // A tensor autograd saves for backward (call it from a saved-tensors pack
  // hook). Returns -1 when the tensor is none of the engine's business: not
  // on the compute device, a view of a slot or of the host store, or a
  // streamed layer's weight. Else a token for restore_activation(): the
  // tensor stays on the device when it is smaller than
  // activation_min_bytes, not dense, or while it is within the device
  // budget's window (or the host cap is reached); otherwise it is copied to
  // pinned host memory on the engine's device-to-host activation stream,
  // after the work enqueued so far on the compute stream. The engine lets the
  // device tensor go when the copy is enqueued if torch's caching allocator
  // owns it (a GPU: the allocator reuses it after the copy), else once the
  // copy has finished. Copies in flight hold at most prefetch + 1 times the
  // largest tensor offloaded so far (always the newest one): past that, the
  // call blocks until the oldest have finished. Thread-safe.
  // Conjugate, negative and zero views (their bit is not in the bytes), and
  // tensors without strided storage, are none of its business either. A save
  // of data a live token holds, unchanged since (same storage, address,
  // sizes, strides, dtype and version), gets a token that shares that entry:
  // one host copy, and one copy back serves both unpacks.
  virtual int64_t stash_activation(const torch::Tensor& t) = 0;
  // The stashed tensor on the compute device (same sizes, strides and
  // dtype), ready for work enqueued on the compute stream after the call
  // (with order_compute=false the caller must order it: on the sim device
  // the ordering checker reports a read before the copy lands). Starts the
  // copy back of the next `prefetch` stashes in reverse saving order (the
  // order backward unpacks them) on the transfer stream. May be called
  // again for the same token (a retained graph): each call copies back
  // (but a copy back that tokens sharing the entry may still unpack is kept
  // for them until the last one unpacks it or the backward ends).
  // Autograd's version check, which its saved-tensor hooks turn off: a tensor
  // written in place since it was saved throws autograd's "modified by an
  // inplace operation" (check_saved_version, below).
  virtual torch::Tensor restore_activation(int64_t token, bool order_compute = true) = 0;
  // Releases a token (its graph was freed): the host copy goes back to the
  // engine's pool, reusable once its copies back have finished (with
  // order_reuse=false the next stash into it is not ordered after them: on
  // the sim device the checker reports the race; for tests of the checker).
  virtual void drop_activation(int64_t token, bool order_reuse = true) = 0;

  // ---- several processes (docs/design/distributed.md) ----
  // Streamed weights' gradients are averaged over `group` as
  // DistributedDataParallel averages the others: on the compute device,
  // before the copy to the host (all-reduce of the gradient divided by the
  // group's size; NCCL work is waited on by the current stream). Every rank
  // must run the same layers' backwards in the same order. Null: none.
  // Ownership: held weakly (torch's registry owns the group until
  // destroy_process_group(); an averaging after that is an error that says so).
  // Call before the first backward; not thread-safe against a running one.
  virtual void set_gradient_group(c10::intrusive_ptr<c10d::ProcessGroup> group) = 0;
  // false: the backwards of forwards run from now on keep their gradients
  // local (DDP's no_sync()); the first synchronised backward after them
  // averages the layers' whole .grad once it ends. Thread-safe.
  virtual void set_gradient_sync(bool sync) = 0;
  // Averages a gradient of `layer` computed outside the engine (a tensor
  // group's, from Python), in place, by the rule above.
  virtual void average_gradient(int layer, torch::Tensor& grad) = 0;
  // Carves the host store from `region`, shared with this node's other
  // processes that register the same layers in the same order; `writer`:
  // this process fills it (the others only map it). `trainable`: trainable
  // tensors are shared too (each rank's optimizer must step only its shard:
  // layerstream.optim does), else they stay in this process's memory. Before
  // any add_*().
  virtual void share_host_store(std::shared_ptr<SharedRegion> region, bool writer, bool trainable) = 0;
  // Whether a tensor that is trainable (or not) goes to the shared region
  // (a trainable tensor read by read_file() must not land there otherwise).
  virtual bool host_store_shared(bool trainable) const = 0;
  // The store's layout digest (HostStore::layout_digest): equal in every
  // process that shares one region, or they disagree.
  virtual uint64_t host_store_digest() const = 0;

  // Waits for every pending transfer (saved activations' included) and gradient, accumulates gradients
  // staged outside any autograd graph task into param.grad (a backward pass
  // applies its own when it finishes), forgets the weights cached in device
  // slots (the next fetch reads the host copy) and re-codes trainable
  // lossless weights before their next copy: the call to make after host
  // writes the version counters cannot see (with cache_across_steps; a few
  // elements of a trainable lossless weight).
  virtual void synchronize() = 0;
  // A call of the model begins (Python: the forward pre-hook offload() and
  // compat's attach() put on the model calls it): its first fetch begins a
  // new step, so a call that skips the layers that began the steps before
  // still drops the weights cached by the last one (Note [When a step
  // begins], core/scheduler.cpp). Ignored inside a backward (a checkpoint's
  // recompute). Cheap; thread-safe.
  virtual void begin_call() = 0;
  // Restores every layer's parameters to ordinary tensors on `device`
  // (bit-identical data) and disables the engine. A quantized layer's
  // parameter keeps its values, unless it is a plain tensor freed (another
  // shape): then it takes dequantized_weight() (Python's stand-ins are
  // restored by the Python layer).
  virtual void detach(const std::vector<torch::Device>& devices) = 0;
  virtual bool detached() const = 0;
  // Frees the engine's device memory (the slot arena) for a while, e.g. for
  // another model, a VAE decode, sampling (docs/design/streaming-core.md,
  // "Suspend"): waits like synchronize(), then frees it; the learnt fetch
  // order is kept. Until resume() every fetch throws (a forward, a backward
  // of a graph recorded before, fetch()). Throws, changing nothing, while a
  // layer is fetched (a fetch() token not released, a layer computing on
  // another thread). resume() allocates the arena again (throws, still
  // suspended, when the device cannot hold it). Both return at once when
  // there is nothing to do. Thread-safe.
  virtual void suspend() = 0;
  virtual void resume() = 0;
  virtual bool suspended() const = 0;

  // Telemetry (EngineStats).
  virtual EngineStats stats() const = 0;
  virtual std::vector<std::string> ordering_errors() const = 0;
  // Per-step counters (see StepStats) of completed steps, with the overlap
  // fraction of each step from the timeline when tracing (else NaN).
  virtual std::vector<std::pair<StepStats, double>> step_stats() const = 0;
  // The timeline in Chrome trace / Perfetto JSON ("" when trace is off).
  virtual std::string trace_json() const = 0;
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
  virtual void watch_weight(int layer, const torch::Tensor& param) = 0;
  // Layers quantized by add_linear/add_conv: packs `dense` (the weight's
  // shape, any float dtype and device; cast to the weight's dtype first, as
  // load_state_dict's copy would) into the layer's host buffer in place of
  // the old weight. Waits for in-flight copies and forgets weights cached on
  // the device first (like synchronize()); the old packed weight stays if
  // packing fails (e.g. NaN). Refused while the layer's host copy sits in
  // the store a node's ranks share (a write there reaches every rank:
  // shared_write_refusal). The watched parameter (watch_weight), when it is
  // a plain tensor of the weight's shape (C++'s dense parameter, not freed),
  // takes the values too: torch::save() and detach() give them back. Not safe
  // concurrently with a forward or backward of this engine.
  virtual void requantize(int layer, const torch::Tensor& dense) = 0;
  // Why requantize(layer, ·) (part < 0) or requantize_part(layer, part, ·)
  // would refuse any new values, whatever they are (a detached handle, a
  // disk-tier or lossless-coded weight, one offload() did not quantize, a
  // store the node's ranks share); "" when values of the right shape would
  // be packed. Writes nothing; both call it first, so the rule and its words
  // are here once. Python's load_state_dict() pre-hook on the model asks it
  // for every key before torch writes any (_packed.RefusedLoads).
  virtual std::string requantize_refusal(int layer, int part = -1) = 0;
  // Quantized layers: the weight dequantized on the host (CPU, original
  // dtype) — what detach() restores (lossy); "" / format name per layer.
  virtual torch::Tensor dequantized_weight(int layer) = 0;
  // Quantized layers: a copy of the packed code bytes (uint8, 1-D).
  virtual torch::Tensor packed_codes(int layer) = 0;
  virtual std::string layer_format(int layer) const = 0;

  // ---- Gradient-ready hook (issue 21; docs/design/optim.md, "Overlap") ----
  // When a hook is set, a streamed Linear's or convolution's weight and bias
  // gradients staged by a backward pass are added to .grad as soon as their
  // copy has landed, on a host thread of the engine, instead of at the end
  // of that backward -- once the layer's gradient of this backward is
  // complete: as many uses staged by it as forward calls with an autograd
  // node (outside any backward) since the backward that last staged it
  // (a layer called twice: with its second use). A layer in a reentrant
  // checkpoint or returning its gradients through autograd is applied at
  // the end of backward as always. Then hook(layer) runs on that thread:
  // it may read .grad and write the parameters' host data (an optimizer
  // step), and must not compute with the engine. After it returns, a weight
  // streamed lossless-coded that it changed is re-coded on that thread.
  // Once a backward queued a layer for the hook, a call of any layer outside
  // a backward waits until the jobs queued so far have run (the hook may be
  // writing the weights it would read). Empty: off.
  using GradReadyHook = std::function<void(int layer)>;
  virtual void set_grad_ready_hook(GradReadyHook hook) = 0;
  // The consuming form (the fused optimizer step, docs/design/optim.md,
  // "Fusion"): a layer whose gradient of this backward is one staged use
  // (called once in the forward) and whose parameters are contiguous is NOT
  // added to .grad: hook(layer, &landed) gets the staged gradients instead --
  // host tensors in the parameters' shape and dtype (undefined: none),
  // views of the engine's staging buffers, readable during the call only --
  // and takes over their accumulation (what the hook does with .grad is its
  // business; the engine never adds them). Once a backward queued a layer
  // for it, a call of any layer outside a backward throws until a hook is
  // set or removed again (it is an optimizer step: the call would read
  // weights partly stepped). Other layers are applied to
  // .grad first and get hook(layer, nullptr), as set_grad_ready_hook's.
  // The hook takes over every landed gradient of the layer, its parameters'
  // that it does not step too (AdamWOverlap puts those in .grad). One hook at
  // a time, of either form: setting one while one is set throws; an empty
  // hook removes it.
  struct LandedGradients {
    torch::Tensor weight, bias;
  };
  using GradConsumeHook = std::function<void(int layer, const LandedGradients* landed)>;
  virtual void set_grad_consume_hook(GradConsumeHook hook) = 0;
  // Blocks until every application and hook queued so far has run; rethrows
  // the first exception a hook threw since the last call.
  virtual void wait_grad_ready() = 0;
  // An overlapped optimizer step that stepped layers during a backward and
  // whose step() has not settled yet (AdamWOverlap sets it when its hook is
  // removed, clears it at settle() or abort()): while set, a call of any layer
  // outside a backward throws, and so do torch::save() of a streamed module
  // and Python's model.state_dict() (Note [No call between an overlapped
  // backward and its step], engine_grad_ready.cpp). Thread-safe.
  virtual void set_unsettled_step(bool unsettled) = 0;
  virtual bool unsettled_step() const = 0;
  // A Linear's or convolution's parameters as registered (bias undefined if
  // none); undefined tensors for other layers.
  virtual std::pair<torch::Tensor, torch::Tensor> layer_parameters(int layer) const = 0;

  virtual torch::Device compute_device() const = 0;
  virtual const std::string& device_name() const = 0;
  virtual int num_layers() const = 0;
  virtual std::string layer_name(int layer) const = 0;
  virtual int64_t layer_bytes(int layer) const = 0;
  virtual const EngineOptions& options() const = 0;

 protected:
  Engine() = default;
};

// Whether a parameter has gradient hooks decides where a streamed layer's
// weight gradients go (hooks fire only when autograd accumulates). torch
// keeps a tensor's hook object registered after its hooks are removed: a C++
// one keeps a list with holes, which the engine reads; Python's keeps a dict,
// which only the Python bindings can read. They set this probe (once, at
// import): given a hook object the engine cannot read, whether it still
// holds a hook. Without a probe such an object counts as a hook. Thread-safe.
struct GradHookProbe {
  bool (*pre)(const torch::autograd::FunctionPreHook& hook) = nullptr;
  bool (*post_accumulate)(const torch::autograd::PostAccumulateGradHook& hook) = nullptr;
};
void set_grad_hook_probe(GradHookProbe probe);

// Resolves a device string for the engine ("auto" and "cuda": the current CUDA
// device, as in PyTorch); throws a clear error for unknown devices or "cuda"
// without a visible GPU. `spelling` is the caller's API: the errors' advice
// names its way of choosing the simulated device (C++: OffloadOptions::device
// = "sim"; Python: device='sim'; the command line: --device sim).
enum class DeviceSpelling { Cpp, Python, Cli };
std::string resolve_device(const std::string& device, DeviceSpelling spelling = DeviceSpelling::Cpp);

// Autograd's check of a saved tensor at unpack, for saved-tensor hooks (under
// them torch skips it): throws its "modified by an inplace operation" error when
// `version` (the tensor's counter, or none for an inference tensor) moved from
// `saved` (its value when autograd saved the tensor). Restore paths of the
// engine, Python's and C++'s activation scopes call it.
void check_saved_version(const std::optional<c10::VariableVersion>& version, uint32_t saved,
                         c10::IntArrayRef sizes);
// The counter of `t` when it has one (not an inference tensor).
std::optional<c10::VariableVersion> version_of(const torch::Tensor& t);

// The values `weight` computes with when it streams quantized in `format`
// (int8, fp8, nf4 or int4; viewed as [rows, cols]): packed, then dequantized to
// `dequant` or its own dtype as the device does, in `weight`'s shape and dtype,
// on the CPU. offload() gives them to a layer its budget keeps resident, so
// that the budget does not change the numbers (docs/design/planner.md,
// "Quantized layers kept resident"). Throws on NaN/Inf, as the packer does.
torch::Tensor quantized_values(const torch::Tensor& weight, int64_t rows, int64_t cols, const std::string& format,
                               std::optional<torch::ScalarType> dequant = std::nullopt);
// Whether a quantized layer kept resident rounds its values: it holds them in
// its weight's dtype `weight`, which cannot hold every value of a wider
// `dequant` (float32 for bf16 weights), while a streamed layer computes in
// `dequant`; the budget then changes the numbers. offload() warns of it, in
// both languages (Python: _C.resident_quantized_rounds).
bool resident_quantized_rounds(torch::ScalarType weight, std::optional<torch::ScalarType> dequant);
// Why a write to a frozen tensor of the host store a node's ranks share is
// refused: "<what> <how>: it sits in the host store ..., <what to do>"
// (docs/design/distributed.md, "One host copy per node"). The engine's
// refusals (requantize() and requantize_part() into a shared store) and
// Python's (writes seen at the next call, _distributed.py) say it alike
// (Python: _C.shared_write_refusal).
std::string shared_write_refusal(const std::string& what, const std::string& how);
// A 64-bit checksum of `t`'s values (core/io/checksum.h over its bytes, copied
// to the CPU, contiguous). A layer kept resident with quantized values tells
// with it a write of the same values (load_state_dict of its own state_dict(),
// torch::load of its own save) from a new one: quantizing quantized values
// again is not the identity with a dequant dtype narrower than the weight's, so only new
// values are quantized.
uint64_t tensor_checksum(const torch::Tensor& t);

}  // namespace layerstream
