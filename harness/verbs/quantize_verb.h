// `meshproof quantize`: quantize a 2-D float32 tensor from HDF5 with any recipe on any backend and
// write every copy, scale and the dequantized values to HDF5 (for inspecting the numerics contract
// of docs/design.md section 4 and for independent reference checks).
#pragma once

#include <optional>
#include <ostream>
#include <string>

namespace CLI {
class App;
}

namespace meshproof::harness {

struct QuantizeVerbOptions {
  std::string recipe;            // current | delayed | mxfp8 | block | nvfp4
  std::string format;            // e4m3 (default) | e5m2; fp8 recipes only
  std::optional<float> scale;    // delayed: the scale the state holds (default 1)
  bool pow2_scales = false;      // current, block: power-of-two scales (block's default)
  bool no_pow2_scales = false;   // current, block: fp32 scales (current's default)
  float eps = 0.0f;              // current, block: amax clamped below by eps, in [0, 1]
  std::string block;             // block: 1x128 (default) | 128x128
  bool two_d = false;            // nvfp4: 16x16 tiles (weights)
  bool rht = false;              // nvfp4: random Hadamard transform of the columnwise copy
  std::string backend = "auto";  // cpu | cuda | auto
  std::string in;                // FILE.h5[:/dataset], dataset defaults to /x
  std::string
      out;  // output FILE.h5: never an input (harness/verbs/output_guard.h), written atomically
};

// Output layout (all in the input's element positions [M, K]):
//   /rowwise/data uint8 [M,K]; /rowwise/scale_inv (float32 [1] per-tensor; uint8 E8M0 [M,K/32]
//   mxfp8; float32 [M,ceil(K/128)] block 1x128; float32 [ceil(M/128),ceil(K/128)] 128x128);
//   /columnwise/data uint8 [M,K] (transposed copies transposed back); /columnwise/scale_inv
//   (float32 [1]; uint8 [M/32,K] mxfp8; float32 [ceil(M/128),K] 1x128 (block of 128 rows of one
//   column); float32 [ceil(M/128),ceil(K/128)] 128x128); /amax and /scale float32 [1] for the
//   per-tensor recipes; /rowwise/dequantized and /columnwise/dequantized float32 [M,K];
//   root attributes recipe, format, backend (and block).
// nvfp4 (docs/design.md section 25), stored layouts: /rowwise/data uint8 [M,K/2] (element 2j in
//   the low nibble), /rowwise/scale_inv uint8 E4M3 [M,K/16] (--2d: each tile's code on each of its
//   16 rows), /rowwise/global_amax float32 [1], /rowwise/dequantized float32 [M,K];
//   /columnwise/data uint8 [K,M/2], /columnwise/scale_inv uint8 [K,M/16],
//   /columnwise/global_amax float32 [1], /columnwise/dequantized float32 [K,M] (the RHT domain
//   with --rht); attributes recipe, backend, 2d, rht. M, K multiples of 16.
// Bad input (file, dataset, rank, dtype, shape, option) throws a kInput kernels::Error.
void run_quantize_verb(const QuantizeVerbOptions& options, std::ostream& out);

// Registers the `quantize` subcommand; its callback sets exit_code.
void add_quantize_command(CLI::App& app, std::ostream& out, int& exit_code);

}  // namespace meshproof::harness
