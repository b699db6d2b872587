// layerstream — LibTorch glue: embedding tables: the lookup and its autograd function (EmbeddingFn)
// (the engine's rooms: engine_impl.h).
#include "engine_impl.h"

#include <algorithm>
#include <cstring>

#include "core/log.h"

namespace layerstream {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {
// A trainable table's lookup: forward reads the rows (EngineImpl::lookup); backward
// computes the weight's gradient on the host with torch's own embedding backward
// (the resident module's numbers on the sim device; on CUDA the same fp32 sums,
// in another order), from the output gradient's rows copied back and the ids, and
// returns it to autograd, which accumulates it into .grad.
struct EmbeddingFn : public torch::autograd::Function<EmbeddingFn> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor ids, torch::Tensor weight, EngineImpl* e,
                               int64_t layer) {
    EngineImpl::LayerInfo& l = e->layer(static_cast<int>(layer));
    ctx->saved_data["engine"] = static_cast<int64_t>(e->id());
    ctx->saved_data["layer"] = layer;
    ctx->save_for_backward({ids});
    return e->lookup(l, ids);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto e = engine_from(ctx);
    EngineImpl::LayerInfo& l = e->layer(static_cast<int>(ctx->saved_data["layer"].toInt()));
    check_no_create_graph(l);
    auto scope = e->device_scope();
    const torch::Tensor go = grads[0];
    if (!go.defined() || !ctx->needs_input_grad(1)) return {torch::Tensor(), torch::Tensor(), torch::Tensor(),
                                                            torch::Tensor()};
    const torch::Tensor ids = saved_variables_of(ctx, l)[0];
    const int layer = static_cast<int>(ctx->saved_data["layer"].toInt());
    return {torch::Tensor(), e->op_lookup_backward(layer, go, ids, /*shape_only=*/false), torch::Tensor(),
            torch::Tensor()};
  }
};
}  // namespace

// The weight's gradient: torch's embedding backward on the host, from the
// output gradient's rows copied back and the ids (EmbeddingFn, and the
// layerstream::embedding_backward operator: Note [Streamed layers as custom
// ops], ops_compiled.cpp).
torch::Tensor EngineImpl::op_lookup_backward(int index, const torch::Tensor& go, const torch::Tensor& ids,
                                             bool shape_only) {
  LayerInfo& l = layer(index);
  LS_CHECK(l.is_table(), "layer '", l.name, "' is not an embedding");
  torch::Tensor go_host = go.to(torch::kCPU);  // synchronous on CUDA: the rows, not the table
  if (!shape_only) count_d2h(static_cast<uint64_t>(go_host.numel()) * go_host.element_size());
  // CUDA's embedding backward sums a repeated id's rows in fp32 and rounds
  // once; the CPU op (the sim device's reference) sums in the gradient's dtype.
  if (!compute_device_.is_cpu() && go_host.is_floating_point() && go_host.element_size() < 4)
    go_host = go_host.to(torch::kFloat);
  torch::Tensor gw = torch::embedding_backward(go_host, ids.to(torch::kCPU), l.w_shape[0], l.table().padding_idx,
                                               l.table().scale_grad_by_freq, l.table().sparse);
  gw = gw.to(l.w_dtype);
  if (!shape_only) {
    LS_CHECK(!(grad_group_ && l.table().sparse), "embedding layer '", l.name, "' has sparse=True: its sparse "
             "gradient cannot be averaged over the process group; use sparse=False with several processes");
    average_gradient(index, gw);  // engine_distributed.cpp
  }
  return gw;
}

// The lookup as an operator computes it: no autograd node (the operator's
// autograd kernel records one); shape_only: on a stand-in table of the ids'
// device (no read).
torch::Tensor EngineImpl::op_lookup(int index, const torch::Tensor& ids, bool shape_only) {
  auto scope = device_scope();
  LayerInfo& l = call_layer(index, "an embedding");
  check_ids(l, ids);
  LS_CHECK(!l.table().sparse, "embedding layer '", l.name, "' has sparse=True: a sparse gradient cannot go "
           "through torch.compile or torch.export; use sparse=False, or run this model eagerly");
  if (shape_only) {
    torch::NoGradGuard no_grad;
    return torch::embedding(ids.new_empty(l.w_shape, ids.options().dtype(l.w_dtype)), ids);
  }
  check_host_alias(l);
  return lookup(l, ids);
}

void EngineImpl::check_ids(const LayerInfo& l, const torch::Tensor& ids) const {
  LS_CHECK(ids.device() == compute_device_, "embedding layer '", l.name, "' streams to ", device_name_,
           " (tensors on ", compute_device_.str(), ") but its ids are on ", ids.device().str(),
           "; move them to ", compute_device_.str());
  LS_CHECK(ids.scalar_type() == torch::kLong || ids.scalar_type() == torch::kInt, "embedding layer '",
           l.name, "' got ", dtype_name(ids.scalar_type()), " ids; they must be int64 or int32");
}

torch::Tensor EngineImpl::embedding(int layer_index, const torch::Tensor& ids) {
  auto scope = device_scope();
  LayerInfo& l = call_layer(layer_index, "an embedding");
  check_ids(l, ids);
  check_host_alias(l);
  if (torch::GradMode::is_enabled() && l.weight.requires_grad())
    return EmbeddingFn::apply(ids, l.weight, this, static_cast<int64_t>(layer_index));
  return lookup(l, ids);
}

torch::Tensor EngineImpl::lookup(LayerInfo& l, const torch::Tensor& ids) {
  torch::NoGradGuard ng;  // the result's graph, if any, is EmbeddingFn's
  Stream cs = compute_stream();
  auto span = trace_begin(cs);
  const uint64_t bytes = static_cast<uint64_t>(ids.numel()) *
                         static_cast<uint64_t>(l.w_shape[1] * static_cast<int64_t>(c10::elementSize(l.w_dtype)));
  torch::Tensor out;
  if (compute_device_.is_cpu()) {
    // The sim device computes on the host: the lookup reads the store directly.
    if (backend_->caps().ordering_checker)
      backend_->declare_host_access(store_->buffer(l.w_index), Access::Read, "lookup in '" + l.name + "'");
    out = torch::embedding(l.weight.detach(), ids);
  } else if (l.table().w_host_mapped != nullptr) {
    // Kernels read the pinned store through its device mapping: only the rows named.
    const auto opts = torch::TensorOptions().dtype(l.w_dtype).device(compute_device_);
    const torch::Tensor table =
        at::for_blob(l.table().w_host_mapped, l.w_shape)
            .strides(l.w_strides.empty() ? at::OptionalIntArrayRef() : at::OptionalIntArrayRef(l.w_strides))
            .target_device(compute_device_)
            .options(opts)
            .make_tensor();
    out = torch::embedding(table, ids);
    std::lock_guard<std::recursive_mutex> lock(mu_);
    backend_->record(l.table().last_read, cs);
  } else {
    // Pageable store: the device cannot read it; gather on the host, then copy.
    out = torch::embedding(l.weight.detach(), ids.to(torch::kCPU)).to(compute_device_);
  }
  gathered_bytes_ += bytes;
  if (span) trace_end(cs, span, "compute", "lookup " + l.name, bytes);
  return out;
}

}  // namespace layerstream
