// Outcome agreement: one MAX all_reduce of [code] or [code, value], then, only when some member
// failed, a broadcast of that member's message.
#include "mesh/core/agreement.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "kernels/core/error.h"
#include "kernels/core/runtime.h"
#include "kernels/core/tensor.h"

namespace meshproof::mesh {
namespace {

using kernels::ErrorKind;
using kernels::Tensor;

// Kinds in order of gravity, as the flag carries them (0: no failure). Exit codes are not
// ordered by gravity (input 2, integrity 1, runtime 3), so the flag has its own scale.
constexpr int kInputCode = 1;
constexpr int kIntegrityCode = 2;
constexpr int kRuntimeCode = 3;
// The broadcast message buffer: the message and its terminating zero.
constexpr int64_t kMaxMessage = 2048;
// Flag values are exact in fp32 up to 2^24.
constexpr int64_t kExactInFloat = int64_t{1} << 24;

struct Failure {
  int code = 0;
  std::string message;
};

Failure describe(const std::exception_ptr& error) {
  Failure f;
  if (!error) return f;
  f.code = kRuntimeCode;
  try {
    std::rethrow_exception(error);
  } catch (const kernels::Error& e) {
    if (e.kind() == ErrorKind::kInput) f.code = kInputCode;
    if (e.kind() == ErrorKind::kIntegrity) f.code = kIntegrityCode;
    f.message = e.message();
  } catch (const std::exception& e) {
    f.message = e.what();
  } catch (...) {
    f.message = "unknown error";
  }
  return f;
}

Tensor on_rank_device(Tensor t) { return t.on(kernels::current_context().device); }

// The flag packs the kind and the member into one MAX-reduced value: code * (n + 1) + (n - member),
// so the largest is the gravest kind and, among equals, the lowest member.
int64_t agree(Communicator& group, std::exception_ptr error, std::optional<int64_t> value,
              std::string_view what) {
  const int n = group.size();
  MP_CHECK(int64_t{kRuntimeCode} * (n + 1) + n < kExactInFloat,
           "{}: a group of {} members is too large to agree on an outcome in an fp32 flag", what,
           n);
  if (!error && value && (*value < 0 || *value >= kExactInFloat)) {
    error = std::make_exception_ptr(kernels::Error(
        ErrorKind::kRuntime, __FILE__, __LINE__, "",
        fmt::format("{}: value {} outside [0, 2^24) cannot be agreed on", what, *value)));
  }
  Failure mine = describe(error);
  std::vector<float> flags{
      mine.code == 0 ? 0.0f : static_cast<float>(mine.code * (n + 1) + (n - group.rank()))};
  if (value) flags.push_back(error ? 0.0f : static_cast<float>(*value));
  Tensor t = on_rank_device(Tensor::from_vector<float>(kernels::Shape{std::ssize(flags)}, flags));
  group.all_reduce(t, ReduceOp::kMax);
  const std::vector<float> got = t.to_vector<float>();
  const auto packed = static_cast<int64_t>(got[0]);
  if (packed == 0) return value ? static_cast<int64_t>(got[1]) : 0;

  const auto code = static_cast<int>(packed / (n + 1));
  const auto root = static_cast<int>(n - packed % (n + 1));
  Tensor text =
      Tensor::zeros(kernels::Shape{kMaxMessage}, kernels::DType::kUInt8, kernels::Device::cpu());
  if (group.rank() == root) {
    std::memcpy(text.raw_data(), mine.message.data(),
                std::min<size_t>(mine.message.size(), kMaxMessage - 1));
  }
  text = on_rank_device(text);
  group.broadcast(text, root);
  if (error) std::rethrow_exception(error);
  const std::vector<uint8_t> bytes = text.to_vector<uint8_t>();
  const std::string message(reinterpret_cast<const char*>(bytes.data()));
  const int who = group.ranks()[static_cast<size_t>(root)];
  if (code == kInputCode) MP_FAIL_INPUT("{} failed on rank {}: {}", what, who, message);
  MP_CHECK_INTEGRITY(code != kIntegrityCode, "{} failed on rank {}: {}", what, who, message);
  MP_FAIL("{} failed on rank {}: {}", what, who, message);
}

}  // namespace

void agree_on_outcome(Communicator& group, std::exception_ptr error, std::string_view what) {
  agree(group, std::move(error), std::nullopt, what);
}

int64_t agree_on_outcome(Communicator& group, std::exception_ptr error, int64_t value,
                         std::string_view what) {
  return agree(group, std::move(error), value, what);
}

}  // namespace meshproof::mesh
