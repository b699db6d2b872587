// layerstream — LibTorch glue: what a compiled call of a streamed layer's operator names besides
// (engine, layer), and the check every kernel makes of it (the engine's rooms: engine_impl.h).
#include "engine_impl.h"

#include <sstream>

#include "core/log.h"

namespace layerstream {

// Note [An operator call names its layer's layout]
// A compiled graph's call of a streamed layer's operator names the layer by
// (engine, layer): numbers, which every process hands out from 1 in the
// same order. Inductor's on-disk cache keys a graph by its code and its
// inputs' metadata, and reuses the code it generated around our operators,
// which assumed the shapes and strides their fake kernels gave, across
// processes. So a graph of another model whose layers have other shapes
// (a frozen Linear's weight is no input of its call) or another convolution
// padding was served to this one (found on 2026-12-06: Inductor's own size
// assertion failed, "incorrect fake kernel"; without it the code reads the
// buffers with the wrong sizes). Each call therefore names what its
// outputs' metadata follow from as well (`spec`, a constant in the graph's
// code, hence in the cache key), and every kernel, the fake ones too,
// refuses a spec that is not the layer's: a stale exported program or
// cached graph cannot compute with another layout. A tensor group's call
// names its module's classes, settings and tensors in `call` likewise
// (_group_op.layout, python/layerstream/_group_op.py).
//
// A Linear's or convolution's spec also names where its weight gradients go
// when the graph is traced: staged by the backward operator, or, for a
// weight another layer shares or a parameter with gradient hooks, returned
// to autograd (" grads=autograd"; Note [Compiled weight gradients are
// staged], ops_compiled.cpp). The backward is traced with the forward and
// torch's on-disk autograd cache keys both by the forward graph: without
// the name, a process whose weight has a hook was served the staged
// backward of a process without one (found on 2026-12-06; the hook check
// raised). Python asks for the spec when Dynamo traces the call
// (_forward._call_spec), so the graph names the state it was traced in.
namespace {
void put_dims(std::ostringstream& s, const std::vector<int64_t>& v, char sep) {
  for (size_t i = 0; i < v.size(); ++i) s << (i ? std::string(1, sep) : std::string()) << v[i];
}

constexpr std::string_view kGradsToAutograd = " grads=autograd";
}  // namespace

std::string EngineImpl::op_spec(int index) const {
  std::string spec;
  bool linear_or_conv = false;
  {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    const LayerInfo& l = layer(index);
    spec = op_layout(l);
    linear_or_conv = !l.is_table() && !l.is_group();
  }
  // Without mu_: reading a Python hook takes the GIL (set_grad_hook_probe).
  if (linear_or_conv && !stages_grads(index)) spec += kGradsToAutograd;
  return spec;
}

bool EngineImpl::grads_to_autograd(std::string_view spec) {
  return spec.size() >= kGradsToAutograd.size() &&
         spec.substr(spec.size() - kGradsToAutograd.size()) == kGradsToAutograd;
}

const std::string& EngineImpl::op_layout(const LayerInfo& l) const {
  if (!l.spec.empty()) return l.spec;  // per traced call: built once
  std::ostringstream s;
  if (l.is_conv())
    s << "conv" << l.conv().dims << "d";
  else
    s << (l.is_table() ? "embedding" : l.is_group() ? "group" : "linear");
  s << " w=";
  put_dims(s, l.w_shape, 'x');
  if (!l.w_strides.empty()) {
    s << "/";
    put_dims(s, l.w_strides, ',');
  }
  s << " " << c10::toString(l.w_dtype);
  if (l.bias.defined()) {
    s << " b=";
    put_dims(s, l.b_shape, 'x');
    s << " " << c10::toString(l.b_dtype);
  }
  if (l.is_conv()) {
    const ConvSpec& c = l.conv();
    s << " stride=";
    put_dims(s, c.stride, ',');
    if (c.same) {
      s << " padding=same";
    } else {
      s << " padding=";
      put_dims(s, c.padding, ',');
    }
    s << " dilation=";
    put_dims(s, c.dilation, ',');
    s << " groups=" << c.groups;
  }
  if (l.is_table())
    s << " padding_idx=" << l.table().padding_idx << " scale_grad_by_freq=" << l.table().scale_grad_by_freq
      << " sparse=" << l.table().sparse;
  l.spec = s.str();
  return l.spec;
}

void EngineImpl::check_op_spec(int index, std::string_view spec) const {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  const LayerInfo& l = layer(index);
  const std::string& mine = op_layout(l);
  // Where the gradients go is the trace's choice, not part of the layout.
  if (!l.is_table() && !l.is_group() && grads_to_autograd(spec)) spec.remove_suffix(kGradsToAutograd.size());
  LS_CHECK(spec == mine, "layerstream operator: this call of streamed layer '", layer_name(index), "' was traced for "
           "a layer of another layout (", spec, "; this one is ", mine, "): the graph was made for "
           "another model or before the layer changed, e.g. an exported program of another offload, or a "
           "compiled graph a cache served from another process. Compile or export the model again in this "
           "process (torch._dynamo.reset() drops what Dynamo holds)");
}

}  // namespace layerstream
