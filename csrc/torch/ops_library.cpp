// layerstream — LibTorch glue: the streamed layers as PyTorch operators (Note [Streamed layers as custom
// ops], ops_compiled.cpp): their schemas, backend, autograd and autocast kernels, and the shape-only
// operators that the fake kernels (python/layerstream/_ops.py) call.
//
// Operators (namespace layerstream; `engine` is Engine::id(), `layer` an index from add_*(), `spec`
// Engine::op_spec(layer): Note [An operator call names its layer's layout], ops_spec.cpp):
//   linear(Tensor x, Tensor? weight, Tensor? bias, int engine, int layer, str spec) -> Tensor
//   conv(Tensor x, Tensor? weight, Tensor? bias, int engine, int layer, str spec) -> Tensor
//   embedding(Tensor ids, Tensor? weight, int engine, int layer, str spec) -> Tensor
//   layer_backward(Tensor grad, Tensor x, int engine, int layer, str spec, bool[3] mask, bool stage) -> Tensor[]
//   embedding_backward(Tensor grad, Tensor ids, int engine, int layer, str spec) -> Tensor
// weight/bias are the module's parameters, passed only when they require grad (the node's edges
// for their gradients, which the backward stages or returns: Note [Compiled weight gradients are
// staged], ops_compiled.cpp); the kernels read the weights from the engine. Thread safety: the
// engine's (each kernel takes its lock where it needs it).
#include "engine_impl.h"

#include <ATen/autocast_mode.h>
#include <torch/library.h>

namespace layerstream {

void ops_library_linked() {}

namespace {
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::shared_ptr<EngineImpl> engine_of(int64_t id) {
  auto e = EngineImpl::lookup(static_cast<uint64_t>(id));
  LS_CHECK(e != nullptr, "layerstream operator: engine ", id, " does not exist in this process (its offload "
           "handle was detached or garbage-collected, or the graph was exported by another process); "
           "offload() the model in this process and compile or export it again");
  return e;
}
// The engine, after checking that the call's spec is its layer's.
std::shared_ptr<EngineImpl> engine_for(int64_t id, int64_t layer, c10::string_view spec) {
  auto e = engine_of(id);
  e->check_op_spec(static_cast<int>(layer), std::string_view(spec.data(), spec.size()));
  return e;
}

constexpr char kLinear[] = "a Linear";
constexpr char kConv[] = "a convolution";

// ---- backend kernels (CPU: the sim device; CUDA) ----
template <const char* Kind>
torch::Tensor layer_kernel(const torch::Tensor& x, const std::optional<torch::Tensor>& w,
                           const std::optional<torch::Tensor>& b, int64_t engine, int64_t layer,
                           c10::string_view spec) {
  const bool trained = (w.has_value() && w->defined()) || (b.has_value() && b->defined());
  return engine_for(engine, layer, spec)->op_forward(static_cast<int>(layer), x, Kind, trained, /*shape_only=*/false);
}
std::vector<torch::Tensor> backward_kernel(const torch::Tensor& grad, const torch::Tensor& x, int64_t engine,
                                           int64_t layer, c10::string_view spec, std::array<bool, 3> mask,
                                           bool stage) {
  return engine_for(engine, layer, spec)
      ->op_backward(static_cast<int>(layer), grad, x, mask, stage, /*shape_only=*/false);
}
torch::Tensor lookup_kernel(const torch::Tensor& ids, const std::optional<torch::Tensor>&, int64_t engine,
                            int64_t layer, c10::string_view spec) {
  return engine_for(engine, layer, spec)->op_lookup(static_cast<int>(layer), ids, /*shape_only=*/false);
}
torch::Tensor lookup_backward_kernel(const torch::Tensor& grad, const torch::Tensor& ids, int64_t engine,
                                     int64_t layer, c10::string_view spec) {
  return engine_for(engine, layer, spec)->op_lookup_backward(static_cast<int>(layer), grad, ids, /*shape_only=*/false);
}

// ---- shape-only operators (composite: they run on whatever tensors they get, FakeTensors included) ----
template <const char* Kind>
torch::Tensor layer_shape(const torch::Tensor& x, int64_t engine, int64_t layer, c10::string_view spec) {
  return engine_for(engine, layer, spec)
      ->op_forward(static_cast<int>(layer), x, Kind, /*trained=*/false, /*shape_only=*/true);
}
std::vector<torch::Tensor> backward_shape(const torch::Tensor& grad, const torch::Tensor& x, int64_t engine,
                                          int64_t layer, c10::string_view spec, std::array<bool, 3> mask,
                                          bool stage) {
  return engine_for(engine, layer, spec)
      ->op_backward(static_cast<int>(layer), grad, x, mask, stage, /*shape_only=*/true);
}
torch::Tensor lookup_shape(const torch::Tensor& ids, int64_t engine, int64_t layer, c10::string_view spec) {
  return engine_for(engine, layer, spec)->op_lookup(static_cast<int>(layer), ids, /*shape_only=*/true);
}
torch::Tensor lookup_backward_shape(const torch::Tensor& grad, const torch::Tensor& ids, int64_t engine,
                                    int64_t layer, c10::string_view spec) {
  return engine_for(engine, layer, spec)->op_lookup_backward(static_cast<int>(layer), grad, ids, /*shape_only=*/true);
}

c10::OperatorHandle op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}
using LayerSig = torch::Tensor(const torch::Tensor&, const std::optional<torch::Tensor>&,
                               const std::optional<torch::Tensor>&, int64_t, int64_t, c10::string_view);
using LookupSig =
    torch::Tensor(const torch::Tensor&, const std::optional<torch::Tensor>&, int64_t, int64_t, c10::string_view);

// ---- autograd kernels: each records one node whose backward is an operator too ----
// The node's edges are x, then weight and bias where given (an absent
// optional is no edge); backward returns one entry per forward argument.
struct LayerOpFn : public torch::autograd::Function<LayerOpFn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const std::optional<torch::Tensor>& w,
                               const std::optional<torch::Tensor>& b, int64_t engine, int64_t layer,
                               c10::string_view spec, bool conv) {
    ctx->saved_data["engine"] = engine;
    ctx->saved_data["layer"] = layer;
    ctx->saved_data["spec"] = std::string(spec.data(), spec.size());
    ctx->saved_data["w"] = w.has_value() && w->defined();
    ctx->saved_data["b"] = b.has_value() && b->defined();
    ctx->save_for_backward({x});
    at::AutoDispatchBelowADInplaceOrView below;
    static const auto linear = op("layerstream::linear").typed<LayerSig>();
    static const auto conv_op = op("layerstream::conv").typed<LayerSig>();
    return (conv ? conv_op : linear).call(x, w, b, engine, layer, spec);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const int64_t engine = ctx->saved_data["engine"].toInt(), layer = ctx->saved_data["layer"].toInt();
    const bool has_w = ctx->saved_data["w"].toBool(), has_b = ctx->saved_data["b"].toBool();
    const std::array<bool, 3> mask{ctx->needs_input_grad(0), has_w && ctx->needs_input_grad(1),
                                   has_b && ctx->needs_input_grad(has_w ? 2 : 1)};
    variable_list out(7);  // one per forward argument
    if (!grads[0].defined() || !(mask[0] || mask[1] || mask[2])) return out;
    check_no_create_graph(engine_of(engine)->layer(static_cast<int>(layer)));
    const torch::Tensor x = ctx->get_saved_variables()[0];
    const std::string spec = ctx->saved_data["spec"].toStringRef();
    // Decided here, when the graph is traced (Note [Compiled weight gradients
    // are staged], ops_compiled.cpp): only beside an input gradient, whose
    // use keeps the operator in the graph, and as the call's spec names it
    // (Note [An operator call names its layer's layout], ops_spec.cpp).
    const bool stage = mask[0] && (mask[1] || mask[2]) && !EngineImpl::grads_to_autograd(spec) &&
                       engine_of(engine)->stages_grads(static_cast<int>(layer));
    static const auto bwd =
        op("layerstream::layer_backward")
            .typed<std::vector<torch::Tensor>(const torch::Tensor&, const torch::Tensor&, int64_t, int64_t,
                                              c10::string_view, std::array<bool, 3>, bool)>();
    const std::vector<torch::Tensor> got = bwd.call(grads[0], x, engine, layer, spec, mask, stage);
    size_t k = 0;
    for (int i = 0; i < (stage ? 1 : 3); ++i)
      if (mask[i]) out[i] = got[k++];
    return out;
  }
};

struct LookupOpFn : public torch::autograd::Function<LookupOpFn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& ids, const std::optional<torch::Tensor>& w,
                               int64_t engine, int64_t layer, c10::string_view spec) {
    ctx->saved_data["engine"] = engine;
    ctx->saved_data["layer"] = layer;
    ctx->saved_data["spec"] = std::string(spec.data(), spec.size());
    ctx->saved_data["w"] = w.has_value() && w->defined();
    ctx->save_for_backward({ids});
    at::AutoDispatchBelowADInplaceOrView below;
    static const auto lookup = op("layerstream::embedding").typed<LookupSig>();
    return lookup.call(ids, w, engine, layer, spec);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const int64_t engine = ctx->saved_data["engine"].toInt(), layer = ctx->saved_data["layer"].toInt();
    variable_list out(5);  // one per forward argument
    // Edges: the ids (integers: never a gradient), then the weight when given.
    if (!grads[0].defined() || !ctx->saved_data["w"].toBool() || !ctx->needs_input_grad(1)) return out;
    check_no_create_graph(engine_of(engine)->layer(static_cast<int>(layer)));
    static const auto bwd = op("layerstream::embedding_backward")
                                .typed<torch::Tensor(const torch::Tensor&, const torch::Tensor&, int64_t, int64_t,
                                                     c10::string_view)>();
    out[1] = bwd.call(grads[0], ctx->get_saved_variables()[0], engine, layer, ctx->saved_data["spec"].toStringRef());
    return out;
  }
};

torch::Tensor linear_autograd(const torch::Tensor& x, const std::optional<torch::Tensor>& w,
                              const std::optional<torch::Tensor>& b, int64_t engine, int64_t layer,
                              c10::string_view spec) {
  return LayerOpFn::apply(x, w, b, engine, layer, spec, false);
}
torch::Tensor conv_autograd(const torch::Tensor& x, const std::optional<torch::Tensor>& w,
                            const std::optional<torch::Tensor>& b, int64_t engine, int64_t layer,
                            c10::string_view spec) {
  return LayerOpFn::apply(x, w, b, engine, layer, spec, true);
}
torch::Tensor lookup_autograd(const torch::Tensor& ids, const std::optional<torch::Tensor>& w, int64_t engine,
                              int64_t layer, c10::string_view spec) {
  return LookupOpFn::apply(ids, w, engine, layer, spec);
}

// ---- autocast kernels: the input cast as the eager path casts it (autocast_input) ----
template <const char* Name, c10::DeviceType Device>
torch::Tensor layer_autocast(const torch::Tensor& x, const std::optional<torch::Tensor>& w,
                             const std::optional<torch::Tensor>& b, int64_t engine, int64_t layer,
                             c10::string_view spec) {
  const torch::Tensor cast = autocast_input(x, Device);
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  static const auto handle = op(Name).typed<LayerSig>();
  return handle.call(cast, w, b, engine, layer, spec);
}
constexpr char kLinearOp[] = "layerstream::linear";
constexpr char kConvOp[] = "layerstream::conv";
}  // namespace

TORCH_LIBRARY(layerstream, m) {
  m.set_python_module("layerstream._ops");  // where the fake kernels are registered
  // cudagraph_unsafe: a CUDA graph replay would skip the host-side copy into the slot;
  // Inductor runs these outside its graphs (EngineImpl::check_not_capturing).
  const std::vector<at::Tag> tags{at::Tag::cudagraph_unsafe};
  m.def("linear(Tensor x, Tensor? weight, Tensor? bias, int engine, int layer, str spec) -> Tensor", tags);
  m.def("conv(Tensor x, Tensor? weight, Tensor? bias, int engine, int layer, str spec) -> Tensor", tags);
  m.def("layer_backward(Tensor grad, Tensor x, int engine, int layer, str spec, bool[3] mask, bool stage) -> "
        "Tensor[]",
        tags);
  m.def("embedding(Tensor ids, Tensor? weight, int engine, int layer, str spec) -> Tensor", tags);
  m.def("embedding_backward(Tensor grad, Tensor ids, int engine, int layer, str spec) -> Tensor", tags);
  // A streamed tensor group's call (its module's own forward, which is Python code) and its
  // backward: kernels, fake kernels and autograd in layerstream/_group_op.py
  // (Note [A tensor group as an operator]). `call` describes the non-tensor arguments.
  m.def("group(Tensor[] inputs, Tensor[] params, int engine, int layer, str call) -> Tensor[]", tags);
  m.def("group_backward(Tensor[] grads, Tensor[] inputs, Tensor rng, int engine, int layer, str call, "
        "bool[] mask) -> Tensor[]",
        tags);
  m.def("linear_shape(Tensor x, int engine, int layer, str spec) -> Tensor", &layer_shape<kLinear>);
  m.def("conv_shape(Tensor x, int engine, int layer, str spec) -> Tensor", &layer_shape<kConv>);
  m.def("layer_backward_shape(Tensor grad, Tensor x, int engine, int layer, str spec, bool[3] mask, bool stage) "
        "-> Tensor[]",
        &backward_shape);
  m.def("embedding_shape(Tensor ids, int engine, int layer, str spec) -> Tensor", &lookup_shape);
  m.def("embedding_backward_shape(Tensor grad, Tensor ids, int engine, int layer, str spec) -> Tensor",
        &lookup_backward_shape);
}

#define LS_BACKEND_KERNELS(KEY)                                     \
  TORCH_LIBRARY_IMPL(layerstream, KEY, m) {                         \
    m.impl("linear", &layer_kernel<kLinear>);                      \
    m.impl("conv", &layer_kernel<kConv>);                          \
    m.impl("layer_backward", &backward_kernel);                     \
    m.impl("embedding", &lookup_kernel);                            \
    m.impl("embedding_backward", &lookup_backward_kernel);          \
  }
LS_BACKEND_KERNELS(CPU)
LS_BACKEND_KERNELS(CUDA)
#undef LS_BACKEND_KERNELS

TORCH_LIBRARY_IMPL(layerstream, Autograd, m) {
  m.impl("linear", &linear_autograd);
  m.impl("conv", &conv_autograd);
  m.impl("embedding", &lookup_autograd);
}

TORCH_LIBRARY_IMPL(layerstream, AutocastCPU, m) {
  m.impl("linear", &layer_autocast<kLinearOp, c10::DeviceType::CPU>);
  m.impl("conv", &layer_autocast<kConvOp, c10::DeviceType::CPU>);
}
TORCH_LIBRARY_IMPL(layerstream, AutocastCUDA, m) {
  m.impl("linear", &layer_autocast<kLinearOp, c10::DeviceType::CUDA>);
  m.impl("conv", &layer_autocast<kConvOp, c10::DeviceType::CUDA>);
}

}  // namespace layerstream
