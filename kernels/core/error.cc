#include "kernels/core/error.h"

namespace meshproof::kernels {
namespace {

std::string compose(const std::string& file, int line, const std::string& expression,
                    const std::string& message) {
  if (expression.empty()) return fmt::format("{}:{}: {}", file, line, message);
  return fmt::format("{}:{}: check '{}' failed: {}", file, line, expression, message);
}

}  // namespace

Error::Error(ErrorKind kind, std::string file, int line, std::string expression,
             std::string message)
    : std::runtime_error(compose(file, line, expression, message)),
      kind_(kind),
      file_(std::move(file)),
      line_(line),
      expression_(std::move(expression)),
      message_(std::move(message)) {}

void throw_error(ErrorKind kind, const char* file, int line, const char* expression,
                 std::string message) {
  throw Error(kind, file, line, expression, std::move(message));
}

}  // namespace meshproof::kernels
