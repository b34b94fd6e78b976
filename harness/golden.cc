#include "harness/golden.h"

#include <H5Cpp.h>
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <system_error>

#include "harness/scenario.h"
#include "kernels/error.h"
#include "kernels/hdf5_check.h"

namespace meshproof::harness {
namespace fs = std::filesystem;

std::string golden_platform(const std::string& backend, const reports::EnvironmentRecord& env) {
  if (backend.rfind("cuda", 0) != 0) return "cpu";
  std::string name = env.gpus.empty() ? "gpu" : env.gpus.front().name;
  std::string lower;
  for (char c : name) lower += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  for (const char* family :
       {"h100", "h200", "h800", "h20", "b200", "b100", "gb200", "a100", "l40s", "l4"}) {
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

fs::path golden_path(const fs::path& root, const std::string& scenario_name,
                     const std::string& platform) {
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

std::optional<GoldenData> read_golden(const fs::path& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) return std::nullopt;
  GoldenData data;
  const std::string p = path.string();
  MP_HDF5(
      kInput,
      [&] {
        H5::H5File f(p, H5F_ACC_RDONLY);
        for (int i = 0; i < f.getNumAttrs(); ++i) {
          H5::Attribute a = f.openAttribute(static_cast<unsigned>(i));
          if (a.getTypeClass() == H5T_STRING) data.provenance[a.getName()] = read_string_attr(a);
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
        return 0;
      }(),
      "reading golden {}", p);
  MP_CHECK_INPUT(data.metrics.count("loss") == 1, "golden {}: /metrics/loss is missing", p);
  return data;
}

void write_golden(const fs::path& path, const GoldenData& data) {
  std::error_code ec;
  fs::create_directories(path.parent_path(), ec);
  MP_CHECK(!ec, "creating golden folder {}: {}", path.parent_path().string(), ec.message());
  const fs::path partial = path.string() + ".partial";
  const std::string tmp = partial.string();
  try {
    MP_HDF5(
        kRuntime,
        [&] {
          H5::H5File f(tmp, H5F_ACC_TRUNC);
          for (const auto& [k, v] : data.provenance) write_string_attr(f, k, v);
          H5::Group g = f.createGroup("/metrics");
          for (const auto& [name, values] : data.metrics) {
            const hsize_t n = values.size();
            H5::DataSpace space(1, &n);
            H5::DataSet ds = g.createDataSet(name, H5::PredType::IEEE_F64LE, space);
            if (n > 0) ds.write(values.data(), H5::PredType::NATIVE_DOUBLE);
          }
          f.close();
          return 0;
        }(),
        "writing golden {}", tmp);
  } catch (...) {
    fs::remove(partial, ec);
    throw;
  }
  fs::rename(partial, path, ec);
  if (ec) {
    std::error_code ignored;
    fs::remove(partial, ignored);
    MP_FAIL("renaming {} to {}: {}", tmp, path.string(), ec.message());
  }
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
