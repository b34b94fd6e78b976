#include "harness/verbs/quantize_verb.h"

#include <H5Cpp.h>
#include <fmt/format.h>
#include <fmt/ostream.h>
#include <fmt/ranges.h>

#include <CLI/CLI.hpp>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <memory>
#include <vector>

#include "engine/config/config.h"
#include "harness/verbs/exit_codes.h"
#include "harness/verbs/output_guard.h"
#include "kernels/core/device.h"
#include "kernels/core/error.h"
#include "kernels/core/hdf5_check.h"
#include "kernels/quantize/nvfp4.h"
#include "kernels/quantize/quantize.h"
#include "reports/record/report_error.h"
#include "reports/writers/atomic_file.h"

namespace meshproof::harness {
namespace {

namespace fs = std::filesystem;

// The recipes that quantize, from the one recipe-name table (engine/config/config.h).
std::vector<std::string> fp8_recipe_names() {
  std::vector<std::string> names;
  for (const engine::RecipeName& r : engine::kRecipeNames) {
    if (engine::is_fp8(r.kind)) names.emplace_back(r.name);
  }
  return names;
}
using kernels::DType;
using kernels::Tensor;

struct InputSpec {
  std::string file;
  std::string dataset = "/x";
};

// FILE.h5[:/dataset]: the dataset part starts with '/' after the last ':'.
InputSpec parse_input_spec(const std::string& in) {
  InputSpec spec;
  const size_t colon = in.rfind(':');
  if (colon != std::string::npos && colon + 1 < in.size() && in[colon + 1] == '/') {
    spec.file = in.substr(0, colon);
    spec.dataset = in.substr(colon + 1);
  } else {
    spec.file = in;
  }
  MP_CHECK_INPUT(!spec.file.empty(), "--in '{}' names no file", in);
  return spec;
}

// Reads a 2-D float32 dataset into a host tensor [M, K].
Tensor read_input(const InputSpec& spec) {
  std::error_code ec;
  MP_CHECK_INPUT(!fs::is_directory(spec.file, ec),
                 "--in '{}' is a folder; quantize reads a 2-D float32 dataset from an HDF5 file",
                 spec.file);
  MP_CHECK_INPUT(fs::is_regular_file(spec.file, ec), "input file '{}' does not exist", spec.file);
  MP_CHECK_INPUT(fs::file_size(spec.file, ec) > 0, "--in '{}' is empty (0 bytes), not an HDF5 file",
                 spec.file);
  H5::H5File file =
      MP_HDF5(kInput, H5::H5File(spec.file, H5F_ACC_RDONLY), "opening '{}' as HDF5", spec.file);
  MP_CHECK_INPUT(MP_HDF5(kInput, file.nameExists(spec.dataset), "looking up {} in '{}'",
                         spec.dataset, spec.file),
                 "dataset {} not found in '{}'", spec.dataset, spec.file);
  H5::DataSet ds = MP_HDF5(kInput, file.openDataSet(spec.dataset), "opening dataset {} in '{}'",
                           spec.dataset, spec.file);
  const H5::DataSpace space = ds.getSpace();
  const int rank = space.getSimpleExtentNdims();
  MP_CHECK_INPUT(rank == 2, "dataset {} in '{}' has rank {}; quantize needs a 2-D [M, K] dataset",
                 spec.dataset, spec.file, rank);
  hsize_t dims[2] = {0, 0};
  space.getSimpleExtentDims(dims);
  const H5::DataType type = ds.getDataType();
  MP_CHECK_INPUT(type.getClass() == H5T_FLOAT && type.getSize() == 4,
                 "dataset {} in '{}' is not float32 (HDF5 class {}, {} bytes per element)",
                 spec.dataset, spec.file, static_cast<int>(type.getClass()), type.getSize());
  MP_CHECK_INPUT(dims[0] > 0 && dims[1] > 0, "dataset {} in '{}' is empty [{}, {}]", spec.dataset,
                 spec.file, dims[0], dims[1]);
  Tensor x = Tensor::empty({static_cast<int64_t>(dims[0]), static_cast<int64_t>(dims[1])},
                           DType::kFloat32, kernels::Device::cpu());
  MP_HDF5(kInput, ds.read(x.data<float>(), H5::PredType::NATIVE_FLOAT), "reading {} from '{}'",
          spec.dataset, spec.file);
  return x;
}

// Writer of one output file; every dataset is written from a host tensor.
class OutputFile {
 public:
  explicit OutputFile(const std::string& path)
      : file_(MP_HDF5(kRuntime, H5::H5File(path, H5F_ACC_TRUNC), "creating '{}'", path)),
        path_(path) {
    MP_HDF5(kRuntime, file_.createGroup("/rowwise"), "writing '{}'", path_);
    MP_HDF5(kRuntime, file_.createGroup("/columnwise"), "writing '{}'", path_);
  }

  void write(const std::string& name, const Tensor& t) {
    const Tensor h = t.on(kernels::Device::cpu());
    std::vector<hsize_t> dims;
    for (int64_t d : h.shape().dims()) dims.push_back(static_cast<hsize_t>(d));
    const bool f32 = h.dtype() == DType::kFloat32;
    MP_CHECK(f32 || kernels::dtype_bits(h.dtype()) == 8, "cannot write {} as {}", h.describe(),
             name);
    const H5::PredType& type = f32 ? H5::PredType::NATIVE_FLOAT : H5::PredType::NATIVE_UINT8;
    MP_HDF5(
        kRuntime,
        file_.createDataSet(name, type, H5::DataSpace(static_cast<int>(dims.size()), dims.data()))
            .write(h.raw_data(), type),
        "writing {} to '{}'", name, path_);
  }

  void attribute(const std::string& name, const std::string& value) {
    const H5::StrType type(H5::PredType::C_S1, H5T_VARIABLE);
    MP_HDF5(kRuntime,
            file_.openGroup("/")
                .createAttribute(name, type, H5::DataSpace(H5S_SCALAR))
                .write(type, value),
            "writing attribute {} to '{}'", name, path_);
  }

  void close() { MP_HDF5(kRuntime, file_.close(), "closing '{}'", path_); }

 private:
  H5::H5File file_;
  std::string path_;
};

bool is_per_tensor(kernels::ScalingMode m) {
  return m == kernels::ScalingMode::kCurrentTensor || m == kernels::ScalingMode::kDelayedTensor;
}

// The packed bytes of an e2m1 tensor [R, C] as uint8 [R, C/2] on the host.
Tensor packed_bytes(const Tensor& e2m1) {
  const Tensor h = e2m1.device().is_cpu() ? e2m1 : e2m1.to(kernels::Device::cpu());
  Tensor b = Tensor::empty({h.shape()[0], h.shape()[1] / 2}, DType::kUInt8, kernels::Device::cpu());
  std::memcpy(b.raw_data(), h.raw_data(), static_cast<size_t>(h.nbytes().value));
  return b;
}

// Runs `write` on a fresh temporary beside `out` and renames it over `out` when complete
// (reports/writers/atomic_file.h), so a failure or a kill leaves the old file or none.
template <typename Write>
void write_atomically(const std::string& out, Write&& write) {
  try {
    reports::write_path_atomically(out, [&](const fs::path& tmp) {
      OutputFile f(tmp.string());
      write(f);
      f.close();
    });
  } catch (const reports::ReportError& e) {
    MP_FAIL("quantize: writing --out {}: {}", out, e.what());
  }
}

// Issue #46, before any work: --out is a writable file path that is not the input, spelled any
// way (harness/verbs/output_guard.h).
void check_paths(const QuantizeVerbOptions& o, const InputSpec& spec) {
  const NamedPath out{"--out", o.out, OutputKind::kFile};
  check_output_file("quantize", out);
  const NamedPath in[] = {{"--in", spec.file}};
  check_outputs_apart("quantize", in, std::span(&out, 1));
}

// `quantize --recipe nvfp4` (docs/design.md section 25): both copies in their stored layouts.
void run_nvfp4(const QuantizeVerbOptions& o, std::ostream& out) {
  MP_CHECK_INPUT(o.format.empty(),
                 "--format {} applies to the fp8 recipes; nvfp4 is e2m1 with "
                 "e4m3 block scales",
                 o.format);
  MP_CHECK_INPUT(
      !o.pow2_scales && !o.no_pow2_scales && o.eps == 0.0f && !o.scale && o.block.empty(),
      "--pow2-scales, --no-pow2-scales, --eps, --scale and --block do not apply to "
      "--recipe nvfp4");
  MP_CHECK_INPUT(!(o.two_d && o.rht),
                 "--2d with --rht: 16x16 tiles are for weights and the random Hadamard transform "
                 "for non-weights (activations, gradients); choose one");
  MP_CHECK_INPUT(!o.out.empty(), "--out is required");
  const kernels::Device device = kernels::resolve_backend(o.backend);
  const InputSpec spec = parse_input_spec(o.in);
  check_paths(o, spec);
  const Tensor x_host = read_input(spec);
  const int64_t M = x_host.shape()[0];
  const int64_t K = x_host.shape()[1];
  kernels::Nvfp4Options opts;
  opts.tile16x16 = o.two_d;
  opts.rht = o.rht;
  const std::string what = fmt::format("dataset {} in '{}'", spec.dataset, spec.file);
  kernels::check_nvfp4_shape(M, K, opts, what);
  const Tensor x = x_host.on(device);
  const kernels::QuantizedTensor q = kernels::quantize_nvfp4(x, opts, {true, true}, what);
  write_atomically(o.out, [&](OutputFile& f) {
    f.write("/rowwise/data", packed_bytes(q.rowwise_data));
    f.write("/rowwise/scale_inv", q.rowwise_scale_inv);
    f.write("/rowwise/global_amax", q.amax);
    f.write("/rowwise/dequantized", kernels::dequantize_nvfp4(q, true));
    f.write("/columnwise/data", packed_bytes(q.columnwise_data));
    f.write("/columnwise/scale_inv", q.columnwise_scale_inv);
    f.write("/columnwise/global_amax", q.columnwise_amax);
    f.write("/columnwise/dequantized", kernels::dequantize_nvfp4(q, false));
    f.attribute("recipe", o.recipe);
    f.attribute("backend", device.is_cpu() ? "cpu" : "cuda");
    f.attribute("2d", o.two_d ? "1" : "0");
    f.attribute("rht", o.rht ? "1" : "0");
  });
  fmt::print(out, "quantized {}:{} [{}, {}] with nvfp4 ({}{}) on {} -> {}\n", spec.file,
             spec.dataset, M, K, o.two_d ? "16x16 tiles" : "1x16 blocks",
             o.rht ? ", columnwise RHT" : "", device.str(), o.out);
}

}  // namespace

void run_quantize_verb(const QuantizeVerbOptions& o, std::ostream& out) {
  using kernels::QuantizedCopy;
  using kernels::ScalingMode;
  if (o.recipe == "nvfp4") return run_nvfp4(o, out);
  MP_CHECK_INPUT(!o.two_d && !o.rht, "--2d and --rht apply to --recipe nvfp4, not {}", o.recipe);
  const std::string format_name = o.format.empty() ? "e4m3" : o.format;
  MP_CHECK_INPUT(format_name == "e4m3" || format_name == "e5m2",
                 "--format '{}' is not e4m3 or e5m2", format_name);
  // An option of another recipe is refused, not ignored.
  MP_CHECK_INPUT(o.block.empty() || o.recipe == "block",
                 "--block {} applies to --recipe block, not {}", o.block, o.recipe);
  MP_CHECK_INPUT(!o.scale || o.recipe == "delayed",
                 "--scale {} applies to --recipe delayed, not {}", o.scale.value_or(1.0f),
                 o.recipe);
  const std::string block = o.block.empty() ? "1x128" : o.block;
  MP_CHECK_INPUT(block == "1x128" || block == "128x128", "--block '{}' is not 1x128 or 128x128",
                 block);
  MP_CHECK_INPUT(!o.out.empty(), "--out is required");
  // The one recipe-name table (engine/config/config.h); fp32 and bf16 do not quantize.
  const engine::RecipeKind kind = engine::parse_recipe(o.recipe, "--recipe");
  MP_CHECK_INPUT(engine::is_fp8(kind), "--recipe '{}' is not {}", o.recipe,
                 fmt::join(fp8_recipe_names(), ", "));
  // Scale options of current and block scaling (TE QParams power_2_scale, amax_epsilon).
  const bool scaled = kind == engine::RecipeKind::kCurrent || kind == engine::RecipeKind::kBlock;
  MP_CHECK_INPUT(!(o.pow2_scales && o.no_pow2_scales),
                 "--pow2-scales and --no-pow2-scales contradict each other");
  MP_CHECK_INPUT(scaled || (!o.pow2_scales && !o.no_pow2_scales),
                 "--pow2-scales/--no-pow2-scales apply to --recipe current or block, not {}",
                 o.recipe);
  MP_CHECK_INPUT(std::isfinite(o.eps) && o.eps >= 0.0f && o.eps <= 1.0f,
                 "--eps {} must be in [0, 1]", o.eps);
  MP_CHECK_INPUT(scaled || o.eps == 0.0f, "--eps applies to --recipe current or block, not {}",
                 o.recipe);
  // Power-of-2 scales: off by default for current, on for block (Float8BlockScaling).
  const bool pow2 = kind == engine::RecipeKind::kBlock ? !o.no_pow2_scales : o.pow2_scales;
  const DType format = format_name == "e5m2" ? DType::kE5M2 : DType::kE4M3;
  const kernels::Device device = kernels::resolve_backend(o.backend);
  const InputSpec spec = parse_input_spec(o.in);
  check_paths(o, spec);
  const Tensor x_host = read_input(spec);
  const int64_t M = x_host.shape()[0];
  const int64_t K = x_host.shape()[1];
  const Tensor x = x_host.on(device);
  const kernels::Usage both{true, true};

  kernels::QuantizedTensor q;
  if (kind == engine::RecipeKind::kCurrent) {
    q = kernels::quantize_current(x, format, both, o.eps, pow2);
  } else if (kind == engine::RecipeKind::kDelayed) {
    const float s = o.scale.value_or(1.0f);
    MP_CHECK_INPUT(std::isfinite(s) && s > 0, "--scale {} must be finite and > 0", s);
    const Tensor scale = Tensor::from_vector<float>({1}, {s}).to(device);
    q = kernels::quantize_per_tensor(x, scale, format, both, ScalingMode::kDelayedTensor,
                                     kernels::compute_amax(x));
  } else if (kind == engine::RecipeKind::kMxfp8) {
    MP_CHECK_INPUT(M % 32 == 0 && K % 32 == 0,
                   "dataset {} in '{}' has shape [{}, {}]: mxfp8 needs both dims to be multiples "
                   "of 32",
                   spec.dataset, spec.file, M, K);
    q = kernels::quantize_mxfp8(x, format, both);
  } else {
    q = kernels::quantize_block(
        x, block == "128x128" ? ScalingMode::kBlock128x128 : ScalingMode::kBlock1x128, format, both,
        pow2, o.eps);
  }

  // Columnwise copies in the input's element positions: per-tensor and block copies are stored
  // transposed, so transpose data (and block scales) back.
  const bool transposed = q.mode != ScalingMode::kMxfp8;
  const Tensor col_data = transposed ? kernels::transpose_2d(q.columnwise_data) : q.columnwise_data;
  const Tensor col_scale = (transposed && !is_per_tensor(q.mode))
                               ? kernels::transpose_2d(q.columnwise_scale_inv)
                               : q.columnwise_scale_inv;

  write_atomically(o.out, [&](OutputFile& f) {
    f.write("/rowwise/data", q.rowwise_data);
    f.write("/rowwise/scale_inv", q.rowwise_scale_inv);
    f.write("/columnwise/data", col_data);
    f.write("/columnwise/scale_inv", col_scale);
    if (q.amax.defined()) f.write("/amax", q.amax);
    if (q.scale.defined()) f.write("/scale", q.scale);
    f.write("/rowwise/dequantized", kernels::dequantize(q, QuantizedCopy::kRowwise));
    f.write("/columnwise/dequantized", kernels::dequantize(q, QuantizedCopy::kColumnwise));
    f.attribute("recipe", o.recipe);
    f.attribute("format", format_name);
    f.attribute("backend", device.is_cpu() ? "cpu" : "cuda");
    f.attribute("scaling_mode", std::string(kernels::scaling_mode_name(q.mode)));
    if (kind == engine::RecipeKind::kBlock) f.attribute("block", block);
    if (scaled) {
      f.attribute("pow2_scales", pow2 ? "1" : "0");
      f.attribute("eps", fmt::format("{}", o.eps));
    }
  });
  fmt::print(out, "quantized {}:{} [{}, {}] with {} {} ({}) on {} -> {}\n", spec.file, spec.dataset,
             M, K, o.recipe, format_name, kernels::scaling_mode_name(q.mode), device.str(), o.out);
}

void add_quantize_command(CLI::App& app, std::ostream& out, int& exit_code) {
  auto opts = std::make_shared<QuantizeVerbOptions>();
  auto* cmd = app.add_subcommand(
      "quantize",
      "Quantize a 2-D float32 HDF5 dataset with a recipe (current, delayed, mxfp8, block, nvfp4) "
      "on any "
      "backend and write data, scales and dequantized values to HDF5");
  cmd->add_option("--recipe", opts->recipe, fmt::format("{}", fmt::join(fp8_recipe_names(), " | ")))
      ->required()
      ->check(CLI::IsMember(fp8_recipe_names()));
  cmd->add_option("--format", opts->format, "Element format: e4m3 (default) | e5m2")
      ->check(CLI::IsMember({"e4m3", "e5m2"}));
  cmd->add_option("--scale", opts->scale, "delayed: the scale to quantize with (default 1)");
  cmd->add_flag("--pow2-scales", opts->pow2_scales,
                "current, block: power-of-two scales (the default for block)");
  cmd->add_flag("--no-pow2-scales", opts->no_pow2_scales,
                "current, block: fp32 scales, not rounded (the default for current)");
  cmd->add_option("--eps", opts->eps,
                  "current, block: amax clamped below by EPS before scale = fp8_max / amax "
                  "(default 0)");
  cmd->add_option("--block", opts->block, "block: 1x128 (default) | 128x128")
      ->check(CLI::IsMember({"1x128", "128x128"}));
  cmd->add_flag("--2d", opts->two_d, "nvfp4: 16x16 tiles (weights) instead of 1x16 blocks");
  cmd->add_flag("--rht", opts->rht,
                "nvfp4: random Hadamard transform of the columnwise copy (wgrad operands)");
  cmd->add_option("--backend", opts->backend, "cpu | cuda | auto (default)")
      ->check(CLI::IsMember({"cpu", "cuda", "auto"}));
  cmd->add_option("--in", opts->in, "Input FILE.h5[:/dataset] (dataset defaults to /x)")
      ->required();
  cmd->add_option("--out", opts->out, "Output HDF5 file")->required();
  cmd->callback([&out, &exit_code, opts] {
    run_quantize_verb(*opts, out);
    exit_code = kExitOk;
  });
}

}  // namespace meshproof::harness
