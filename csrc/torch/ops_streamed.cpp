// layerstream — LibTorch glue: the streamed Linear and convolution (StreamedFn) and what the autograd functions share
// (the engine's rooms: engine_impl.h).
#include "engine_impl.h"

#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/cpp_hook.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/jit/frontend/tracer.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <queue>
#include <type_traits>
#include <typeinfo>
#include <unordered_map>

#include "core/log.h"

namespace layerstream {

// ---- shared by the autograd functions (declared in engine_impl.h) ----
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::shared_ptr<EngineImpl> engine_from(AutogradContext* ctx) {
  const uint64_t id = static_cast<uint64_t>(ctx->saved_data["engine"].toInt());
  auto e = EngineImpl::lookup(id);
  LS_CHECK(e != nullptr, "the layerstream engine of this graph was destroyed before backward "
           "(the offload handle was detached or garbage-collected); keep the handle alive until "
           "backward completes");
  return e;
}

// backward(create_graph=True) runs backward functions with grad mode on, to
// build a graph of the gradients (double backward, e.g. a gradient penalty).
// A streamed layer cannot take part: its device weight is a slot that is
// reused right after (a graph saving it would read other weights later), and
// it is not the parameter (the weight's share of the second derivative would
// be missing). Refuse instead of returning silently wrong numbers.
void check_no_create_graph(const EngineImpl::LayerInfo& l) {
  LS_CHECK(!torch::GradMode::is_enabled(), "layer '", l.name, "': backward with create_graph=True "
           "(double backward, e.g. a gradient penalty) is not supported through a streamed layer; "
           "keep the layers it must differentiate through resident (offload(exclude=[...]); C++: "
           "OffloadOptions::exclude) or "
           "compute that gradient without create_graph");
}

// ctx->get_saved_variables(), naming the layer when autograd's version check
// fails (its weight or input was written in place after the forward); any
// other error (e.g. a second backward through a freed graph) is autograd's
// own, passed on as it is.
variable_list saved_variables_of(AutogradContext* ctx, const EngineImpl::LayerInfo& l) {
  try {
    return ctx->get_saved_variables();
  } catch (const c10::Error& err) {
    if (std::string(err.what_without_backtrace()).find("modified by an inplace operation") == std::string::npos)
      throw;
    LS_FAIL("streamed layer '", l.name, "': a tensor its backward needs (its weight or its input) "
             "was modified in place after the forward pass (e.g. an optimizer step or a weight edit "
             "before this backward); autograd raises the same for a resident layer. ",
             err.what_without_backtrace());
  }
  return {};
}

// Under torch.autocast, Linear and convolutions run in the autocast dtype:
// the input is cast here as autocast would cast it (differentiably, so its
// gradient is cast back), and the weight follows the activation dtype by the
// dtype rule (the compute_dtype copy in the slot when it matches). Without
// this, autocast would cast the weight inside the op, outside the budget.
torch::Tensor autocast_input(const torch::Tensor& x, c10::DeviceType device) {
  if (!at::autocast::is_autocast_enabled(device)) return x;
  const torch::ScalarType to = at::autocast::get_autocast_dtype(device);
  const torch::ScalarType t = x.scalar_type();
  if (!x.is_floating_point() || t == torch::kDouble || t == to) return x;
  return x.to(to);
}

void check_input(EngineImpl& e, const EngineImpl::LayerInfo& l, const torch::Tensor& x) {
  LS_CHECK(x.device() == e.compute_device(), "layer '", l.name, "' streams to ",
           e.device_name(), " (tensors on ", e.compute_device().str(), ") but its input is on ",
           x.device().str(), "; move the input to ", e.compute_device().str());
  LS_CHECK(is_float_activation(x.scalar_type()), "layer '", l.name, "' got a ", dtype_name(x.scalar_type()),
           " input; activations must be float32, bfloat16 or float16");
}

// A plain loss.backward(): autograd accumulates into every leaf's .grad. Then
// layerstream copies weight gradients back asynchronously and accumulates them
// itself. Otherwise (torch.autograd.grad, backward(inputs=...)) autograd must
// decide where each gradient goes, so they are returned to it.
bool plain_backward() {
  const auto* info = torch::autograd::get_current_graph_task_exec_info();
  return info == nullptr || info->empty();
}

// Under torch.autograd.grad / backward(inputs=...): whether the caller asked
// for leaf p's gradient (its accumulator runs, or its gradient is captured).
// In a plain backward every leaf's is.
bool asked_for(const torch::Tensor& p) {
  const auto* info = torch::autograd::get_current_graph_task_exec_info();
  if (info == nullptr || info->empty()) return true;
  const auto acc = torch::autograd::impl::try_get_grad_accumulator(p);
  if (!acc) return false;
  const auto it = info->find(acc.get());
  return it != info->end() && it->second.should_execute();
}

namespace {
// Set by the Python bindings at import; read at every streamed call (no lock).
std::atomic<decltype(GradHookProbe::pre)> probe_pre{nullptr};
std::atomic<decltype(GradHookProbe::post_accumulate)> probe_post{nullptr};
}  // namespace

bool EngineImpl::stages_grads(int layer_index) const {
  const LayerInfo& l = layer(layer_index);
  return !l.shared_weight && !has_grad_hooks(l.weight) && !has_grad_hooks(l.bias);
}

void set_grad_hook_probe(GradHookProbe probe) {
  probe_pre.store(probe.pre);
  probe_post.store(probe.post_accumulate);
}

// Gradient hooks on a parameter (Python's register_hook or
// register_post_accumulate_grad_hook among them): they fire only when
// autograd accumulates its gradient. A hook object whose hooks were all
// removed stays registered (set_grad_hook_probe, engine.h) and is none: it
// counted as one, and a compiled backward then raised "registered after
// torch.compile traced it" for a hook registered and removed again (found on
// 2026-12-06). A tensor without autograd metadata (a quantized weight's
// stand-in) has none.
bool has_grad_hooks(const torch::Tensor& p) {
  namespace ag = torch::autograd;
  if (!p.defined() || ag::impl::get_autograd_meta(p) == nullptr) return false;
  for (const auto& h : ag::impl::hooks(p)) {
    if (!h) continue;
    // LibTorch exports no type_info of its hook classes (no dynamic_cast):
    // the object's own type name says which it is (Itanium ABI).
    if (std::strcmp(typeid(*h).name(), "N5torch8autograd24CppFunctionTensorPreHookE") == 0) {
      const auto& list = *static_cast<const ag::CppFunctionTensorPreHook&>(*h).hooks_;
      if (std::any_of(list.begin(), list.end(), [](const auto& f) { return static_cast<bool>(f); })) return true;
      continue;
    }
    const auto pre = probe_pre.load();
    if (!pre || pre(*h)) return true;
  }
  const auto& post = ag::impl::post_acc_grad_hooks(p);
  if (post == nullptr) return false;
  const auto post_probe = probe_post.load();
  return !post_probe || post_probe(*post);
}

namespace {

bool wants_grad(const torch::Tensor& p) {
  return p.defined() && p.requires_grad() && p.is_floating_point();
}

// While it lives, the layer's parked storages point at `fresh` (the weights
// its backward fetched); parked again when it ends, also on an exception, and
// before the slot lease declared before it goes back.
class Unparked {
 public:
  Unparked(EngineImpl& e, int layer, torch::ScalarType dtype, const EngineImpl::DeviceParams& fresh)
      : e_(e), layer_(layer), dtype_(dtype) {
    e_.unpark(layer_, dtype_, fresh);
  }
  Unparked(const Unparked&) = delete;
  Unparked& operator=(const Unparked&) = delete;
  ~Unparked() {
    try {
      e_.park(layer_, dtype_);
    } catch (const std::exception& err) {  // a destructor must not throw
      warn(std::string("layerstream: parking a layer's storages failed: ") + err.what());
    }
  }

 private:
  EngineImpl& e_;
  int layer_;
  torch::ScalarType dtype_;
};

// The scratch slot of a weight gradient: released here on the compute stream
// unless push_grads() took it (it releases it after the gradient stream has
// read it).
class ScratchLease {
 public:
  ScratchLease(Scheduler& sched, Stream cs) : sched_(sched), lease_(sched.acquire_scratch(cs)), cs_(cs) {}
  ScratchLease(const ScratchLease&) = delete;
  ScratchLease& operator=(const ScratchLease&) = delete;
  ~ScratchLease() {
    if (!handed_on_) SlotLease release(sched_, std::move(lease_), cs_);  // releases, never throws
  }
  Lease& get() { return lease_; }
  void handed_on() { handed_on_ = true; }

 private:
  Scheduler& sched_;
  Lease lease_;
  Stream cs_;
  bool handed_on_ = false;
};

// Note [Same calls as the resident module]
// Bit-exactness with the resident model holds only if a streamed layer issues
// the resident module's ATen/BLAS calls on operands of the same shapes,
// strides and requires_grad: at::matmul folds a 3-D+ input into one GEMM
// only when the weight requires grad, at::_convolution picks its backend by
// grad mode, mm's backward transposes its product by the weight's layout, and
// each BLAS rounds these variants differently on some CPUs. So the streamed
// op does not reimplement the module's math; it runs the module's own call
// (torch::linear, at::convNd) on leaves that stand in for the parameters
// (EngineImpl::device_params: views of the slot with the parameters'
// requires_grad) under the caller's grad mode, and with a gradient to come,
// keeps the autograd graph that call recorded and runs it in backward with
// the autograd engine itself: op for op the resident module's graph.
//
// The graph's saved tensors must not pin slot memory (the slot is reused
// right after the forward): the storages of the device parameters it may
// have saved (the leaves, and their cast-at-use copies) are *parked* after
// the forward (data pointer null; a cast copy's memory freed), and in
// backward pointed at the re-fetched slot (and fresh cast copies) before the
// graph runs, then parked again (the way FSDP frees and restores parameter
// storage under saved tensors). Only the storages change: the saved tensors'
// metadata and version counters stay, so autograd's checks hold. The
// storages are registered per layer (EngineImpl::register_storages), not per
// graph: under a non-reentrant checkpoint the graph's saved tensors are the
// ones its recompute made, which the backward of the layer must point at the
// fetched weights too; a recompute run inside the layer's own backward
// computes on that backward's weights (EngineImpl::active_params). A
// Linear's weight and bias gradients read no weight, so its backward that
// needs no input gradient fetches nothing. A convolution's backward may read
// it even then: ATen makes the weight contiguous in the memory format it
// picks from the input and the weight (a channels_last input with a
// contiguous weight, e.g. peft's lora_A conv in a channels_last model: a
// copy), and a parked storage's null data pointer read by a copy kernel is
// a crash, not an error. So a conv always fetches (as op_backward does).

// What a streamed op's forward keeps for its backward. Not the input: the
// graph reaches it through a sink (input_with_sink), so that nothing but
// the recorded graph's saved variables holds it (which activation offload
// may have stashed; docs/design/activations.md).
struct KeptGraph : torch::CustomClassHolder {
  torch::autograd::Edge root;    // the op's output in the recorded graph
  torch::autograd::Edge x_edge;  // where the input's gradient arrives (invalid: no gradient)
  torch::Tensor w, b;            // the leaves the graph was recorded on (b may be undefined)
  torch::ScalarType dtype = torch::kFloat;  // the activations' (device_params)
};

// The input gradient's end of a kept graph: run_kept_graph and the autograd
// engine collect the gradient arriving here; it is never run.
struct InputSink : torch::autograd::Node {
  torch::autograd::variable_list apply(torch::autograd::variable_list&&) override { return {}; }
};

// A new node: Edge::function is an intrusive_ptr in recent LibTorch, a
// shared_ptr before (both branches depend on the template arguments, so only
// the one this LibTorch takes is compiled).
template <class Ptr, class N = InputSink>
Ptr make_node() {
  if constexpr (std::is_same_v<Ptr, std::shared_ptr<torch::autograd::Node>>)
    return std::make_shared<N>();
  else
    return c10::make_intrusive<N>();
}

// `x` as the kept graph's input: the same data and version counter (an
// in-place write after the forward still fails autograd's check), no
// autograd history; when it requires grad, its gradient edge is a sink
// instead of a leaf's accumulator, which would hold the tensor alive.
torch::Tensor input_with_sink(const torch::Tensor& x, torch::autograd::Edge* edge) {
  auto impl = x.getIntrusivePtr()->shallow_copy_and_detach(x.unsafeGetTensorImpl()->version_counter(),
                                                           /*allow_tensor_metadata_change=*/true);
  torch::Tensor xin(std::move(impl));
  if (x.requires_grad()) {
    auto sink = make_node<decltype(torch::autograd::Edge::function)>();
    sink->add_input_metadata(xin);
    *edge = torch::autograd::Edge(std::move(sink), 0);
    torch::autograd::impl::set_gradient_edge(xin, *edge);
  }
  return xin;
}

// New leaves on the memory of `p` (other storage objects, same pointers), as
// device_params() would make them: for a forward run inside the layer's own
// backward, whose storages that backward parks when it ends.
EngineImpl::DeviceParams alias_params(const EngineImpl::DeviceParams& p, torch::ScalarType dtype) {
  const auto alias = [](const torch::Tensor& t) {
    torch::Tensor a = torch::from_blob(t.data_ptr(), t.sizes(), t.strides(), t.options());
    if (t.requires_grad()) a.set_requires_grad(true);
    return a;
  };
  EngineImpl::DeviceParams out;
  out.w_leaf = alias(p.w_leaf);
  out.w = out.w_leaf.scalar_type() == dtype ? out.w_leaf : out.w_leaf.to(dtype);
  if (p.b_leaf.defined()) {
    out.b_leaf = alias(p.b_leaf);
    out.b = out.b_leaf.scalar_type() == dtype ? out.b_leaf : out.b_leaf.to(dtype);
  }
  return out;
}

// Note [The kept graph runs in the caller's graph task]
// Engine::execute (torch autograd's) would run a kept graph as a graph task of its own, and
// non-reentrant checkpointing keys its recompute by the current graph task:
// each streamed layer of a checkpointed region would recompute the whole
// region again (N layers, N recomputes), and each nested task costs a graph
// task's setup. In a plain backward (no exec_info: every edge computes) the
// graph is small and runs here instead, node by node as the autograd engine
// runs nodes: only the nodes that lead to a wanted leaf, in the engine's
// order (highest sequence number first among the ready ones), gradients
// summed per input as its input buffers do, each node's outputs validated
// (cast and shaped) by the engine's own validate_outputs, and the saved
// variables released after the node unless the graph is kept.
variable_list run_kept_graph(const torch::autograd::Edge& root, const torch::Tensor& go,
                             const torch::autograd::edge_list& wanted, bool keep_graph) {
  using torch::autograd::Node;
  using NodePtr = decltype(torch::autograd::Edge::function);
  std::unordered_map<Node*, size_t> want;
  for (size_t i = 0; i < wanted.size(); ++i) want.emplace(wanted[i].function.get(), i);
  std::unordered_map<Node*, bool> needed;  // a path to a wanted leaf (the graph is a DAG)
  const std::function<bool(Node*)> leads = [&](Node* n) {
    auto it = needed.find(n);
    if (it != needed.end()) return it->second;
    bool need = false;
    for (const auto& e : n->next_edges())
      if (e.is_valid() && (want.count(e.function.get()) || leads(e.function.get()))) need = true;
    needed[n] = need;
    return need;
  };
  variable_list got(wanted.size());
  if (!leads(root.function.get())) return got;
  std::unordered_map<Node*, int> deps;
  for (const auto& [n, need] : needed)
    if (need)
      for (const auto& e : n->next_edges())
        if (e.is_valid() && !want.count(e.function.get()) && needed[e.function.get()]) ++deps[e.function.get()];
  const auto add = [](torch::Tensor& into, torch::Tensor&& g) {
    if (!g.defined()) return;
    into = into.defined() ? into + g : std::move(g);
  };
  std::unordered_map<Node*, variable_list> inputs;
  const auto buffer = [&](Node* n) -> variable_list& {
    auto& b = inputs[n];
    if (b.empty()) b.resize(n->num_inputs());
    return b;
  };
  auto later = [](const NodePtr& a, const NodePtr& b) { return a->sequence_nr() < b->sequence_nr(); };
  std::priority_queue<NodePtr, std::vector<NodePtr>, decltype(later)> ready(later);
  buffer(root.function.get())[root.input_nr] = go;
  ready.push(root.function);
  while (!ready.empty()) {
    NodePtr fn = ready.top();
    ready.pop();
    variable_list in = std::move(buffer(fn.get()));
    inputs.erase(fn.get());
    if (!keep_graph) fn->will_release_variables();
    variable_list out = (*fn)(std::move(in));
    if (!keep_graph) fn->release_variables();
    torch::autograd::validate_outputs(fn->next_edges(), out,
                                      [&](const std::string& msg) { return fn->name() + ": " + msg; });
    for (size_t i = 0; i < out.size(); ++i) {
      const auto& e = fn->next_edge(i);
      if (!e.is_valid()) continue;
      Node* to = e.function.get();
      auto w = want.find(to);
      if (w != want.end()) {
        add(got[w->second], std::move(out[i]));
        continue;
      }
      if (!needed[to]) continue;
      add(buffer(to)[e.input_nr], std::move(out[i]));
      if (--deps[to] == 0) ready.push(e.function);
    }
  }
  return got;
}

}  // namespace

// The resident module's own call (Note [Same calls as the resident module]).
torch::Tensor layer_op(const EngineImpl::LayerInfo& l, const torch::Tensor& x, const torch::Tensor& w,
                       const torch::Tensor& b) {
  if (!l.is_conv()) return torch::linear(x, w, b);
  const ConvSpec& c = l.conv();
  switch (c.dims) {
    case 1:
      return c.same ? at::conv1d(x, w, b, c.stride, "same", c.dilation, c.groups)
                    : at::conv1d(x, w, b, c.stride, c.padding, c.dilation, c.groups);
    case 2:
      return c.same ? at::conv2d(x, w, b, c.stride, "same", c.dilation, c.groups)
                    : at::conv2d(x, w, b, c.stride, c.padding, c.dilation, c.groups);
    default:
      return c.same ? at::conv3d(x, w, b, c.stride, "same", c.dilation, c.groups)
                    : at::conv3d(x, w, b, c.stride, c.padding, c.dilation, c.groups);
  }
}

// A streamed layer's computation without an autograd node of its own (no
// gradient can flow): fetch, compute under the caller's grad mode, release.
torch::Tensor streamed_forward(EngineImpl* e, EngineImpl::LayerInfo& l, int layer, const torch::Tensor& x) {
  Stream cs = e->compute_stream();
  SlotLease lease(e->scheduler(), e->scheduler().acquire(layer, cs, e->current_phase()), cs);
  auto span = e->trace_begin(cs);
  const EngineImpl::DeviceParams p = e->device_params(l, lease.get(), x.scalar_type());
  torch::Tensor out = layer_op(l, x, p.w, p.b);
  if (span) e->trace_end(cs, span, "compute", std::string("fwd ") + l.name);
  return out;
}

namespace {

// A streamed Linear or convolution when a gradient can flow.
struct StreamedFn : public torch::autograd::Function<StreamedFn> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor x, torch::Tensor weight,
                               torch::Tensor bias, EngineImpl* e, int64_t layer, bool via_autograd) {
    EngineImpl::LayerInfo& l = e->layer(static_cast<int>(layer));
    auto kept = c10::make_intrusive<KeptGraph>();
    kept->dtype = x.scalar_type();
    const int index = static_cast<int>(layer);
    torch::Tensor out;
    // Inside this layer's own backward (a non-reentrant checkpoint recomputing
    // its region to unpack a saved tensor): on the weights that backward holds.
    const std::optional<EngineImpl::DeviceParams> active = e->active_params(index, kept->dtype);
    {
      Stream cs = e->compute_stream();
      std::optional<SlotLease> lease;
      if (!active) lease.emplace(e->scheduler(), e->scheduler().acquire(index, cs, e->current_phase()), cs);
      auto span = e->trace_begin(cs);
      at::AutoGradMode grad_on(true);  // as the resident module's call runs
      const torch::Tensor xin = input_with_sink(x, &kept->x_edge);
      const EngineImpl::DeviceParams p =
          active ? alias_params(*active, kept->dtype) : e->device_params(l, lease->get(), kept->dtype);
      kept->w = p.w_leaf;
      kept->b = p.b_leaf;
      const EngineImpl::WeightsNotActivations weights(p);  // what the graph saves of them stays put
      torch::Tensor recorded = layer_op(l, xin, p.w, p.b);
      if (recorded.requires_grad()) kept->root = torch::autograd::impl::gradient_edge(recorded);
      out = recorded.detach();
      if (span) e->trace_end(cs, span, "compute", std::string("fwd ") + l.name);
      // Parked now, before the slot goes back (or, inside the layer's
      // backward, when that backward ends).
      e->register_storages(index, kept->dtype, p, /*park_now=*/!active);
    }
    ctx->saved_data["via_autograd"] = via_autograd;
    ctx->saved_data["engine"] = static_cast<int64_t>(e->id());
    ctx->saved_data["layer"] = layer;
    ctx->saved_data["graph"] = c10::IValue::make_capsule(kept);
    // The parameter is saved (no copy) where the resident module's graph
    // saves the weight (a Linear when the input gradient needs it, a conv
    // always): unpacking checks its version, so an in-place write between
    // forward and backward raises autograd's error instead of
    // differentiating through the new values.
    ctx->save_for_backward({l.is_conv() || x.requires_grad() ? weight : torch::Tensor()});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto e = engine_from(ctx);
    const int layer = static_cast<int>(ctx->saved_data["layer"].toInt());
    EngineImpl::LayerInfo& l = e->layer(layer);
    check_no_create_graph(l);
    auto scope = e->device_scope();
    saved_variables_of(ctx, l);  // the version check
    auto kept = c10::static_intrusive_pointer_cast<KeptGraph>(ctx->saved_data["graph"].toCapsule());
    const variable_list none(6);
    const torch::Tensor& go = grads[0];
    if (!go.defined() || !kept->root.is_valid()) return none;
    const bool need_x = ctx->needs_input_grad(0) && kept->x_edge.is_valid();
    const bool need_w = ctx->needs_input_grad(1) && kept->w.requires_grad() && wants_grad(l.weight);
    const bool need_b = l.bias.defined() && ctx->needs_input_grad(2) && kept->b.defined() &&
                        kept->b.requires_grad() && wants_grad(l.bias);
    if (!need_x && !need_w && !need_b) return none;
    // A gradient hook registered since the forward (stages_grads() now false) fires
    // only if autograd accumulates the gradient: returned, not staged (it got None).
    const bool via_autograd = ctx->saved_data["via_autograd"].toBool() || !plain_backward() || !e->stages_grads(layer);
    const bool keep_graph = torch::autograd::get_current_graph_task_keep_graph();
    torch::autograd::edge_list wanted;
    if (need_x) wanted.push_back(kept->x_edge);
    for (const auto& [need, leaf] : {std::pair{need_w, &kept->w}, {need_b, &kept->b}})
      if (need) wanted.push_back(torch::autograd::impl::gradient_edge(*leaf));
    Stream cs = e->compute_stream();
    Scheduler& sched = e->scheduler();
    // Note [The kept graph runs in the caller's graph task]; under
    // torch.autograd.grad / backward(inputs=...) the autograd engine runs it
    // (the caller's exec_info would prune the kept graph's edges).
    const bool plain = plain_backward();
    const auto run = [&] {
      if (plain) return run_kept_graph(kept->root, go, wanted, keep_graph);
      return torch::autograd::Engine::get_default_engine().execute({kept->root}, {go}, keep_graph,
                                                                  /*create_graph=*/false,
                                                                  /*accumulate_grad=*/false, wanted);
    };
    variable_list got;
    if (!need_x && !l.is_conv()) {
      // A Linear's weight and bias gradients are functions of the input and the
      // output gradient only: the graph reads no weight, so it is not fetched
      // again (a conv's may: Note [Same calls as the resident module]).
      got = run();
    } else {
      SlotLease lease(sched, sched.acquire(layer, cs, Phase::Backward), cs);
      auto span = e->trace_begin(cs);
      {
        const Unparked unparked(*e, layer, kept->dtype, e->device_params(l, lease.get(), kept->dtype));
        got = run();
      }  // parked before the slot goes back: nothing may point into it
      if (span) e->trace_end(cs, span, "compute", std::string("bwd ") + l.name);
    }
    if (!keep_graph) kept->root = torch::autograd::Edge();
    size_t k = 0;
    const torch::Tensor gx = need_x ? got[k++] : torch::Tensor();
    torch::Tensor gw = need_w ? got[k++] : torch::Tensor();
    torch::Tensor gb = need_b ? got[k++] : torch::Tensor();
    if ((need_w || need_b) && via_autograd) {
      // Returned to autograd (host copies, synchronous), which routes them.
      e->average_gradient(layer, gw);  // engine_distributed.cpp
      e->average_gradient(layer, gb);
      return {gx, need_w ? e->grad_to_host(gw, l.w_dtype) : torch::Tensor(),
              need_b ? e->grad_to_host(gb, l.b_dtype) : torch::Tensor(), torch::Tensor(), torch::Tensor(),
              torch::Tensor()};
    }
    if (need_w || need_b) e->stage_grads(layer, gw, gb);
    return {gx, torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace
}  // namespace layerstream

// Note [An eager streamed layer refuses compiled autograd]
// torch._dynamo's compiled autograd captures the whole backward as a graph:
// each custom autograd node offers what it saved (compiled_args) and is
// either traced or called opaquely. StreamedFn's backward cannot be either:
// it runs the graph its forward recorded on the streamed weights (saved as a
// capsule, which compiled autograd cannot even hash: torch said only
// "unhashable type: 'Capsule'"), and the gradients it stages are added when
// the autograd engine ends its backward, which a compiled backward never
// does (the compiled model's operators are refused the same way for trainable
// weights: _refuse_compiled_autograd, python/layerstream/_ops.py). So it is
// refused when compiled autograd collects it, before anything ran, naming the
// layer and what to do. This specializes LibTorch's CppNode<T>::compiled_args
// for StreamedFn alone (it must precede the first StreamedFn::apply).
namespace torch::autograd {
template <>
void CppNode<layerstream::StreamedFn>::compiled_args(torch::dynamo::autograd::CompiledNodeArgs&) const {
  std::string name = "?";
  const auto engine = ctx_.saved_data.find("engine"), layer = ctx_.saved_data.find("layer");
  if (engine != ctx_.saved_data.end() && layer != ctx_.saved_data.end())
    if (auto e = layerstream::EngineImpl::lookup(static_cast<uint64_t>(engine->second.toInt())))
      name = e->layer(static_cast<int>(layer->second.toInt())).name;
  LS_FAIL("compiled autograd (torch._dynamo.compiled_autograd) cannot run the backward of streamed layer '", name,
          "' called eagerly: that backward runs a graph of its own on the streamed weights. Run this backward "
          "without compiled autograd, or torch.compile the model first (its streamed layers then are operators, "
          "which compiled autograd runs while their weights are frozen, e.g. for LoRA)");
}
}  // namespace torch::autograd

namespace layerstream {

void EngineImpl::stage_grads(int layer_index, const torch::Tensor& gw, const torch::Tensor& gb) {
  const LayerInfo& l = layer(layer_index);
  const bool has_w = gw.defined(), has_b = gb.defined();
  // Averaged over the process group, if any, before the copy to the host
  // (engine_distributed.cpp), overlapped with the rest of the backward.
  const bool average = averages_now(layer_index);
  // Into the scratch slot in the parameters' dtypes (as autograd's cast back
  // would), then to the host on the gradient stream.
  Stream cs = compute_stream();
  ScratchLease scratch(scheduler(), cs);
  const auto dopts = torch::TensorOptions().device(compute_device());
  std::vector<torch::Tensor> parts;
  if (has_w)
    parts.push_back(torch::from_blob(scratch.get().part_ptr(0), l.w_shape, dopts.dtype(l.w_dtype)).copy_(gw));
  if (has_b)
    parts.push_back(torch::from_blob(static_cast<char*>(scratch.get().slot_buf.ptr) +
                                         slot_layout::gradient_bias_offset(l.w_bytes),
                                     l.b_shape, dopts.dtype(l.b_dtype))
                        .copy_(gb));
  if (average) average_before_copy(parts);
  push_grads(layer_index, scratch.get(), has_w, has_b);
  scratch.handed_on();
  ensure_backward_callback();
}

namespace {
// torch.jit.trace (torch::jit::trace) would record the device weight of this
// one call, a view of a slot that holds other layers later, as a constant:
// the traced module would compute with whatever that memory holds.
void check_not_tracing(const EngineImpl::LayerInfo& l) {
  LS_CHECK(!torch::jit::tracer::isTracing(), "streamed layer '", l.name, "' cannot be recorded by "
           "torch.jit.trace: its weights are copied into reused device memory at each call, which "
           "a trace would freeze. Trace the model before offload() or after handle.detach(), or "
           "use torch.export or torch.compile (they record each streamed layer as a layerstream operator).");
}

}  // namespace

// A CUDA graph would record the kernels of one call and replay them without
// the scheduler's host-side work (the copy into the slot, the wait for it):
// a replay would compute on whatever the slot holds then.
void EngineImpl::check_not_capturing(const LayerInfo& l) const {
  LS_CHECK(cuda_index_ < 0 || !cuda_glue::capturing(cuda_index_), "streamed layer '", l.name,
           "' cannot run inside a CUDA graph capture (torch.cuda.graph, or a CUDA graph that "
           "torch.compile(mode=\"reduce-overhead\") records around it): its weights are copied by host-side "
           "scheduling that a replay would skip. Under torch.compile the layerstream operators are tagged "
           "cudagraph_unsafe, so Inductor captures only the code between them; capture by hand only code "
           "that calls no streamed layer.");
}

const char* kind_of(const EngineImpl::LayerInfo& l) {
  return l.is_conv() ? "a convolution" : l.is_table() ? "an embedding" : l.is_group() ? "a tensor group" : "a Linear";
}

namespace {
// Whether a gradient can flow through the layer's call (else it runs without
// an autograd node of its own, as the resident module would record none).
bool needs_node(const torch::Tensor& x, const EngineImpl::LayerInfo& l) {
  return torch::GradMode::is_enabled() &&
         (x.requires_grad() || l.weight.requires_grad() || (l.bias.defined() && l.bias.requires_grad()));
}
}  // namespace

EngineImpl::LayerInfo& EngineImpl::call_layer(int index, const char* kind) {
  report_failed_backward();
  LayerInfo& l = layer(index);
  check_not_tracing(l);
  check_not_capturing(l);
  check_no_step_in_flight(l);
  LS_CHECK(std::strcmp(kind_of(l), kind) == 0, "layer '", l.name, "' is ", kind_of(l), ", not ", kind);
  return l;
}

torch::Tensor EngineImpl::linear(int layer_index, const torch::Tensor& x_in, bool grads_via_autograd) {
  auto scope = device_scope();
  LayerInfo& l = call_layer(layer_index, "a Linear");
  check_input(*this, l, x_in);
  const torch::Tensor x = autocast_input(x_in, compute_device_.type());
  check_host_alias(l);
  ensure_scheduler();
  // No gradient can flow (no_grad / inference, or nothing requires grad):
  // skip the autograd node entirely.
  if (!needs_node(x, l)) return streamed_forward(this, l, layer_index, x);
  note_forward_use(l);  // the gradient-ready hook (engine_grad_ready.cpp)
  // Autograd inputs must be defined tensors: without a bias, the weight
  // stands in (the functions read the bias from the layer, never from here).
  return StreamedFn::apply(x, l.weight, l.bias.defined() ? l.bias : l.weight, this,
                           static_cast<int64_t>(layer_index), grads_via_autograd || !stages_grads(layer_index));
}

void check_conv_input(const EngineImpl::LayerInfo& l, const torch::Tensor& x) {
  LS_CHECK(x.dim() == l.conv().dims + 1 || x.dim() == l.conv().dims + 2, "Conv", l.conv().dims, "d layer '", l.name,
           "' expects a ", l.conv().dims + 1, "-D or ", l.conv().dims + 2, "-D input, got ", x.dim(), "-D");
}

torch::Tensor EngineImpl::conv(int layer_index, const torch::Tensor& x_in, bool grads_via_autograd) {
  auto scope = device_scope();
  LayerInfo& l = call_layer(layer_index, "a convolution");
  check_input(*this, l, x_in);
  const torch::Tensor x = autocast_input(x_in, compute_device_.type());
  check_host_alias(l);
  ensure_scheduler();
  check_conv_input(l, x);
  if (!needs_node(x, l)) return streamed_forward(this, l, layer_index, x);
  note_forward_use(l);  // the gradient-ready hook (engine_grad_ready.cpp)
  return StreamedFn::apply(x, l.weight, l.bias.defined() ? l.bias : l.weight, this,
                           static_cast<int64_t>(layer_index), grads_via_autograd || !stages_grads(layer_index));
}

}  // namespace layerstream
