// Scalars over a communicator's members, identical on every member and deterministic (gathered,
// then combined in rank order): the session's loss sums, squared gradient norms and
// allgather_parity counts.
#pragma once

#include <vector>

#include "mesh/core/communicator.h"

namespace meshproof::engine {

// Sum of one double per member (gathered, then summed in rank order).
double sum_doubles(mesh::Communicator& comm, double v);
// Every member's `v` (same length on all members), concatenated in rank order.
std::vector<double> gather_doubles(mesh::Communicator& comm, const std::vector<double>& v);

}  // namespace meshproof::engine
