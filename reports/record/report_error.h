// Errors of the reports layer. reports/ depends on nothing of ours, so it cannot throw
// kernels::Error; the harness maps ReportError::Kind::kInput to exit code 2 (bad input: a
// malformed report.json given to `report compare`, an invalid record) and kIo to exit code 3.
#pragma once

#include <stdexcept>
#include <string>

namespace meshproof::reports {

class ReportError : public std::runtime_error {
 public:
  enum class Kind {
    kInput,  // the input (a record field, a report file's content or path) is wrong
    kIo,     // reading or writing a file failed
  };
  ReportError(Kind kind, const std::string& message) : std::runtime_error(message), kind_(kind) {}
  Kind kind() const { return kind_; }

 private:
  Kind kind_;
};

// Throws a kInput ReportError (bad input; the message names the file or field and what is wrong).
[[noreturn]] inline void input_error(const std::string& message) {
  throw ReportError(ReportError::Kind::kInput, message);
}

}  // namespace meshproof::reports
