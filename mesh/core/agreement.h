// Outcome agreement (docs/design.md section 12): after a step that some members of a group may
// have failed (a checkpoint phase, creating a folder every rank shares), every member learns
// whether anyone failed, and if so every member throws, so no member moves on alone into the
// next collective while another has given up (a hang, issue #18), and every process can name
// the cause. One MAX all_reduce when nobody failed; a 2 KiB message broadcast when someone did.
#pragma once

#include <cstdint>
#include <exception>
#include <string_view>

#include "mesh/core/communicator.h"

namespace meshproof::mesh {

// Collective over `group`. `error` is this member's failure (nullptr: it succeeded). When no
// member failed, returns. Otherwise every member throws: a member that failed rethrows its own
// error; the others throw kernels::Error of the gravest kind any member reported (input <
// integrity < runtime, as exit codes 2, 1, 3 say), with the message "{what} failed on rank {r}:
// {message}" of the lowest group member reporting that kind (r: its global rank; the message cut
// at 2047 bytes). Errors that are not kernels::Error count as runtime errors. Buffers live on the
// rank's device (kernels::current_context()), as the group's backend requires.
void agree_on_outcome(Communicator& group, std::exception_ptr error, std::string_view what);

// The same, also carrying a value: returns the largest `value` any member passed (members without
// one pass 0). Values must lie in [0, 2^24), exact in the fp32 flag the agreement reduces; a value
// outside is this member's runtime error (agreed on like any other, never a throw before the
// collective, which would leave the other members waiting).
int64_t agree_on_outcome(Communicator& group, std::exception_ptr error, int64_t value,
                         std::string_view what);

// Runs fn() and returns what it threw (nullptr when it returned): the error to agree on.
template <typename Fn>
std::exception_ptr capture_error(Fn&& fn) {
  try {
    fn();
  } catch (...) {
    return std::current_exception();
  }
  return nullptr;
}

}  // namespace meshproof::mesh
