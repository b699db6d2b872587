// The `layerstream` command-line tool: dispatches to subcommands.
#include <cstdio>
#include <cstring>
#include <string>

int main(int argc, char** argv) {
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    std::puts("usage: layerstream <demo|plan|bench> [options]");
    return argc < 2 ? 2 : 0;
  }
  std::fprintf(stderr, "layerstream: unknown subcommand '%s' (try: demo, plan, bench)\n", argv[1]);
  return 2;
}
