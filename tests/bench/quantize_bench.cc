// Quantizer throughput per recipe (Google Benchmark). Reported bytes_per_second counts the bytes
// each quantizer must move: every pass over the fp32 input (current scaling reads it twice: amax,
// then cast) plus every byte written (rowwise and columnwise data, scales). On CUDA a
// device-to-device copy of the input is measured beside them as the bandwidth ceiling.
// On the CPU each recipe is also measured with the element-wise loops the vectorised quantizers
// replaced (quantize/cpu_old/..., tests/kernels/quantize/quantize_oracle.h), and a host memcpy of
// the input (copy/cpu/memcpy_fp32) is the bandwidth ceiling, all in the same run.
// CUDA timings synchronise the rank's stream after each iteration (wall clock including launch
// overhead), so small shapes understate the kernels' bandwidth.
#include <benchmark/benchmark.h>

#include <random>
#include <string>
#include <vector>

#include "kernels/core/device.h"
#include "kernels/core/runtime.h"
#include "kernels/quantize/quantize.h"
#include "tests/kernels/quantize/quantize_oracle.h"

namespace meshproof::kernels {
namespace {

enum class Recipe { kCurrent, kMxfp8, kBlock1x128, kBlock128x128 };

const char* recipe_name(Recipe r) {
  switch (r) {
    case Recipe::kCurrent:
      return "current";
    case Recipe::kMxfp8:
      return "mxfp8";
    case Recipe::kBlock1x128:
      return "block1x128";
    case Recipe::kBlock128x128:
      return "block128x128";
  }
  return "?";
}

Tensor make_input(int64_t M, int64_t K, Device device) {
  std::mt19937 rng(1);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(M * K));
  for (float& x : v) x = n(rng);
  const Tensor h = Tensor::from_vector<float>({M, K}, v);
  return device.is_cpu() ? h : h.to(device);
}

// Bytes a quantizer producing both copies must read and write.
int64_t traffic_bytes(Recipe r, int64_t M, int64_t K) {
  const int64_t in = 4 * M * K;
  const int64_t data = 2 * M * K;  // rowwise + columnwise fp8 copies
  switch (r) {
    case Recipe::kCurrent:
      return 2 * in + data + 8;
    case Recipe::kMxfp8:
      return in + data + 2 * (M * K / 32);
    case Recipe::kBlock1x128:
      return in + data + 4 * (M * ((K + 127) / 128) + K * ((M + 127) / 128));
    case Recipe::kBlock128x128:
      return in + data + 8 * ((M + 127) / 128) * ((K + 127) / 128);
  }
  return 0;
}

void run_quantizer(Recipe r, const Tensor& x) {
  const Usage both{true, true};
  QuantizedTensor q;
  switch (r) {
    case Recipe::kCurrent:
      q = quantize_current(x, DType::kE4M3, both);
      break;
    case Recipe::kMxfp8:
      q = quantize_mxfp8(x, DType::kE4M3, both);
      break;
    case Recipe::kBlock1x128:
      q = quantize_block(x, ScalingMode::kBlock1x128, DType::kE4M3, both);
      break;
    case Recipe::kBlock128x128:
      q = quantize_block(x, ScalingMode::kBlock128x128, DType::kE4M3, both);
      break;
  }
  benchmark::DoNotOptimize(q.rowwise_data.raw_data());
}

// The pre-vectorisation CPU loops (the same scale rule as quantize_current: amax, then the scale).
void run_old_quantizer(Recipe r, const Tensor& x) {
  const Usage both{true, true};
  QuantizedTensor q;
  switch (r) {
    case Recipe::kCurrent: {
      const Tensor scale = compute_current_scale(quantize_oracle::compute_amax(x), DType::kE4M3);
      q = quantize_oracle::quantize_per_tensor(x, scale, DType::kE4M3, both,
                                               ScalingMode::kCurrentTensor);
      break;
    }
    case Recipe::kMxfp8:
      q = quantize_oracle::quantize_mxfp8(x, DType::kE4M3, both);
      break;
    case Recipe::kBlock1x128:
      q = quantize_oracle::quantize_block(x, ScalingMode::kBlock1x128, DType::kE4M3, both, true,
                                          0.0f);
      break;
    case Recipe::kBlock128x128:
      q = quantize_oracle::quantize_block(x, ScalingMode::kBlock128x128, DType::kE4M3, both, true,
                                          0.0f);
      break;
  }
  benchmark::DoNotOptimize(q.rowwise_data.raw_data());
}

void bm_quantize_old(benchmark::State& state, Recipe r) {
  const int64_t M = state.range(0);
  const int64_t K = state.range(1);
  const Tensor x = make_input(M, K, Device::cpu());
  for (auto _ : state) run_old_quantizer(r, x);
  state.SetBytesProcessed(state.iterations() * traffic_bytes(r, M, K));
}

void bm_quantize(benchmark::State& state, Recipe r, Device device) {
  const int64_t M = state.range(0);
  const int64_t K = state.range(1);
  const Tensor x = make_input(M, K, device);
  for (auto _ : state) {
    run_quantizer(r, x);
    synchronize_current();
  }
  state.SetBytesProcessed(state.iterations() * traffic_bytes(r, M, K));
}

void bm_device_copy(benchmark::State& state, Device device) {
  const int64_t M = state.range(0);
  const int64_t K = state.range(1);
  const Tensor x = make_input(M, K, device);
  Tensor y = Tensor::empty({M, K}, DType::kFloat32, device);
  for (auto _ : state) {
    y.copy_from(x);
    synchronize_current();
  }
  state.SetBytesProcessed(state.iterations() * 2 * x.nbytes().value);  // read + write
}

void register_all() {
  for (Recipe r : {Recipe::kCurrent, Recipe::kMxfp8, Recipe::kBlock1x128, Recipe::kBlock128x128}) {
    benchmark::RegisterBenchmark((std::string("quantize/cpu/") + recipe_name(r)).c_str(),
                                 bm_quantize, r, Device::cpu())
        ->Args({256, 256})
        ->Args({1024, 1024})
        ->Unit(benchmark::kMicrosecond);
    benchmark::RegisterBenchmark((std::string("quantize/cpu_old/") + recipe_name(r)).c_str(),
                                 bm_quantize_old, r)
        ->Args({256, 256})
        ->Args({1024, 1024})
        ->Unit(benchmark::kMicrosecond);
  }
  benchmark::RegisterBenchmark("copy/cpu/memcpy_fp32", bm_device_copy, Device::cpu())
      ->Args({256, 256})
      ->Args({1024, 1024})
      ->Unit(benchmark::kMicrosecond);
  if (!cuda_status().usable) return;
  const Device gpu = Device::cuda(0);
  for (Recipe r : {Recipe::kCurrent, Recipe::kMxfp8, Recipe::kBlock1x128, Recipe::kBlock128x128}) {
    benchmark::RegisterBenchmark((std::string("quantize/cuda/") + recipe_name(r)).c_str(),
                                 bm_quantize, r, gpu)
        ->Args({1024, 1024})
        ->Args({8192, 8192})
        ->Unit(benchmark::kMicrosecond)
        ->UseRealTime();
  }
  benchmark::RegisterBenchmark("copy/cuda/d2d_fp32", bm_device_copy, gpu)
      ->Args({1024, 1024})
      ->Args({8192, 8192})
      ->Unit(benchmark::kMicrosecond)
      ->UseRealTime();
}

}  // namespace
}  // namespace meshproof::kernels

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  meshproof::kernels::register_all();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
