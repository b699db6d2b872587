// layerstream — LibTorch glue: activation offload for C++ users (docs/design/activations.md, "In C++").
// Python wraps the forward in saved_tensors_hooks; LibTorch has no such hooks of its own, but every
// SavedVariable asks the process's autograd engine for default hooks (Engine::
// get_default_saved_variable_hooks). While a SavedActivations scope lives on a thread, layerstream's
// engine subclass answers with hooks that hand the saved tensor to the layerstream Engine.
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/saved_variable_hooks.h>

#include <atomic>
#include <mutex>
#include <set>
#include <thread>

#include "core/error.h"
#include "layerstream/offload.h"

namespace layerstream {

struct SavedActivations::State {
  std::shared_ptr<Engine> engine;
  std::set<const c10::StorageImpl*> keep;  // the model's parameters and buffers: held by the model anyway
  State* previous = nullptr;
  std::thread::id thread = std::this_thread::get_id();  // whose chain (t_scope) links it
  // Ended on another thread (Note [A scope ended on another thread]): its own
  // thread unlinks and frees it.
  std::atomic<bool> ended{false};
};

namespace {

thread_local SavedActivations::State* t_scope = nullptr;

// Note [A scope ended on another thread]: a scope belongs to the thread that
// made it (its t_scope chain links it), but a SavedActivations object can be
// destroyed anywhere. Freed there, its thread's chain pointed into freed
// memory and the next forward crashed. Instead it is marked ended and left
// to its thread, which unlinks and frees the ended scopes at the next lookup
// or the next scope it makes or ends; a warning says the rule.
void unlink_ended() {
  for (SavedActivations::State** link = &t_scope; *link != nullptr;) {
    if ((*link)->ended.load(std::memory_order_acquire)) {
      SavedActivations::State* dead = *link;
      *link = dead->previous;
      delete dead;
    } else {
      link = &(*link)->previous;
    }
  }
}

// One saved tensor: a token of the engine's, or the tensor itself when the
// engine does not take it (a parameter, not on the compute device, ...).
class EngineHooks final : public torch::autograd::SavedVariableHooks {
 public:
  explicit EngineHooks(const SavedActivations::State& s) : engine_(s.engine), keep_(&s.keep) {}
  void call_pack_hook(const at::Tensor& t) override {
    if (!t.has_storage() || !keep_->count(t.storage().unsafeGetStorageImpl())) token_ = engine_->stash_activation(t);
    keep_ = nullptr;  // the scope may end before backward
    if (token_ < 0) {
      // Detached: an op saving its own output hands it over with its grad_fn, which
      // kept here would make the graph refer to itself (never freed without a
      // backward). Autograd restores the history at unpack; the version counter is shared.
      kept_ = t.detach();
      version_ = version_of(t);
      if (version_) saved_version_ = version_->current_version();
    }
  }
  at::Tensor call_unpack_hook() override {
    if (token_ >= 0) return engine_->restore_activation(token_);
    check_saved_version(version_, saved_version_, kept_.sizes());
    return kept_;
  }
  ~EngineHooks() override {
    if (token_ < 0) return;
    try {
      engine_->drop_activation(token_);
    } catch (...) {  // a destructor: the engine's own errors are reported where they happen
    }
  }

 private:
  std::shared_ptr<Engine> engine_;
  const std::set<const c10::StorageImpl*>* keep_;
  int64_t token_ = -1;
  at::Tensor kept_;
  std::optional<c10::VariableVersion> version_;  // kept_'s (autograd's check, check_saved_version)
  uint32_t saved_version_ = 0;
};

// torch's engine, but with the hooks above while a scope lives on this thread.
class ActivationEngine final : public torch::autograd::Engine {
 public:
  std::unique_ptr<torch::autograd::SavedVariableHooks> get_default_saved_variable_hooks() override {
    unlink_ended();
    if (t_scope == nullptr) return nullptr;
    return std::make_unique<EngineHooks>(*t_scope);
  }
};

torch::autograd::Engine& activation_engine() {
  static ActivationEngine engine;
  return engine;
}

// Installs the engine above as the process's autograd engine (once).
void install_engine() {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  torch::autograd::Engine& current = torch::autograd::Engine::get_default_engine();
  if (&current == &activation_engine()) return;
  LS_CHECK(&current == &torch::autograd::Engine::get_base_engine(),
           "saved_activations(): this process's autograd engine is not LibTorch's own (it runs under Python?); "
           "from Python use layerstream.offload(model, activations=...), which uses saved_tensors_hooks");
  torch::autograd::set_default_engine_stub(&activation_engine);
}

}  // namespace

SavedActivations::SavedActivations(std::shared_ptr<Engine> engine, uint64_t device_budget,
                                   const std::vector<torch::Tensor>& keep)
    : state_(std::make_unique<State>()) {
  install_engine();
  state_->engine = std::move(engine);
  for (const torch::Tensor& t : keep)
    if (t.defined() && t.has_storage()) state_->keep.insert(t.storage().unsafeGetStorageImpl());
  state_->engine->begin_activations(device_budget);
  unlink_ended();
  state_->previous = t_scope;
  t_scope = state_.get();
}

SavedActivations::~SavedActivations() {
  if (state_->thread != std::this_thread::get_id()) {  // Note [A scope ended on another thread]
    TORCH_WARN("layerstream: a saved_activations() scope ended on another thread than the one that made it; "
               "it is ended for that thread too (what it saves next stays where autograd keeps it). End a "
               "scope on the thread that made it (offload.h, SavedActivations)");
    state_.release()->ended.store(true, std::memory_order_release);
    return;
  }
  // Unlinked from this thread's chain wherever it is (scopes that end out of
  // order leave no dangling link).
  for (State** link = &t_scope; *link != nullptr; link = &(*link)->previous)
    if (*link == state_.get()) {
      *link = state_->previous;
      break;
    }
  unlink_ended();
}

SavedActivations OffloadHandle::saved_activations() {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  LS_CHECK(activations_ >= 0, "saved_activations(): this model was offloaded without activation offload; set "
           "OffloadOptions::activations (0: every saved tensor that can goes to the host, or a device budget "
           "in bytes)");
  LS_CHECK(engine_ != nullptr, "saved_activations(): this handle was detached");
  const auto root = root_.lock();
  LS_CHECK(root != nullptr, "saved_activations(): the offloaded module no longer exists");
  std::vector<torch::Tensor> keep = root->parameters(/*recurse=*/true);
  for (const auto& b : root->buffers(/*recurse=*/true)) keep.push_back(b);
  return SavedActivations(engine_, static_cast<uint64_t>(activations_), keep);
}

}  // namespace layerstream
