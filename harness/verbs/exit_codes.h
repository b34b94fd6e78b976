// Process exit codes (docs/design.md section 10).
#pragma once

namespace meshproof::harness {

enum ExitCode : int {
  kExitOk = 0,            // all checks passed
  kExitCheckFailed = 1,   // a check failed
  kExitBadInput = 2,      // bad input or usage
  kExitRuntimeError = 3,  // runtime error
};

}  // namespace meshproof::harness
