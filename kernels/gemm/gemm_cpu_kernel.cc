// CPU GEMM micro-kernels and the packed product (docs/design.md section 21): the register-tiled
// micro-kernels (AVX2, and a portable 4-lane vector loop) that sum every element of a kMr x kNr
// tile of C in increasing k order, the process-wide choice between them, the K-blocked loop over
// the packed panels, the choice between the plain and the swapped plan, and gemm_cpu, which packs
// the operands (gemm_cpu_pack.cc), multiplies them and writes or accumulates the output. Every
// kernel, tile and plan gives the same bits (gemm.cc states the contract); the kernels library is
// compiled with -ffp-contract=off, so no multiply and add is ever fused into an FMA.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>

#include "kernels/core/formats.h"
#include "kernels/gemm/gemm_cpu_internal.h"
#include "kernels/gemm/gemm_internal.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace meshproof::kernels {

namespace {

using detail::kKc;
using detail::kMc;
using detail::kMr;
using detail::kNr;
using detail::StoredView;

// The micro-kernel's A operand: element (i, k) of the tile at p[i * is + k * ks]. A packed panel
// has is = 1, ks = kMr and zero rows past the matrix; an fp32 operand read in place (canonical,
// stored [n, K]) has is = K, ks = 1, and `rows` < kMr on its last tile: the rows past it read row
// rows - 1 instead (in bounds; their results are never stored).
struct ATile {
  const float* p;
  int64_t is, ks;
  int rows;
};

// c[kMr][kNr] (row stride ldc) = (load_c ? c : +0.0f) + sum over k < kc, in order, of
// a(i, k) * b[k * kNr + j]. kSwapped: the kernel computes C^T (its A operand is the GEMM's B and
// its B panel the GEMM's A), and every product is formed as b * a so that each one is still the
// GEMM's A element times its B element, operands in that order (which NaN an x86 multiply of two
// NaNs returns depends on the order, section 21). Portable kernel: GCC/Clang 4-lane vector
// extensions (SSE2 on any x86-64, NEON on aarch64), lane-wise IEEE multiply then add, the same
// order in every lane.
using V4 = float __attribute__((vector_size(16)));

V4 load4(const float* p) {
  V4 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
void store4(float* p, V4 v) { std::memcpy(p, &v, sizeof(v)); }

template <bool kSwapped>
void micro_kernel_portable(int64_t kc, const ATile& a, const float* b, float* c, int64_t ldc,
                           bool load_c) {
  constexpr int kV = kNr / 4;
  const float* ar[kMr];
  for (int i = 0; i < kMr; ++i) ar[i] = a.p + std::min(i, a.rows - 1) * a.is;
  V4 acc[kMr][kV];
  for (int i = 0; i < kMr; ++i)
    for (int v = 0; v < kV; ++v) acc[i][v] = load_c ? load4(c + i * ldc + 4 * v) : V4{};
  for (int64_t k = 0; k < kc; ++k) {
    V4 bv[kV];
    for (int v = 0; v < kV; ++v) bv[v] = load4(b + k * kNr + 4 * v);
    for (int i = 0; i < kMr; ++i) {
      const float ai = ar[i][k * a.ks];
      const V4 av = {ai, ai, ai, ai};
      for (int v = 0; v < kV; ++v) acc[i][v] = acc[i][v] + (kSwapped ? bv[v] * av : av * bv[v]);
    }
  }
  for (int i = 0; i < kMr; ++i)
    for (int v = 0; v < kV; ++v) store4(c + i * ldc + 4 * v, acc[i][v]);
}

#if defined(__x86_64__) || defined(__i386__)
#define MESHPROOF_GEMM_AVX2 1
// AVX2: 12 accumulators (6 rows x 2 vectors of 8) + 2 B vectors + 1 broadcast + 1 product = 16
// ymm registers. Explicit mul then add (the avx2 target has no FMA and the kernels are compiled
// with -ffp-contract=off, so nothing is fused).
template <bool kSwapped>
__attribute__((target("avx2"))) inline __m256 product(__m256 av, __m256 bv) {
  return kSwapped ? _mm256_mul_ps(bv, av) : _mm256_mul_ps(av, bv);
}

template <bool kSwapped>
__attribute__((target("avx2"))) void micro_kernel_avx2(int64_t kc, const ATile& a, const float* b,
                                                       float* c, int64_t ldc, bool load_c) {
  const float* a0 = a.p;
  const float* a1 = a.p + std::min(1, a.rows - 1) * a.is;
  const float* a2 = a.p + std::min(2, a.rows - 1) * a.is;
  const float* a3 = a.p + std::min(3, a.rows - 1) * a.is;
  const float* a4 = a.p + std::min(4, a.rows - 1) * a.is;
  const float* a5 = a.p + std::min(5, a.rows - 1) * a.is;
  const int64_t ks = a.ks;
  __m256 c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51;
  if (load_c) {
    c00 = _mm256_loadu_ps(c + 0 * ldc), c01 = _mm256_loadu_ps(c + 0 * ldc + 8);
    c10 = _mm256_loadu_ps(c + 1 * ldc), c11 = _mm256_loadu_ps(c + 1 * ldc + 8);
    c20 = _mm256_loadu_ps(c + 2 * ldc), c21 = _mm256_loadu_ps(c + 2 * ldc + 8);
    c30 = _mm256_loadu_ps(c + 3 * ldc), c31 = _mm256_loadu_ps(c + 3 * ldc + 8);
    c40 = _mm256_loadu_ps(c + 4 * ldc), c41 = _mm256_loadu_ps(c + 4 * ldc + 8);
    c50 = _mm256_loadu_ps(c + 5 * ldc), c51 = _mm256_loadu_ps(c + 5 * ldc + 8);
  } else {
    c00 = c01 = c10 = c11 = c20 = c21 = c30 = c31 = c40 = c41 = c50 = c51 = _mm256_setzero_ps();
  }
  for (int64_t k = 0, off = 0; k < kc; ++k, off += ks) {
    const __m256 b0 = _mm256_loadu_ps(b);
    const __m256 b1 = _mm256_loadu_ps(b + 8);
    __m256 av = _mm256_broadcast_ss(a0 + off);
    c00 = _mm256_add_ps(c00, product<kSwapped>(av, b0));
    c01 = _mm256_add_ps(c01, product<kSwapped>(av, b1));
    av = _mm256_broadcast_ss(a1 + off);
    c10 = _mm256_add_ps(c10, product<kSwapped>(av, b0));
    c11 = _mm256_add_ps(c11, product<kSwapped>(av, b1));
    av = _mm256_broadcast_ss(a2 + off);
    c20 = _mm256_add_ps(c20, product<kSwapped>(av, b0));
    c21 = _mm256_add_ps(c21, product<kSwapped>(av, b1));
    av = _mm256_broadcast_ss(a3 + off);
    c30 = _mm256_add_ps(c30, product<kSwapped>(av, b0));
    c31 = _mm256_add_ps(c31, product<kSwapped>(av, b1));
    av = _mm256_broadcast_ss(a4 + off);
    c40 = _mm256_add_ps(c40, product<kSwapped>(av, b0));
    c41 = _mm256_add_ps(c41, product<kSwapped>(av, b1));
    av = _mm256_broadcast_ss(a5 + off);
    c50 = _mm256_add_ps(c50, product<kSwapped>(av, b0));
    c51 = _mm256_add_ps(c51, product<kSwapped>(av, b1));
    b += kNr;
  }
  _mm256_storeu_ps(c + 0 * ldc, c00), _mm256_storeu_ps(c + 0 * ldc + 8, c01);
  _mm256_storeu_ps(c + 1 * ldc, c10), _mm256_storeu_ps(c + 1 * ldc + 8, c11);
  _mm256_storeu_ps(c + 2 * ldc, c20), _mm256_storeu_ps(c + 2 * ldc + 8, c21);
  _mm256_storeu_ps(c + 3 * ldc, c30), _mm256_storeu_ps(c + 3 * ldc + 8, c31);
  _mm256_storeu_ps(c + 4 * ldc, c40), _mm256_storeu_ps(c + 4 * ldc + 8, c41);
  _mm256_storeu_ps(c + 5 * ldc, c50), _mm256_storeu_ps(c + 5 * ldc + 8, c51);
}
#else
#define MESHPROOF_GEMM_AVX2 0
#endif

using MicroKernel = void (*)(int64_t, const ATile&, const float*, float*, int64_t, bool);

std::atomic<detail::CpuGemmKernel> g_forced_kernel{detail::CpuGemmKernel::kAuto};

bool gemm_cpu_has_avx2() {
#if MESHPROOF_GEMM_AVX2
  static const bool has = __builtin_cpu_supports("avx2");
  return has;
#else
  return false;
#endif
}

MicroKernel select_kernel(bool swapped) {
  const detail::CpuGemmKernel k = detail::cpu_gemm_kernel();
#if MESHPROOF_GEMM_AVX2
  if (k == detail::CpuGemmKernel::kAvx2)
    return swapped ? micro_kernel_avx2<true> : micro_kernel_avx2<false>;
#endif
  (void)k;
  return swapped ? micro_kernel_portable<true> : micro_kernel_portable<false>;
}

// The A operand of gemm_packed: packed kMr-row panels (pack_panels), or an fp32 matrix read in
// place, stored [R, K] (canonical) or [K, R] (k_major: the transposed weight of a dgrad).
struct ASource {
  const float* data;
  bool panels;
  bool k_major = false;
  ATile tile(int64_t ip, int64_t k0, int64_t R, int64_t K) const {
    if (panels) return {data + ip * K * kMr + k0 * kMr, 1, kMr, kMr};
    const int64_t i0 = ip * kMr;
    const int rows = static_cast<int>(std::min<int64_t>(kMr, R - i0));
    if (k_major) return {data + k0 * R + i0, 1, R, rows};
    return {data + i0 * K + k0, K, 1, rows};
  }
};

// c[R, S] (row stride S) = A · B^T from A (panels or in place) and B's packed panels, every
// element summed in k order. `swapped`: A and B are the GEMM's B and A (c is C^T).
void gemm_packed(const ASource& a, const float* bpack, float* c, int64_t R, int64_t S, int64_t K,
                 bool swapped) {
  if (K == 0) {  // an empty sum is +0
    std::fill_n(c, R * S, 0.0f);
    return;
  }
  const MicroKernel kernel = select_kernel(swapped);
  const int64_t a_panels = (R + kMr - 1) / kMr;
  const int64_t b_panels = (S + kNr - 1) / kNr;
  float edge[kMr * kNr];
  for (int64_t k0 = 0; k0 < K; k0 += kKc) {
    const int64_t kc = std::min(kKc, K - k0);
    const bool load_c = k0 > 0;
    for (int64_t ib = 0; ib < a_panels; ib += kMc / kMr) {
      const int64_t ie = std::min(a_panels, ib + kMc / kMr);
      for (int64_t jp = 0; jp < b_panels; ++jp) {
        const float* bp = bpack + jp * K * kNr + k0 * kNr;
        const int64_t j0 = jp * kNr;
        const int64_t cols = std::min<int64_t>(kNr, S - j0);
        for (int64_t ip = ib; ip < ie; ++ip) {
          const ATile at = a.tile(ip, k0, R, K);
          const int64_t i0 = ip * kMr;
          const int64_t rows = std::min<int64_t>(kMr, R - i0);
          float* ct = c + i0 * S + j0;
          if (rows == kMr && cols == kNr) {
            kernel(kc, at, bp, ct, S, load_c);
            continue;
          }
          // Edge tile: through a full-size local tile; only the valid part is read and written.
          if (load_c)
            for (int64_t i = 0; i < rows; ++i) std::memcpy(edge + i * kNr, ct + i * S, cols * 4);
          kernel(kc, at, bp, edge, kNr, load_c);
          for (int64_t i = 0; i < rows; ++i) std::memcpy(ct + i * S, edge + i * kNr, cols * 4);
        }
      }
    }
  }
}

// Packing costs about one pass over the packed matrix, so with few rows of A (a virtual rank's
// share of the batch) packing B, the whole weight, costs more than the product. Two plans, the
// same bits (every element is the same k-ordered sum of the same A x B products):
//  - plain: the kernel's A is the GEMM's A (read in place when it is a canonical fp32 matrix,
//    packed otherwise) and its B panels are the GEMM's B, packed;
//  - swapped: C^T = B · A^T; the kernel reads the GEMM's B in place (an fp32 matrix, stored
//    canonical or transposed: a dgrad's weight), packs the GEMM's A into B panels, and C^T is
//    transposed into the output.
// The cheaper one by elements moved runs: packing a matrix, transposing C^T, and streaming B
// again for every kNr rows of A beyond the first in the swapped plan (its kernel walks the whole
// of B, read in place, once per packed panel of A; the plain plan streams its packed B once per
// kMc rows of A). Without that last term the swapped plan also ran at 32-128
// rows, where the whole 8-rank run took 2-5% more CPU than with the plain plan (`perf stat`
// task-clock, dp_shard 8 at hidden 128 and 256, two interleaved repetitions each, 2026-11-25; at
// hidden 64 the two were within noise); with it, it runs at 16 rows or fewer. The plain plan reads
// only a canonical A in place: a transposed A (a wgrad's output gradient) is packed, so that the
// kernel's A reads stay contiguous where A is large.
bool in_place(const StoredView& v) { return v.kind == StoredView::Kind::kF32 && v.canonical; }
bool in_place_swapped(const StoredView& v) { return v.kind == StoredView::Kind::kF32; }

bool swap_operands(const StoredView& a, const StoredView& b, int64_t R, int64_t S, int64_t K) {
  if (!in_place_swapped(b)) return false;
  const int64_t plain = (in_place(a) ? 0 : R * K) + S * K;
  const int64_t restreams = (R + kNr - 1) / kNr - 1;
  const int64_t swapped = R * K + R * S + restreams * S * K;
  return swapped < plain;
}

// Per-thread scratch reused across calls (virtual ranks are threads): no malloc, page faults or
// zeroing per GEMM. Buffers above kKeepFloats are released after the call.
class GemmScratch {
 public:
  float* get(size_t n) {
    if (n > cap_) {
      buf_.reset(new float[n]);
      cap_ = n;
    }
    return buf_.get();
  }
  void trim() {
    if (cap_ > kKeepFloats) {
      buf_.reset();
      cap_ = 0;
    }
  }

 private:
  static constexpr size_t kKeepFloats = size_t{8} << 20;  // 32 MiB
  std::unique_ptr<float[]> buf_;
  size_t cap_ = 0;
};

}  // namespace

namespace detail {

bool cpu_gemm_kernel_available(CpuGemmKernel k) {
  return k != CpuGemmKernel::kAvx2 || gemm_cpu_has_avx2();
}

void set_cpu_gemm_kernel(CpuGemmKernel k) {
  MP_CHECK_INPUT(cpu_gemm_kernel_available(k), "gemm: this CPU has no AVX2 for the AVX2 kernel");
  g_forced_kernel.store(k);
}

CpuGemmKernel cpu_gemm_kernel() {
  const CpuGemmKernel k = g_forced_kernel.load();
  if (k != CpuGemmKernel::kAuto) return k;
  return gemm_cpu_has_avx2() ? CpuGemmKernel::kAvx2 : CpuGemmKernel::kPortable;
}

void gemm_cpu(const GemmProblem& p, Tensor& out, const GemmOptions& options) {
  const int64_t R = p.r, S = p.s, K = p.k;
  thread_local GemmScratch a_buf, b_buf, c_buf, row_buf;
  const StoredView av = stored_view(p.a);
  const StoredView bv = stored_view(p.b);
  const bool swap = swap_operands(av, bv, R, S, K);
  const bool avx2 = detail::cpu_gemm_kernel() == detail::CpuGemmKernel::kAvx2;
  // The kernel's operands: x (its A, xr rows) and y (its B panels, yr rows).
  const StoredView& x = swap ? bv : av;
  const StoredView& y = swap ? av : bv;
  const int64_t xr = swap ? S : R, yr = swap ? R : S;
  // Room for kNr decoded rows (pack_panels of a canonical operand decodes a panel's rows at once).
  float* row = row_buf.get(static_cast<size_t>(kNr * std::max({av.cols, bv.cols, int64_t{1}})));
  ASource asrc{static_cast<const float*>(x.data), true};
  if (swap || in_place(x)) {  // swapped: x is the GEMM's fp32 B (swap_operands)
    asrc.panels = false;
    asrc.k_major = !x.canonical;
  } else {
    float* apack = a_buf.get(static_cast<size_t>((xr + kMr - 1) / kMr * kMr * K + 1));
    pack_panels(x, xr, K, kMr, apack, row, avx2);
    asrc.data = apack;
  }
  float* bpack = b_buf.get(static_cast<size_t>((yr + kNr - 1) / kNr * kNr * K + 1));
  pack_panels(y, yr, K, kNr, bpack, row, avx2);
  const size_t n = static_cast<size_t>(R * S);
  const bool direct = !swap && out.dtype() == DType::kFloat32 && !options.accumulate;
  float* c = direct ? out.data<float>() : c_buf.get(n);  // [R, S], or C^T [S, R] when swapped
  gemm_packed(asrc, bpack, c, xr, yr, K, swap);
  // Element (i, j) of C, row by row.
  const auto for_each_c = [&](auto&& f) {
    if (!swap) {
      for (size_t i = 0; i < n; ++i) f(i, c[i]);
      return;
    }
    for (int64_t i = 0; i < R; ++i)
      for (int64_t j = 0; j < S; ++j) f(static_cast<size_t>(i * S + j), c[j * R + i]);
  };
  if (out.dtype() == DType::kFloat32) {
    float* o = out.data<float>();
    if (options.accumulate) {
      for_each_c([o](size_t i, float v) { o[i] += v; });
    } else if (!direct) {
      for_each_c([o](size_t i, float v) { o[i] = v; });
    }
  } else {
    auto* o = static_cast<uint16_t*>(out.raw_data());
    // round to nearest even
    for_each_c([o](size_t i, float v) { o[i] = fmt8::float_to_bf16(v); });
  }
  for (GemmScratch* s : {&a_buf, &b_buf, &c_buf, &row_buf}) s->trim();
}

}  // namespace detail

}  // namespace meshproof::kernels
