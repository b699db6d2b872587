// layerstream — telemetry: a timeline of copies and layer computations, and
// per-step counters.
//
// TraceRecorder collects slices (lane, name, start, end, bytes) from any
// thread. Lanes are the streams ("transfer", "compute", "grad"). Times are
// microseconds on the steady clock since the recorder was created. The
// scheduler and the torch glue record into it when tracing is enabled, using
// host functions enqueued on the streams, so a slice's times are when the
// stream reached that point (exact on the sim device; a few microseconds of
// callback latency on CUDA).
//
// to_chrome_json() writes the Chrome trace / Perfetto JSON format: one
// "thread" per lane, one complete ("X") event per slice, plus a "step"
// instant event per step boundary.
//
// Thread safety: all methods may be called concurrently.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "runtime.h"

namespace layerstream {

struct TraceSlice {
  std::string lane;
  std::string name;
  double start_us = 0;
  double end_us = 0;
  uint64_t bytes = 0;
};

class TraceRecorder {
 public:
  TraceRecorder();
  double now_us() const;
  void add(TraceSlice slice);
  void mark_step(uint64_t step);
  std::vector<TraceSlice> slices() const;
  std::vector<std::pair<uint64_t, double>> steps() const;  // (step, time_us)
  size_t size() const;
  // Slices beyond this many are dropped (and counted) to bound memory.
  void set_capacity(size_t max_slices);
  uint64_t dropped() const;
  std::string to_chrome_json() const;
  // Fraction of the time spent copying on `copy_lane` during which
  // `compute_lane` was also busy, within [from_us, to_us) (all time if
  // to_us <= from_us). 1.0 = every copy hid behind compute; NaN if no copy.
  double overlap_fraction(const std::string& copy_lane, const std::string& compute_lane,
                          double from_us = 0, double to_us = 0) const;
  // The same for each window [from_us, to_us) in one pass over the slices.
  std::vector<double> overlap_fractions(const std::string& copy_lane, const std::string& compute_lane,
                                        const std::vector<std::pair<double, double>>& windows) const;

 private:
  std::chrono::steady_clock::time_point origin_;
  mutable std::mutex mu_;
  std::vector<TraceSlice> slices_;
  std::vector<std::pair<uint64_t, double>> steps_;
  size_t capacity_ = 1000000;
  uint64_t dropped_ = 0;
};

// Timing work on a stream: trace_stream_begin() enqueues a host function that
// notes when `s` reaches it; trace_stream_end() enqueues one that adds `slice`
// (its lane, name and bytes) from that moment to when `s` reaches the end.
// begin returns nullptr, and end does nothing for it, when `t` is null or the
// backend cannot run host functions.
std::shared_ptr<double> trace_stream_begin(const std::shared_ptr<TraceRecorder>& t, Backend& be, Stream s);
void trace_stream_end(const std::shared_ptr<TraceRecorder>& t, Backend& be, Stream s,
                      const std::shared_ptr<double>& start, TraceSlice slice);

}  // namespace layerstream
