// layerstream — warnings.
//
// Library code reports non-fatal problems (e.g. "pinned memory unavailable,
// falling back to pageable memory") through warn(). The default handler
// prints "layerstream: warning: ..." to stderr; the torch glue installs a
// handler that turns them into Python warnings. warn_once() reports a given
// key only once per process.
// Thread safety: all functions may be called from any thread.
#pragma once

#include <functional>
#include <string>

namespace layerstream {

using WarningHandler = std::function<void(const std::string&)>;

// Installs a handler (nullptr restores the default). Returns the previous one.
WarningHandler set_warning_handler(WarningHandler handler);
void warn(const std::string& message);
// Warns only the first time `key` is seen in this process.
void warn_once(const std::string& key, const std::string& message);

}  // namespace layerstream
