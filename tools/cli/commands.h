// Subcommand registry of the `layerstream` tool. Each subcommand lives in its
// own cmd_<name>.cpp and registers itself with LS_REGISTER_COMMAND; main.cpp
// only dispatches. A command returns the process exit code (0 ok, 1 runtime
// failure, 2 bad usage/input) and prints one-line errors to stderr.
#pragma once

#include <map>
#include <string>

namespace layerstream::cli {

using CommandFn = int (*)(int argc, char** argv);  // argv[0] is the subcommand name

struct CommandInfo {
  CommandFn fn;
  std::string summary;
};

std::map<std::string, CommandInfo>& registry();

struct Registrar {
  Registrar(const char* name, CommandFn fn, const char* summary) {
    registry()[name] = CommandInfo{fn, summary};
  }
};

}  // namespace layerstream::cli

#define LS_REGISTER_COMMAND(name, fn, summary) \
  static ::layerstream::cli::Registrar ls_cli_registrar_##fn(name, fn, summary)
