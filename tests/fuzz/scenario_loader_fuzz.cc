// libFuzzer target for the scenario loader (docs/design.md section 17): YAML text plus optional
// --set overrides -> parse_override -> load_scenario_text (parse, overrides, matrix expansion,
// validation) -> check_unique_name over the expanded scenarios.
//
// Input: the scenario's YAML text, optionally followed by a line `%%set`; every line after it is
// one override as written on the command line ("mesh.tp=2"). The contract under test is the
// loader's: any input either loads or throws kernels::Error. Anything else (a crash, a sanitizer
// report, another exception type, a hang past -timeout, memory past -rss_limit_mb) is a finding.
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "harness/scenario/scenario_loader.h"
#include "kernels/core/error.h"

namespace {

constexpr std::string_view kSetSeparator = "\n%%set\n";

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace meshproof;
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  std::string_view yaml = input;
  std::string_view sets;
  if (const size_t at = input.find(kSetSeparator); at != std::string_view::npos) {
    yaml = input.substr(0, at);
    sets = input.substr(at + kSetSeparator.size());
  }
  try {
    std::vector<harness::Override> overrides;
    while (!sets.empty()) {
      const size_t eol = sets.find('\n');
      const std::string_view line = sets.substr(0, eol);
      sets = eol == std::string_view::npos ? std::string_view() : sets.substr(eol + 1);
      if (!line.empty()) overrides.push_back(harness::parse_override(std::string(line)));
    }
    const std::vector<harness::Scenario> scenarios =
        harness::load_scenario_text(yaml, "fuzz.yaml", overrides);
    std::map<std::string, std::string> seen;
    for (const harness::Scenario& s : scenarios) harness::check_unique_name(s, seen);
  } catch (const kernels::Error&) {
    // The project's error type: a clean rejection of bad input.
  }
  return 0;
}
