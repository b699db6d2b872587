#include "host_tier.h"

#include <algorithm>
#include <fstream>
#include <iterator>

#include "error.h"
#include "host_memory.h"
#include "planner.h"  // format_bytes

namespace layerstream::host_tier {

Plan plan(const std::vector<Layer>& layers, int64_t host_budget, int64_t pinned_budget, int prefetch) {
  Plan p;
  p.on_disk.assign(layers.size(), false);
  uint64_t total = 0, must = 0, largest_file = 0, largest = 0, grads = 0;
  std::string largest_name;
  for (const Layer& l : layers) {
    total += l.bytes;
    grads += l.grad_bytes;
    if (l.bytes > largest) largest = l.bytes, largest_name = l.name;
    if (l.from_file) largest_file = std::max(largest_file, l.bytes);
    else must += l.bytes;
  }
  const uint64_t entries_wanted = static_cast<uint64_t>(std::max(prefetch, 0)) + 2;
  p.grad_staging_bytes = grads;  // always in RAM: the device copies each gradient there
  const bool limited = host_budget != kUnlimited, pin_limited = pinned_budget != kUnlimited;
  const uint64_t budget = limited ? static_cast<uint64_t>(host_budget) : UINT64_MAX;
  const uint64_t pinned = pin_limited ? static_cast<uint64_t>(pinned_budget) : UINT64_MAX;
  // All in RAM, the store tensors the pinned budget cannot hold beside the
  // gradients' buffers are pageable and cross through pinned staging entries:
  // two of the largest layer at least (core/io/stager.h), or none of it works.
  const bool crosses = pin_limited && total + grads > pinned;
  if (total + grads + (crosses ? 2 * largest : 0) <= budget) {
    p.store_bytes = total;
    if (crosses) {
      // In whole entries (the stager makes no partial one): a fraction counted
      // here was RAM the spare host bytes (saved activations) never got.
      p.staging_bytes = std::min(entries_wanted * largest, budget - total - grads) / largest * largest;
      // Entries exist here only to make pageable copies asynchronous, which a
      // pageable entry cannot: as many as the pinned budget holds (two at least).
      if (p.staging_bytes > pinned && pinned >= 2 * largest) p.staging_bytes = pinned / largest * largest;
    }
  } else {
    if (!(largest_file > 0 && must + grads + 2 * largest_file <= budget)) {
      // The weights fit; the staging entries that pinned_budget makes necessary do not.
      LS_CHECK(total + grads > budget, "the host budget of ", format_bytes(budget), " holds the streamed weights (",
               format_bytes(total), grads ? " and " + format_bytes(grads) + " for the staging buffers of their "
               "gradients" : "", ") but not the staging entries the pinned budget of ", format_bytes(pinned),
               " needs: the store tensors it cannot pin are pageable and cross through pinned staging entries, "
               "at least two of the largest layer ('", largest_name, "', ", format_bytes(largest), " each, ",
               format_bytes(2 * largest), "). Raise host_budget to at least ",
               format_bytes(total + grads + 2 * largest), ", or pinned_budget to at least ",
               format_bytes(total + grads), " (then every store tensor is pinned)");
      LS_CHECK(false, "the host budget of ", format_bytes(budget), " cannot hold the streamed weights: ",
               format_bytes(must), " must be in RAM (trainable, cast as read, or not loaded from a file)",
               grads ? ", " + format_bytes(grads) + " for the staging buffers of their gradients" : "",
               largest_file ? ", and the disk tier needs two staging entries of " + format_bytes(largest_file) +
                                  " each (" + format_bytes(2 * largest_file) + ")" : "",
               "; the streamed weights", grads ? " and those buffers" : "", " are ", format_bytes(total + grads),
               " in all. Raise host_budget to at least ",
               format_bytes(largest_file ? must + grads + 2 * largest_file : total + grads),
               largest_file ? std::string() :
                              std::string(", or let frozen weights stay in their file: only frozen Linear weights "
                                          "that load_safetensors() left in a .safetensors file can, and none here "
                                          "can"));
    }
    for (size_t i = 0; i < layers.size(); ++i)
      if (layers[i].from_file) p.on_disk[i] = true, p.disk_bytes += layers[i].bytes;
    p.store_bytes = must;
    // All the RAM that is left caches disk layers (at most all of them), in
    // whole entries (the stager makes no partial one).
    p.staging_bytes = std::min<uint64_t>(budget - must - grads, p.disk_bytes + entries_wanted * largest_file);
    p.staging_bytes = p.staging_bytes / largest_file * largest_file;
  }
  // What the plan leaves of the host budget, after every staging entry.
  if (limited) p.spare_host_bytes = static_cast<int64_t>(budget - std::min(p.host_bytes(), budget));
  if (!pin_limited) return p;
  p.staging_pinned = p.staging_bytes <= pinned;
  uint64_t left = p.staging_pinned ? pinned - p.staging_bytes : pinned;
  // The gradients' buffers are pinned next (the device copies into them); the
  // store gets what is left.
  p.grad_pinned_cap = static_cast<int64_t>(std::min(left, p.grad_staging_bytes));
  left -= std::min(left, p.grad_staging_bytes);
  p.store_pinned_cap = static_cast<int64_t>(left);
  p.pageable_store_bytes = p.store_bytes > left ? p.store_bytes - left : 0;
  p.spare_pinned_bytes = static_cast<int64_t>(left - std::min<uint64_t>(p.store_bytes, left));
  return p;
}

std::vector<std::string> in_ram_reasons(bool linear, bool frozen, bool as_stored, const std::string& format,
                                        bool cache_dir) {
  const bool dense = format.empty() || format == "none";
  std::vector<std::string> why;
  if (!linear) why.emplace_back("not_linear");
  if (!frozen) why.emplace_back("trainable");
  if (!as_stored) why.emplace_back("cast");
  if (format == "lossless") why.emplace_back("lossless");  // coded in RAM, with a cache directory or not
  else if (!dense && !cache_dir) why.emplace_back("quantized");
  return why;
}

bool may_stay_in_file(bool linear, bool frozen, bool as_stored, const std::string& format, bool cache_dir) {
  return in_ram_reasons(linear, frozen, as_stored, format, cache_dir).empty();
}

int64_t default_host_budget() {
  const HostMemory m = host_memory();
  if (m.total_bytes == 0) return kUnlimited;
  const int64_t margin = std::max<int64_t>(static_cast<int64_t>(m.total_bytes / 10), int64_t(2) << 30);
  return std::max<int64_t>(static_cast<int64_t>(m.available_bytes) - margin, 0);
}

int64_t default_pinned_budget() {
  std::ifstream f("/proc/version");
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::transform(text.begin(), text.end(), text.begin(), [](unsigned char c) { return std::tolower(c); });
  if (text.find("microsoft") == std::string::npos) return kUnlimited;
  const uint64_t total = host_memory().total_bytes;
  return total == 0 ? kUnlimited : static_cast<int64_t>(total / 10 * 4);
}

}  // namespace layerstream::host_tier
