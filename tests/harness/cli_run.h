// `meshproof ARGS...` in process, through run_cli exactly as the binary's main calls it: the
// exit code and what it printed to stdout and stderr. Shared by the tests of every verb.
#pragma once

#include <sstream>
#include <string>
#include <vector>

#include "harness/verbs/cli.h"

namespace meshproof::harness::testing {

struct CliResult {
  int code;
  std::string out;
  std::string err;
};

inline CliResult run_meshproof(const std::vector<std::string>& args) {
  std::vector<const char*> argv = {"meshproof"};
  for (const std::string& a : args) argv.push_back(a.c_str());
  std::ostringstream out, err;
  const int code = run_cli(static_cast<int>(argv.size()), argv.data(), out, err);
  return {code, out.str(), err.str()};
}

}  // namespace meshproof::harness::testing
