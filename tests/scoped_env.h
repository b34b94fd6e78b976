// Sets (or unsets) one environment variable for a scope and restores what it was, so that a test
// that sets MESHPROOF_* variables leaves the process as it found it even when an assertion
// returns early.
#pragma once

#include <stdlib.h>

#include <optional>
#include <string>

namespace meshproof::test_env {

class ScopedEnv {
 public:
  // value nullptr: unset for the scope.
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    set(value);
  }
  ~ScopedEnv() { set(old_ ? old_->c_str() : nullptr); }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

  // Changes the value inside the scope (nullptr: unset); the destructor still restores the
  // value from before the scope.
  void set(const char* value) {
    if (value != nullptr) {
      ::setenv(name_.c_str(), value, 1);
    } else {
      ::unsetenv(name_.c_str());
    }
  }

 private:
  std::string name_;
  std::optional<std::string> old_;
};

}  // namespace meshproof::test_env
