// layerstream core — the placement planner: model descriptions (checkpoints, GGUF files, built-in models) and each layer's bytes as offload() would stream it
// (planner.h; the files: docs/design/README.md).
#include "planner.h"
#include "optim/optim.h"
#include "planner_impl.h"
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <numeric>
#include <set>

#include "error.h"
#include "slot_layout.h"
#include "gguf.h"
#include "json.h"
#include "quant.h"
#include "io/source_file.h"
#include "lossless.h"

namespace layerstream {

// ------------------------------------------------------ model descriptions

Quantization parse_quantization(const std::string& s) {
  switch (quant::parse_format(s)) {  // the names offload(quantize=) takes, aliases too (core/quant.h)
    case quant::Format::None: return Quantization::None;
    case quant::Format::Int8: return Quantization::Int8;
    case quant::Format::Fp8E4M3: return Quantization::FP8;
    case quant::Format::NF4: return Quantization::NF4;
    case quant::Format::Int4: return Quantization::Int4;
    case quant::Format::Lossless: return Quantization::Lossless;
    default: LS_FAIL("unknown quantization ", json::quote(s), " (valid: none, int8, fp8, nf4, int4, lossless)");
  }
}

const char* to_string(Quantization q) {
  switch (q) {
    case Quantization::None: return "none";
    case Quantization::Int8: return "int8";
    case Quantization::FP8: return "fp8";
    case Quantization::NF4: return "nf4";
    case Quantization::Int4: return "int4";
    case Quantization::Lossless: return "lossless";
  }
  return "?";
}

namespace {
uint64_t numel_of(const std::vector<uint64_t>& shape) {
  uint64_t n = 1;
  for (uint64_t d : shape) n *= d;  // shapes were validated by the header reader
  return n;
}
uint64_t bytes_of(uint64_t numel, const std::string& dtype) {
  unsigned bits = safetensors_dtype_bits(dtype);
  uint32_t id = 0;
  if (bits == 0 && ggml_type_by_name(dtype, id)) {  // a GGUF block type: whole blocks
    const GgmlType t = ggml_type(id);
    return (numel + t.block_elems - 1) / t.block_elems * t.block_bytes;
  }
  LS_CHECK(bits > 0, "unknown dtype ", json::quote(dtype));
  return (numel * bits + 7) / 8;
}
// A safetensors float dtype ("F32", "BF16", "F16") as the lossless coder's.
lossless::Dtype lossless_dtype(const std::string& dtype) {
  return dtype == "F32" ? lossless::Dtype::F32 : dtype == "BF16" ? lossless::Dtype::BF16 : lossless::Dtype::F16;
}
}  // namespace

uint64_t ModelLayer::weight_numel() const { return numel_of(weight_shape); }
uint64_t ModelLayer::params() const { return group ? group_params : weight_numel() + bias_numel; }
uint64_t ModelLayer::stored_bytes() const {
  if (group) return group_bytes;
  return bytes_of(weight_numel(), weight_dtype) + (bias_dtype.empty() ? 0 : bytes_of(bias_numel, bias_dtype));
}

uint64_t quantized_weight_bytes(const std::vector<uint64_t>& shape, const std::string& dtype, Quantization q) {
  uint64_t numel = numel_of(shape);
  if (q == Quantization::None || q == Quantization::Lossless || !safetensors_dtype_is_wide_float(dtype) ||
      shape.empty())
    return bytes_of(numel, dtype);  // lossless: layer_specs() takes the measured size
  uint64_t rows = shape[0];
  if (rows == 0 || numel == 0) return 0;
  uint64_t in = numel / rows;
  // The exact size of the packed buffer the runtime uses (core/quant.h:
  // sections 256-byte aligned). A shape the format cannot lay out (int4 with
  // in % 128 != 0) streams unquantized, as offload() streams it (with a warning:
  // quant_check), so it is planned as stored.
  quant::Format fmt = q == Quantization::Int8  ? quant::Format::Int8
                      : q == Quantization::FP8 ? quant::Format::Fp8E4M3
                      : q == Quantization::NF4 ? quant::Format::NF4
                                               : quant::Format::Int4;
  if (rows <= static_cast<uint64_t>(INT64_MAX) && in <= static_cast<uint64_t>(INT64_MAX)) {
    try {
      return quant::layout_for(fmt, static_cast<int64_t>(rows), static_cast<int64_t>(in)).total_bytes();
    } catch (const Error&) {
    }
  }
  return bytes_of(numel, dtype);
}

double experts_reached(double active, uint64_t tokens) {
  return 1.0 - std::pow(1.0 - active, static_cast<double>(tokens));
}

namespace {
// A float tensor's gradient and optimizer-state bytes (optim::train_bytes); 0
// for any other (integers, 8-bit floats, GGUF blocks: they do not train).
uint64_t tensor_train_bytes(const optim::TrainSpec& train, const std::vector<uint64_t>& shape,
                            const std::string& dtype) {
  if (!safetensors_dtype_is_wide_float(dtype)) return 0;
  return optim::train_bytes(train, std::vector<int64_t>(shape.begin(), shape.end()),
                            safetensors_dtype_bits(dtype) / 8);
}
}  // namespace

uint64_t small_train_bytes(const ModelDescription& m, const LayerOptions& opt) {
  if (!opt.training) return 0;
  const optim::TrainSpec train = optim::parse_train_spec(opt.train);
  uint64_t total = 0;
  for (const auto& [shape, dtype] : m.small_shapes) total += tensor_train_bytes(train, shape, dtype);
  return total;
}

std::vector<PlannerLayer> layer_specs(const ModelDescription& m, const LayerOptions& opt) {
  const optim::TrainSpec train = optim::parse_train_spec(opt.training ? opt.train : "");
  std::vector<PlannerLayer> out;
  const double tokens = static_cast<double>(opt.tokens);
  // LayerOptions::activations: a linear layer's saved input, tokens x in_features.
  // An input several layers read (q, k and v) once: reads_an_earlier_layers_input.
  auto saved_input_bytes = [&](const ModelLayer& l, const std::string& dtype) -> uint64_t {
    if (!opt.training || !opt.activations || l.weight_shape.empty() || l.weight_shape[0] == 0) return 0;
    if (reads_an_earlier_layers_input(m.layers, static_cast<size_t>(&l - m.layers.data()))) return 0;
    return bytes_of(opt.tokens * (l.weight_numel() / l.weight_shape[0]), dtype);
  };
  for (const auto& l : m.layers) {
    PlannerLayer s;
    s.name = l.name;
    if (l.group) {
      // A tensor group: all of it in one slot; quantized, each tensor of 2+
      // dimensions crosses packed (a matrix of its last dimension's columns)
      // and is dequantized into the slot's workspace (in compute_dtype, else
      // as stored), as offload() does. Never cast otherwise. Only the active
      // experts compute.
      std::vector<slot_layout::Part> parts;
      // Trained, a coded tensor's slot part holds its largest coding, and the
      // host its dense copy too (Note [Trainable coded weights], engine_coded.cpp).
      std::vector<slot_layout::Part> slot_parts;
      uint64_t host = 0;
      bool gguf = false, narrow = true;  // narrow: every tensor written on the device is 2 bytes wide
      bool packed = false, coded_trained = false;  // some tensor crosses packed or coded; a coded one trains
      for (size_t k = 0; k < l.group_tensors.size(); ++k) {
        const auto& [shape, dtype] = l.group_tensors[k];
        const uint64_t numel = numel_of(shape);
        const bool pack = opt.quantize != Quantization::None && opt.quantize != Quantization::Lossless &&
                          shape.size() >= 2 && shape.back() > 0 &&
                          safetensors_dtype_is_wide_float(dtype);
        const uint64_t coded = opt.quantize == Quantization::Lossless && k < l.group_lossless_bytes.size()
                                   ? l.group_lossless_bytes[k]
                                   : 0;
        if (!l.dense_dtype.empty() && safetensors_dtype_bits(dtype) == 0) {
          // GGUF blocks (load_gguf): they cross as they are, padded as the
          // engine stores them, and are dequantized into the workspace.
          gguf = true;
          const std::string& written = opt.compute_dtype.empty() ? l.dense_dtype : opt.compute_dtype;
          parts.push_back({bytes_of(numel, dtype), bytes_of(numel, written)});
          narrow = narrow && safetensors_dtype_bits(written) <= 16;
        } else if (coded) {  // decoded into its own dtype
          packed = true;
          parts.push_back({coded, bytes_of(numel, dtype)});
          narrow = narrow && safetensors_dtype_bits(dtype) <= 16;
        } else if (pack) {
          packed = true;
          const std::string& written = opt.compute_dtype.empty() ? dtype : opt.compute_dtype;
          parts.push_back({quantized_weight_bytes({numel / shape.back(), shape.back()}, dtype, opt.quantize),
                           bytes_of(numel, written)});
          narrow = narrow && safetensors_dtype_bits(written) <= 16;
        } else {
          parts.push_back({bytes_of(numel, dtype), 0});
        }
        slot_parts.push_back(parts.back());
        host += parts.back().bus;
        if (coded && opt.training) {  // the pieces as the measure cut them (one per expert of dim 0)
          coded_trained = true;
          const lossless::Dtype d = lossless_dtype(dtype);
          const int64_t n = static_cast<int64_t>(numel);
          const int64_t count =
              shape.size() >= 3 ? lossless::expert_pieces(d, n, int64_t(shape[0]), int64_t(shape[0])) : 1;
          slot_parts.back().bus = lossless::max_pieces_bytes(d, n, count);
          host += bytes_of(numel, dtype) + slot_parts.back().bus - coded;
        }
      }
      const slot_layout::Layout layout = slot_layout::of(parts);  // each part aligned, as the engine lays them out
      const uint64_t workspace = layout.workspace_bytes;
      const uint64_t bus = l.group_tensors.empty() ? l.group_bytes : layout.bus_bytes;
      s.bytes = bus;
      if (workspace) s.slot_bytes = slot_layout::of(slot_parts).slot_bytes();  // else 0: the bus bytes
      if (coded_trained) s.host_bytes = host;
      s.narrow_write = workspace && narrow;
      // Resident, a group with GGUF tensors is dense (group_bytes: dequantized).
      s.resident_bytes = opt.resident_dequantized || gguf ? l.group_bytes : bus;
      s.flops = 2.0 * tokens * static_cast<double>(l.group_params) * l.active * (opt.training ? 3.0 : 1.0);
      // GGUF tensors are frozen; a lossless group trains coded.
      s.trainable = opt.training && (opt.quantize == Quantization::None || opt.quantize == Quantization::Lossless) &&
                    !gguf;
      if (s.trainable)
        for (const auto& [shape, dtype] : l.group_tensors) s.train_bytes += tensor_train_bytes(train, shape, dtype);
      s.as_stored = gguf || (opt.quantize != Quantization::None && !packed);  // nothing to pack
      if (opt.routed_experts && l.active < 1.0) {
        const double share = experts_reached(l.active, opt.tokens);
        if (share <= 0.5) s.routed_bytes = std::max<uint64_t>(1, static_cast<uint64_t>(std::ceil(bus * share)));
      }
      out.push_back(std::move(s));
      continue;
    }
    // A tied layer reads the table's dense host copy: never quantized (as offload()).
    const Quantization quantize = l.tied_to.empty() ? opt.quantize : Quantization::None;
    if (!l.tied_to.empty()) {
      for (size_t j = 0; j < out.size(); ++j)
        if (out[j].name == l.tied_to && out[j].lookup) s.tied_table = static_cast<int>(j);
      LS_CHECK(s.tied_table >= 0, "layer ", json::quote(l.name), " is tied to ", json::quote(l.tied_to),
               ", which is not an embedding table before it");
      s.as_stored = true;
    }
    uint64_t bias = l.bias_dtype.empty() ? 0 : bytes_of(l.bias_numel, l.bias_dtype);
    const uint64_t w_stored = bytes_of(l.weight_numel(), l.weight_dtype);
    const bool lossless = quantize == Quantization::Lossless && l.lossless_bytes > 0 && !l.embedding;
    // Trained, a lossless weight stays dense on the host and its slot holds
    // its largest coded size (Note [Trainable coded weights], engine_coded.cpp).
    const uint64_t coded_max = lossless && opt.training ? lossless::max_encoded_bytes(lossless_dtype(l.weight_dtype),
                                                                                      int64_t(l.weight_numel()))
                                                        : 0;
    const uint64_t w_bus = lossless ? l.lossless_bytes : quantized_weight_bytes(l.weight_shape, l.weight_dtype, quantize);
    if (!l.dense_dtype.empty() && !l.embedding) {
      // GGUF blocks (load_gguf): they cross as they are (padded to 256 B, as
      // the engine stores them) and are dequantized in the slot to the
      // parameter's dtype (compute_dtype when given); resident, offload()
      // holds the dequantized weight.
      const std::string& dense = opt.compute_dtype.empty() ? l.dense_dtype : opt.compute_dtype;
      const uint64_t dense_w = bytes_of(l.weight_numel(), dense);
      const slot_layout::Layout layout = slot_layout::of({{w_stored, dense_w}, {bias, 0}});
      s.bytes = layout.bus_bytes;
      s.slot_bytes = layout.slot_bytes();
      s.resident_bytes = dense_w + bias;
      s.flops = 2.0 * tokens * static_cast<double>(l.params()) * (opt.training ? 3.0 : 1.0);
      s.trainable = false;  // a GGUF weight is frozen
      s.as_stored = true;
      s.narrow_write = safetensors_dtype_bits(dense) <= 16;
      s.activation_bytes = saved_input_bytes(l, dense);
      out.push_back(std::move(s));
      continue;
    }
    // The slot's workspace, written on the device after the copy: a
    // quantized layer's dequantized weight (in compute_dtype, else the stored
    // dtype), or a float weight / bias cast to compute_dtype.
    const std::string& cd = opt.compute_dtype;
    uint64_t w_written = 0, b_written = 0;
    if (lossless) {  // decoded into its own dtype (compute_dtype casts at use)
      w_written = w_stored;
      s.narrow_write = safetensors_dtype_bits(l.weight_dtype) <= 16;
    } else if (quantize != Quantization::None && w_bus != w_stored) {
      w_written = cd.empty() ? w_stored : bytes_of(l.weight_numel(), cd);
      s.narrow_write = safetensors_dtype_bits(cd.empty() ? l.weight_dtype : cd) <= 16;
    } else if (!cd.empty() && l.weight_dtype != cd && safetensors_dtype_is_wide_float(l.weight_dtype)) {
      w_written = bytes_of(l.weight_numel(), cd);
      s.narrow_write = safetensors_dtype_bits(cd) <= 16;
    }
    if (!cd.empty() && !l.bias_dtype.empty() && l.bias_dtype != cd && safetensors_dtype_is_wide_float(l.bias_dtype))
      b_written = bytes_of(l.bias_numel, cd);
    // The slot as the engine lays it out (EngineImpl::layout_of): each part aligned.
    s.bytes = slot_layout::of({{w_bus, w_written}, {bias, b_written}}).bus_bytes;
    if (w_written || b_written) {  // else 0: the bus bytes
      s.slot_bytes = slot_layout::of({{coded_max ? coded_max : w_bus, w_written}, {bias, b_written}}).slot_bytes();
      s.stored_slot_bytes = slot_layout::of({{w_stored, 0}, {bias, 0}}).slot_bytes();
    }
    if (coded_max) s.host_bytes = w_stored + coded_max + bias;
    s.resident_bytes = opt.resident_dequantized ? l.stored_bytes() : s.bytes;
    uint64_t rows = l.weight_shape.empty() ? 0 : l.weight_shape[0];
    uint64_t row_size = rows ? l.weight_numel() / rows : 0;
    s.flops = l.embedding ? tokens * static_cast<double>(row_size) : 2.0 * tokens * static_cast<double>(l.params());
    if (opt.training) s.flops *= 3.0;
    // Quantizing freezes the model, but for lossless (trainable weights stay dense on the host).
    s.trainable = opt.training && (opt.quantize == Quantization::None || opt.quantize == Quantization::Lossless);
    if (s.trainable && !l.embedding)  // a table is looked up on the host: its gradient is there
      s.train_bytes = tensor_train_bytes(train, l.weight_shape, l.weight_dtype) +
                      (l.bias_dtype.empty() ? 0 : tensor_train_bytes(train, {l.bias_numel}, l.bias_dtype));
    if (!l.embedding) s.activation_bytes = saved_input_bytes(l, cd.empty() ? l.weight_dtype : cd);
    if (l.embedding) {
      // As offload() does: a table is looked up in host memory (the rows a
      // step names cross the bus; a trainable one's gradient rows come back),
      // never quantized, never in a slot.
      s.bytes = s.resident_bytes = l.stored_bytes();
      s.slot_bytes = s.stored_slot_bytes = 0;
      s.lookup = true;
      s.lookup_bytes = opt.tokens * (rows ? l.stored_bytes() / rows : 0);
    }
    out.push_back(std::move(s));
  }
  return out;
}

namespace {

// Natural order: digit runs compare as numbers ("layers.2" < "layers.10").
bool natural_less(const std::string& a, const std::string& b) {
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    bool da = std::isdigit(static_cast<unsigned char>(a[i])), db = std::isdigit(static_cast<unsigned char>(b[j]));
    if (da && db) {
      size_t ie = i, je = j;
      while (ie < a.size() && std::isdigit(static_cast<unsigned char>(a[ie]))) ++ie;
      while (je < b.size() && std::isdigit(static_cast<unsigned char>(b[je]))) ++je;
      size_t is = i, js = j;
      while (is + 1 < ie && a[is] == '0') ++is;
      while (js + 1 < je && b[js] == '0') ++js;
      if (ie - is != je - js) return ie - is < je - js;
      int c = a.compare(is, ie - is, b, js, je - js);
      if (c != 0) return c < 0;
      i = ie;
      j = je;
    } else {
      if (a[i] != b[j]) return static_cast<unsigned char>(a[i]) < static_cast<unsigned char>(b[j]);
      ++i;
      ++j;
    }
  }
  if ((a.size() - i) != (b.size() - j)) return a.size() - i < b.size() - j;
  return a < b;
}

std::vector<std::string> split_dots(const std::string& s) {
  std::vector<std::string> out(1);
  for (char c : s) {
    if (c == '.')
      out.emplace_back();
    else
      out.back().push_back(c);
  }
  return out;
}

// Known module names in their usual execution order (attention before MLP,
// q/k/v/o, gate/up/down); -1 when unknown.
int component_rank(const std::string& c) {
  static const std::map<std::string, int> kRank = {
      {"self_attn", 0}, {"attn", 0},    {"attention", 0}, {"cross_attn", 1},   {"mlp", 2},
      {"ffn", 2},       {"feed_forward", 2}, {"q_proj", 10}, {"k_proj", 11}, {"v_proj", 12},
      {"o_proj", 13},   {"gate_proj", 20}, {"up_proj", 21},  {"down_proj", 22},
      // A mixture-of-experts block: its router, the experts it routes to, then a shared
      // expert (Qwen2/3-MoE `mlp.gate`, Mixtral `block_sparse_moe.gate`, GPT-OSS `mlp.router`).
      {"gate", 15},     {"router", 15},    {"experts", 16},  {"shared_expert", 17}, {"shared_expert_gate", 18}};
  auto it = kRank.find(c);
  return it == kRank.end() ? -1 : it->second;
}

bool looks_like_embedding(const std::string& prefix);

// Approximate execution order of checkpoint layers: embeddings first, the LM
// head last, otherwise component-wise natural order with known module names
// (component_rank) in execution order.
bool execution_less(const std::string& a, const std::string& b) {
  auto top = [](const std::string& n) {
    if (looks_like_embedding(n)) return 0;
    if (n == "lm_head" || (n.size() > 8 && n.compare(n.size() - 8, 8, ".lm_head") == 0)) return 2;
    return 1;
  };
  int ta = top(a), tb = top(b);
  if (ta != tb) return ta < tb;
  std::vector<std::string> ca = split_dots(a), cb = split_dots(b);
  for (size_t i = 0; i < std::min(ca.size(), cb.size()); ++i) {
    if (ca[i] == cb[i]) continue;
    int ra = component_rank(ca[i]), rb = component_rank(cb[i]);
    if (ra >= 0 && rb >= 0 && ra != rb) return ra < rb;
    return natural_less(ca[i], cb[i]);
  }
  if (ca.size() != cb.size()) return ca.size() < cb.size();
  return a < b;
}

bool looks_like_embedding(const std::string& prefix) {
  std::string last = prefix.substr(prefix.rfind('.') == std::string::npos ? 0 : prefix.rfind('.') + 1);
  std::transform(last.begin(), last.end(), last.begin(), [](unsigned char c) { return std::tolower(c); });
  return last.find("embed") != std::string::npos || last == "wte" || last == "wpe" || last == "token_embd";
}

}  // namespace

ModelDescription describe_checkpoint(const Checkpoint& ck) {
  ModelDescription m;
  m.name = ck.path;
  m.files = ck.files;
  std::map<std::string, const TensorInfo*> by_name;
  for (const auto& t : ck.tensors) by_name[t.name] = &t;
  std::set<std::string> used;
  std::vector<ModelLayer> layers;
  // Mixture of experts: every tensor under "<prefix>.experts." (per expert,
  // "experts.7.gate_proj.weight", or fused, "experts.gate_up_proj") joins the
  // group "<prefix>.experts", as offload() streams transformers' *Experts
  // modules (docs/design/torch-glue.md "Tensor groups").
  std::map<std::string, ModelLayer> groups;
  for (const auto& t : ck.tensors) {
    const size_t at = t.name.find(".experts.");
    if (at == std::string::npos) continue;
    ModelLayer& g = groups[t.name.substr(0, at + 8)];
    if (!g.group) {
      g.name = t.name.substr(0, at + 8);
      g.group = true;
      g.weight_dtype = t.dtype;
    }
    g.group_bytes += t.nbytes;
    g.group_params += t.numel;
    g.group_tensors.emplace_back(t.shape, t.dtype);
    g.group_tensor_names.push_back(t.name);
    used.insert(t.name);
  }
  // torch's nn.MultiheadAttention ("<prefix>.in_proj_weight", or separate
  // "q/k/v_proj_weight", and "<prefix>.out_proj.weight"): one group of all its
  // tensors, its out_proj's included, as offload() streams the module (its
  // forward reads them directly).
  for (const auto& t : ck.tensors) {
    std::string prefix;
    for (const char* s : {".in_proj_weight", ".q_proj_weight"}) {
      const std::string suf = s;
      if (t.name.size() > suf.size() && t.name.compare(t.name.size() - suf.size(), suf.size(), suf) == 0)
        prefix = t.name.substr(0, t.name.size() - suf.size());
    }
    if (prefix.empty() || used.count(t.name) || !by_name.count(prefix + ".out_proj.weight")) continue;
    ModelLayer g;
    g.name = prefix;
    g.group = true;
    g.weight_dtype = t.dtype;
    for (const char* s : {".in_proj_weight", ".q_proj_weight", ".k_proj_weight", ".v_proj_weight", ".in_proj_bias",
                          ".bias_k", ".bias_v", ".out_proj.weight", ".out_proj.bias"}) {
      auto it = by_name.find(prefix + s);
      if (it == by_name.end() || used.count(it->first)) continue;
      g.group_bytes += it->second->nbytes;
      g.group_params += it->second->numel;
      g.group_tensors.emplace_back(it->second->shape, it->second->dtype);
      g.group_tensor_names.push_back(it->first);
      used.insert(it->first);
    }
    groups[prefix] = std::move(g);
  }
  for (auto& [name, g] : groups) layers.push_back(std::move(g));
  for (const auto& t : ck.tensors) {
    if (used.count(t.name)) continue;
    const std::string suffix = ".weight";
    if (t.shape.size() < 2 || t.name.size() <= suffix.size() ||
        t.name.compare(t.name.size() - suffix.size(), suffix.size(), suffix) != 0)
      continue;
    ModelLayer l;
    l.name = t.name.substr(0, t.name.size() - suffix.size());
    l.weight_shape = t.shape;
    l.weight_dtype = t.dtype;
    used.insert(t.name);
    auto b = by_name.find(l.name + ".bias");
    if (b != by_name.end()) {
      l.bias_numel = b->second->numel;
      l.bias_dtype = b->second->dtype;
      used.insert(b->first);
    }
    // A table: an embedding-like name, a 2-D weight and no bias (Flux's
    // "x_embedder" and "context_embedder" are Linear layers with biases).
    l.embedding = looks_like_embedding(l.name) && t.shape.size() == 2 && l.bias_dtype.empty();
    layers.push_back(std::move(l));
  }
  std::stable_sort(layers.begin(), layers.end(),
                   [](const ModelLayer& a, const ModelLayer& b) { return execution_less(a.name, b.name); });
  m.layers = std::move(layers);
  for (const auto& t : ck.tensors) {
    if (used.count(t.name)) continue;
    m.small_bytes += t.nbytes;
    ++m.small_tensors;
    m.small_shapes.emplace_back(t.shape, t.dtype);
  }
  return m;
}

size_t cast_to_dtype(ModelDescription& m, const std::string& dtype) {
  auto floating = [](const std::string& d) {
    return d == "F64" || d == "F32" || d == "F16" || d == "BF16" || d == "F8_E4M3" || d == "F8_E5M2";
  };
  LS_CHECK(floating(dtype), "cast_to_dtype: ", json::quote(dtype), " is not a floating-point dtype");
  size_t changed = 0;
  auto cast = [&](std::string& d) {
    if (d.empty() || d == dtype || !floating(d)) return false;
    d = dtype;
    ++changed;
    return true;
  };
  for (ModelLayer& l : m.layers) {
    if (l.group) {
      l.group_bytes = 0;
      for (auto& [shape, d] : l.group_tensors) {
        l.cast = cast(d) || l.cast;
        l.group_bytes += bytes_of(numel_of(shape), d);
      }
    } else {
      l.cast = cast(l.weight_dtype) || l.cast;
      l.cast = cast(l.bias_dtype) || l.cast;
    }
  }
  m.small_bytes = 0;
  for (auto& [shape, d] : m.small_shapes) {
    cast(d);
    m.small_bytes += bytes_of(numel_of(shape), d);
  }
  return changed;
}

void measure_lossless(ModelDescription& m, const Checkpoint& ck, const std::string& as_dtype) {
  std::map<std::string, const TensorInfo*> by_name;
  for (const auto& t : ck.tensors) by_name[t.name] = &t;
  std::map<std::string, std::shared_ptr<SourceFile>> files;
  constexpr uint64_t kRuns = 16, kRunElems = 4096;
  std::vector<char> sample, cast;
  // The coded size of tensor `name` (with `by_expert`, a 3-D one in a piece
  // per expert, lossless::expert_pieces); 0 when it is not in the checkpoint
  // or not coded (dtype, no elements).
  auto estimate = [&](const std::string& name, bool by_expert) -> uint64_t {
    const auto it = by_name.find(name);
    if (it == by_name.end()) return 0;
    const TensorInfo& t = *it->second;
    auto codable = [](const std::string& d) { return d == "F32" || d == "BF16" || d == "F16"; };
    if (!codable(t.dtype) || t.numel == 0) return 0;
    const lossless::Dtype stored = lossless_dtype(t.dtype);
    const lossless::Dtype d = codable(as_dtype) ? lossless_dtype(as_dtype) : stored;  // what offload() codes
    const uint64_t elem = lossless::element_bytes(stored);
    const int64_t pieces = by_expert && t.shape.size() >= 3
                               ? lossless::expert_pieces(d, int64_t(t.numel), int64_t(t.shape[0]), int64_t(t.shape[0]))
                               : 1;
    auto& f = files[t.file];
    if (!f) f = SourceFile::open(t.file, t.identity);
    // kRuns runs of kRunElems elements, evenly spaced (all of a small tensor).
    const uint64_t runs = std::min<uint64_t>(kRuns, (t.numel + kRunElems - 1) / kRunElems);
    const uint64_t run = std::min<uint64_t>(kRunElems, t.numel);
    sample.resize(static_cast<size_t>(runs * run * elem));
    for (uint64_t r = 0; r < runs; ++r) {
      const uint64_t first = runs > 1 ? (t.numel - run) / (runs - 1) * r : 0;
      f->read(sample.data() + r * run * elem, t.file_offset + first * elem, run * elem, t.name);
    }
    const char* values = sample.data();
    if (d != stored) {  // the sample cast to the model's dtype, as load_safetensors() casts it
      const uint64_t n = runs * run;
      cast.resize(static_cast<size_t>(n * lossless::element_bytes(d)));
      for (uint64_t i = 0; i < n; ++i) {
        float v = 0;
        if (stored == lossless::Dtype::F32) std::memcpy(&v, sample.data() + i * 4, 4);
        uint16_t h = 0;
        if (stored != lossless::Dtype::F32) std::memcpy(&h, sample.data() + i * 2, 2);
        if (stored == lossless::Dtype::BF16) v = quant::bf16_bits_to_float(h);
        if (stored == lossless::Dtype::F16) v = quant::f16_bits_to_float(h);
        if (d == lossless::Dtype::F32) {
          std::memcpy(cast.data() + i * 4, &v, 4);
        } else {
          h = d == lossless::Dtype::BF16 ? quant::float_to_bf16_bits(v) : quant::float_to_f16_bits(v);
          std::memcpy(cast.data() + i * 2, &h, 2);
        }
      }
      values = cast.data();
    }
    return lossless::estimate_encoded_bytes(d, values, static_cast<int64_t>(runs * run),
                                            static_cast<int64_t>(t.numel) / pieces) *
           static_cast<uint64_t>(pieces);
  };
  for (auto& l : m.layers) {
    if (!l.dense_dtype.empty()) continue;  // GGUF blocks cross as they are
    if (!l.group) {
      l.lossless_bytes = estimate(l.name + ".weight", false);
      continue;
    }
    // A group's tensors of 2+ dimensions; a fused expert tensor (dim 0 the
    // experts) in a piece per expert, as offload(experts="routed") codes it.
    l.group_lossless_bytes.assign(l.group_tensors.size(), 0);
    for (size_t k = 0; k < l.group_tensors.size() && k < l.group_tensor_names.size(); ++k)
      if (l.group_tensors[k].first.size() >= 2)
        l.group_lossless_bytes[k] = estimate(l.group_tensor_names[k], true);
  }
}

ModelDescription describe_gguf(const GgufFile& g, const std::string& dense_dtype) {
  LS_CHECK(safetensors_dtype_is_wide_float(dense_dtype), "the dense dtype of GGUF weights must be F32, BF16 or "
           "F16 (the model's parameter dtype), got ", json::quote(dense_dtype));
  Checkpoint ck;
  ck.path = g.path;
  ck.files = {g.path};
  for (const auto& t : g.tensors) {
    const bool plain = safetensors_dtype_bits(t.type_name) > 0;
    LS_CHECK(plain || ggml_type_format(t.type) != quant::Format::None,
             gguf_type_unreadable(g.path, t.name, t.type_name));
    TensorInfo i;
    i.name = t.name;
    // llama.cpp's expert tensors ("blk.7.ffn_up_exps.weight"): one group per
    // block, "blk.7.experts", as load_gguf(rename="llama.cpp") puts them into
    // transformers' experts module, which offload() streams as one group.
    const std::string exps = "_exps.weight";
    const size_t ffn = t.name.find(".ffn_");
    if (t.name.rfind("blk.", 0) == 0 && ffn != std::string::npos && t.name.size() > exps.size() &&
        t.name.compare(t.name.size() - exps.size(), exps.size(), exps) == 0)
      i.name = t.name.substr(0, ffn) + ".experts." + t.name.substr(ffn + 1, t.name.size() - ffn - 1 - 7);
    i.dtype = t.type_name;
    i.shape = t.shape;
    i.numel = t.numel;
    i.nbytes = t.nbytes;
    i.file = g.path;
    ck.tensors.push_back(std::move(i));
  }
  ModelDescription m = describe_checkpoint(ck);
  // Plain F32/F16/BF16 tensors: load_gguf() casts them to the model's dtype (the
  // packed ones are not floating types here: left to the loop below).
  cast_to_dtype(m, dense_dtype);
  const auto packed = [](const std::string& dtype) { return safetensors_dtype_bits(dtype) == 0; };
  // The share of experts one token runs, from the file (<arch>.expert_used_count / expert_count).
  double active = 1.0;
  const auto arch = g.metadata.find("general.architecture");
  if (arch != g.metadata.end()) {
    const auto number = [&](const std::string& key) {
      const auto it = g.metadata.find(arch->second + "." + key);
      char* end = nullptr;
      const double v = it == g.metadata.end() ? 0.0 : std::strtod(it->second.c_str(), &end);
      return it != g.metadata.end() && end != it->second.c_str() && *end == '\0' && v > 0 ? v : 0.0;
    };
    const double used = number("expert_used_count"), count = number("expert_count");
    if (used > 0 && count >= used) active = used / count;
  }
  for (auto& l : m.layers) {
    if (l.group) {
      // Tensors in a GGUF block type stay packed (load_gguf) and are
      // dequantized in the slot to dense_dtype; group_bytes is the dense
      // (resident) size.
      l.group_bytes = 0;
      for (const auto& [shape, dtype] : l.group_tensors) {
        if (packed(dtype)) l.dense_dtype = dense_dtype;
        l.group_bytes += bytes_of(numel_of(shape), packed(dtype) ? dense_dtype : dtype);
      }
      if (packed(l.weight_dtype)) l.weight_dtype = dense_dtype;
      l.active = active;
    } else if (packed(l.weight_dtype)) {
      if (l.embedding) l.weight_dtype = dense_dtype;  // dequantized on load
      else l.dense_dtype = dense_dtype;
    }
    if (!l.bias_dtype.empty() && packed(l.bias_dtype)) l.bias_dtype = dense_dtype;
  }
  return m;
}

std::string add_tied_head(ModelDescription& m, const std::string& config_json, const std::string& what) {
  const json::Value cfg = json::parse(config_json, what);
  if (!cfg.is_object()) return "";
  const auto last_part = [](const std::string& n) { return n.substr(n.rfind('.') == std::string::npos ? 0 : n.rfind('.') + 1); };
  for (const auto& l : m.layers)
    if (last_part(l.name) == "lm_head" || !l.tied_to.empty()) return "";  // the head is there
  // tie_word_embeddings: top level, else in text_config (multimodal configs).
  const json::Value* tie = cfg.find("tie_word_embeddings");
  const json::Value* text = cfg.find("text_config");
  if ((tie == nullptr || !tie->is_bool()) && text != nullptr && text->is_object()) tie = text->find("tie_word_embeddings");
  bool tied = false;
  if (tie != nullptr && tie->is_bool()) {
    tied = tie->boolean;
  } else if (const json::Value* archs = cfg.find("architectures"); archs != nullptr && archs->is_array()) {
    for (const auto& a : archs->array) {
      if (!a.is_string()) continue;
      for (const char* suffix : {"ForCausalLM", "LMHeadModel", "ForConditionalGeneration"}) {
        const std::string sfx = suffix;
        if (a.text.size() >= sfx.size() && a.text.compare(a.text.size() - sfx.size(), sfx.size(), sfx) == 0)
          tied = true;
      }
    }
  }
  if (!tied) return "";
  uint64_t vocab = 0;
  const json::Value* v = cfg.find("vocab_size");
  if ((v == nullptr || !v->is_number()) && text != nullptr && text->is_object()) v = text->find("vocab_size");
  const bool know_vocab = v != nullptr && v->to_uint64(vocab);
  const ModelLayer* table = nullptr;
  for (const auto& l : m.layers) {
    const std::string last = last_part(l.name);
    if (!l.embedding || l.weight_shape.size() != 2) continue;
    if (last != "embed_tokens" && last != "wte" && last != "word_embeddings" && last != "shared") continue;
    if (know_vocab && l.weight_shape[0] != vocab) continue;
    if (table == nullptr) table = &l;
  }
  if (table == nullptr) return "";
  ModelLayer head;
  head.name = "lm_head";
  head.weight_shape = table->weight_shape;
  head.weight_dtype = table->weight_dtype;
  head.tied_to = table->name;
  const std::string name = table->name;
  m.layers.push_back(std::move(head));  // last in execution order
  return name;
}

double set_expert_activity(ModelDescription& m, const std::string& config_json, const std::string& what) {
  const json::Value cfg = json::parse(config_json, what);
  if (!cfg.is_object()) return 0.0;
  const json::Value* text = cfg.find("text_config");
  // A key's value, 0 when absent (or null); a value that is not a count of
  // experts is refused (it was ignored as if absent, and every expert planned).
  const char* e_key = "num_experts";
  auto number = [&](const char* key) -> double {
    for (const json::Value* c : {&cfg, text}) {
      if (c == nullptr || !c->is_object()) continue;
      const json::Value* x = c->find(key);
      if (x == nullptr || x->is_null()) continue;
      uint64_t v = 0;
      LS_CHECK(x->to_uint64(v) && v > 0, what, ": ", key, " is ",
               x->is_number() ? x->text : x->is_string() ? json::quote(x->text) : json::to_string(x->type),
               ", not a whole number of experts above 0; correct it, or remove the key to plan every expert");
      return static_cast<double>(v);
    }
    return 0.0;
  };
  const double k = number("num_experts_per_tok");
  double e = number(e_key);
  if (e == 0.0) e = number(e_key = "num_local_experts");
  if (e == 0.0) e = number(e_key = "n_routed_experts");
  LS_CHECK(k == 0.0 || e == 0.0 || k <= e, what, ": num_experts_per_tok ", k, " is more than the model's ", e,
           " experts (", e_key, "); correct it, or remove the key to plan every expert");
  if (k == 0.0 || e == 0.0) return 0.0;
  bool any = false;
  for (auto& l : m.layers)
    if (l.group) {
      l.active = k / e;
      any = true;
    }
  return any ? k / e : 0.0;
}

namespace {

struct Builder {
  ModelDescription m;
  std::string dtype;
  void linear(const std::string& name, uint64_t out, uint64_t in, bool bias) {
    ModelLayer l;
    l.name = name;
    l.weight_shape = {out, in};
    l.weight_dtype = dtype;
    if (bias) {
      l.bias_numel = out;
      l.bias_dtype = dtype;
    }
    m.layers.push_back(std::move(l));
  }
  void embedding(const std::string& name, uint64_t rows, uint64_t dim) {
    linear(name, rows, dim, false);
    m.layers.back().embedding = true;
  }
  void small(uint64_t numel, int count = 1) {
    m.small_bytes += bytes_of(numel, dtype) * static_cast<uint64_t>(count);
    m.small_tensors += static_cast<size_t>(count);
    for (int i = 0; i < count; ++i) m.small_shapes.push_back({{numel}, dtype});
  }
};

ModelDescription gpt2(const std::string& name, uint64_t d, int n_layers) {
  Builder b;
  b.m.name = name;
  b.dtype = "F32";
  b.embedding("transformer.wte", 50257, d);
  b.embedding("transformer.wpe", 1024, d);
  for (int i = 0; i < n_layers; ++i) {
    std::string p = "transformer.h." + std::to_string(i) + ".";
    b.small(d, 2);  // ln_1 weight + bias
    b.linear(p + "attn.c_attn", 3 * d, d, true);
    b.linear(p + "attn.c_proj", d, d, true);
    b.small(d, 2);  // ln_2
    b.linear(p + "mlp.c_fc", 4 * d, d, true);
    b.linear(p + "mlp.c_proj", d, 4 * d, true);
  }
  b.small(d, 2);  // ln_f
  b.linear("lm_head", 50257, d, false);
  b.m.layers.back().tied_to = "transformer.wte";  // tied: it streams wte's host copy
  return b.m;
}

ModelDescription llama(const std::string& name, uint64_t d, int n_layers, uint64_t ff, uint64_t kv_dim,
                       uint64_t vocab) {
  Builder b;
  b.m.name = name;
  b.dtype = "BF16";
  b.embedding("model.embed_tokens", vocab, d);
  for (int i = 0; i < n_layers; ++i) {
    std::string p = "model.layers." + std::to_string(i) + ".";
    b.small(d);  // input_layernorm
    b.linear(p + "self_attn.q_proj", d, d, false);
    b.linear(p + "self_attn.k_proj", kv_dim, d, false);
    b.linear(p + "self_attn.v_proj", kv_dim, d, false);
    b.linear(p + "self_attn.o_proj", d, d, false);
    b.small(d);  // post_attention_layernorm
    b.linear(p + "mlp.gate_proj", ff, d, false);
    b.linear(p + "mlp.up_proj", ff, d, false);
    b.linear(p + "mlp.down_proj", d, ff, false);
  }
  b.small(d);  // model.norm
  b.linear("lm_head", vocab, d, false);
  return b.m;
}

ModelDescription flux_dev() {
  const uint64_t h = 3072, mlp = 12288;
  Builder b;
  b.m.name = "flux-dev";
  b.dtype = "BF16";
  b.linear("img_in", h, 64, true);
  b.linear("time_in.in_layer", h, 256, true);
  b.linear("time_in.out_layer", h, h, true);
  b.linear("guidance_in.in_layer", h, 256, true);
  b.linear("guidance_in.out_layer", h, h, true);
  b.linear("vector_in.in_layer", h, 768, true);
  b.linear("vector_in.out_layer", h, h, true);
  b.linear("txt_in", h, 4096, true);
  for (int i = 0; i < 19; ++i) {
    std::string p = "double_blocks." + std::to_string(i) + ".";
    for (const char* s : {"img", "txt"}) {
      std::string q = p + s;
      b.linear(q + "_mod.lin", 6 * h, h, true);
      b.linear(q + "_attn.qkv", 3 * h, h, true);
      b.small(128, 2);  // q/k norm scales
      b.linear(q + "_attn.proj", h, h, true);
      b.linear(q + "_mlp.0", mlp, h, true);
      b.linear(q + "_mlp.2", h, mlp, true);
    }
  }
  for (int i = 0; i < 38; ++i) {
    std::string p = "single_blocks." + std::to_string(i) + ".";
    b.linear(p + "modulation.lin", 3 * h, h, true);
    b.linear(p + "linear1", 3 * h + mlp, h, true);
    b.small(128, 2);
    b.linear(p + "linear2", h, h + mlp, true);
  }
  b.linear("final_layer.adaLN_modulation.1", 2 * h, h, true);
  b.linear("final_layer.linear", 64, h, true);
  return b.m;
}

// Qwen3-30B-A3B (transformers' layout): 48 layers of GQA attention (32 query
// heads, 4 key/value heads of 128) and a mixture of 128 experts of width 768,
// 8 per token, fused as transformers holds them (gate_up_proj [experts,
// 2 * 768, 2048], down_proj [experts, 2048, 768]): one tensor group each.
ModelDescription qwen3_30b_a3b() {
  const uint64_t d = 2048, q = 32 * 128, kv = 4 * 128, experts = 128, inter = 768, vocab = 151936;
  Builder b;
  b.m.name = "qwen3-30b-a3b";
  b.dtype = "BF16";
  b.embedding("model.embed_tokens", vocab, d);
  for (int i = 0; i < 48; ++i) {
    std::string p = "model.layers." + std::to_string(i) + ".";
    b.small(d);  // input_layernorm
    b.linear(p + "self_attn.q_proj", q, d, false);
    b.linear(p + "self_attn.k_proj", kv, d, false);
    b.linear(p + "self_attn.v_proj", kv, d, false);
    b.small(128, 2);  // q_norm, k_norm
    b.linear(p + "self_attn.o_proj", d, q, false);
    b.small(d);  // post_attention_layernorm
    b.linear(p + "mlp.gate", experts, d, false);  // the router
    ModelLayer g;
    g.name = p + "mlp.experts";
    g.group = true;
    g.weight_dtype = b.dtype;
    g.group_tensors = {{{experts, 2 * inter, d}, b.dtype}, {{experts, d, inter}, b.dtype}};
    g.group_params = experts * 3 * inter * d;
    g.group_bytes = bytes_of(g.group_params, b.dtype);
    g.active = 8.0 / 128.0;
    b.m.layers.push_back(std::move(g));
  }
  b.small(d);  // model.norm
  b.linear("lm_head", vocab, d, false);
  return b.m;
}

}  // namespace

std::vector<std::string> builtin_model_names() {
  return {"gpt2-small", "gpt2-xl", "llama-7b", "llama-13b", "llama-70b", "flux-dev", "qwen3-30b-a3b"};
}

ModelDescription builtin_model(const std::string& name) {
  if (name == "gpt2-small") return gpt2(name, 768, 12);
  if (name == "gpt2-xl") return gpt2(name, 1600, 48);
  if (name == "llama-7b") return llama(name, 4096, 32, 11008, 4096, 32000);
  if (name == "llama-13b") return llama(name, 5120, 40, 13824, 5120, 32000);
  if (name == "llama-70b") return llama(name, 8192, 80, 28672, 1024, 32000);
  if (name == "flux-dev") return flux_dev();
  if (name == "qwen3-30b-a3b") return qwen3_30b_a3b();
  std::string names;
  for (const auto& n : builtin_model_names()) names += (names.empty() ? "" : ", ") + n;
  LS_FAIL("unknown model ", json::quote(name), " (built-in models: ", names, ")");
}

}  // namespace layerstream
