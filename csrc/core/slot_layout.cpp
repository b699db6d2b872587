#include "core/slot_layout.h"

namespace layerstream::slot_layout {

Layout of(const std::vector<Part>& parts) {
  Layout l;
  l.workspace_offsets.reserve(parts.size());
  for (const Part& p : parts) {
    l.bus_bytes += align(p.bus);
    l.workspace_offsets.push_back(l.workspace_bytes);
    l.workspace_bytes += align(p.written);
  }
  return l;
}

}  // namespace layerstream::slot_layout
