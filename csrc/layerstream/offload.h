// layerstream — C++ API for LibTorch users.
//
//   #include "layerstream/offload.h"
//   layerstream::OffloadOptions opts;          // device "auto": CUDA if visible, else sim
//   opts.budget_bytes = 2LL << 30;
//   auto handle = layerstream::offload(*model, opts);
//   auto loss = model->forward(x).sum(); loss.backward();   // grads on host, complete
//   handle->stats(); handle->detach();
//
// Streamed module types. layerstream::nn::Linear / Conv1d / Conv2d / Conv3d /
// Embedding are drop-in replacements for torch::nn::Linear / Conv*d /
// Embedding (same options, parameters "weight" and "bias"): they compute like
// the torch module until offload() attaches them to an engine, then they
// stream their weights (an embedding: a table without max_norm, looked up in
// host memory; see Engine::add_embedding).
//
// offload(root, options) needs root owned by a std::shared_ptr
// (std::make_shared<Net>(), or a TORCH_MODULE holder): its walk of the tree
// takes root as one (Module::named_modules, root included), and a module on
// the stack gets torch's "attempted to retrieve your top-level module as a
// shared_ptr". It walks root's module tree and
//  * attaches every layerstream::nn::* module (an Embedding only without
//    max_norm), and
//  * swaps a registered torch::nn::Linear / Conv*d child for a streamed
//    module sharing the same parameters (same named_parameters() names) via
//    Module::replace_module, when nothing but its parent's registry holds it
//    (a parent that re-reads its children from the registry, as the streamed
//    type: the swapped-in module is a layerstream::nn::LinearImpl / ConvImpl,
//    not a torch::nn::LinearImpl, so `as<torch::nn::Linear>()` gives null). A
//    child held elsewhere, by a ModuleHolder member (`torch::nn::Linear
//    fc{nullptr}`: how C++ modules usually call their children) or a variable
//    of the caller's, would go on being called unswapped: when the plan
//    streams it, offload() throws naming it, before anything changes; declare
//    the member as layerstream::nn::Linear / Conv*d, or exclude it. Children
//    of Sequential / ModuleList / ModuleDict cannot be swapped either (their
//    element lists are private): offload() throws naming them, so nothing runs
//    unstreamed silently. torch::nn::Embedding is never swapped (it stays
//    resident): declare the member as layerstream::nn::Embedding to stream a
//    table.
// Tied weights (one weight parameter of several modules, e.g. an output
// projection sharing a layerstream::nn::Embedding's table) stream when every
// module that has it streams: they read one host copy, unquantized (with a
// warning when `quantize` is set), and their gradients go back through
// autograd. A layer whose weight another, resident module shares (e.g. a
// torch::nn::Embedding), or whose bias is shared, stays resident, with one
// warning (docs/design/torch-glue.md).
// budget_bytes (>= 0) bounds every weight on the device, with Python's rule
// (core/planner.h plan_slots_first): the slots the prefetch depth needs
// (prefetch + 1, or `slots`) are reserved first, then the planner keeps as many
// layers resident as the rest holds (handle->resident_layers(), plan()); only
// the others stream. A budget too small for 2 slots of the largest streamed
// layer throws layerstream::BudgetTooSmall before anything changes (a
// layerstream::Error; to catch it by type: #include "layerstream/core/planner.h").
// Non-streamed parameters and buffers are moved to the compute device. After
// offload(), model->to(<compute device>) leaves the streamed weights in host
// memory; other devices or dtypes throw (children convert in order, so
// modules before the first streamed one may already be converted then).
//
// Thread safety: the handle's methods are thread-safe. Calls of the offloaded
// module: one thread at a time (a mutex around forward when several threads
// serve it): concurrent calls share the slots and the traced step, and may
// run out of slots. Python's offload() makes its calls take turns itself
// (docs/design/torch-glue.md, "Calls from several threads").
#pragma once

#include <torch/torch.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "engine.h"

namespace layerstream {

struct OffloadOptions : EngineOptions {
  // Glob patterns (* and ?) on qualified module names; empty include = all.
  std::vector<std::string> include;
  std::vector<std::string> exclude;
  // "" or "none", "int8", "fp8" (also "fp8_e4m3", "e4m3"), "nf4", "int4" or
  // "lossless", in any case (quant::parse_format's names): pack every streamed
  // weight (they must be frozen, but for "lossless"). In C++ the module's
  // dense parameter is left as it is (the engine does not use it; free it
  // yourself if host RAM matters: weight.set_data(torch::empty({0})). Freed,
  // torch::save() writes the dequantized packed copy and detach() puts that
  // back). A write to it is refused at the layer's next call;
  // Engine::requantize() (handle->engine()) or torch::load() loads new values,
  // packed and written into the dense parameter too unless it was freed.
  // A trainable weight with "lossless" stays the dense parameter, adopted
  // into the host store like an unquantized one, and only its copy to the
  // device is coded (re-coded after it changes; Note [Trainable coded
  // weights], engine_coded.cpp).
  std::string quantize;
  // Activation offload (docs/design/activations.md): -1 off; else the device
  // budget for saved activations in bytes (0: every saved tensor that can
  // goes to the host), used by OffloadHandle::saved_activations().
  int64_t activations = -1;
  // With a budget: what the trainable weights kept resident take on the
  // device beside themselves while they train, which the budget then covers
  // too (docs/design/planner.md, "Training"): "" counts the weights only;
  // "grads", "adamw", "adamw-bf16", "adamw-8bit", "adafactor",
  // "adafactor-beta1", or a number of optimizer-state bytes per parameter
  // (core/optim/optim.h parse_train_spec).
  std::string train;
};

// While it lives, the tensors autograd saves on this thread go through the
// handle's engine (Engine::stash_activation when saved, restore_activation
// when backward unpacks them, drop_activation when the graph is freed); the
// model's parameters and buffers stay as they are. Made by
// OffloadHandle::saved_activations() around a forward. LibTorch has no
// saved-tensor hooks of its own: the first scope installs layerstream's
// subclass of torch's autograd engine as the process's
// (torch::autograd::set_default_engine_stub), which differs only in
// supplying these hooks while a scope lives; a process whose engine is
// already another (LibTorch under Python) is refused. Scopes nest (the
// innermost wins). Thread safety: a scope belongs to the thread that made it
// and ends there; one destroyed on another thread warns and is ended for its
// own thread too (saved_activations.cpp, Note [A scope ended on another
// thread]). Not copyable or movable.
class SavedActivations {
 public:
  ~SavedActivations();
  SavedActivations(const SavedActivations&) = delete;
  SavedActivations& operator=(const SavedActivations&) = delete;
  struct State;  // saved_activations.cpp

 private:
  friend class OffloadHandle;
  SavedActivations(std::shared_ptr<Engine> engine, uint64_t device_budget, const std::vector<torch::Tensor>& keep);
  std::unique_ptr<State> state_;
};

class OffloadHandle {
 public:
  // The engine's counters; with a budget, budget_bytes is the budget given to
  // offload() and peak_device_bytes counts the layers the planner kept resident
  // too (as Python's Handle.stats()); engine()->stats() has the slots' alone.
  EngineStats stats() const;
  void synchronize();
  // Restores plain computation: weights back to ordinary tensors on their
  // original devices (bit-identical); swapped children are swapped back
  // (into the parents that still live: the handle may outlive the model).
  void detach();
  // Frees the device memory the offloaded model holds, for a while (another
  // model, a VAE decode, sampling): Engine::suspend() (the streaming slots),
  // and every parameter (with its grad) and buffer of the model on the
  // compute device goes to host memory (set_data: the same tensors). Until
  // resume() the model must not be called: its streamed layers throw, and
  // resident ones would compute on the host copies. resume() moves them back
  // and allocates the slots again (throws, still suspended, when the device
  // cannot hold them; a retry redoes both). Nothing to do when already
  // suspended / not suspended; detach() of a suspended handle moves them back
  // and allocates no slots. Call them between steps, not while the model runs.
  void suspend();
  void resume();
  bool suspended() const { return engine()->suspended(); }
  // Fixed by offload() (detach() leaves them as they were): no lock needed.
  const std::vector<std::string>& layers() const { return names_; }  // streamed layers
  // With a budget: the layers the planner kept resident (not streamed, moved to
  // the compute device) and its placement as text; empty without a budget.
  const std::vector<std::string>& resident_layers() const { return resident_; }
  const std::string& plan() const { return plan_; }
  std::shared_ptr<Engine> engine() const;
  // With OffloadOptions::activations: a scope to open around the forward
  // (see SavedActivations). The offloaded module must still live. Throws
  // without that option, or once detached.
  SavedActivations saved_activations();

 private:
  friend std::shared_ptr<OffloadHandle> offload(torch::nn::Module&, const OffloadOptions&);
  // Held by every method that reads or changes the members below (recursive:
  // they call engine()); never while the model runs, which does not take it.
  mutable std::recursive_mutex mu_;
  // Weak references to the modules of the offloaded tree: the handle may outlive
  // them (detach() then has nothing to swap back into; saved_activations()
  // throws), and keeps nothing of the user's model alive.
  struct Swap {
    std::weak_ptr<torch::nn::Module> parent;
    std::string child;
    std::shared_ptr<torch::nn::Module> original;
  };
  std::shared_ptr<Engine> engine_;
  std::weak_ptr<torch::nn::Module> root_;  // the offloaded module (saved_activations())
  int64_t activations_ = -1;           // OffloadOptions::activations
  std::vector<std::string> names_;
  std::vector<std::string> resident_;
  std::string plan_;
  int64_t budget_bytes_ = -1;   // OffloadOptions::budget_bytes (stats())
  uint64_t resident_bytes_ = 0;  // the planner's resident bytes (stats())
  std::vector<torch::Device> devices_;
  std::vector<Swap> swaps_;
  // suspend(): the tensors it moved to host memory and where they were.
  std::vector<std::pair<torch::Tensor, torch::Device>> moved_;
  void move_back();  // moves them back (again: a no-op for those already there)
  std::vector<std::function<void()>> unbind_;
  // Trainable parameters the budget kept on the device without
  // OffloadOptions::train (optim::note_uncounted_training); false once detached.
  std::shared_ptr<std::atomic<bool>> uncounted_;
};

// Keep the handle while the model is offloaded: its layers hold the engine, so
// a handle dropped without detach() leaves them streamed (and another offload()
// of them refused) until they are destroyed.
std::shared_ptr<OffloadHandle> offload(torch::nn::Module& root, const OffloadOptions& options = {});

namespace nn {

// Common part of the streamed modules: the engine binding.
class StreamedBase {
 public:
  bool attached() const { return engine_ != nullptr; }
  void bind(std::shared_ptr<Engine> engine, int index) {
    engine_ = std::move(engine);
    index_ = index;
  }
  void unbind() {
    engine_.reset();
    index_ = -1;
  }
  // offload(quantize=) kept this layer resident with its weight's quantized
  // values (the budget must not change the numbers; docs/design/planner.md,
  // "Quantized layers kept resident"): from here on, a torch::load() into it is
  // quantized again as it loads, and a write into its weight (its version
  // counter moved, or the parameter was replaced) at its next forward, as a
  // streamed layer's is. Called by offload() after it wrote the values; ended
  // (the values stay) by stop_quantized(), which detach() calls. A weight
  // unfrozen since is refused at the next forward (a step's values would be
  // quantized again), naming the layer `name`. Not concurrently with a call of
  // the module.
  void keep_quantized(const torch::Tensor& weight, std::string format, std::optional<torch::Dtype> dequant,
                      std::string name);
  void stop_quantized() { quantized_.reset(); }

 protected:
  // keep_quantized()'s refresh of `weight` (a no-op without it): quantizes it
  // again when it was written since (`force`: whatever its version says; a
  // load) with other values than the quantized ones (tensor_checksum). Without
  // `force` (a forward), an unfrozen weight throws first.
  void refresh_quantized(const torch::Tensor& weight, bool force = false);
  // module->to() once attached: a move to the engine's compute device in the
  // weight's own dtype leaves the streamed weights in host memory (returns
  // true: nothing to do); any other device or dtype throws, naming detach().
  // Returns false when not attached (convert as torch does).
  bool keep_streamed(const torch::Tensor& weight, std::optional<torch::Device> device,
                     std::optional<torch::Dtype> dtype) const;
  // clone() once attached throws: the copy would keep this binding, streaming (and
  // training) the original's weights instead of its own.
  void refuse_clone() const;
  // torch::load() into the module once attached (each module's load() override):
  // LibTorch's archive replaces every tensor (set_), which the engine would refuse
  // at the next call; instead the values are read first (a missing tensor or a
  // shape that differs throws, nothing written), then written in place, cast to
  // the parameter's dtype: a weight quantized by offload() is packed again
  // (Engine::requantize). Not concurrently with a call of the model. Returns
  // false when not attached (torch's load then runs).
  bool load_in_place(torch::nn::Module& self, torch::serialize::InputArchive& archive);
  // torch::save() of the module once attached with a quantized weight (each
  // module's save() override): as torch's, but a dense weight parameter the
  // caller freed (another shape than the layer's) is saved as the dequantized
  // packed copy, what the layer computes with. Returns false otherwise (torch's
  // save then runs).
  bool save_streamed(const torch::nn::Module& self, torch::serialize::OutputArchive& archive) const;
  std::shared_ptr<Engine> engine_;
  int index_ = -1;

 private:
  struct Quantized {
    std::string format;
    std::optional<torch::Dtype> dequant;
    std::string name;    // the layer's, for the errors
    const void* weight;  // the parameter's TensorImpl the values were written into
    int64_t version;     // its version counter then
    uint64_t checksum;   // the values' (tensor_checksum): a write of the same ones is not quantized again
  };
  std::optional<Quantized> quantized_;
};

class LinearImpl : public torch::nn::Cloneable<LinearImpl>, public StreamedBase {
 public:
  LinearImpl(int64_t in, int64_t out) : LinearImpl(torch::nn::LinearOptions(in, out)) {}
  explicit LinearImpl(const torch::nn::LinearOptions& options);
  // Shares the given parameters (e.g. those of an existing torch::nn::Linear).
  LinearImpl(const torch::nn::LinearOptions& options, torch::Tensor weight, torch::Tensor bias);
  void reset() override;
  torch::Tensor forward(const torch::Tensor& x);
  void pretty_print(std::ostream& stream) const override;
  // Once attached: see StreamedBase::keep_streamed and refuse_clone (a parent's
  // clone() clones its children with it).
  std::shared_ptr<torch::nn::Module> clone(const std::optional<torch::Device>& device = std::nullopt) const override;
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Device device, bool non_blocking = false) override;
  void load(torch::serialize::InputArchive& archive) override;  // see StreamedBase::load_in_place
  void save(torch::serialize::OutputArchive& archive) const override;  // see StreamedBase::save_streamed

  torch::nn::LinearOptions options;
  torch::Tensor weight, bias;
};
TORCH_MODULE(Linear);

template <size_t D>
class ConvImpl : public torch::nn::Cloneable<ConvImpl<D>>, public StreamedBase {
 public:
  explicit ConvImpl(const torch::nn::ConvOptions<D>& options);
  // Shares the given parameters (e.g. those of an existing torch::nn::Conv{D}d).
  ConvImpl(const torch::nn::ConvOptions<D>& options, torch::Tensor weight, torch::Tensor bias);
  void reset() override;
  torch::Tensor forward(const torch::Tensor& x);
  ConvSpec spec() const;
  // Once attached: see StreamedBase::keep_streamed and refuse_clone (a parent's
  // clone() clones its children with it).
  std::shared_ptr<torch::nn::Module> clone(const std::optional<torch::Device>& device = std::nullopt) const override;
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Device device, bool non_blocking = false) override;
  void load(torch::serialize::InputArchive& archive) override;  // see StreamedBase::load_in_place
  void save(torch::serialize::OutputArchive& archive) const override;  // see StreamedBase::save_streamed

  torch::nn::ConvOptions<D> options;
  torch::Tensor weight, bias;
};
// A drop-in replacement for torch::nn::Embedding (same options, parameter
// "weight"). Attached (a table without max_norm), its lookups read the rows
// from host memory and a trainable one's gradient is computed on the host
// (Engine::add_embedding); otherwise it computes like the torch module.
class EmbeddingImpl : public torch::nn::Cloneable<EmbeddingImpl>, public StreamedBase {
 public:
  EmbeddingImpl(int64_t num, int64_t dim) : EmbeddingImpl(torch::nn::EmbeddingOptions(num, dim)) {}
  explicit EmbeddingImpl(const torch::nn::EmbeddingOptions& options);
  // Shares the given weight (e.g. that of an existing torch::nn::Embedding).
  EmbeddingImpl(const torch::nn::EmbeddingOptions& options, torch::Tensor weight);
  void reset() override;
  torch::Tensor forward(const torch::Tensor& ids);
  void pretty_print(std::ostream& stream) const override;
  // Once attached: see StreamedBase::keep_streamed and refuse_clone (a parent's
  // clone() clones its children with it).
  std::shared_ptr<torch::nn::Module> clone(const std::optional<torch::Device>& device = std::nullopt) const override;
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Device device, bool non_blocking = false) override;
  void load(torch::serialize::InputArchive& archive) override;  // see StreamedBase::load_in_place

  torch::nn::EmbeddingOptions options;  // padding_idx normalized to a row index
  torch::Tensor weight;

 private:
  void normalize_padding_idx();
};
TORCH_MODULE(Embedding);

using Conv1dImpl = ConvImpl<1>;
using Conv2dImpl = ConvImpl<2>;
using Conv3dImpl = ConvImpl<3>;
TORCH_MODULE(Conv1d);
TORCH_MODULE(Conv2d);
TORCH_MODULE(Conv3d);

}  // namespace nn
}  // namespace layerstream
