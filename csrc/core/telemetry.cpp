#include "telemetry.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <sstream>

namespace layerstream {

TraceRecorder::TraceRecorder() : origin_(std::chrono::steady_clock::now()) {}

double TraceRecorder::now_us() const {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - origin_).count();
}

void TraceRecorder::add(TraceSlice slice) {
  std::lock_guard<std::mutex> lock(mu_);
  if (slices_.size() >= capacity_) {
    dropped_++;
    return;
  }
  slices_.push_back(std::move(slice));
}

void TraceRecorder::mark_step(uint64_t step) {
  const double t = now_us();
  std::lock_guard<std::mutex> lock(mu_);
  steps_.emplace_back(step, t);
}

std::vector<TraceSlice> TraceRecorder::slices() const {
  std::lock_guard<std::mutex> lock(mu_);
  return slices_;
}

std::vector<std::pair<uint64_t, double>> TraceRecorder::steps() const {
  std::lock_guard<std::mutex> lock(mu_);
  return steps_;
}

size_t TraceRecorder::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return slices_.size();
}

void TraceRecorder::set_capacity(size_t max_slices) {
  std::lock_guard<std::mutex> lock(mu_);
  capacity_ = max_slices;
}

uint64_t TraceRecorder::dropped() const {
  std::lock_guard<std::mutex> lock(mu_);
  return dropped_;
}

namespace {
std::string json_escape(const std::string& s) {
  std::string out;
  out.reserve(s.size() + 2);
  for (char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += c;
        }
    }
  }
  return out;
}
}  // namespace

std::string TraceRecorder::to_chrome_json() const {
  const auto slices = this->slices();
  const auto steps = this->steps();
  std::map<std::string, int> tids;
  const char* order[] = {"compute", "transfer", "grad"};
  for (const char* l : order) tids.emplace(l, static_cast<int>(tids.size()) + 1);
  for (const auto& s : slices) tids.emplace(s.lane, static_cast<int>(tids.size()) + 1);
  std::ostringstream os;
  os.precision(3);
  os << std::fixed;
  os << "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n";
  os << "{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": 1, \"args\": {\"name\": \"layerstream\"}}";
  for (const auto& [lane, tid] : tids) {
    os << ",\n{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": 1, \"tid\": " << tid
       << ", \"args\": {\"name\": \"" << json_escape(lane) << "\"}}";
    os << ",\n{\"name\": \"thread_sort_index\", \"ph\": \"M\", \"pid\": 1, \"tid\": " << tid
       << ", \"args\": {\"sort_index\": " << tid << "}}";
  }
  for (const auto& s : slices) {
    os << ",\n{\"name\": \"" << json_escape(s.name) << "\", \"cat\": \"" << json_escape(s.lane)
       << "\", \"ph\": \"X\", \"pid\": 1, \"tid\": " << tids[s.lane] << ", \"ts\": " << s.start_us
       << ", \"dur\": " << std::max(0.0, s.end_us - s.start_us) << ", \"args\": {\"bytes\": " << s.bytes
       << "}}";
  }
  for (const auto& [step, t] : steps) {
    os << ",\n{\"name\": \"step " << step << "\", \"ph\": \"i\", \"s\": \"g\", \"pid\": 1, \"tid\": 1, \"ts\": "
       << t << "}";
  }
  os << "\n]}\n";
  return os.str();
}

double TraceRecorder::overlap_fraction(const std::string& copy_lane, const std::string& compute_lane,
                                       double from_us, double to_us) const {
  return overlap_fractions(copy_lane, compute_lane, {{from_us, to_us}}).front();
}

// One pass over the slices for any number of windows (step_stats() asks for every
// step's): the compute intervals merged once, with a prefix sum of their lengths, so
// the busy time within [a, b) is two binary searches; the copies sorted by start, so
// a window visits only those that can reach it. (Per window, copying the slices and
// pairing every copy with every compute interval made step_stats() quadratic in the
// run's length: 31 s after 2000 traced steps.)
std::vector<double> TraceRecorder::overlap_fractions(const std::string& copy_lane, const std::string& compute_lane,
                                                     const std::vector<std::pair<double, double>>& windows) const {
  std::vector<std::pair<double, double>> compute, copies;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& s : slices_) {
      if (s.lane == compute_lane) compute.emplace_back(s.start_us, s.end_us);
      if (s.lane == copy_lane && s.end_us > s.start_us) copies.emplace_back(s.start_us, s.end_us);
    }
  }
  std::sort(compute.begin(), compute.end());
  std::vector<std::pair<double, double>> merged;  // disjoint, sorted
  for (const auto& iv : compute) {
    if (iv.second <= iv.first) continue;
    if (!merged.empty() && iv.first <= merged.back().second) {
      merged.back().second = std::max(merged.back().second, iv.second);
    } else {
      merged.push_back(iv);
    }
  }
  std::vector<double> before(merged.size() + 1, 0.0);  // busy time of merged[0, i)
  for (size_t i = 0; i < merged.size(); ++i) before[i + 1] = before[i] + (merged[i].second - merged[i].first);
  auto busy_until = [&](double t) {  // compute-busy time in (-inf, t)
    const size_t i = static_cast<size_t>(
        std::upper_bound(merged.begin(), merged.end(), t, [](double v, const auto& iv) { return v < iv.first; }) -
        merged.begin());
    if (i == 0) return 0.0;
    return before[i - 1] + (std::min(t, merged[i - 1].second) - merged[i - 1].first);
  };
  std::sort(copies.begin(), copies.end());
  double longest = 0;
  for (const auto& c : copies) longest = std::max(longest, c.second - c.first);
  std::vector<double> out;
  out.reserve(windows.size());
  for (const auto& [from_us, to_us] : windows) {
    const bool window = to_us > from_us;
    // A copy reaching into the window starts after from_us - longest.
    auto it = window ? std::lower_bound(copies.begin(), copies.end(), std::make_pair(from_us - longest, -HUGE_VAL))
                     : copies.begin();
    double copy_total = 0, hidden = 0;
    for (; it != copies.end() && (!window || it->first < to_us); ++it) {
      double a = it->first, b = it->second;
      if (window) {
        a = std::max(a, from_us);
        b = std::min(b, to_us);
      }
      if (b <= a) continue;
      copy_total += b - a;
      hidden += busy_until(b) - busy_until(a);
    }
    out.push_back(copy_total <= 0 ? std::numeric_limits<double>::quiet_NaN() : hidden / copy_total);
  }
  return out;
}

std::shared_ptr<double> trace_stream_begin(const std::shared_ptr<TraceRecorder>& t, Backend& be, Stream s) {
  if (!t || !be.caps().host_functions) return nullptr;
  auto start = std::make_shared<double>(0);
  be.launch_host_func(s, [t, start] { *start = t->now_us(); });
  return start;
}

void trace_stream_end(const std::shared_ptr<TraceRecorder>& t, Backend& be, Stream s,
                      const std::shared_ptr<double>& start, TraceSlice slice) {
  if (!t || !start) return;
  be.launch_host_func(s, [t, start, slice = std::move(slice)]() mutable {
    slice.start_us = *start;
    slice.end_us = t->now_us();
    t->add(std::move(slice));
  });
}

}  // namespace layerstream
