#include "harness/checks/golden.h"

#include <H5Cpp.h>
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <system_error>

#include "harness/scenario/scenario.h"
#include "kernels/core/error.h"
#include "kernels/core/hdf5_check.h"
#include "reports/record/report_error.h"
#include "reports/writers/atomic_file.h"

namespace meshproof::harness {
namespace fs = std::filesystem;

std::string golden_platform(const std::string& backend, const reports::EnvironmentRecord& env) {
  if (backend.rfind("cuda", 0) != 0) return "cpu";
  std::string name = env.gpus.empty() ? "gpu" : env.gpus.front().name;
  std::string lower;
  for (char c : name) lower += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  // First match wins: a family whose name holds another's comes first (gb200 before b200, h200
  // before h20, l40s before l4).
  for (const char* family :
       {"h100", "h200", "h800", "h20", "gb200", "b200", "b100", "a100", "l40s", "l4"}) {
    if (lower.find(family) != std::string::npos) return family;
  }
  std::string out;
  for (char c : lower) out += std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
  return out.empty() ? "gpu" : out;
}

std::string golden_scenario_dir(const std::string& scenario_name) {
  std::string out;
  for (char c : scenario_name) {
    if (c == '[') {
      out += '@';
    } else if (c == ']') {
      continue;
    } else if (std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == ',' ||
               c == '=' || c == '@' || c == '-') {
      out += c;
    } else {
      out += '_';
    }
  }
  return out;
}

bool valid_platform_name(const std::string& platform) {
  return !platform.empty() && std::all_of(platform.begin(), platform.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
  });
}

fs::path golden_path(const fs::path& root, const std::string& scenario_name,
                     const std::string& platform) {
  // The platform is a file name inside the scenario's folder: never a path.
  MP_CHECK_INPUT(valid_platform_name(platform),
                 "golden platform '{}': expected a name of [a-z0-9_-] characters", platform);
  return path_inside(root, fs::path(golden_scenario_dir(scenario_name)) / (platform + ".h5"));
}

namespace {

std::string read_string_attr(const H5::Attribute& a) {
  std::string value;
  a.read(a.getStrType(), value);
  // Fixed-length strings written with a 1-byte type for "" read back as a NUL.
  while (!value.empty() && value.back() == '\0') value.pop_back();
  return value;
}

void write_string_attr(H5::H5File& f, const std::string& key, const std::string& value) {
  H5::StrType type(H5::PredType::C_S1, value.empty() ? 1 : value.size());
  H5::Attribute a = f.createAttribute(key, type, H5::DataSpace(H5S_SCALAR));
  a.write(type, value.empty() ? std::string(1, '\0') : value);
}

}  // namespace

namespace {

// The whole read, as one call: an HDF5 failure names this call, not its source text.
GoldenData read_golden_file(const std::string& p) {
  GoldenData data;
  H5::H5File f(p, H5F_ACC_RDONLY);
  for (int i = 0; i < f.getNumAttrs(); ++i) {
    H5::Attribute a = f.openAttribute(static_cast<unsigned>(i));
    if (a.getTypeClass() == H5T_STRING) data.provenance[a.getName()] = read_string_attr(a);
  }
  if (f.nameExists("steps")) {
    H5::DataSet ds = f.openDataSet("steps");
    H5::DataSpace space = ds.getSpace();
    MP_CHECK_INPUT(space.getSimpleExtentNdims() == 1, "golden {}: /steps must be 1-D int64", p);
    hsize_t n = 0;
    space.getSimpleExtentDims(&n);
    data.steps.resize(n);
    if (n > 0) ds.read(data.steps.data(), H5::PredType::NATIVE_INT64);
  }
  H5::Group g = f.openGroup("/metrics");
  for (hsize_t i = 0; i < g.getNumObjs(); ++i) {
    const std::string name = g.getObjnameByIdx(i);
    H5::DataSet ds = g.openDataSet(name);
    H5::DataSpace space = ds.getSpace();
    MP_CHECK_INPUT(space.getSimpleExtentNdims() == 1,
                   "golden {}: /metrics/{} must be 1-D float64 [steps]", p, name);
    hsize_t n = 0;
    space.getSimpleExtentDims(&n);
    std::vector<double> v(n);
    if (n > 0) ds.read(v.data(), H5::PredType::NATIVE_DOUBLE);
    data.metrics[name] = std::move(v);
  }
  return data;
}

// The golden as the bytes of an HDF5 file, built in memory (the core driver without a backing
// store), so that the file itself is written by reports::write_file_atomically.
std::string golden_image(const GoldenData& data) {
  H5::FileAccPropList fapl;
  fapl.setCore(64 * 1024, false);
  H5::H5File f("golden-in-memory.h5", H5F_ACC_TRUNC, H5::FileCreatPropList::DEFAULT, fapl);
  for (const auto& [k, v] : data.provenance) write_string_attr(f, k, v);
  if (!data.steps.empty()) {
    const hsize_t n = data.steps.size();
    H5::DataSpace space(1, &n);
    f.createDataSet("steps", H5::PredType::STD_I64LE, space)
        .write(data.steps.data(), H5::PredType::NATIVE_INT64);
  }
  H5::Group g = f.createGroup("/metrics");
  for (const auto& [name, values] : data.metrics) {
    const hsize_t n = values.size();
    H5::DataSpace space(1, &n);
    H5::DataSet ds = g.createDataSet(name, H5::PredType::IEEE_F64LE, space);
    if (n > 0) ds.write(values.data(), H5::PredType::NATIVE_DOUBLE);
  }
  f.flush(H5F_SCOPE_GLOBAL);
  const ssize_t size = H5Fget_file_image(f.getId(), nullptr, 0);
  MP_CHECK(size > 0, "HDF5 gave no file image for the golden");
  std::string bytes(static_cast<size_t>(size), '\0');
  MP_CHECK(H5Fget_file_image(f.getId(), bytes.data(), bytes.size()) == size,
           "HDF5 file image of the golden changed size");
  return bytes;
}

}  // namespace

std::optional<GoldenData> read_golden(const fs::path& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) return std::nullopt;
  const std::string p = path.string();
  GoldenData data = MP_HDF5(kInput, read_golden_file(p), "reading golden {}", p);
  MP_CHECK_INPUT(data.metrics.count("loss") == 1, "golden {}: /metrics/loss is missing", p);
  if (!data.steps.empty()) {
    for (const auto& [name, values] : data.metrics) {
      MP_CHECK_INPUT(values.size() == data.steps.size(),
                     "golden {}: /metrics/{} has {} values for {} /steps", p, name, values.size(),
                     data.steps.size());
    }
    for (size_t i = 0; i < data.steps.size(); ++i) {
      MP_CHECK_INPUT(data.steps[i] >= 1 && (i == 0 || data.steps[i] > data.steps[i - 1]),
                     "golden {}: /steps must ascend from 1 (entry {} is {})", p, i, data.steps[i]);
    }
  }
  return data;
}

void write_golden(const fs::path& path, const GoldenData& data) {
  std::error_code ec;
  fs::create_directories(path.parent_path(), ec);
  MP_CHECK(!ec, "creating golden folder {}: {}", path.parent_path().string(), ec.message());
  const std::string bytes =
      MP_HDF5(kRuntime, golden_image(data), "writing golden {}", path.string());
  // Temporaries of earlier updates that were killed before their rename.
  (void)reports::remove_orphan_temporaries(path.parent_path(), {path.filename().string()});
  try {
    reports::write_file_atomically(path, bytes);
  } catch (const reports::ReportError& e) {
    MP_FAIL("writing golden {}: {}", path.string(), e.what());
  }
}

bool golden_is_imported(const GoldenData& golden) {
  const auto it = golden.provenance.find("origin");
  return it != golden.provenance.end() && it->second == "imported";
}

std::optional<double> mean_relative_shift(const std::vector<double>& before,
                                          const std::vector<double>& now) {
  const size_t n = std::min(before.size(), now.size());
  double sum = 0;
  int64_t count = 0;
  for (size_t i = 0; i < n; ++i) {
    if (before[i] == 0 || !std::isfinite(before[i]) || !std::isfinite(now[i])) continue;
    sum += (now[i] - before[i]) / std::fabs(before[i]);
    ++count;
  }
  if (count == 0) return std::nullopt;
  return sum / static_cast<double>(count);
}

}  // namespace meshproof::harness
