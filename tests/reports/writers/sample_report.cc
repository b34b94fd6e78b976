// Writes the sample run record's four reports into a directory:
//   reports_sample OUT_DIR [--hostile | --wrong-check]
// Used by CTest (the Python structural checks read its output) and to look at a report.html.
#include <cstdio>
#include <cstring>
#include <exception>

#include "reports/writers/report_writers.h"
#include "sample_record.h"

int main(int argc, char** argv) {
  const char* variant = argc == 3 ? argv[2] : "";
  if (argc < 2 || argc > 3 ||
      (argc == 3 && std::strcmp(variant, "--hostile") != 0 &&
       std::strcmp(variant, "--wrong-check") != 0)) {
    std::fprintf(stderr, "usage: %s OUT_DIR [--hostile | --wrong-check]\n", argv[0]);
    return 2;
  }
  try {
    using namespace meshproof::reports;
    const RunRecord r = std::strcmp(variant, "--hostile") == 0       ? testing::hostile_record()
                        : std::strcmp(variant, "--wrong-check") == 0 ? testing::wrong_check_record()
                                                                     : testing::sample_record();
    const ReportPaths p = write_reports(r, argv[1]);
    std::printf("%s\n%s\n%s\n%s\n", p.json.c_str(), p.markdown.c_str(), p.junit.c_str(),
                p.html.c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "reports_sample: %s\n", e.what());
    return 3;
  }
  return 0;
}
