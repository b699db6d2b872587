// The `layerstream` command-line tool: dispatches to the registered subcommands.
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>

#include "commands.h"
#include "core/error.h"

namespace layerstream::cli {
std::map<std::string, CommandInfo>& registry() {
  static std::map<std::string, CommandInfo> r;
  return r;
}
}  // namespace layerstream::cli

static void usage(FILE* out) {
  std::fprintf(out, "usage: layerstream <command> [options]   (layerstream --version: the version)\n\ncommands:\n");
  for (const auto& [name, info] : layerstream::cli::registry())
    std::fprintf(out, "  %-8s %s\n", name.c_str(), info.summary.c_str());
  std::fprintf(out, "\nRun 'layerstream <command> --help' for a command's options.\n");
}

int main(int argc, char** argv) {
  if (argc < 2) {
    usage(stderr);
    return 2;
  }
  if (!std::strcmp(argv[1], "--version")) {
    std::printf("layerstream %s\n", LS_VERSION);
    return 0;
  }
  if (!std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h") || !std::strcmp(argv[1], "help")) {
    usage(stdout);
    return 0;
  }
  auto& reg = layerstream::cli::registry();
  auto it = reg.find(argv[1]);
  if (it == reg.end()) {
    std::fprintf(stderr, "layerstream: unknown command '%s'; run 'layerstream --help' for the list\n", argv[1]);
    return 2;
  }
  try {
    return it->second.fn(argc - 1, argv + 1);
  } catch (const layerstream::Error& e) {
    std::fprintf(stderr, "layerstream %s: error: %s\n", argv[1], e.message().c_str());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "layerstream %s: error: %s\n", argv[1], e.what());
    return 1;
  }
}
