// Error handling core: every failed check throws meshproof::kernels::Error carrying the file:line,
// the failed expression and a specific formatted message. The CLI maps error kinds to exit codes
// (docs/design.md section 10): kInput -> 2 (bad input or usage), kIntegrity -> 1 (stored data
// failed an integrity check), kRuntime -> 3 (runtime error).
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace meshproof::kernels {

enum class ErrorKind {
  kInput,      // the user's input is wrong (file, key, shape, option): exit code 2
  kIntegrity,  // well-formed stored data that fails its own integrity record (a checksum, size or
               // self-description mismatch: corruption, truncation, a swapped file): exit code 1
  kRuntime,    // something failed while running (CUDA, NCCL, I/O, internal invariant): exit code 3
};

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, std::string file, int line, std::string expression, std::string message);

  ErrorKind kind() const { return kind_; }
  const std::string& file() const { return file_; }
  int line() const { return line_; }
  const std::string& expression() const { return expression_; }
  // The message alone, without the source location (for user-facing input errors).
  const std::string& message() const { return message_; }

 private:
  ErrorKind kind_;
  std::string file_;
  int line_;
  std::string expression_;
  std::string message_;
};

// Builds the "file:line: check 'expr' failed: message" text and throws.
[[noreturn]] void throw_error(ErrorKind kind, const char* file, int line, const char* expression,
                              std::string message);

}  // namespace meshproof::kernels

// MP_CHECK(cond, "format {}", args...): internal invariant or runtime failure (exit 3).
#define MP_CHECK(cond, ...)                                                                  \
  do {                                                                                       \
    if (!(cond)) [[unlikely]] {                                                              \
      ::meshproof::kernels::throw_error(::meshproof::kernels::ErrorKind::kRuntime, __FILE__, \
                                        __LINE__, #cond, ::fmt::format(__VA_ARGS__));        \
    }                                                                                        \
  } while (0)

// MP_CHECK_INPUT(cond, "format {}", args...): the user's input is wrong (exit 2). The message must
// name what is wrong: the file, line and key, or the tensor and its shape.
#define MP_CHECK_INPUT(cond, ...)                                                          \
  do {                                                                                     \
    if (!(cond)) [[unlikely]] {                                                            \
      ::meshproof::kernels::throw_error(::meshproof::kernels::ErrorKind::kInput, __FILE__, \
                                        __LINE__, #cond, ::fmt::format(__VA_ARGS__));      \
    }                                                                                      \
  } while (0)

// MP_CHECK_INTEGRITY(cond, "format {}", args...): stored data contradicts its own integrity
// record (exit 1). The message must name the file and key.
#define MP_CHECK_INTEGRITY(cond, ...)                                                          \
  do {                                                                                         \
    if (!(cond)) [[unlikely]] {                                                                \
      ::meshproof::kernels::throw_error(::meshproof::kernels::ErrorKind::kIntegrity, __FILE__, \
                                        __LINE__, #cond, ::fmt::format(__VA_ARGS__));          \
    }                                                                                          \
  } while (0)

// Unconditional failures, for switch defaults and parse errors.
#define MP_FAIL(...)                                                                               \
  ::meshproof::kernels::throw_error(::meshproof::kernels::ErrorKind::kRuntime, __FILE__, __LINE__, \
                                    "", ::fmt::format(__VA_ARGS__))
#define MP_FAIL_INPUT(...)                                                                       \
  ::meshproof::kernels::throw_error(::meshproof::kernels::ErrorKind::kInput, __FILE__, __LINE__, \
                                    "", ::fmt::format(__VA_ARGS__))
