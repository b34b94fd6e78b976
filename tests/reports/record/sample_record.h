// A realistic run record for the report tests and the sample report program: three scenarios on
// an H100 (FSDP MXFP8 passing, HSDP x TP delayed scaling failing its golden check, a
// fault-injection scenario caught by the all-gather parity check).
#pragma once

#include <string>

#include "reports/record/run_record.h"

namespace meshproof::reports::testing {

RunRecord sample_record();

// The sample with hostile strings everywhere a user or a check can put text (markup
// characters, quotes, pipes, control characters, invalid UTF-8), for escaping tests; it also
// has a scenario that stopped with an error and a check that errored.
RunRecord hostile_record();

// The sample with the fault of its third scenario caught by the wrong check: the intended
// allgather_parity check passes and a determinism check (not in caught_by) fails with evidence.
// Its verdict must be fail everywhere (reports and the `meshproof run` exit code).
RunRecord wrong_check_record();

// How often `needle` occurs in `hay`, overlapping occurrences included.
inline size_t occurrences(const std::string& hay, const std::string& needle) {
  size_t n = 0;
  for (size_t p = hay.find(needle); p != std::string::npos; p = hay.find(needle, p + 1)) ++n;
  return n;
}

}  // namespace meshproof::reports::testing
