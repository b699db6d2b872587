// layerstream core — what offload() decides about a model, written once for
// the C++ offload() (csrc/torch/offload.cpp) and the Python one
// (python/layerstream/_discovery.py, _forward.py, through _C). Torch-free:
// callers describe their modules with opaque ids.
//
// Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace layerstream::policy {

// ---- Tied weights ----
// A parameter of several distinct modules (an lm_head sharing the embedding's
// weight). When it is the weight of every module that has it and all of them
// stream, they stream together: the engine keeps one host copy, and their
// gradients go through autograd, which sums them into the one .grad as it
// does for a resident tied weight. Otherwise (a shared bias, a tensor group's
// tensor, or a module that stays resident uses it) those layers stay
// resident, with one warning: streaming one would move the tensor to the host
// under the other module, which keeps it on the device anyway. A layer kept
// resident keeps the layers it shares a weight with resident too.

// One module that holds a parameter.
struct TieOwner {
  uint64_t module = 0;     // the module's id
  std::string param;       // its name in that module ("weight")
  std::string qualified;   // "emb.weight"
};

// A layer offload() would stream, and its parameters.
struct TieCandidate {
  std::string name;     // qualified module name ("" = the root)
  uint64_t module = 0;  // the module's id
  struct Param {
    std::string role;     // "weight", "bias", or a tensor group's name for it
    uint64_t tensor = 0;  // the parameter's id
    bool streams_shared = false;  // may stream while shared: a Linear/conv/table weight
  };
  std::vector<Param> params;
};

struct TieResult {
  std::vector<size_t> kept;      // indices of the candidates that still stream
  std::vector<bool> shares;      // per kept candidate: its weight is another kept one's
  // The names of the kept candidates that share one weight, one list per weight
  // (only weights shared by two or more), in candidate order.
  std::vector<std::vector<std::string>> groups;
  // Per candidate kept resident: "'name' (weight shared with 'x.weight', ...)".
  std::vector<std::string> resident;
};

// `owners`: every parameter of the model (by id) and the distinct modules
// that hold it.
TieResult analyse_ties(const std::vector<TieCandidate>& candidates,
                       const std::map<uint64_t, std::vector<TieOwner>>& owners);

// ---- Mixture-of-experts routing (Engine::fetch with experts) ----
// Only the named experts' slices cross the bus when they are at most half of
// the group's experts; more: the whole group, which may be prefetched.
constexpr bool fetch_some_experts(int64_t distinct, int64_t experts) {
  return distinct > 0 && 2 * distinct <= experts;
}
// More than twice as many (token, expert) picks as experts nearly always
// reach more than half of them: the caller need not read the ids (a device
// sync) to know that the whole group is fetched.
constexpr bool picks_may_route(int64_t picks, int64_t experts) {
  return picks > 0 && picks <= 2 * experts;
}

}  // namespace layerstream::policy
