// Device memory held outside the tensor allocator's accounting (kernels::MemoryTracker counts
// tensors only): the CUDA memory pool's reserve, NCCL's communicator buffers, cuBLASLt
// workspaces. Each is a named reserve per device, so the per-rank memory figures of a report can
// show what the device really holds (docs/design.md section 34).
//
// Three kinds of entries, all process-wide and thread-safe:
//  - fixed amounts set by their owner when they are created (NCCL: the device memory taken by
//    creating the communicators, measured around it) and cleared when they are freed;
//  - providers asked at report time, for memory whose owner can count it at any moment;
//  - the built-ins "cuda_pool" (cuda_pool_reserve(device)) and "cublaslt" (the per-stream
//    workspaces, cublaslt_reserved_bytes(device)).
// A name is one of the three, never two (an error otherwise).
#pragma once

#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/core/runtime.h"
#include "kernels/core/units.h"

namespace meshproof::kernels {

struct NamedReserve {
  std::string name;
  Bytes bytes;
};

// Sets (replaces) the fixed reserve `name` on `device`; negative amounts are an error.
void set_device_reserve(Device device, std::string_view name, Bytes bytes);
void clear_device_reserve(Device device, std::string_view name);

using ReserveProvider = std::function<Bytes(Device)>;
// Registers (replaces) the provider `name`; it is asked for every device queried.
void register_reserve_provider(std::string_view name, ReserveProvider provider);
void unregister_reserve_provider(std::string_view name);

// Every non-zero reserve of `device` (fixed entries and providers), sorted by name.
std::vector<NamedReserve> device_reserves(Device device);
Bytes total_of(const std::vector<NamedReserve>& reserves);

// The default CUDA memory pool's reserve on `device`: the bytes it reserved at its high-water
// mark beyond what allocations used at theirs (0 on the CPU, without a usable GPU or for an
// ordinal this process does not see).
Bytes cuda_pool_reserve(Device device);

}  // namespace meshproof::kernels
