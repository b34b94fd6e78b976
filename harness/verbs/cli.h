// The meshproof command line. Thin: each verb parses its options and calls a harness function
// that tests can call directly. run_cli never throws; it returns the process exit code.
#pragma once

#include <ostream>

namespace meshproof::harness {

int run_cli(int argc, const char* const* argv, std::ostream& out, std::ostream& err);

}  // namespace meshproof::harness
