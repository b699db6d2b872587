// layerstream — placement planner (torch-free).
//
// Decides which layers stay resident on the device and which are streamed
// from pinned host memory through a ring of equally sized device slots, under
// a hard device-memory budget, and predicts the step time. The policy and the
// time model are described in docs/design/planner.md.
//
// Also: model descriptions (from a safetensors checkpoint or a built-in model
// name), quantized byte sizes, and parse_bytes/format_bytes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "error.h"

#include "safetensors.h"

namespace layerstream {

// ---------------------------------------------------------------- planner

struct PlannerLayer {
  std::string name;
  uint64_t bytes = 0;           // bytes that cross the bus when streamed (packed if quantized)
  uint64_t slot_bytes = 0;      // device bytes of its slot when streamed, if more than `bytes`
                                // (quantized: packed + dequantized workspace); 0 = `bytes`
  uint64_t streamed_slot_bytes() const { return slot_bytes > bytes ? slot_bytes : bytes; }
  uint64_t resident_bytes = 0;  // bytes it occupies on the device if kept resident
  // Training (offload(train=...), docs/design/planner.md "Training"): what its
  // trainable weights' gradients and optimizer states take on the device
  // when it is kept resident (optim::train_bytes); 0: frozen, or not counted.
  // Streamed, its gradient goes to the host and its states live there.
  uint64_t train_bytes = 0;
  uint64_t resident_cost() const { return resident_bytes + train_bytes; }
  // Host bytes when streamed, if not `bytes` (a trainable lossless weight:
  // the dense weight and its coded copy at its largest size); 0 = `bytes`.
  uint64_t host_bytes = 0;
  double flops = 0.0;           // FLOPs per step (0 = unknown)
  bool trainable = false;       // training: its gradient is offloaded to the host when streamed
  // An embedding table looked up in host memory (what offload() does with a
  // table without max_norm): never resident and never in a slot; `bytes` stay in
  // pinned host memory and `lookup_bytes` (the rows one step reads) cross
  // the bus on the compute stream, in the forward pass.
  bool lookup = false;
  uint64_t lookup_bytes = 0;
  // Tied weights: this layer's weight is lookup table #tied_table's (an
  // lm_head tied to the embedding; -1: none). Streamed, it reads the table's
  // host copy (host bytes counted once); kept resident, the table is
  // resident with it (the tensor is on the device once, in this layer's
  // resident_bytes, and no rows cross the bus).
  int tied_table = -1;
  // Tied weights of two streamed layers (offload(): Linears / convs whose
  // weight is one tensor, core/offload_policy.h): this layer's weight is layer
  // #tied_layer's (an earlier layer, neither a lookup table nor tied to
  // another; -1: none), `tied_bytes` of this layer's `bytes`. Both are
  // resident or both stream (as offload() runs them): resident, the tensor is
  // on the device once, in #tied_layer's resident_bytes and train_bytes, which
  // this layer's leave out; streamed, both copy the one host copy, pinned once
  // (in #tied_layer's bytes).
  int tied_layer = -1;
  uint64_t tied_bytes = 0;
  // Streamed as stored whatever the quantization asked for (a tied layer, a
  // tensor group with nothing to pack): the "too small" error then does not
  // suggest quantizing.
  bool as_stored = false;
  // What the device writes into the slot (a dequantized or cast weight) is
  // already 2 bytes per element (bf16 / fp16): the "too small" error then
  // does not suggest a narrower dequant_dtype / compute_dtype.
  bool narrow_write = false;
  // Quantized or cast on the device: the slot it would take streamed as stored
  // (without quantize= / compute_dtype; 0: not known, or not quantized or
  // cast). When it is smaller than the slot, the "too small" error says so: the
  // slot holds what crosses and the weight written from it.
  uint64_t stored_slot_bytes = 0;
  // A mixture-of-experts group under routed fetch (offload(experts="routed")):
  // the bytes one fetch copies when a step's tokens reach at most half of the
  // experts (0: the whole group, prefetched). Such a copy is on demand, after
  // the router ran: it starts when the compute before it is done.
  uint64_t routed_bytes = 0;
  uint64_t fetch_bytes() const { return routed_bytes ? routed_bytes : bytes; }
  // Activation offload (training): bytes of saved activations this layer's
  // forward sends to the host (device-to-host, after its compute) and its
  // backward brings back (host-to-device, on the link the weights use,
  // before its compute). 0: none.
  uint64_t activation_bytes = 0;
};

struct PlannerInput {
  uint64_t budget_bytes = 0;
  std::vector<PlannerLayer> layers;       // in execution order
  uint64_t fixed_resident_bytes = 0;   // small tensors that are always resident (norms, biases, ...)
  uint64_t fixed_train_bytes = 0;      // their gradients and optimizer states (PlannerLayer::train_bytes)
  double link_bytes_per_s = 0.0;       // host->device bandwidth (0 = unknown: no time prediction)
  double device_flops_per_s = 0.0;     // device throughput (0 = unknown: compute time 0)
  int min_slots = 2;                   // at least 2 (one in use + one being filled)
  int max_prefetch = 4;                // slots <= max_prefetch + 1
  // The prefetch depth the engine runs over the slots: min(it, slots - 1)
  // (offload(prefetch=); -1: slots - 1). Slots beyond it + 1 hold no copy in
  // flight, so the plan's depth and copy times use it.
  int prefetch_depth = -1;
  bool training = false;               // forward + backward pass (streamed layers cross twice)
  bool cli = false;                    // errors name `layerstream plan`'s flags, not offload()'s options
};

struct LayerPlacement {
  size_t index = 0;  // position in PlannerInput::layers
  std::string name;
  bool resident = false;
  bool lookup = false;  // looked up in host memory (PlannerLayer::lookup); resident is false
  // Tied weights: the other layer of the pair (-1: none). A table whose tied
  // layer is resident is resident too, with resident_bytes 0 (that layer
  // holds the tensor). A layer with PlannerLayer::tied_layer: that layer (set
  // on this one only, so several may share one weight).
  int tied_with = -1;
  bool shares_weight = false;  // PlannerLayer::tied_layer: the weight's bytes are tied_with's
  uint64_t bytes = 0;
  uint64_t routed_bytes = 0;  // PlannerLayer::routed_bytes (0: copied whole)
  uint64_t resident_bytes = 0;
  uint64_t train_bytes = 0;  // PlannerLayer::train_bytes when resident, else 0
  double flops = 0.0;
  double compute_s = 0.0;   // per step
  double transfer_s = 0.0;  // per step (0 when resident)
};

struct Plan {
  std::vector<LayerPlacement> layers;  // in execution order
  uint64_t budget_bytes = 0;
  uint64_t resident_bytes = 0;        // resident layers (their resident_bytes)
  uint64_t fixed_resident_bytes = 0;  // small always-resident tensors
  // Gradients and optimizer states of the resident trainable weights (layers
  // and small tensors; PlannerLayer::train_bytes, PlannerInput::fixed_train_bytes).
  uint64_t train_bytes = 0;
  uint64_t slot_bytes = 0;            // largest streamed layer's slot (0 when nothing streams)
  int num_slots = 0;                  // 0 when nothing streams, else >= 2
  int prefetch_depth = 0;             // min(num_slots - 1, PlannerInput::prefetch_depth) (0 when nothing streams)
  uint64_t device_bytes = 0;          // resident + fixed + train + num_slots * slot_bytes  (<= budget)
  uint64_t host_pinned_bytes = 0;     // sum of streamed and looked-up layers' bytes
  uint64_t bus_bytes_per_step = 0;    // host->device bytes per step (streamed x2 when training, + lookups)
  uint64_t activation_bytes_per_step = 0;  // saved activations to the host and back (each way)
  size_t num_resident = 0;
  size_t num_streamed = 0;
  size_t num_lookup = 0;              // tables looked up in host memory

  double link_bytes_per_s = 0.0;
  double device_flops_per_s = 0.0;
  bool training = false;
  bool has_time = false;        // link bandwidth known
  double step_time_s = 0.0;     // steady-state time of one step (pipeline simulation)
  double first_step_time_s = 0.0;  // the first step, starting with empty slots
  double compute_time_s = 0.0;  // sum of compute times
  double transfer_time_s = 0.0; // sum of host->device transfer times
  // "compute" (compute_time_s >= transfer_time_s), "transfer", or "unknown"
  // (no link bandwidth, or layers stream and the device's FLOP/s are unknown).
  std::string bound() const;
  double stall_s() const { return step_time_s > compute_time_s ? step_time_s - compute_time_s : 0.0; }

  // Human-readable table + summary. host_budget: the caller places the
  // streamed layers under a host budget (core/host_tier.h) and prints that
  // placement itself; the pinned-RAM line then says it is the need without one.
  std::string explain(bool host_budget = false) const;
  std::string to_json() const;  // one JSON object (schema in docs/design/planner.md)
};

// A budget too small for the slots a plan needs (the message names the
// largest layer, its size, the budget and the budget needed).
class BudgetTooSmall : public Error {
 public:
  using Error::Error;
};

// Throws BudgetTooSmall when no plan fits, layerstream::Error for bad
// input. Deterministic.
Plan plan_placement(const PlannerInput& in);

// offload()'s rule, slots first and residency with what is left: reserves
// the slots the prefetch depth needs (prefetch + 1: one in use, `prefetch`
// in flight; or exactly `slots` when > 0) before any layer is kept resident
// (without a time model the placement would trade slots for residency and
// run at prefetch depth 1). A budget too small for them gets fewer, down to
// 2 (prefetch becomes slots - 1); with `slots` given, none fewer. The slots
// are sized by the largest *streamed* layer: whether k slots fit is the
// placement's call (it may keep an outlier resident). `in.min_slots` and
// `in.max_prefetch` and `in.prefetch_depth` (= prefetch) are set here.
Plan plan_slots_first(PlannerInput in, int prefetch, int slots);

// "12GiB", "500MB", "1.5e9", "123", "64 KiB", "2g" (k/m/g/t = powers of 1000,
// ki/mi/gi/ti = powers of 1024, optional trailing "B"). Throws on bad input.
uint64_t parse_bytes(const std::string& s);
// 1536 -> "1.50 KiB".
std::string format_bytes(uint64_t bytes);

// ------------------------------------------------------ model descriptions

// Lossless (core/lossless.h): a weight's coded size depends on its values,
// measured from a sample of them (measure_lossless); GGUF weights, and
// tensor groups when training, stay as stored, as offload() keeps them.
enum class Quantization { None, Int8, FP8, NF4, Int4, Lossless };
Quantization parse_quantization(const std::string& s);  // "none"|"int8"|"fp8"|"nf4"|"int4"|"lossless"
const char* to_string(Quantization q);

// One streamable layer: a 2-D (or higher) weight plus an optional bias.
struct ModelLayer {
  std::string name;                    // module prefix, e.g. "model.layers.0.mlp.up_proj"
  std::vector<uint64_t> weight_shape;  // [out, in, ...]
  std::string weight_dtype;            // safetensors dtype name
  uint64_t bias_numel = 0;
  std::string bias_dtype;              // empty when there is no bias
  bool embedding = false;              // a lookup table (FLOPs ~ tokens * row size)
  // Tied weights: the name of the table whose weight this layer's is (an
  // lm_head tied to the embedding, not in the checkpoint); empty: none. As
  // offload() does, it reads the table's host copy and is never quantized.
  std::string tied_to;
  // A mixture-of-experts module's expert tensors (every tensor under a
  // "<prefix>.experts." name, per expert or fused), streamed as one tensor
  // group as offload() does: `group_bytes` / `group_params` over all of them
  // as stored; `active` is the share of the experts one
  // token runs (num_experts_per_tok / num_experts from config.json, 1 when
  // unknown): FLOPs = 2 * tokens * params * active.
  bool group = false;
  uint64_t group_bytes = 0, group_params = 0;
  double active = 1.0;
  // Its tensors (shape, dtype): with --quantize each of 2+ dimensions is
  // packed as a matrix of its last dimension's columns, as offload() does.
  std::vector<std::pair<std::vector<uint64_t>, std::string>> group_tensors;
  // Their names in the checkpoint (empty for a built-in model), and each
  // one's lossless-coded size from measure_lossless() (0: not measured or
  // not coded, e.g. a bias), as offload() codes a group's tensor.
  std::vector<std::string> group_tensor_names;
  std::vector<uint64_t> group_lossless_bytes;
  // A weight stored in a GGUF block format that offload() streams as it is
  // (load_gguf(); weight_dtype is the ggml type name, e.g. "Q4_K"): the dtype
  // the device dequantizes it to, the model's parameter dtype ("BF16", ...).
  // For a group: set when some of group_tensors are in a GGUF block format
  // (their dtype is the ggml type name), and group_bytes is then the dense
  // size (what a resident group holds). Empty otherwise.
  std::string dense_dtype;
  // The weight's lossless-coded size, estimated by measure_lossless() from a
  // sample of its elements in the checkpoint; 0: not measured.
  uint64_t lossless_bytes = 0;
  // cast_to_dtype() changed the dtype of one of its tensors: offload() reads
  // it cast into RAM, so it never streams from disk.
  bool cast = false;
  uint64_t params() const;             // weight + bias elements
  uint64_t weight_numel() const;
  uint64_t stored_bytes() const;       // as stored (weight + bias)
};

struct ModelDescription {
  std::string name;
  std::vector<ModelLayer> layers;  // execution order
  uint64_t small_bytes = 0;        // tensors that are not part of a layer (always resident)
  size_t small_tensors = 0;
  std::vector<std::pair<std::vector<uint64_t>, std::string>> small_shapes;  // each one's (shape, dtype)
  std::vector<std::string> files;  // checkpoint files (empty for built-ins)
};

// Groups a checkpoint's tensors into layers: a layer is a module prefix P
// whose "P.weight" has >= 2 dimensions, plus "P.bias" if present; every other
// tensor is small and resident. Layers are ordered to approximate the
// execution order: embeddings first, lm_head last, otherwise component-wise
// natural order (numbers compare as numbers: layers.2 < layers.10) with
// well-known module names in their usual order (attention before mlp;
// q/k/v/o_proj; gate/up/down_proj).
ModelDescription describe_checkpoint(const Checkpoint& ck);

// The model's parameter dtype where the checkpoint holds another (a safetensors
// dtype name, e.g. "BF16"): every floating-point tensor of `m` (F64, F32, F16,
// BF16, F8_E4M3, F8_E5M2) of another dtype becomes `dtype`, as load_safetensors()
// and offload() cast them (docs/design/host-tier.md "Cast as read"); each layer
// with such a tensor is marked `cast`. Returns how many tensors changed.
size_t cast_to_dtype(ModelDescription& m, const std::string& dtype);

// Sets lossless_bytes of every layer of `m` (from describe_checkpoint(ck))
// whose weight is float32, bfloat16 or float16, and group_lossless_bytes of
// every tensor group's tensors of 2+ dimensions: the coded size predicted
// from about 64K of its elements read from the checkpoint (16 evenly spaced
// runs; lossless::estimate_encoded_bytes), a fused expert tensor in one
// piece per expert (lossless::expert_pieces). Reads at most ~128 KiB per
// tensor.
// `as_dtype` ("F32", "BF16", "F16"; empty: as stored): the tensors of another of
// those dtypes are measured cast to it (round to nearest even, as cast_to_dtype()
// plans them and offload() codes them after load_safetensors() casts them).
void measure_lossless(ModelDescription& m, const Checkpoint& ck, const std::string& as_dtype = "");

struct GgufFile;
// A .gguf file (core/gguf.h) as load_gguf() + offload() place it: layers as
// describe_checkpoint() groups them, plus llama.cpp's expert tensors
// ("blk.N.ffn_up_exps.weight", ...) as one group per block, "blk.N.experts",
// whose active share comes from the file (<arch>.expert_used_count /
// expert_count). A weight or group tensor in a block format layerstream
// streams (Q8_0 .. Q6_K) crosses the bus as the file's blocks and is
// dequantized in the slot to `dense_dtype` (a safetensors float dtype name,
// the model's parameter dtype; ModelLayer::dense_dtype says so, for groups
// too); resident, it is dense. Embedding tables, which load_gguf()
// dequantizes on load, are planned dense in `dense_dtype`. Other ggml types
// load dense as stored. Types layerstream cannot read throw.
ModelDescription describe_gguf(const GgufFile& g, const std::string& dense_dtype = "BF16");

// Tied output head: a checkpoint of a model whose lm_head is tied to the
// token embedding stores only the table. Given the model's config.json text,
// adds an "lm_head" layer (the table's shape and dtype, tied_to the table)
// when the description has no lm_head, has a token table ("embed_tokens",
// "wte", "word_embeddings", "shared"; of `vocab_size` rows when the config
// says), and the config says tie_word_embeddings (top level or in
// text_config), or does not say and names a language-model architecture
// ("...ForCausalLM", "...LMHeadModel", "...ForConditionalGeneration"): such a
// model without an lm_head tensor can only take it from the table. Returns
// the table's name, or "" when nothing was added. Bad JSON throws.
std::string add_tied_head(ModelDescription& m, const std::string& config_json, const std::string& what);
// Mixture of experts: sets every expert group's `active` share from the
// config (num_experts_per_tok over num_experts / num_local_experts /
// n_routed_experts, top level or in text_config). Returns the share, or 0
// when the config does not say (or the model has no expert group).
double set_expert_activity(ModelDescription& m, const std::string& config_json, const std::string& what);

// Built-in approximate model shapes; unknown name -> Error listing valid names.
ModelDescription builtin_model(const std::string& name);
std::vector<std::string> builtin_model_names();

struct LayerOptions {
  uint64_t tokens = 4096;     // tokens per step (FLOPs = 2 * tokens * params)
  Quantization quantize = Quantization::None;
  bool training = false;      // FLOPs x3, layers trainable
  // Resident quantized layers take their stored (unquantized) bytes, as offload()
  // holds them (dense, with the quantized values); false: their packed bytes.
  bool resident_dequantized = true;
  // "" or a safetensors float dtype ("F32", "BF16", "F16"): like the engine's
  // compute_dtype, a streamed float weight or bias of another dtype also
  // holds its cast copy in the slot, and quantized weights are dequantized
  // to it (instead of to the stored dtype).
  std::string compute_dtype;
  // As offload(experts="routed"): a group whose `active` share of experts
  // (per token) reaches at most half of them over `tokens` tokens copies only
  // those (PlannerLayer::routed_bytes), assuming uniform routing: a share
  // 1 - (1 - active)^tokens of the experts.
  bool routed_experts = true;
  // As offload(activations="host") when training: each linear layer's saved
  // input (tokens x in_features in compute_dtype, else the weight's dtype)
  // goes to the host in the forward and back in the backward
  // (PlannerLayer::activation_bytes). Other saved tensors (norms,
  // nonlinearities, attention) are not counted; an input several layers read
  // (q, k and v) is counted once, as offload() copies it
  // (reads_an_earlier_layers_input, planner_impl.h: by the layers' names).
  bool activations = false;
  // With training: what a trainable weight kept resident takes on the device
  // beside itself (its gradient, optimizer states), as offload(train=...):
  // optim::parse_train_spec's text, "grads" by default (PlannerLayer::train_bytes).
  std::string train = "grads";
};

// The share of a mixture-of-experts layer's experts that `tokens` tokens
// reach when each runs a share `active` of them, routed uniformly:
// 1 - (1 - active)^tokens (what LayerOptions::routed_experts plans with).
double experts_reached(double active, uint64_t tokens);

// Bytes of one weight of `shape`/`dtype` after quantization (unchanged for
// None or for dtypes narrower than 16 bits): the exact packed buffer size of
// core/quant.h (layout_for(...).total_bytes(), sections 256-byte aligned) for
// shape [rows, in...] viewed as [rows, prod(in...)]; for shapes quant.h does
// not support (int4 with in % 128 != 0) the formula plus 768 B of padding.
uint64_t quantized_weight_bytes(const std::vector<uint64_t>& shape, const std::string& dtype, Quantization q);

std::vector<PlannerLayer> layer_specs(const ModelDescription& m, const LayerOptions& opt);
// With training, the small tensors' gradients and optimizer states (LayerOptions::train;
// PlannerInput::fixed_train_bytes): every small tensor of a float dtype of 16+ bits trains.
uint64_t small_train_bytes(const ModelDescription& m, const LayerOptions& opt);

}  // namespace layerstream
