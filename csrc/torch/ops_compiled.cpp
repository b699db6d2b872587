// layerstream — LibTorch glue: the kernels of the streamed Linear's and convolution's operators under
// torch.compile / torch.export (op_forward, op_backward; registered in ops_library.cpp) and the choice
// their backward makes for the weight gradients (the engine's rooms: engine_impl.h).
#include "engine_impl.h"

#include <optional>

#include "core/log.h"

namespace layerstream {

// Note [Streamed layers as custom ops]
// Under torch.compile and torch.export a streamed layer is a dispatcher
// operator (layerstream::linear, ::conv, ::embedding; ops_library.cpp
// registers them), which Dynamo records as one node of the graph instead of
// breaking it at an opaque call. The kernels are functional and
// self-contained: each call acquires its layer's slot, computes and
// releases the slot before it returns, so whatever order Inductor gives the
// nodes, no read can precede its copy and no slot is reused before its free
// event (the scheduler's replay adopts the compiled order by retracing, as
// for any change of order). The fake kernels are the same C++ calls on
// stand-in weights of the input's device (shape_only), so shapes, dtypes and
// strides have one source. The backward is an operator too
// (layerstream::layer_backward): the input gradient from the re-fetched
// weight, the weight's and bias's from the saved input, staged as the eager
// path stages them or returned to autograd (Note [Compiled weight gradients
// are staged]). The eager path stays
// StreamedFn, which replays the resident module's own graph (Note [Same
// calls as the resident module]); compiled, the resident model's calls are
// Inductor's choice anyway, so the compiled path equals it within rounding,
// not bit for bit.
//
// Note [Compiled weight gradients are staged]
// Returned to autograd, a weight gradient must be a finished host tensor:
// a blocking copy per layer (the device idles meanwhile), and no layer is
// complete before the whole backward ends, so opt.overlap() stepped nothing
// under compile. So layer_backward stages them as the eager path does
// (stage_grads: the gradient stream copies them while the backward goes on,
// the end-of-backward callback adds them to .grad, the gradient-ready hook
// counts the forward calls given parameters; docs/design/gradients.md) and
// returns only the input gradient; autograd gets no gradient for the
// parameters. Whether it stages is decided when the graph is traced
// (LayerOpFn::backward, ops_library.cpp), as the forward call's spec names
// it (Note [An operator call names its layer's layout], ops_spec.cpp), so it
// cannot depend on the call:
//  * only beside an input gradient: an operator whose outputs nothing reads
//    could be dropped from the graph, and its staging with it (the first
//    layer of a network, whose input needs no gradient, returns its
//    gradients to autograd);
//  * not for a weight another layer shares (autograd sums the uses, as in
//    eager) nor for a parameter with gradient hooks then (they fire only
//    when autograd accumulates); a hook registered later raises at the
//    backward, since it would silently not fire;
//  * torch.autograd.grad / backward(inputs=...): a parameter's gradient not
//    asked for is dropped, as autograd drops it; one asked for raises (it
//    can only be returned by the autograd path).
//  * torch._dynamo's compiled autograd runs the backward as a graph of its
//    own and never ends the autograd engine's backward (no callback runs):
//    staged gradients would be lost, so the fake kernel refuses to be traced
//    into such a graph (python/layerstream/_ops.py).
// Staged or returned, a weight gradient queues the end-of-backward callback
// (stage_grads, grad_to_host), as in eager: that backward's end is a step's
// (Note [No copy in flight at a step's end] and Note [When a step begins],
// core/scheduler.cpp).

namespace {
// What a fake kernel computes with: empty tensors shaped (and strided) as the
// layer's device weight and bias in the activations' dtype, on x's device.
EngineImpl::DeviceParams stand_in_params(const EngineImpl::LayerInfo& l, const torch::Tensor& x) {
  EngineImpl::DeviceParams p;
  p.w = l.w_strides.empty() ? x.new_empty(l.w_shape) : x.new_empty_strided(l.w_shape, l.w_strides);
  p.w_leaf = p.w;
  if (l.bias.defined()) p.b = p.b_leaf = x.new_empty(l.b_shape);
  return p;
}

// The layer's gradients (input, weight, bias; undefined where not asked) on
// the device, in the activations' dtype. p.w is read only for the input
// gradient of a Linear and for every conv gradient.
std::array<torch::Tensor, 3> layer_grads(const EngineImpl::LayerInfo& l, const torch::Tensor& grad,
                                         const torch::Tensor& x, const EngineImpl::DeviceParams& p,
                                         std::array<bool, 3> need) {
  std::array<torch::Tensor, 3> g;
  if (!l.is_conv()) {
    if (need[0]) g[0] = at::matmul(grad, p.w);
    const torch::Tensor g2 = grad.reshape({-1, l.w_shape[0]});
    if (need[1]) g[1] = g2.t().mm(x.reshape({-1, l.w_shape[1]}));
    if (need[2]) g[2] = g2.sum(0);
    return g;
  }
  // at::convolution_backward's form: batched, symmetric padding. An
  // unbatched input gets a batch of one; "same" padding that needs one more
  // element on one side pads the input there first, as torch's forward does
  // (at::_convolution_mode), and the input gradient drops that part again.
  const ConvSpec& c = l.conv();
  const bool unbatched = x.dim() == c.dims + 1;
  torch::Tensor xb = unbatched ? x.unsqueeze(0) : x;
  const torch::Tensor gb = unbatched ? grad.unsqueeze(0) : grad;
  std::vector<int64_t> padding = c.padding, extra(2 * c.dims, 0);
  bool padded = false;
  if (c.same) {
    padding.assign(c.dims, 0);
    for (int d = 0; d < c.dims; ++d) {
      const int64_t total = c.dilation[d] * (l.w_shape[2 + d] - 1), left = total / 2;
      padding[d] = left;
      extra[2 * (c.dims - 1 - d) + 1] = total - 2 * left;  // constant_pad_nd: last dim first
      padded = padded || total != 2 * left;
    }
  }
  if (padded) xb = at::constant_pad_nd(xb, extra, 0);
  auto [gx, gw, gbias] = at::convolution_backward(
      gb, xb, p.w, need[2] ? at::OptionalIntArrayRef(l.b_shape) : at::OptionalIntArrayRef(), c.stride, padding,
      c.dilation, /*transposed=*/false, std::vector<int64_t>(c.dims, 0), c.groups, need);
  if (gx.defined() && padded)
    for (int d = 0; d < c.dims; ++d) gx = gx.narrow_symint(2 + d, 0, x.sym_size(x.dim() - c.dims + d));
  if (gx.defined() && unbatched) gx = gx.squeeze(0);
  g = {gx, gw, gbias};
  return g;
}
}  // namespace

torch::Tensor EngineImpl::op_forward(int index, const torch::Tensor& x, const char* kind, bool trained,
                                     bool shape_only) {
  torch::NoGradGuard no_grad;  // the operator's graph is its autograd kernel's
  auto scope = device_scope();
  LayerInfo& l = call_layer(index, kind);
  check_input(*this, l, x);
  if (l.is_conv()) check_conv_input(l, x);
  if (shape_only) {
    const DeviceParams p = stand_in_params(l, x);
    return layer_op(l, x, p.w, p.b);
  }
  check_host_alias(l);
  ensure_scheduler();
  if (trained) note_forward_use(l);  // the gradient-ready hook (engine_grad_ready.cpp)
  return streamed_forward(this, l, index, x);
}

std::vector<torch::Tensor> EngineImpl::op_backward(int index, const torch::Tensor& grad, const torch::Tensor& x,
                                                   std::array<bool, 3> mask, bool stage, bool shape_only) {
  auto scope = device_scope();
  LayerInfo& l = layer(index);
  LS_CHECK(!l.is_table() && !l.is_group(), "layer '", l.name, "' is ", kind_of(l),
           ", not a Linear or a convolution");
  if (!shape_only) check_no_create_graph(l);
  mask[2] = mask[2] && l.bias.defined();
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> out;
  std::array<torch::Tensor, 3> g;
  if (shape_only) {
    g = layer_grads(l, grad, x, stand_in_params(l, x), mask);
  } else {
    Stream cs = compute_stream();
    std::optional<SlotLease> lease;
    DeviceParams p;
    if (mask[0] || l.is_conv()) {  // else a Linear's gradients read no weight: nothing is fetched
      lease.emplace(scheduler(), scheduler().acquire(index, cs, Phase::Backward), cs);
      p = device_params(l, lease->get(), x.scalar_type());
    }
    auto span = trace_begin(cs);
    g = layer_grads(l, grad, x, p, mask);
    if (span) trace_end(cs, span, "compute", std::string("bwd ") + l.name);
  }  // the slot goes back after the work that reads it was enqueued
  if (mask[0]) out.push_back(g[0]);
  if (shape_only) {
    if (stage) return out;
  } else {
    if (stage) {  // Note [Compiled weight gradients are staged]
      const bool plain = plain_backward();
      for (int i = 1; i < 3; ++i) {
        if (!g[i].defined()) continue;
        const torch::Tensor& p = i == 1 ? l.weight : l.bias;
        LS_CHECK(!has_grad_hooks(p), "a gradient hook was registered on the ", i == 1 ? "weight" : "bias",
                 " of streamed layer '", l.name, "' after torch.compile traced it: the compiled graph hands "
                 "that gradient to layerstream, not to autograd, so the hook would not fire. Register "
                 "gradient hooks before the first compiled call, or call torch._dynamo.reset() after "
                 "registering them.");
        if (plain) continue;
        LS_CHECK(!asked_for(p), "torch.autograd.grad / backward(inputs=...) asked for the ",
                 i == 1 ? "weight" : "bias", " gradient of streamed layer '", l.name, "' through a compiled "
                 "graph, which hands it to layerstream's own accumulation into .grad: use loss.backward() "
                 "and read .grad, or call the model uncompiled for this");
        g[i] = torch::Tensor();  // not asked for: autograd would drop it too
      }
      if (g[1].defined() || g[2].defined()) stage_grads(index, g[1], g[2]);
      return out;
    }
  }
  for (int i = 1; i < 3; ++i) {
    if (!mask[i]) continue;
    if (!shape_only) average_gradient(index, g[i]);  // engine_distributed.cpp
    const torch::ScalarType dtype = i == 1 ? l.w_dtype : l.b_dtype;
    out.push_back(shape_only ? g[i].to(dtype).to(torch::kCPU) : grad_to_host(g[i], dtype));
  }
  return out;
}

}  // namespace layerstream
