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
  const auto slices = this->slices();
  const bool window = to_us > from_us;
  std::vector<std::pair<double, double>> compute;
  for (const auto& s : slices)
    if (s.lane == compute_lane) compute.emplace_back(s.start_us, s.end_us);
  std::sort(compute.begin(), compute.end());
  // Merge compute intervals.
  std::vector<std::pair<double, double>> merged;
  for (const auto& iv : compute) {
    if (!merged.empty() && iv.first <= merged.back().second) {
      merged.back().second = std::max(merged.back().second, iv.second);
    } else {
      merged.push_back(iv);
    }
  }
  double copy_total = 0, hidden = 0;
  for (const auto& s : slices) {
    if (s.lane != copy_lane) continue;
    double a = s.start_us, b = s.end_us;
    if (window) {
      a = std::max(a, from_us);
      b = std::min(b, to_us);
    }
    if (b <= a) continue;
    copy_total += b - a;
    for (const auto& iv : merged) {
      const double lo = std::max(a, iv.first), hi = std::min(b, iv.second);
      if (hi > lo) hidden += hi - lo;
    }
  }
  if (copy_total <= 0) return std::numeric_limits<double>::quiet_NaN();
  return hidden / copy_total;
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
