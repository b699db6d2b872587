// layerstream core — the placement planner: the time model (an event simulation of the streaming pipeline)
// (planner.h; the files: docs/design/README.md).
#include "planner.h"
#include "planner_impl.h"
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <numeric>
#include <set>

#include "error.h"
#include "slot_layout.h"
#include "gguf.h"
#include "json.h"
#include "quant.h"

namespace layerstream {

double compute_seconds(const PlannerInput& in, const PlannerLayer& l) {
  return in.device_flops_per_s > 0 ? l.flops / in.device_flops_per_s : 0.0;
}
double transfer_seconds(const PlannerInput& in, uint64_t bytes) {
  return in.link_bytes_per_s > 0 ? static_cast<double>(bytes) / in.link_bytes_per_s : 0.0;
}

// Declared, with what they model, in planner_impl.h; docs/design/planner.md.
std::vector<char> tables_held(const PlannerInput& in, const std::vector<char>& resident) {
  std::vector<char> held(in.layers.size(), 0);
  for (size_t i = 0; i < in.layers.size(); ++i)
    if (resident[i] && in.layers[i].tied_table >= 0) held[static_cast<size_t>(in.layers[i].tied_table)] = 1;
  return held;
}

Timing simulate(const PlannerInput& in, const std::vector<char>& resident, int slots) {
  const size_t n = in.layers.size();
  const std::vector<char> held = tables_held(in, resident);
  struct Op {
    size_t layer;
    double compute;
    bool streamed;
    double grad_out;  // seconds of device->host gradient copy after compute
    double act_out = 0.0;  // forward: saved activations to the host (device->host, after compute)
    double act_in = 0.0;   // backward: saved activations back (host->device link, before compute)
    double rows_in = 0.0;  // forward: a table's rows read across the bus (in `compute`; the link too)
    double rows_out = 0.0; // backward: its gradient rows back (in `compute`; the device->host link too)
  };
  std::vector<Op> ops;
  for (size_t i = 0; i < n; ++i) {
    const PlannerLayer& l = in.layers[i];
    double c = compute_seconds(in, l);
    double fwd = in.training ? c / 3.0 : c;
    // Rows read across the bus, by the compute stream: they take the link from the weights' copies too.
    const double rows = (l.lookup && !held[i]) ? transfer_seconds(in, l.lookup_bytes) : 0.0;
    ops.push_back({i, fwd + rows, !resident[i] && !l.lookup, 0.0});
    ops.back().rows_in = rows;
    if (in.training) ops.back().act_out = transfer_seconds(in, l.activation_bytes);
  }
  if (in.training) {
    for (size_t r = n; r-- > 0;) {
      const PlannerLayer& l = in.layers[r];
      double c = compute_seconds(in, l);
      bool streamed = !resident[r] && !l.lookup;
      // (A layer tied to another's weight: its weight's gradient too, which resident_bytes leaves out.)
      double g = (streamed && l.trainable) ? transfer_seconds(in, l.resident_bytes + l.tied_bytes) : 0.0;
      // A trainable table's gradient rows go back synchronously, on the compute stream.
      const double rows_back = (l.lookup && !held[r] && l.trainable) ? transfer_seconds(in, l.lookup_bytes) : 0.0;
      ops.push_back({r, c * 2.0 / 3.0 + rows_back, streamed, g});
      ops.back().act_in = transfer_seconds(in, l.activation_bytes);
      ops.back().rows_out = rows_back;
    }
  }
  const int kSteps = 4;
  // Copies in flight: the slots, or the engine's prefetch depth + 1 when less.
  const int in_flight = in.prefetch_depth >= 0 ? std::min(slots, in.prefetch_depth + 1) : slots;
  std::vector<double> slot_free(static_cast<size_t>(std::max(in_flight, 1)), 0.0);
  double link_free = 0.0, d2h_free = 0.0, compute_free = 0.0;
  double prev_start = 0.0;  // when the previous op's compute started
  uint64_t streamed_count = 0;
  std::vector<double> step_end;
  for (int s = 0; s < kSteps; ++s) {
    for (const Op& op : ops) {
      double ready = 0.0;
      size_t slot = 0;
      if (op.streamed) {
        const PlannerLayer& l = in.layers[op.layer];
        slot = static_cast<size_t>(streamed_count++ % slot_free.size());
        double start = std::max(link_free, slot_free[slot]);
        if (l.routed_bytes) start = std::max(start, compute_free);  // on demand, after the router
        link_free = start + transfer_seconds(in, l.fetch_bytes());
        ready = link_free;
      }
      if (op.act_in > 0) {
        // Copied back when the previous op's backward unpacked its own (one
        // layer ahead, engine_activations.cpp), in line with the weights.
        link_free = std::max(link_free, prev_start) + op.act_in;
        ready = std::max(ready, link_free);
      }
      double start = std::max(compute_free, ready);
      prev_start = start;
      compute_free = start + op.compute;
      // The rows share the link with the copies queued on it: they hold it as long
      // again (the step is never shorter than the bytes it moves).
      if (op.rows_in > 0) link_free = std::max(link_free, start) + op.rows_in;
      if (op.rows_out > 0) d2h_free = std::max(d2h_free, start) + op.rows_out;
      if (op.streamed) slot_free[slot] = compute_free;
      if (op.grad_out > 0) d2h_free = std::max(d2h_free, compute_free) + op.grad_out;
      if (op.act_out > 0) d2h_free = std::max(d2h_free, compute_free) + op.act_out;
    }
    step_end.push_back(std::max(compute_free, d2h_free));
  }
  Timing t;
  t.first_step = step_end[0];
  t.step = (step_end[kSteps - 1] - step_end[kSteps - 3]) / 2.0;
  return t;
}

int effective_slots(int k, int min_slots, size_t num_streamed) {
  if (num_streamed == 0) return 0;
  return std::min<int>(k, std::max<int>(min_slots, static_cast<int>(std::min<size_t>(num_streamed, 1u << 20))));
}

}  // namespace layerstream
