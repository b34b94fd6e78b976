// The row functions of the MoE router (kernels/moe/moe_route.h), __host__ __device__ so that the
// CPU reference (moe_route.cc) and the CUDA kernels (moe_route.cu) run the same code. No tensor
// types: included by the .cu file. On the device every double product and sum that the CPU
// evaluates as a separate rounded operation is written with the explicit __dmul_rn / __dadd_rn /
// __dsub_rn / __ddiv_rn intrinsics (mp_mul and friends), so nvcc cannot contract a * b + c into an
// FMA that the host (compiled with -ffp-contract=off) does not do.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define MP_MOE_HD __host__ __device__
#else
#define MP_MOE_HD
#endif

namespace meshproof::kernels::moe_row {

MP_MOE_HD inline double mp_mul(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
MP_MOE_HD inline double mp_add(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}
MP_MOE_HD inline double mp_sub(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dsub_rn(a, b);
#else
  return a - b;
#endif
}
MP_MOE_HD inline double mp_div(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __ddiv_rn(a, b);
#else
  return a / b;
#endif
}
// exp in double: glibc's on the host, CUDA's on the device (both within about 1 ulp of double,
// not always the same bits: the one difference between the backends, docs/design.md section 37).
MP_MOE_HD inline double mp_exp(double x) {
#if defined(__CUDA_ARCH__)
  return ::exp(x);
#else
  return std::exp(x);
#endif
}

// Rounded once to float (fp32 router), or kept in double (the CPU backend's float64 mode).
MP_MOE_HD inline double round_prob(double v, bool f64) {
  return f64 ? v : static_cast<double>(static_cast<float>(v));
}

// One token's routing. `l` [E] the logits (as doubles, exact), `p` [E] receives the
// probabilities (softmax: exp(l_e - max) / sum_e exp(l_e - max), the sum in expert order; sigmoid:
// 1 / (1 + exp(-l_e)); each rounded by round_prob), `ex` [k] the chosen experts by descending
// probability, equal probabilities to the lower expert index (the first k of a stable sort by
// descending probability: pick by pick, the highest remaining probability, the lowest index among
// equals), `w` [k] the combine weights p_ex[j] / sum over the chosen (in pick order), rounded by
// round_prob. The max is the first of the largest, as std::max_element finds it.
template <typename L>
MP_MOE_HD inline void route_row(const L* l, int64_t experts, int64_t top_k, bool sigmoid, bool f64,
                                double* p, int32_t* ex, double* w) {
  if (sigmoid) {
    for (int64_t e = 0; e < experts; ++e)
      p[e] = round_prob(mp_div(1.0, mp_add(1.0, mp_exp(-static_cast<double>(l[e])))), f64);
  } else {
    double mx = static_cast<double>(l[0]);
    for (int64_t e = 1; e < experts; ++e)
      if (mx < static_cast<double>(l[e])) mx = static_cast<double>(l[e]);
    double sum = 0;
    for (int64_t e = 0; e < experts; ++e)
      sum = mp_add(sum, mp_exp(mp_sub(static_cast<double>(l[e]), mx)));
    for (int64_t e = 0; e < experts; ++e)
      p[e] = round_prob(mp_div(mp_exp(mp_sub(static_cast<double>(l[e]), mx)), sum), f64);
  }
  double chosen = 0;
  for (int64_t j = 0; j < top_k; ++j) {
    int64_t best = -1;
    for (int64_t e = 0; e < experts; ++e) {
      bool taken = false;
      for (int64_t i = 0; i < j; ++i) taken = taken || ex[i] == e;
      if (!taken && (best < 0 || p[e] > p[best])) best = e;
    }
    ex[j] = static_cast<int32_t>(best);
    chosen = mp_add(chosen, p[best]);
  }
  for (int64_t j = 0; j < top_k; ++j) w[j] = round_prob(mp_div(p[ex[j]], chosen), f64);
}

// One token's d(objective)/d(logits) `o` [E] (in double) from its probabilities `p` [E], choices
// `ex` [k], weights `w` [k], d/d(weight) `dw` [k] and the per-expert term `aux` [E] (the
// load-balancing loss's, added to d/d(probs); nullptr: zero). With S the sum of the chosen
// probabilities and w_j = p_j / S: dL/dp_e = aux_e + sum over j with ex_j = e of
// (dw_j - sum_i dw_i w_i) / S; softmax: o_e = p_e (dp_e - sum_e p_e dp_e); sigmoid:
// o_e = dp_e p_e (1 - p_e). `o` holds dp first, then the result.
MP_MOE_HD inline void route_backward_row(const double* p, const int32_t* ex, const double* w,
                                         const double* dw, const double* aux, int64_t experts,
                                         int64_t top_k, bool sigmoid, double* o) {
  double chosen = 0, dot = 0;
  for (int64_t j = 0; j < top_k; ++j) {
    chosen = mp_add(chosen, p[ex[j]]);
    dot = mp_add(dot, mp_mul(dw[j], w[j]));
  }
  for (int64_t e = 0; e < experts; ++e) o[e] = aux != nullptr ? aux[e] : 0.0;
  for (int64_t j = 0; j < top_k; ++j)
    o[ex[j]] = mp_add(o[ex[j]], mp_div(mp_sub(dw[j], dot), chosen));
  if (sigmoid) {
    for (int64_t e = 0; e < experts; ++e) o[e] = mp_mul(mp_mul(o[e], p[e]), mp_sub(1.0, p[e]));
  } else {
    double s = 0;
    for (int64_t e = 0; e < experts; ++e) s = mp_add(s, mp_mul(p[e], o[e]));
    for (int64_t e = 0; e < experts; ++e) o[e] = mp_mul(p[e], mp_sub(o[e], s));
  }
}

// The rows of one expert's block in a dispatch: `rows` routed pairs padded up to a multiple of
// `align`; an expert without pairs gets no block, or one block of `align` zero rows with
// keep_empty (the quantized recipes, engine/moe/moe.h).
MP_MOE_HD inline int64_t padded_block(int64_t rows, int64_t align, bool keep_empty) {
  const int64_t n = rows > 0 ? rows : (keep_empty ? 1 : 0);
  return (n + align - 1) / align * align;
}

}  // namespace meshproof::kernels::moe_row
