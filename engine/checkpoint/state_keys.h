// Checkpoint key names (docs/design.md section 6): the one place the engine, the checkpoint code,
// the harness and the tests spell them. A key is a '/'-separated path; tensors and scalars:
//   model/<param>                                   fp32 master weight
//   optim/<param>/exp_avg, optim/<param>/exp_avg_sq AdamW moments
//   fp8/<linear>/<role>/scale, .../amax_history     delayed scaling (role: input, weight,
//                                                   grad_output; linear as the recipe names it)
//   fp8/params/<param>/rowwise_data, .../scale_inv  FP8 primary weights (fsdp.fp8_params); mxfp8:
//     .../rowwise_scale_inv, .../columnwise_data, .../columnwise_scale_inv
//   scalars optim/step, data/cursor, rng/offset, lr/step
#pragma once

#include <string>
#include <string_view>

namespace meshproof::engine::keys {

inline constexpr std::string_view kModel = "model/";
inline constexpr std::string_view kOptim = "optim/";
inline constexpr std::string_view kFp8 = "fp8/";
inline constexpr std::string_view kFp8Params = "fp8/params/";
inline constexpr std::string_view kExpAvg = "exp_avg";
inline constexpr std::string_view kExpAvgSq = "exp_avg_sq";

// Scalars (char arrays: they key std::map<std::string, ...> lookups as they are).
inline constexpr char kOptimStep[] = "optim/step";
inline constexpr char kDataCursor[] = "data/cursor";
inline constexpr char kRngOffset[] = "rng/offset";
inline constexpr char kLrStep[] = "lr/step";

inline std::string model(std::string_view param) { return std::string(kModel).append(param); }
inline std::string exp_avg(std::string_view param) {
  return std::string(kOptim).append(param).append("/").append(kExpAvg);
}
inline std::string exp_avg_sq(std::string_view param) {
  return std::string(kOptim).append(param).append("/").append(kExpAvgSq);
}
// "fp8/<state>/<what>": state is the recipe's delayed-state key "<linear>/<role>", what is
// "scale" or "amax_history".
inline std::string fp8_delayed(std::string_view state, std::string_view what) {
  return std::string(kFp8).append(state).append("/").append(what);
}
// "fp8/params/<param>/<part>".
inline std::string fp8_param(std::string_view param, std::string_view part) {
  return std::string(kFp8Params).append(param).append("/").append(part);
}

inline bool is_fp8(std::string_view key) { return key.starts_with(kFp8); }
inline bool is_optim(std::string_view key) { return key.starts_with(kOptim); }

}  // namespace meshproof::engine::keys
