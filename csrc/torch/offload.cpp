// layerstream — LibTorch glue: the C++ offload() and its handle. offload() runs in phases:
// collect the layers it may stream, keep tied weights' layers resident, plan what a
// budget keeps resident (as Python's offload()), refuse torch::nn modules held outside
// their parent's registry, then attach the rest to one engine and move everything else
// to the compute device. The streamed modules themselves: nn_modules.cpp.
#include "layerstream/offload.h"

#include <fnmatch.h>

#include <algorithm>
#include <map>
#include <set>

#include "core/offload_policy.h"
#include "core/optim/optim.h"
#include "core/options.h"
#include "core/planner.h"
#include "core/slot_layout.h"
#include "dtype_name.h"
#include "engine_impl.h"  // src_dtype_of
#include "layerstream/host_optim.h"

namespace layerstream {

namespace {

bool glob_any(const std::vector<std::string>& patterns, const std::string& name) {
  for (const auto& p : patterns)
    if (fnmatch(p.c_str(), name.c_str(), 0) == 0) return true;
  return false;
}

template <size_t D, typename Opt>
torch::nn::ConvOptions<D> conv_options_from(const Opt& o) {
  torch::nn::ConvOptions<D> c(o.in_channels(), o.out_channels(), o.kernel_size());
  c.stride(o.stride()).padding(o.padding()).dilation(o.dilation()).groups(o.groups()).bias(o.bias());
  c.padding_mode(o.padding_mode());
  return c;
}

// A layer offload() may stream. Collected before anything changes: swapping
// while iterating the tree would invalidate it.
struct Item {
  std::string name;
  torch::nn::Module* parent;
  std::weak_ptr<torch::nn::Module> parent_ref;  // what the handle keeps (Swap)
  std::string child;
  std::shared_ptr<torch::nn::Module> module;
  bool shared = false;  // its weight is tied to another streamed layer's
};

struct Candidates {
  std::vector<Item> items;
  std::set<torch::nn::Module*> collected;  // every module taken, planned or not
  std::shared_ptr<torch::nn::Module> root;  // named_modules' shared_ptr to the root
  // Linear/conv layers left resident: their weight's dtype (float64) needs
  // activations of that dtype, which streamed layers refuse ("'name' (float64)").
  std::vector<std::string> resident_dtype;
  // include patterns that name no module: most likely typos, the layers meant
  // then stay resident (Python's _discovery._warn_unmatched; exclude patterns,
  // often written for several architectures at once, are not checked).
  std::vector<std::string> unmatched_include;
};

// Whether a streamed Linear/conv with weights of this dtype can be called: it
// takes float32/bfloat16/float16 activations (ops_streamed.cpp's check_input),
// and torch's module takes its input in its weight's dtype. A one-byte float
// (float8) is cast at use to the activations' dtype. As Python's
// _discovery._activation_dtype.
bool streams_in(torch::ScalarType t) { return c10::elementSize(t) == 1 || is_float_activation(t); }

// The modules offload() would stream, ties aside, in the tree's order.
Candidates collect_candidates(torch::nn::Module& root, const OffloadOptions& options) {
  auto selected = [&](const std::string& name) {
    if (!options.include.empty() && !glob_any(options.include, name)) return false;
    return !glob_any(options.exclude, name);
  };
  Candidates c;
  std::vector<std::string> names;  // every module's, the root's ("") too
  for (const auto& named : root.named_modules("", /*include_self=*/true)) names.push_back(named.key());
  for (const auto& p : options.include)
    if (std::none_of(names.begin(), names.end(), [&](const std::string& n) { return glob_any({p}, n); }))
      c.unmatched_include.push_back("'" + p + "'");
  for (const auto& named : root.named_modules("", /*include_self=*/true)) {
    if (named.key().empty()) c.root = named.value();
    torch::nn::Module* parent = named.value().get();
    const bool is_container = dynamic_cast<torch::nn::SequentialImpl*>(parent) ||
                              dynamic_cast<torch::nn::ModuleListImpl*>(parent) ||
                              dynamic_cast<torch::nn::ModuleDictImpl*>(parent);
    for (const auto& child : parent->named_children()) {
      const std::string name = named.key().empty() ? child.key() : named.key() + "." + child.key();
      auto m = child.value();
      // layerstream::nn::Embedding: a float table without max_norm (which
      // renormalizes the rows it reads, in place); others compute as the torch
      // module, resident. torch::nn::Embedding is not swapped: parents
      // usually call it through their own holder member, which would keep
      // calling the torch module on a weight moved to the host.
      if (const auto* e = dynamic_cast<nn::EmbeddingImpl*>(m.get())) {
        if (!e->weight.is_floating_point() || e->options.max_norm()) continue;
      }
      const bool plain = dynamic_cast<torch::nn::LinearImpl*>(m.get()) ||
                         dynamic_cast<torch::nn::Conv1dImpl*>(m.get()) ||
                         dynamic_cast<torch::nn::Conv2dImpl*>(m.get()) ||
                         dynamic_cast<torch::nn::Conv3dImpl*>(m.get());
      const bool ours = dynamic_cast<nn::StreamedBase*>(m.get()) != nullptr;
      if ((!plain && !ours) || !selected(name)) continue;
      const auto own = m->named_parameters(/*recurse=*/false);  // kept: find() points into it
      if (const torch::Tensor* w = own.find("weight"); w && w->numel() == 0)
        continue;  // zero elements (e.g. Linear(0, n)): nothing to stream
      if (const torch::Tensor* w = own.find("weight");
          w && w->is_floating_point() && !dynamic_cast<nn::EmbeddingImpl*>(m.get()) && !streams_in(w->scalar_type())) {
        c.resident_dtype.push_back("'" + name + "' (" + dtype_name(w->scalar_type()) + ")");
        continue;
      }
      if (!c.collected.insert(m.get()).second) continue;  // one module under two names
      LS_CHECK(!(plain && is_container), "cannot stream '", name, "': it is a torch::nn module "
               "inside a Sequential/ModuleList/ModuleDict, whose element list offload() cannot "
               "swap. Declare it as layerstream::nn::Linear/Conv*d, or exclude it.");
      if (ours) {
        LS_CHECK(!dynamic_cast<nn::StreamedBase*>(m.get())->attached(), "module '", name,
                 "' is already offloaded by another layerstream handle; detach it first (OffloadHandle::detach(): a "
                 "handle dropped without detach() leaves its layers streamed until they are destroyed)");
      }
      c.items.push_back(Item{name, parent, named.value(), child.key(), m});
    }
  }
  // The root itself a layer (offload(*layerstream::nn::Linear(...)), named ""
  // as Python names it): one of ours is bound where it is; a torch::nn layer
  // would have to be swapped in a parent, and the root has none.
  torch::nn::Module* r = c.root ? c.root.get() : nullptr;
  if (r && !c.collected.count(r) && selected("")) {
    LS_CHECK(!(dynamic_cast<torch::nn::LinearImpl*>(r) || dynamic_cast<torch::nn::Conv1dImpl*>(r) ||
               dynamic_cast<torch::nn::Conv2dImpl*>(r) || dynamic_cast<torch::nn::Conv3dImpl*>(r)),
             "cannot stream the root module: it is a torch::nn layer, which offload() streams by swapping it in "
             "its parent, and the root has none. Declare it as layerstream::nn::Linear/Conv*d (streamed where it "
             "is), or offload a module that holds it");
    const auto* e = dynamic_cast<nn::EmbeddingImpl*>(r);
    const auto own = r->named_parameters(/*recurse=*/false);
    const torch::Tensor* w = own.find("weight");
    if (dynamic_cast<nn::StreamedBase*>(r) && (!e || (e->weight.is_floating_point() && !e->options.max_norm())) &&
        !(w && w->numel() == 0)) {
      LS_CHECK(!dynamic_cast<nn::StreamedBase*>(r)->attached(), "the root module is already offloaded by another "
               "layerstream handle; detach it first");
      c.collected.insert(r);
      c.items.insert(c.items.begin(), Item{"", nullptr, {}, "", c.root});
    }
  }
  return c;
}

struct Ties {
  std::vector<std::string> resident;     // the layers tied weights keep resident, explained
  std::vector<std::string> unquantized;  // streamed layers sharing a weight: not quantized
  std::vector<std::vector<std::string>> groups;  // streamed layers that share one weight
};

// Tied weights (the rule: core/offload_policy.h analyse_ties): drops from `items`
// the layers whose weight a module that stays resident shares, and marks those
// that share it with another streamed layer.
Ties apply_ties(torch::nn::Module& root, std::vector<Item>& items, quant::Format qformat) {
  std::map<uint64_t, std::vector<policy::TieOwner>> owners;  // every parameter's distinct modules
  std::set<torch::nn::Module*> seen;
  for (const auto& named : root.named_modules("", /*include_self=*/true)) {
    if (!seen.insert(named.value().get()).second) continue;
    for (const auto& p : named.value()->named_parameters(/*recurse=*/false)) {
      if (!p.value().defined()) continue;
      owners[reinterpret_cast<uint64_t>(p.value().unsafeGetTensorImpl())].push_back(
          {reinterpret_cast<uint64_t>(named.value().get()), p.key(),
           named.key().empty() ? p.key() : named.key() + "." + p.key()});
    }
  }
  std::vector<policy::TieCandidate> described;
  for (const auto& it : items) {
    policy::TieCandidate c{it.name, reinterpret_cast<uint64_t>(it.module.get()), {}};
    for (const auto& p : it.module->named_parameters(/*recurse=*/false))
      if (p.value().defined())
        c.params.push_back({p.key(), reinterpret_cast<uint64_t>(p.value().unsafeGetTensorImpl()),
                            p.key() == "weight"});
    described.push_back(std::move(c));
  }
  policy::TieResult r = policy::analyse_ties(described, owners);
  Ties t{std::move(r.resident), {}, std::move(r.groups)};
  std::vector<Item> kept;
  for (size_t k = 0; k < r.kept.size(); ++k) {
    Item it = items[r.kept[k]];
    it.shared = r.shares[k];
    if (it.shared && qformat != quant::Format::None && !dynamic_cast<nn::EmbeddingImpl*>(it.module.get()))
      t.unquantized.push_back("'" + it.name + "'");
    kept.push_back(std::move(it));
  }
  items = std::move(kept);
  return t;
}

// What training a tensor keeps on the device beyond its weight (OffloadOptions::train).
uint64_t train_bytes_of(const optim::TrainSpec& train, const torch::Tensor& t) {
  return t.defined() && t.requires_grad()
             ? optim::train_bytes(train, t.sizes().vec(), static_cast<uint64_t>(t.element_size()))
             : uint64_t{0};
}

// One streamed layer as the planner sees it: the bytes it moves over the bus,
// its slot (packed and dequantized or cast parts, core/slot_layout.h), its size resident.
PlannerLayer planner_layer(const Item& it, quant::Format qformat, const options::Dtypes& dtypes,
                           const optim::TrainSpec& train) {
  const auto out_bytes = [](quant::OutDtype d) { return static_cast<uint64_t>(quant::out_dtype_bytes(d)); };
  const auto cast_to_compute = [&](const torch::Tensor& t) {
    return dtypes.compute && t.element_size() != static_cast<int64_t>(out_bytes(*dtypes.compute))
               ? t.numel() * out_bytes(*dtypes.compute)
               : uint64_t{0};
  };
  const auto params = it.module->named_parameters(/*recurse=*/false);
  const torch::Tensor& w = params["weight"];
  const torch::Tensor* b = params.find("bias");
  const bool has_bias = b && b->defined();
  const quant::Format fmt = it.shared ? quant::Format::None : qformat;
  const int64_t rows = w.size(0), cols = w.numel() / std::max<int64_t>(rows, 1);
  const uint64_t dense = static_cast<uint64_t>(w.numel() * w.element_size());
  std::vector<slot_layout::Part> parts;
  // A trainable lossless weight (Note [Trainable coded weights]): the slot
  // holds its largest coded size, the bus its coded size.
  const bool coded = fmt == quant::Format::Lossless && w.requires_grad();
  uint64_t coded_gap = 0;
  if (coded) {
    const quant::SrcDtype d = src_dtype_of(w.scalar_type(), it.name);
    const uint64_t cap = lossless::max_encoded_bytes(d, w.numel());
    coded_gap = slot_layout::align(cap) -
                slot_layout::align(quant::packed_bytes(fmt, d, w.detach().cpu().contiguous().data_ptr(), rows, cols));
    parts.push_back({cap, dense});
  } else if (fmt != quant::Format::None) {  // packed on the bus; dequantized after it in the slot
    const torch::Tensor src = fmt == quant::Format::Lossless ? w.detach().cpu().contiguous() : torch::Tensor();
    parts.push_back({quant::packed_bytes(fmt, src_dtype_of(w.scalar_type(), it.name),
                                         src.defined() ? src.data_ptr() : nullptr, rows, cols),
                     dtypes.dequant && fmt != quant::Format::Lossless ? w.numel() * out_bytes(*dtypes.dequant)
                                                                      : dense});
  } else {
    parts.push_back({dense, cast_to_compute(w)});
  }
  if (has_bias) parts.push_back({static_cast<uint64_t>(b->numel() * b->element_size()), cast_to_compute(*b)});
  const auto layout = slot_layout::of(parts);
  PlannerLayer l;
  l.name = it.name;
  l.bytes = layout.bus_bytes - coded_gap;
  l.slot_bytes = layout.slot_bytes();
  l.resident_bytes = dense + (has_bias ? static_cast<uint64_t>(b->numel() * b->element_size()) : 0);
  l.trainable = w.requires_grad();
  l.train_bytes = train_bytes_of(train, w) + (has_bias ? train_bytes_of(train, *b) : 0);
  return l;
}

struct Residency {
  std::set<std::string> resident;  // the layers the plan keeps on the device
  int64_t engine_budget = -1;      // what is left for the engine's slots
  uint64_t resident_bytes = 0;     // the resident layers and the small always-resident tensors
  std::string plan;                // Plan::explain()
};

// With a budget, the planner's rule, as Python's offload(): slots first,
// residency with what is left (core/planner.h plan_slots_first); the budget
// covers every weight on the device. Layers it keeps resident are not
// attached; the engine's slots get what is left.
Residency plan_residency(torch::nn::Module& root, const std::vector<Item>& items,
                         const std::set<torch::nn::Module*>& collected, const OffloadOptions& options,
                         quant::Format qformat, const std::vector<std::vector<std::string>>& tie_groups) {
  const options::Dtypes dtypes = options::check_dtypes(options.dequant_dtype, options.compute_dtype);
  const optim::TrainSpec train = optim::parse_train_spec(options.train);
  PlannerInput in;
  in.budget_bytes = static_cast<uint64_t>(options.budget_bytes);
  std::set<torch::nn::Module*> planned;
  std::map<std::string, size_t> index;  // planned layer name -> its index in in.layers
  for (const auto& it : items) {
    if (dynamic_cast<nn::EmbeddingImpl*>(it.module.get())) continue;  // looked up in host memory
    planned.insert(it.module.get());
    index[it.name] = in.layers.size();
    in.layers.push_back(planner_layer(it, qformat, dtypes, train));
  }
  // Tied weights of streamed layers: placed together by the planner, the weight
  // counted once, in the first one's bytes (PlannerLayer::tied_layer); tables are
  // not planned.
  for (const auto& group : tie_groups) {
    int first = -1;
    for (const auto& name : group) {
      auto at = index.find(name);
      if (at == index.end()) continue;
      if (first < 0) {
        first = static_cast<int>(at->second);
        continue;
      }
      const Item& it = *std::find_if(items.begin(), items.end(), [&](const Item& i) { return i.name == name; });
      const torch::Tensor w = it.module->named_parameters(/*recurse=*/false)["weight"];
      PlannerLayer& l = in.layers[at->second];
      l.tied_layer = first;
      l.tied_bytes = slot_layout::align(w.nbytes());
      l.resident_bytes -= w.nbytes();
      l.train_bytes -= train_bytes_of(train, w);
    }
  }
  std::set<torch::TensorImpl*> counted;  // a tensor shared by two modules is on the device once
  for (const auto& named : root.named_modules("", /*include_self=*/true)) {
    if (planned.count(named.value().get()) || collected.count(named.value().get())) continue;
    for (const auto& t : named.value()->parameters(/*recurse=*/false))
      if (t.defined() && counted.insert(t.unsafeGetTensorImpl()).second) {
        in.fixed_resident_bytes += t.nbytes();
        in.fixed_train_bytes += train_bytes_of(train, t);
      }
    for (const auto& t : named.value()->buffers(/*recurse=*/false))
      if (t.defined() && counted.insert(t.unsafeGetTensorImpl()).second) in.fixed_resident_bytes += t.nbytes();
  }
  // The copy times: the sim device models its link (as Python's offload());
  // a GPU's is not known here.
  if (resolve_device(options.device, DeviceSpelling::Cpp) == "sim") in.link_bytes_per_s = options.sim_h2d_gbps * 1e9;
  const Plan plan = plan_slots_first(in, options.prefetch, options.slots);
  Residency r;
  for (const auto& l : plan.layers)
    if (l.resident) r.resident.insert(l.name);
  // Tied weights: a head kept resident keeps the tensor on the device, so
  // the table that shares it is resident too (in the head's bytes).
  for (const auto& group : tie_groups)
    for (const auto& n : group)
      if (r.resident.count(n)) {
        r.resident.insert(group.begin(), group.end());
        break;
      }
  r.engine_budget = static_cast<int64_t>(
      plan.budget_bytes - std::min(plan.budget_bytes, plan.resident_bytes + plan.fixed_resident_bytes + plan.train_bytes));
  r.resident_bytes = plan.resident_bytes + plan.fixed_resident_bytes;
  r.plan = plan.explain();
  return r;
}

// A torch::nn::Linear / Conv*d is swapped in its parent's registry only. Anyone
// else who holds it would go on calling the old module on weights moved to the
// host: unstreamed and outside the budget on the sim device (no error at all), a
// device mismatch on CUDA. C++ modules call their children through ModuleHolder
// members (`torch::nn::Linear fc{nullptr}`), which hold them, so this is the usual
// case. Layers the plan keeps resident are not swapped: they may be held. Owners
// now: the registry, `items`, and whoever else (use_count()). docs/design/torch-glue.md.
void refuse_held_torch_modules(const std::vector<Item>& items) {
  std::string held;
  for (const auto& it : items)
    if (!dynamic_cast<nn::StreamedBase*>(it.module.get()) && it.module.use_count() > 2)
      held += (held.empty() ? "'" : ", '") + it.name + "'";
  LS_CHECK(held.empty(), "cannot stream ", held, ": torch::nn modules that are held outside their parent's "
           "registry (a member `torch::nn::Linear fc{nullptr}` through which the parent calls it, or a "
           "variable of yours). offload() can swap a torch::nn::Linear/Conv*d child only in the registry, "
           "so such a holder would go on calling the old module on weights moved to host memory. Declare "
           "the members as layerstream::nn::Linear / Conv1d / Conv2d / Conv3d (drop-in replacements: same "
           "options and parameter names), or exclude them (OffloadOptions::exclude: they stay resident, "
           "as a budget that holds them keeps them); nothing was changed");
}

std::string join(const std::vector<std::string>& names, const char* sep) {
  std::string list;
  for (const auto& t : names) list += (list.empty() ? "" : sep) + t;
  return list;
}

void warn_list(const std::string& head, const std::vector<std::string>& names, const char* sep) {
  if (!names.empty()) TORCH_WARN(head, join(names, sep));
}

}  // namespace


// ---------------------------------------------------------------------------
// OffloadHandle
// ---------------------------------------------------------------------------
std::shared_ptr<Engine> OffloadHandle::engine() const {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  LS_CHECK(engine_ != nullptr, "this layerstream handle was detached; call offload() again");
  return engine_;
}

EngineStats OffloadHandle::stats() const {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  EngineStats s = engine()->stats();
  if (budget_bytes_ >= 0) {  // the engine's budget is what the resident layers left for the slots
    s.budget_bytes = budget_bytes_;
    s.peak_device_bytes += resident_bytes_;
  }
  return s;
}

void OffloadHandle::synchronize() { engine()->synchronize(); }  // engine(): a copy, taken under the lock

// Note [Suspend] (engine.cpp): the engine frees its slots; the model's tensors on
// the compute device are the handle's to move (as the Python Handle does).
void OffloadHandle::suspend() {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  auto e = engine();
  if (e->suspended()) return;
  e->suspend();  // first: it refuses while a layer computes
  const torch::Device dev = e->compute_device();
  auto root = root_.lock();
  if (!root || dev.is_cpu()) return;  // the sim device computes on the host: nothing to move
  torch::NoGradGuard ng;
  std::set<torch::TensorImpl*> seen;
  auto off = [&](torch::Tensor t) {
    if (!t.defined() || t.device() != dev || !seen.insert(t.unsafeGetTensorImpl()).second) return;
    t.set_data(t.data().to(torch::kCPU));
    if (t.grad().defined() && t.grad().device() == dev) t.mutable_grad() = t.grad().to(torch::kCPU);
    moved_.emplace_back(t, dev);
  };
  for (auto& p : root->parameters(/*recurse=*/true)) off(p);
  for (auto& b : root->buffers(/*recurse=*/true)) off(b);
}

void OffloadHandle::move_back() {
  torch::NoGradGuard ng;
  for (auto& [t, dev] : moved_) {
    if (t.device() != dev) t.set_data(t.data().to(dev));
    if (t.grad().defined() && t.grad().device() != dev) t.mutable_grad() = t.grad().to(dev);
  }
}

void OffloadHandle::resume() {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  auto e = engine();
  if (!e->suspended()) return;
  move_back();  // before the slots: a retry after an error redoes both
  e->resume();
  moved_.clear();
}

void OffloadHandle::detach() {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  auto e = engine();
  move_back();  // a suspended model's tensors; no slots for detach
  moved_.clear();
  e->detach(devices_);
  for (auto& u : unbind_) u();
  for (auto& s : swaps_)
    if (auto parent = s.parent.lock()) parent->replace_module(s.child, s.original);
  unbind_.clear();
  swaps_.clear();
  engine_.reset();
  root_.reset();
  if (uncounted_) *uncounted_ = false;
}

std::shared_ptr<OffloadHandle> offload(torch::nn::Module& root, const OffloadOptions& options) {
  auto handle = std::shared_ptr<OffloadHandle>(new OffloadHandle());
  LS_CHECK(options.activations >= -1, "OffloadOptions::activations is ", options.activations,
           ": use -1 (off), 0 (every saved tensor that can goes to the host) or a device budget in bytes");
  optim::parse_train_spec(options.train);  // an unknown spec throws before anything changes
  LS_CHECK(options.train.empty() || options.train == "none" || options.budget_bytes >= 0, "OffloadOptions::train '",
           options.train, "' sizes what the budget covers; it needs budget_bytes too (without a budget nothing is "
           "kept resident for it)");
  handle->activations_ = options.activations;
  const quant::Format qformat =
      options.quantize.empty() || options.quantize == "none" ? quant::Format::None
                                                             : quant::parse_format(options.quantize);

  // Nothing changes until every layer is chosen and checked.
  Candidates found = collect_candidates(root, options);
  handle->root_ = found.root;
  std::vector<Item> items = std::move(found.items);
  const Ties ties = apply_ties(root, items, qformat);
  if (!found.unmatched_include.empty())  // before the error below, which a typo may explain
    TORCH_WARN("layerstream: OffloadOptions::include: ", join(found.unmatched_include, ", "), " match",
               found.unmatched_include.size() == 1 ? "es" : "", " no module name (glob patterns on the qualified "
               "names root.named_modules() lists, e.g. \"layers.*\")");
  const char* dtype_why = "torch's Linear/conv takes its input in its weight's dtype, and a streamed one refuses "
                          "such activations at every call; to stream them, convert the model before offload(), "
                          "e.g. model->to(torch::kFloat)";
  LS_CHECK(!items.empty(), "offload() found no Linear, Conv1d/2d/3d or Embedding module to stream: it streams "
           "layerstream::nn::Linear / Conv*d / Embedding (a table without max_norm) and registered "
           "torch::nn::Linear / Conv*d children outside Sequential/ModuleList/ModuleDict, never "
           "torch::nn::Embedding, and keeps layers whose weights are tied to a resident module resident (a "
           "warning names them); a layer of zero elements has nothing to stream; include/exclude select "
           "among them",
           found.resident_dtype.empty() ? std::string()
                                        : "; Linear/conv layers whose weight dtype streamed layers do not compute "
                                          "in stay resident (" + std::string(dtype_why) + "): " +
                                              join(found.resident_dtype, ", "));
  EngineOptions engine_options = options;
  // A quantized layer the plan keeps resident computes with the values it would
  // stream with (the budget must not change the numbers): computed here, before
  // anything changes (NaN/Inf throw), written once every layer is attached.
  struct QuantizedResident {
    std::shared_ptr<torch::nn::Module> module;
    torch::Tensor weight, values;
    std::string name;
  };
  std::vector<QuantizedResident> quantized_resident;
  std::vector<std::string> not_ours;  // torch::nn modules among them: nothing quantizes a later write
  std::vector<std::string> rounded;   // their weights' dtype cannot hold the dequant_dtype values
  std::optional<torch::ScalarType> rounded_dtype;
  const auto dequant = scalar_type_of(options::check_dtypes(options.dequant_dtype, options.compute_dtype).dequant);
  if (options.budget_bytes >= 0) {
    const Residency r = plan_residency(root, items, found.collected, options, qformat, ties.groups);
    engine_options.budget_bytes = r.engine_budget;
    handle->plan_ = r.plan;
    handle->budget_bytes_ = options.budget_bytes;
    handle->resident_bytes_ = r.resident_bytes;
    std::vector<Item> streaming;
    for (auto& it : items) {
      if (!r.resident.count(it.name)) {
        streaming.push_back(std::move(it));
        continue;
      }
      handle->resident_.push_back(it.name);
      if (it.shared || qformat == quant::Format::None || qformat == quant::Format::Lossless ||
          dynamic_cast<nn::EmbeddingImpl*>(it.module.get()))
        continue;
      torch::Tensor w = it.module->named_parameters(/*recurse=*/false)["weight"];
      // As the engine refuses a streamed one (engine_register.cpp): whether it streams is the budget's call.
      LS_CHECK(!w.requires_grad(), "layer '", it.name, "': a quantized weight cannot be trained; freeze it "
               "first (requires_grad_(false), as QLoRA does with the base model) or do not quantize");
      quantized_resident.push_back({it.module, w, quantized_values(w, w.size(0),
                                                                   w.numel() / std::max<int64_t>(w.size(0), 1),
                                                                   options.quantize, dequant),
                                    it.name});
      if (!dynamic_cast<nn::StreamedBase*>(it.module.get())) not_ours.push_back("'" + it.name + "'");
      if (resident_quantized_rounds(w.scalar_type(), dequant)) {
        rounded.push_back("'" + it.name + "'");
        if (!rounded_dtype) rounded_dtype = w.scalar_type();
      }
    }
    items = std::move(streaming);
  }
  refuse_held_torch_modules(items);

  auto engine = Engine::create(engine_options);
  handle->engine_ = engine;
  const torch::Device dev = engine->compute_device();
  warn_list("layerstream: " + std::to_string(ties.resident.size()) + " layer(s) with tied weights stay resident on " +
                dev.str() + " (another module that stays resident, or a bias, shares the tensor; a streamed copy "
                "would move it under that module): ",
            ties.resident, "; ");
  warn_list("layerstream: " + std::to_string(found.resident_dtype.size()) + " Linear/conv layer(s) whose weight "
                "dtype streamed layers do not compute in stay resident on " + dev.str() + " (" + dtype_why + "): ",
            found.resident_dtype, ", ");
  warn_list("layerstream: quantize=" + options.quantize + " does not apply to " +
                std::to_string(ties.unquantized.size()) +
                " layer(s) with tied weights (a shared weight streams unquantized): ",
            ties.unquantized, ", ");

  // A failure part way (a trainable layer to quantize, host or device
  // memory) undoes the layers attached so far, as detach() does, before it
  // propagates.
  struct UndoOnThrow {
    OffloadHandle* handle;
    bool armed = true;
    ~UndoOnThrow() {
      if (!armed) return;
      try {
        handle->detach();
      } catch (...) {
      }
    }
  } undo{handle.get()};
  std::set<torch::TensorImpl*> streamed;
  // Called right after the engine took the layer, with the device its
  // weight was on before (the engine moved it to the host store).
  auto record = [&](const std::string& name, const torch::Tensor& w, const torch::Tensor& b,
                    torch::Device before) {
    handle->names_.push_back(name);
    handle->devices_.push_back(before);
    streamed.insert(w.unsafeGetTensorImpl());
    if (b.defined()) streamed.insert(b.unsafeGetTensorImpl());
  };
  // The model may die before the handle: detach() then has nothing to unbind (a
  // raw pointer here was a write into freed memory; HandleOutlivingItsModel...).
  auto unbind_later = [&handle](const std::shared_ptr<torch::nn::Module>& module) {
    handle->unbind_.push_back([weak = std::weak_ptr<torch::nn::Module>(module)] {
      if (auto alive = weak.lock()) dynamic_cast<nn::StreamedBase&>(*alive).unbind();
    });
  };
  for (auto& it : items) {
    torch::nn::Module* m = it.module.get();
    const quant::Format fmt = it.shared ? quant::Format::None : qformat;
    const auto own = m->named_parameters(/*recurse=*/false);  // kept: find() points into it
    const torch::Tensor* w0 = own.find("weight");
    const torch::Device before = w0 ? w0->device() : torch::Device(torch::kCPU);
    if (auto* l = dynamic_cast<nn::LinearImpl*>(m)) {
      const int idx = engine->add_linear(it.name, l->weight, l->bias, fmt);
      l->bind(engine, idx);
      unbind_later(it.module);
      record(it.name, l->weight, l->bias, before);
    } else if (auto* e = dynamic_cast<nn::EmbeddingImpl*>(m)) {
      const int idx = engine->add_embedding(it.name, e->weight, e->options.padding_idx().value_or(-1),
                                            e->options.scale_grad_by_freq(), e->options.sparse());
      e->bind(engine, idx);
      unbind_later(it.module);
      record(it.name, e->weight, torch::Tensor(), before);
    } else if (auto* tl = dynamic_cast<torch::nn::LinearImpl*>(m)) {
      auto s = std::make_shared<nn::LinearImpl>(tl->options, tl->weight, tl->bias);
      const int idx = engine->add_linear(it.name, s->weight, s->bias, fmt);
      s->bind(engine, idx);
      unbind_later(s);  // a reference the caller kept computes as a plain layer after detach()
      it.parent->replace_module(it.child, s);
      handle->swaps_.push_back({it.parent_ref, it.child, it.module});
      record(it.name, s->weight, s->bias, before);
    } else {
      auto swap_conv = [&](auto* conv, auto dim_tag) -> bool {
        if (!conv) return false;
        constexpr size_t D = decltype(dim_tag)::value;
        auto opts = conv_options_from<D>(conv->options);
        auto s = std::make_shared<nn::ConvImpl<D>>(opts, conv->weight, conv->bias);
        const int idx = engine->add_conv(it.name, s->weight, s->bias, s->spec(), fmt);
        s->bind(engine, idx);
        unbind_later(s);
        it.parent->replace_module(it.child, s);
        handle->swaps_.push_back({it.parent_ref, it.child, it.module});
        record(it.name, s->weight, s->bias, before);
        return true;
      };
      auto bind_ours = [&](auto* conv) -> bool {
        if (!conv) return false;
        const int idx = engine->add_conv(it.name, conv->weight, conv->bias, conv->spec(), fmt);
        conv->bind(engine, idx);
        unbind_later(it.module);
        record(it.name, conv->weight, conv->bias, before);
        return true;
      };
      if (bind_ours(dynamic_cast<nn::Conv1dImpl*>(m)) || bind_ours(dynamic_cast<nn::Conv2dImpl*>(m)) ||
          bind_ours(dynamic_cast<nn::Conv3dImpl*>(m)))
        continue;
      if (swap_conv(dynamic_cast<torch::nn::Conv1dImpl*>(m), std::integral_constant<size_t, 1>{}) ||
          swap_conv(dynamic_cast<torch::nn::Conv2dImpl*>(m), std::integral_constant<size_t, 2>{}) ||
          swap_conv(dynamic_cast<torch::nn::Conv3dImpl*>(m), std::integral_constant<size_t, 3>{}))
        continue;
    }
  }

  // Everything not streamed goes to the compute device (device memory can run
  // out here too: still undone).
  torch::NoGradGuard ng;
  for (auto& p : root.parameters(/*recurse=*/true)) {
    if (streamed.count(p.unsafeGetTensorImpl()) || p.device() == dev) continue;
    p.set_data(p.data().to(dev));
  }
  for (auto& b : root.buffers(/*recurse=*/true)) {
    if (b.device() != dev) b.set_data(b.data().to(dev));
  }
  if (options.budget_bytes >= 0 && (options.train.empty() || options.train == "none")) {
    std::vector<torch::Tensor> kept;  // trainable, on the device, beyond what the budget counted
    for (auto& p : root.parameters(/*recurse=*/true))
      if (p.requires_grad() && !streamed.count(p.unsafeGetTensorImpl())) kept.push_back(p);
    handle->uncounted_ = optim::note_uncounted_training(kept);
  }
  // A later torch::load() or write into them is quantized again
  // (StreamedBase::keep_quantized); torch::nn modules have no hook for it.
  for (auto& q : quantized_resident) {
    q.weight.copy_(q.values);
    if (auto* ours = dynamic_cast<nn::StreamedBase*>(q.module.get())) {
      ours->keep_quantized(q.weight, options.quantize, dequant, q.name);
      handle->unbind_.push_back([weak = std::weak_ptr<torch::nn::Module>(q.module)] {
        if (auto alive = weak.lock()) dynamic_cast<nn::StreamedBase&>(*alive).stop_quantized();
      });
    }
  }
  warn_list("layerstream: " + std::to_string(not_ours.size()) + " torch::nn layer(s) kept resident hold their "
                "quantize=" + options.quantize + " values, but a later torch::load() or write into them is not "
                "quantized again (declare them layerstream::nn::Linear / Conv*d, which quantize it as a streamed "
                "layer does): ",
            not_ours, ", ");
  if (rounded_dtype) {  // as Python's _attach._warn_resident_rounding says it
    const std::string held = dtype_name(*rounded_dtype), dq = dtype_name(*dequant);
    warn_list("layerstream: " + std::to_string(rounded.size()) + " quantized layer(s) kept resident by the budget "
                  "hold their quantized values in their weights' dtype (" + held + "), rounded from dequant_dtype=" +
                  dq + ", while streamed layers compute in " + dq + ": the budget changes the numbers. For the "
                  "same numbers everywhere, pass a dequant_dtype the weights' dtype holds (dequant_dtype=" + held +
                  "), or a budget that streams them: ",
              rounded, ", ");
  }
  undo.armed = false;
  return handle;
}

}  // namespace layerstream
