// layerstream — LibTorch glue: tensor groups and the expert-routed fetch
// (the engine's rooms: engine_impl.h).
#include "engine_impl.h"

#include <algorithm>
#include <cstring>

#include "core/log.h"
#include "core/offload_policy.h"

namespace layerstream {

int EngineImpl::add_group(const std::string& name, const std::vector<torch::Tensor>& tensors, quant::Format format,
                      int64_t experts, const std::vector<PrepackedPart>& prepacked) {
  auto scope = device_scope();
  std::lock_guard<std::recursive_mutex> lock(mu_);
  LS_CHECK(!detached_, "this layerstream handle was detached; create a new one with offload()");
  LS_CHECK(!tensors.empty(), "tensor group '", name, "' has no tensors");
  LS_CHECK(experts >= 0, "tensor group '", name, "': experts must be >= 0 (0: not indexed by expert), got ",
           experts);
  for (size_t k = 0; k < tensors.size(); ++k) {
    const torch::Tensor& t = tensors[k];
    // Raw bytes (diffusers' GGUF blocks, which the module's own forward decodes)
    // stream as they are: frozen, never quantized or cast.
    LS_CHECK(t.defined(), "tensor group '", name, "': tensor #", k, " is undefined");
    LS_CHECK(t.is_floating_point() || !t.requires_grad(), "tensor group '", name, "': tensor #", k, " (",
             layerstream::dtype_name(t.scalar_type()), ") requires grad but is not floating point; a tensor "
             "group trains floating-point tensors only: freeze it (requires_grad_(False)) or keep the module "
             "resident");
    for (const auto& l : layers_) {
      bool taken = l->weight.is_same(t) || (l->bias.defined() && l->bias.is_same(t));
      for (const auto& e : l->parts()) taken = taken || e.param.is_same(t);
      LS_CHECK(!taken, "tensor group '", name, "': tensor #", k, " is already streamed by layer '", l->name,
               "'; a tensor can be in one streamed layer only");
    }
    for (size_t j = 0; j < k; ++j)
      LS_CHECK(!tensors[j].is_same(t), "tensor group '", name, "' lists one tensor twice");
    const bool pre = k < prepacked.size() && prepacked[k].format != quant::Format::None;
    // Lossless trains coded (Note [Trainable coded weights], engine_coded.cpp).
    if ((format != quant::Format::None && format != quant::Format::Lossless && t.dim() >= 2 && t.is_floating_point()) ||
        pre)
      LS_CHECK(!t.requires_grad(), "tensor group '", name, "': tensor #", k, " requires grad, but a quantized "
               "tensor cannot be trained; freeze it (requires_grad_(False) in Python, requires_grad_(false) in C++) or "
               "do not quantize this group");
    if (pre) {
      LS_CHECK(quant::is_gguf(prepacked[k].format), "tensor group '", name, "': tensor #", k,
               ": pre-packed tensors are supported in the GGUF formats only, got ",
               quant::to_string(prepacked[k].format));
      LS_CHECK(t.dim() >= 2 && t.numel() > 0, "tensor group '", name, "': pre-packed tensor #", k,
               " must have 2 or more dimensions and elements, got ", shape_str(t.sizes().vec()));
    }
  }
  LS_CHECK(prepacked.empty() || prepacked.size() == tensors.size(), "tensor group '", name, "': ",
           prepacked.size(), " pre-packed entries for ", tensors.size(), " tensors (give one per tensor, or none)");
  LayerInfo info;
  info.name = name;
  info.kind = GroupKind{};
  for (size_t k = 0; k < tensors.size(); ++k) {
    LayerInfo::Part e;
    e.param = tensors[k];
    e.shape = e.param.sizes().vec();
    e.dtype = e.param.scalar_type();
    const std::string label = name + "#" + std::to_string(k);
    const bool pre = !prepacked.empty() && prepacked[k].format != quant::Format::None;
    const bool trainable_coded = format == quant::Format::Lossless && e.param.dim() >= 2 && e.param.requires_grad();
    if (pre || (format != quant::Format::None && e.param.dim() >= 2 && e.param.is_floating_point() &&
                !trainable_coded)) {
      // Packed as a matrix of the last dimension's columns (an expert's rows
      // follow each other), dequantized into the workspace after the copy.
      const quant::Format f = pre ? prepacked[k].format : format;
      const int64_t cols = e.shape.back();
      const int64_t rows = cols ? e.param.numel() / cols : 0;
      if (pre) {
        LS_CHECK(e.dtype == torch::kFloat || e.dtype == torch::kBFloat16 || e.dtype == torch::kHalf,
                 "tensor group '", name, "': pre-packed tensor #", k, " must be float32, bfloat16 or float16 "
                 "(its dense dtype), got ", e.dtype);
        const torch::Tensor b = prepacked[k].bytes.detach().to(torch::kCPU).contiguous();
        LS_CHECK(b.element_size() == 1 && !b.is_floating_point(), "tensor group '", name, "': the bytes of "
                 "pre-packed tensor #", k, " must be an int8/uint8 tensor, got ", b.scalar_type());
        try {
          e.qlayout = quant::layout_for(f, rows, cols);
        } catch (const Error& err) {
          LS_FAIL("tensor group '", name, "': pre-packed tensor #", k, " (", shape_str(e.shape), ") cannot be ",
                  quant::to_string(f), ": ", err.message());
        }
        LS_CHECK(static_cast<size_t>(b.numel()) == e.qlayout.data_bytes, "tensor group '", name,
                 "': pre-packed tensor #", k, " ", shape_str(e.shape), " in ", quant::to_string(f), " needs ",
                 e.qlayout.data_bytes, " bytes, got ", b.numel());
        // The layout pads its section to 256 bytes: zeros, as pack() leaves them.
        e.bytes = e.qlayout.total_bytes();
        e.index = store_->add(e.bytes, nullptr, label + "[" + quant::to_string(f) + "]");
        e.host = store_->buffer(e.index).ptr;
        std::memset(e.host, 0, e.bytes);
        std::memcpy(static_cast<char*>(e.host) + e.qlayout.data_offset(), b.data_ptr(), e.qlayout.data_bytes);
      } else {
        torch::NoGradGuard ng;
        const torch::Tensor src = e.param.detach().to(torch::kCPU).contiguous();
        try {
          const quant::SrcDtype d = src_dtype_of(src.scalar_type(), name);
          if (f == quant::Format::Lossless) {
            // Coded bit for bit, per expert when indexed by expert (Piece).
            const int64_t count = lossless::expert_pieces(d, src.numel(), e.shape[0], experts);
            const lossless::PiecesAnalysis P = lossless::analyze_pieces(d, src.data_ptr(), src.numel(), count);
            e.bytes = P.total_bytes();
            e.qlayout = quant::lossless_layout(rows, cols, e.bytes);
            e.index = store_->add(e.bytes, nullptr, label + "[lossless]");
            e.host = store_->buffer(e.index).ptr;
            lossless::encode_pieces(P, src.data_ptr(), e.host, e.bytes);
            e.piece_layout = P.pieces.front().layout;
            for (size_t p = 0; p < P.pieces.size(); ++p) {
              e.pieces.push_back({P.offsets[p], P.pieces[p].total_bytes()});
              // One layout for all (decode_pieces_cuda reads only the code and the stream's length).
              const lossless::Layout &a = P.pieces[p].layout, &b = e.piece_layout;
              LS_INTERNAL_CHECK(a.dtype == b.dtype && a.numel == b.numel && a.block_elems == b.block_elems &&
                                    a.num_blocks == b.num_blocks,
                                "(lossless pieces of '", name, "' with different layouts)");
            }
          } else {
            e.qlayout = quant::layout_for(f, rows, cols);
            e.bytes = e.qlayout.total_bytes();
            e.index = store_->add(e.bytes, nullptr, label + "[" + quant::to_string(f) + "]");
            e.host = store_->buffer(e.index).ptr;
            quant::pack(f, src.data_ptr(), d, rows, cols, e.host, 0);
          }
        } catch (const Error& err) {
          LS_FAIL("cannot quantize tensor #", k, " of group '", name, "' (", shape_str(e.shape), ") to ",
                  quant::to_string(f), ": ", err.message());
        }
      }
      e.qformat = f;
      // Lossless decodes into its own dtype (dequant_dtype does not apply).
      e.q_dtype = f == quant::Format::Lossless ? e.dtype : dequant_dtype_.value_or(e.dtype);
      e.param = meta_like(e.shape, e.dtype);  // the engine keeps no dense copy
      // An expert's rows start on whole blocks: GGUF rows always do; for our
      // formats, an expert's element count must be a multiple of 64 (whole nf4
      // blocks and 16 bytes of codes, what the device kernel loads at once);
      // lossless: one coded piece per expert.
      if (f == quant::Format::Lossless) {
        e.by_expert = e.pieces.size() > 1;
        e.expert_rows = e.by_expert ? rows / experts : 0;
      } else if (experts > 0 && e.shape[0] == experts && rows % experts == 0 &&
                 (quant::is_gguf(f) || (rows / experts * cols) % 64 == 0)) {
        e.by_expert = true;
        e.expert_rows = rows / experts;
      }
    } else {
      e.host = adopt(*store_, keepalive_, e.param, label, &e.index, &e.bytes, &e.strides);
      // Dim-0 slices are contiguous when dim 0 is the outermost (densely
      // laid out: adopt() keeps only dense, non-overlapping layouts).
      const int64_t n = e.param.numel();
      if (experts > 0 && e.shape[0] == experts && n > 0 &&
          (e.strides.empty() || e.strides[0] * experts == n)) {
        e.by_expert = true;
        e.expert_bytes = e.bytes / static_cast<size_t>(experts);
      }
      if (trainable_coded) {
        // Dense here, where backward and the optimizer write it; coded on the
        // bus, one piece per expert when by expert, re-coded before a copy
        // once it changed (Note [Trainable coded weights], engine_coded.cpp).
        LS_CHECK(e.param.is_contiguous(), "tensor group '", name, "': tensor #", k, " ", shape_str(e.shape),
                 " is not contiguous, so it cannot be lossless-coded; make it contiguous or do not quantize "
                 "this group");
        const quant::SrcDtype d = src_dtype_of(e.dtype, name);
        auto c = std::make_shared<CodedWeight>();
        c->piece_count = lossless::expert_pieces(d, n, e.shape[0], experts);
        c->capacity = lossless::max_pieces_bytes(d, n, c->piece_count);
        // Private to this process in a shared store: each rank codes its own copy.
        c->index = store_->add(c->capacity, nullptr, label + "[lossless]", /*shareable=*/false);
        c->buffer = store_->buffer(c->index).ptr;
        e.coded = std::move(c);
        e.q_dtype = e.dtype;  // decoded into its own dtype
        e.by_expert = e.coded->piece_count > 1;
      }
    }
    info.group().parts.push_back(std::move(e));
  }
  info.group().experts = experts;
  const slot_layout::Layout layout = layout_of(info);
  GroupKind& group = info.group();
  for (size_t k = 0; k < group.parts.size(); ++k) group.parts[k].ws_offset = layout.workspace_offsets[k];
  group.workspace_bytes = layout.workspace_bytes;
  return register_layer_locked(std::move(info));
}

static EngineImpl::LayerInfo::Part& group_part(EngineImpl::LayerInfo& l, int part) {
  LS_CHECK(l.is_group() && part >= 0 && static_cast<size_t>(part) < l.parts().size(), "layer '", l.name,
           "' has no tensor #", part, l.is_group() ? "" : " (it is not a tensor group)");
  return l.group().parts[static_cast<size_t>(part)];
}

std::string EngineImpl::requantize_refusal(int index, int part) {
  using detail::compose;
  std::lock_guard<std::recursive_mutex> lock(mu_);
  if (detached_) return "this layerstream handle was detached; write the module's tensors directly";
  LayerInfo& l = layer(index);
  if (part < 0) {
    if (l.on_disk())
      return compose("layer '", l.name, "' streams its weight from ", l.w_file->path, " (the disk tier), which "
                     "layerstream does not write: detach(), save the new weights to a checkpoint, load it and "
                     "offload() again");
    if (l.qformat == quant::Format::Lossless)
      return compose("layer '", l.name, "' streams its weight lossless-coded, whose size depends on its values: "
                     "new values cannot be coded into its place. detach(), load the weights, and offload() again");
    if (!l.packed_here)
      return compose("layer '", l.name, "' was not quantized by offload() (",
                     l.qformat == quant::Format::None ? "it is not quantized: write its parameter in place"
                                                      : "its weight came pre-packed: detach(), load, and offload() again",
                     ")");
    if (store_->in_shared(l.w_host))
      return shared_requantize_refusal("the quantized weight of streamed layer '" + l.name + "'");
    return "";
  }
  const LayerInfo::Part& e = group_part(l, part);
  if (e.qformat == quant::Format::None)
    return compose("tensor #", part, " of group '", l.name, "' is not quantized: write its parameter in place");
  if (e.qformat == quant::Format::Lossless)
    return compose("tensor #", part, " of group '", l.name, "' streams lossless-coded, whose size depends on its "
                   "values: new values cannot be coded into its place. detach(), load the weights, and offload() "
                   "again");
  if (store_->in_shared(e.host))
    return shared_requantize_refusal("tensor #" + std::to_string(part) + " of streamed group '" + l.name + "'");
  return "";
}

torch::Tensor EngineImpl::dequantized_part(int index, int part) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  LayerInfo::Part& e = group_part(*layers_.at(static_cast<size_t>(index)), part);
  LS_CHECK(e.qformat != quant::Format::None, "tensor #", part, " of group '", layers_[static_cast<size_t>(index)]->name,
           "' is not quantized");
  if (e.qformat == quant::Format::Lossless) {  // bit for bit, in its own dtype
    torch::Tensor dense = torch::empty(e.shape, torch::TensorOptions().dtype(e.dtype));
    const size_t piece_out = dense.nbytes() / e.pieces.size();
    for (size_t p = 0; p < e.pieces.size(); ++p)
      lossless::decode(static_cast<const char*>(e.host) + e.pieces[p].offset, e.pieces[p].bytes,
                       static_cast<char*>(dense.data_ptr()) + p * piece_out, piece_out, 0);
    return dense;
  }
  torch::Tensor dense = torch::empty(e.shape, torch::TensorOptions().dtype(torch::kFloat));
  quant::dequantize_cpu(e.qlayout, e.host, dense.data_ptr(), quant::OutDtype::F32, 0);
  return dense.to(e.dtype);
}

void EngineImpl::requantize_part(int index, int part, const torch::Tensor& dense) {
  auto scope = device_scope();
  LetGoAfterUnlock let_go;  // Note [Saved tensors are let go after the lock]
  std::lock_guard<std::recursive_mutex> lock(mu_);
  const std::string why = requantize_refusal(index, part);
  if (!why.empty()) LS_FAIL(why);
  LayerInfo& l = *layers_.at(static_cast<size_t>(index));
  LayerInfo::Part& e = group_part(l, part);
  LS_CHECK(dense.defined() && dense.sizes().vec() == e.shape, "group '", l.name, "': new tensor #", part,
           " of shape ", dense.defined() ? shape_str(dense.sizes().vec()) : "(undefined)", " does not match ",
           shape_str(e.shape));
  LS_CHECK(dense.is_floating_point() && !dense.is_meta(), "group '", l.name, "': new tensor #", part,
           " must be a floating-point tensor with values (not meta)");
  torch::NoGradGuard ng;
  const torch::Tensor src = dense.detach().to(torch::kCPU).to(e.dtype).contiguous();
  const int64_t cols = e.shape.back();
  const int64_t rows = cols ? src.numel() / cols : 0;
  std::vector<char> packed(e.bytes);
  try {
    quant::pack(e.qformat, src.data_ptr(), src_dtype_of(src.scalar_type(), l.name), rows, cols, packed.data(), 0);
  } catch (const Error& err) {
    LS_FAIL("cannot quantize the new tensor #", part, " of group '", l.name, "' to ", quant::to_string(e.qformat),
            ": ", err.message(), " (the old values are kept)");
  }
  wait_all_locked();  // no copy may read the host buffer while it changes; forgets cached slots
  std::memcpy(e.host, packed.data(), e.bytes);
}

std::pair<int64_t, std::vector<torch::Tensor>> EngineImpl::fetch(int layer_index, const std::vector<int64_t>& experts) {
  auto scope = device_scope();
  LayerInfo& l = call_layer(layer_index, "a tensor group");
  LS_CHECK(l.is_group(), "fetch(): layer '", l.name, "' is not a tensor group");
  LS_CHECK(experts.empty() || l.group().experts > 0, "fetch(): tensor group '", l.name, "' was not added as indexed by "
           "expert (add_group(..., experts)); fetch it whole");
  std::vector<int64_t> ids(experts);
  for (int64_t x : ids)
    LS_CHECK(x >= 0 && x < l.group().experts, "fetch(): expert ", x, " of tensor group '", l.name, "' is outside [0, ",
             l.group().experts, ")");
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  check_host_alias(l);
  ensure_scheduler();
  Stream cs = compute_stream();
  // Some experts only: copy their slices (unless the group is in a slot
  // already); more: the whole group, which may be prefetched.
  const bool routed = policy::fetch_some_experts(static_cast<int64_t>(ids.size()), l.group().experts);
  if (l.group().experts > 0) scheduler().set_prefetch(layer_index, !routed);
  Lease lease;
  if (routed) {
    std::vector<std::pair<int64_t, int64_t>> runs;  // consecutive experts, [begin, end)
    for (int64_t x : ids) {
      if (!runs.empty() && runs.back().second == x)
        runs.back().second = x + 1;
      else
        runs.push_back({x, x + 1});
    }
    recode_for_fetch(layer_index);
    PartialCopy copy;
    copy.ranges.resize(l.parts().size());
    for (size_t k = 0; k < l.parts().size(); ++k) {
      const LayerInfo::Part& e = l.parts()[k];
      auto& r = copy.ranges[k];
      if (e.coded) {  // trainable coded (recode_for_fetch above): its current pieces
        std::lock_guard<std::mutex> g(e.coded->mu);
        const auto& pieces = e.coded->pieces;
        if (!e.by_expert) {
          r.push_back({0, e.coded->coded_bytes()});
        } else {
          for (const auto& run : runs) {
            const auto& first = pieces[static_cast<size_t>(run.first)];
            const auto& last = pieces[static_cast<size_t>(run.second - 1)];
            r.push_back({first.offset, last.offset + last.bytes - first.offset});
          }
        }
      } else if (!e.by_expert) {
        r.push_back({0, e.bytes});
      } else if (e.qformat == quant::Format::None) {
        for (const auto& run : runs)
          r.push_back({static_cast<size_t>(run.first) * e.expert_bytes,
                       static_cast<size_t>(run.second - run.first) * e.expert_bytes});
      } else if (e.qformat == quant::Format::Lossless) {  // the runs' pieces lie back to back
        for (const auto& run : runs) {
          const auto& first = e.pieces[static_cast<size_t>(run.first)];
          const auto& last = e.pieces[static_cast<size_t>(run.second - 1)];
          r.push_back({first.offset, last.offset + last.bytes - first.offset});
        }
      } else {
        for (const auto& run : runs) {
          const quant::RowRange q = quant::row_range(e.qlayout, run.first * e.expert_rows, run.second * e.expert_rows);
          r.push_back({q.data_begin, q.data_bytes});
          r.push_back({q.scale_begin, q.scale_bytes});
          if (q.zero_bytes) r.push_back({q.zero_begin, q.zero_bytes});
        }
      }
    }
    if (l.group().workspace_bytes) copy.post_copy = make_group_post_copy(l, l.parts().size(), &runs);
    lease = scheduler().acquire_partial(layer_index, cs, current_phase(), copy);
    if (!lease.hit) routed_fetches_++;
  } else {
    lease = scheduler().acquire(layer_index, cs, current_phase());
  }
  // Views with their parameters' requires_grad: the module's forward then
  // takes the resident module's paths (Note [Same calls as the resident module]).
  std::vector<torch::Tensor> views;
  auto view = [&](void* ptr, const std::vector<int64_t>& shape, const std::vector<int64_t>& strides,
                  torch::ScalarType dtype) {
    const auto opts = torch::TensorOptions().dtype(dtype).device(compute_device_);
    views.push_back(strides.empty() ? torch::from_blob(ptr, shape, opts) : torch::from_blob(ptr, shape, strides, opts));
    if (l.parts()[views.size() - 1].param.requires_grad()) views.back().set_requires_grad(true);
  };
  for (size_t k = 0; k < l.parts().size(); ++k) {
    const LayerInfo::Part& e = l.parts()[k];
    if (e.qformat != quant::Format::None || e.coded)  // its dequantized (decoded) copy in the workspace
      view(static_cast<char*>(lease.part_ptr(l.parts().size())) + e.ws_offset, e.shape, {}, e.q_dtype);
    else
      view(lease.part_ptr(k), e.shape, e.strides, e.dtype);
  }
  std::lock_guard<std::recursive_mutex> lock(mu_);
  const int64_t token = next_token_++;
  fetched_.emplace(token, std::move(lease));
  return {token, std::move(views)};
}

void EngineImpl::release(int64_t token) {
  auto scope = device_scope();
  Lease lease;
  {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    auto it = fetched_.find(token);
    LS_CHECK(it != fetched_.end(), "release(): token ", token, " is not a fetched tensor group (released twice?)");
    lease = std::move(it->second);
    fetched_.erase(it);
  }
  scheduler().release(lease, compute_stream());
}

namespace {
// A lossless part's pieces to decode (GroupPart::Piece), each into its place
// in the workspace; on CUDA one call per part (decode_pieces_cuda).
struct PiecesDecode {
  size_t part;
  lossless::Layout shared;                       // every piece's (equal sizes)
  std::vector<lossless::device::PieceJob> jobs;  // in the part's bytes; in the workspace
  std::vector<size_t> coded_bytes;               // each job's
  size_t out_bytes = 0;                          // each piece's
};

// Every piece, or with `runs` the runs' experts' pieces (by expert).
PiecesDecode pieces_decode(size_t part, const lossless::Layout& shared,
                           const std::vector<EngineImpl::CodedPiece>& pieces, size_t ws_offset, size_t out_total,
                           const std::vector<std::pair<int64_t, int64_t>>* runs) {
  LS_INTERNAL_CHECK(!pieces.empty(), "(a coded group tensor decoded before its first coding)");
  PiecesDecode d;
  d.part = part;
  d.shared = shared;
  d.out_bytes = out_total / pieces.size();
  auto add = [&](size_t p) {
    d.jobs.push_back({pieces[p].offset, ws_offset + p * d.out_bytes});
    d.coded_bytes.push_back(pieces[p].bytes);
  };
  if (!runs) {
    for (size_t p = 0; p < pieces.size(); ++p) add(p);
  } else {
    for (const auto& run : *runs)
      for (int64_t x = run.first; x < run.second; ++x) add(static_cast<size_t>(x));
  }
  return d;
}
}  // namespace

PostCopyFn EngineImpl::make_group_post_copy(const LayerInfo& l, size_t workspace_part,
                                        const std::vector<std::pair<int64_t, int64_t>>* runs) {
  // Runs on the dequant stream right after the group's bytes landed in the
  // slot: each packed part -> its dense copy in the workspace (with `runs`,
  // only those experts' rows of the expert-indexed parts, where they lie).
  struct Job {
    size_t part;
    quant::PackedLayout layout;
    quant::OutDtype out;
    size_t ws_offset;   // of the rows' output
    int64_t row_begin, row_end;
  };
  std::vector<Job> jobs;
  std::vector<PiecesDecode> decodes;
  // Trainable coded parts: their pieces move when re-coded, so the decode is
  // built when the step is issued (right after the copy, under the
  // scheduler's lock: the coding the copy read).
  struct Coded {
    size_t part;
    std::shared_ptr<CodedWeight> c;
    size_t ws_offset, out_total;
    bool routed;  // only the runs' experts
  };
  std::vector<Coded> coded;
  const std::vector<std::pair<int64_t, int64_t>> run_list = runs ? *runs : std::vector<std::pair<int64_t, int64_t>>{};
  for (size_t k = 0; k < l.parts().size(); ++k) {
    const LayerInfo::Part& e = l.parts()[k];
    const size_t out_total = static_cast<size_t>(e.param.numel()) * c10::elementSize(e.dtype);
    if (e.coded) {
      coded.push_back({k, e.coded, e.ws_offset, out_total, runs && e.by_expert});
      continue;
    }
    if (e.qformat == quant::Format::None) continue;
    if (e.qformat == quant::Format::Lossless) {
      decodes.push_back(pieces_decode(k, e.piece_layout, e.pieces, e.ws_offset, out_total,
                                      runs && e.by_expert ? runs : nullptr));
      continue;
    }
    const quant::OutDtype out = out_dtype_of(e.q_dtype);
    if (!runs || !e.by_expert) {
      jobs.push_back({k, e.qlayout, out, e.ws_offset, 0, e.qlayout.rows});
      continue;
    }
    const size_t row_out = static_cast<size_t>(e.qlayout.cols) * quant::out_dtype_bytes(out);
    for (const auto& run : *runs) {
      const int64_t r0 = run.first * e.expert_rows, r1 = run.second * e.expert_rows;
      jobs.push_back({k, e.qlayout, out, e.ws_offset + static_cast<size_t>(r0) * row_out, r0, r1});
    }
  }
  Backend* be = backend_.get();
  const bool on_cpu = compute_device_.is_cpu();
  const int device = compute_device_.index();
  const std::string what = "dequantize '" + l.name + "'";
  return [=](const BufferRef& slot, const std::vector<size_t>& off, Stream s) {
    char* base = static_cast<char*>(slot.ptr);
    char* ws = base + off.at(workspace_part);
    if (be->caps().ordering_checker) {
      be->declare_access(slot, Access::Read, s, what + " (reads the copied tensors)");
      be->declare_access(slot, Access::Write, s, what + " (writes the workspace)");
    }
    for (const Job& j : jobs) {
      const void* src = base + off.at(j.part);
      void* dst = ws + j.ws_offset;
      if (on_cpu)
        be->launch_host_func(
            s, [=] { quant::dequantize_rows_cpu(j.layout, src, j.row_begin, j.row_end, dst, j.out, 1); });
      else
        cuda_glue::dequantize_on(j.layout, src, dst, j.out, device, s.native(), j.row_begin, j.row_end);
    }
    std::vector<PiecesDecode> now = decodes;
    for (const Coded& c : coded) {
      std::lock_guard<std::mutex> g(c.c->mu);
      now.push_back(pieces_decode(c.part, c.c->piece_layout, c.c->pieces, c.ws_offset, c.out_total,
                                  c.routed ? &run_list : nullptr));
    }
    for (const PiecesDecode& d : now) {
      const char* src = base + off.at(d.part);
      if (on_cpu) {  // the reference decoder, piece by piece
        be->launch_host_func(s, [=] {
          for (size_t j = 0; j < d.jobs.size(); ++j)
            lossless::decode(src + d.jobs[j].coded_offset, d.coded_bytes[j], ws + d.jobs[j].out_offset,
                             d.out_bytes, 1);
        });
      } else {
        cuda_glue::lossless_decode_pieces_on(d.shared, src, d.jobs, ws, device, s.native());
      }
    }
  };
}

}  // namespace layerstream
