#include "core/offload_policy.h"

#include <set>

namespace layerstream::policy {

TieResult analyse_ties(const std::vector<TieCandidate>& candidates,
                       const std::map<uint64_t, std::vector<TieOwner>>& owners) {
  std::set<uint64_t> streaming;
  for (const auto& c : candidates) streaming.insert(c.module);
  TieResult r;
  for (;;) {
    r = TieResult{};
    std::map<uint64_t, size_t> group_of;  // shared weight -> index in r.groups
    for (size_t i = 0; i < candidates.size(); ++i) {
      const TieCandidate& c = candidates[i];
      std::string why;
      bool shares = false;
      for (const auto& p : c.params) {
        auto it = owners.find(p.tensor);
        if (it == owners.end() || it->second.size() < 2) continue;
        bool streams = p.streams_shared;
        for (const auto& o : it->second) streams = streams && o.param == "weight" && streaming.count(o.module);
        if (streams) {
          shares = true;
          auto g = group_of.find(p.tensor);
          if (g == group_of.end()) {
            group_of[p.tensor] = r.groups.size();
            r.groups.push_back({c.name});
          } else {
            r.groups[g->second].push_back(c.name);
          }
          continue;
        }
        const std::string own = c.name.empty() ? p.role : c.name + "." + p.role;
        std::string others;
        for (const auto& o : it->second)
          if (o.qualified != own) others += (others.empty() ? "'" : ", '") + o.qualified + "'";
        why += (why.empty() ? "" : "; ") + p.role + " shared with " + others;
      }
      if (!why.empty()) {
        r.resident.push_back("'" + (c.name.empty() ? std::string("<root>") : c.name) + "' (" + why + ")");
      } else {
        r.kept.push_back(i);
        r.shares.push_back(shares);
      }
    }
    std::set<uint64_t> still;
    for (size_t i : r.kept) still.insert(candidates[i].module);
    if (still == streaming) break;
    streaming = std::move(still);
  }
  std::vector<std::vector<std::string>> groups;
  for (auto& g : r.groups)
    if (g.size() > 1) groups.push_back(std::move(g));
  r.groups = std::move(groups);
  return r;
}

}  // namespace layerstream::policy
