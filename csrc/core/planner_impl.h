// layerstream core — internal to the planner's files (planner*.cpp).
#pragma once

#include <string>
#include <vector>

#include "planner.h"

namespace layerstream {

// "1.5 ms", "12.3 us", "0 s".
std::string format_seconds(double s);
// A finite number with 9 significant digits, else "null".
std::string json_number(double v);

// ---- the time model (planner_time.cpp; docs/design/planner.md) ----
struct Timing {
  double first_step = 0.0;
  double step = 0.0;
};

double compute_seconds(const PlannerInput& in, const PlannerLayer& l);
double transfer_seconds(const PlannerInput& in, uint64_t bytes);
// Tables held on the device by their resident tied layer (PlannerLayer::tied_table):
// resident with it, so they are not looked up.
std::vector<char> tables_held(const PlannerInput& in, const std::vector<char>& resident);
// Event simulation of the streaming pipeline: one compute stream, one
// host->device copy engine, one device->host copy engine (gradients),
// `slots` device slots used round-robin by the streamed layers. A streamed
// layer's copy starts when the link is free and its slot has been released
// by the compute of the layer that used it before; its compute starts when
// the previous compute and its copy are done.
Timing simulate(const PlannerInput& in, const std::vector<char>& resident, int slots);
// The slots a plan with `k` slots uses for `num_streamed` streamed layers.
int effective_slots(int k, int min_slots, size_t num_streamed);

// Whether layers[i] reads the same input as an earlier layer of the list: a
// sibling under one parent (same prefix) of one family of projections that
// transformers and diffusers feed one tensor (q/k/v_proj, gate/up_proj,
// to_q/k/v, query/key/value, w1/w3, wq/wk/wv, ...) with the same in_features.
// offload(activations=) copies such an input once (Note [A tensor saved by
// several ops], engine_activations.cpp), so the plan counts it once
// (LayerOptions::activations). By name: a guess, as the rest of the estimate.
bool reads_an_earlier_layers_input(const std::vector<ModelLayer>& layers, size_t i);

}  // namespace layerstream
