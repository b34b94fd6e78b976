#include "kernels/attention/attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "kernels/gemm/gemm_internal.h"
#include "kernels/ops/op_util.h"

namespace meshproof::kernels {

void detail::check_attention_operand(std::string_view op, const Tensor& qkv,
                                     const AttentionShape& s) {
  MP_CHECK(s.batch > 0 && s.seq > 0 && s.heads > 0 && s.head_dim > 0 && s.kv_heads >= 0,
           "{}: bad shape B={} S={} A={} d={} KV={}", op, s.batch, s.seq, s.heads, s.head_dim,
           s.kv_heads);
  MP_CHECK(s.heads % s.kv() == 0, "{}: KV={} does not divide A={}", op, s.kv(), s.heads);
  detail::check_operand(qkv, op, "qkv", s.batch * s.seq * s.qkv_width());
  detail::check_float(qkv, op, "qkv");
}

namespace {

// The CUDA kernels keep one row of S doubles (plus a few static bytes) in shared memory (48 KiB
// without opt-in) and launch one block per (batch, head, row).
constexpr int64_t kCudaMaxSeq = 6000;

void check_cuda_shape(std::string_view op, const AttentionShape& s) {
  MP_CHECK(s.seq <= kCudaMaxSeq, "{}: the CUDA attention supports S <= {}, got S={}", op,
           kCudaMaxSeq, s.seq);
  MP_CHECK(s.batch * s.heads * s.seq < (int64_t{1} << 31), "{}: B*A*S={} blocks exceed the grid",
           op, s.batch * s.heads * s.seq);
}

// Column offsets of query head a in a qkv row (the grouped layout of attention.h).
struct HeadCols {
  int64_t q, k, v;
};
HeadCols head_cols(const AttentionShape& s, int64_t a) {
  const int64_t r = s.heads / s.kv(), d = s.head_dim, base = (a / r) * (r + 2) * d;
  return {base + (a % r) * d, base + r * d, base + (r + 1) * d};
}

// ---- CPU: the attention's sums as tiled row products (docs/design.md section 21) ----
//
// Every sum of the attention is a row of a small matrix product in double: scores q·k over the
// head dimension, outputs p·v over keys, and in the backward dp = do·v, dv += pᵀ·do, dq = ds·k,
// dk += dsᵀ·q. Each output element is summed term by term in the order of the element-wise loops
// (tests/kernels/attention/attention_oracle.h), each product rounded to double and then added
// (never fused: the kernels library is compiled with -ffp-contract=off and the avx2 target has no
// FMA); the tiles only decide which elements are computed side by side, so the bits are the
// oracle's.

using V4d = double __attribute__((vector_size(32)));
constexpr int64_t kTileRows = 4;  // rows of C per tile
constexpr int64_t kTileCols = 8;  // columns of C per tile: two 4-lane vectors

int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// Which inner terms t row r of C sums: all of [0, terms), its causal prefix [0, r + 1) or its
// suffix [r, terms).
enum class Terms : uint8_t { kAll, kPrefix, kSuffix };

// C[r][c] (r < rows, c < n) = (accumulate ? C[r][c] : +0.0) + sum over row r's terms t, in
// increasing t, of A(r, t) * B[t][c]. A(r, t) is a[r * lda + t], or a[t * lda + r] when
// a_transposed. B and C rows hold at least round_up(n, kTileCols) doubles (B's padding finite,
// C's overwritten). causal_cols: row r needs only its columns c <= r (a tile computes up to its
// last row's).
struct RowProduct {
  const double* a = nullptr;
  int64_t lda = 0;
  bool a_transposed = false;
  const double* b = nullptr;
  int64_t ldb = 0;
  double* c = nullptr;
  int64_t ldc = 0;
  int64_t rows = 0, terms = 0, n = 0;
  Terms which = Terms::kAll;
  bool causal_cols = false;
  bool accumulate = false;
};

#define MP_INLINE __attribute__((always_inline)) inline

// Vectors pass by reference: a 32-byte vector argument or return value has a different ABI with and
// without AVX (-Wpsabi).
MP_INLINE void load4d(V4d& v, const double* p) { std::memcpy(&v, p, sizeof(v)); }
MP_INLINE void store4d(double* p, const V4d& v) { std::memcpy(p, &v, sizeof(v)); }

// One tile: rows r0 .. r0 + R - 1, columns c0 .. c0 + 7. Each row takes its own terms in order:
// the ones before the rows' common range alone, the common range with the whole tile (one B load
// for R rows), the ones after alone.
template <int R, bool kAT>
MP_INLINE void row_product_tile(const RowProduct& p, int64_t r0, int64_t c0) {
  V4d acc[R][2];
  for (int i = 0; i < R; ++i) {
    if (p.accumulate) {
      load4d(acc[i][0], p.c + (r0 + i) * p.ldc + c0);
      load4d(acc[i][1], p.c + (r0 + i) * p.ldc + c0 + 4);
    } else {
      acc[i][0] = V4d{};
      acc[i][1] = V4d{};
    }
  }
  int64_t tb[R], te[R];
  int64_t common_b = 0, common_e = p.terms;
  for (int i = 0; i < R; ++i) {
    const int64_t r = r0 + i;
    tb[i] = p.which == Terms::kSuffix ? r : 0;
    te[i] = p.which == Terms::kPrefix ? std::min(r + 1, p.terms) : p.terms;
    common_b = std::max(common_b, tb[i]);
    common_e = std::min(common_e, te[i]);
  }
  if (common_b >= common_e) common_b = common_e = 0;  // no common range: each row alone
  const double* b = p.b + c0;
  const int64_t lda = p.lda, ldb = p.ldb;
  for (int i = 0; i < R; ++i) {  // row i's terms before the common range
    const int64_t r = r0 + i, end = common_e > common_b ? common_b : te[i];
    for (int64_t t = tb[i]; t < end; ++t) {
      const double x = kAT ? p.a[t * lda + r] : p.a[r * lda + t];
      const V4d av = {x, x, x, x};
      V4d b0, b1;
      load4d(b0, b + t * ldb);
      load4d(b1, b + t * ldb + 4);
      acc[i][0] = acc[i][0] + av * b0;
      acc[i][1] = acc[i][1] + av * b1;
    }
  }
  for (int64_t t = common_b; t < common_e; ++t) {
    V4d b0, b1;
    load4d(b0, b + t * ldb);
    load4d(b1, b + t * ldb + 4);
    for (int i = 0; i < R; ++i) {
      const int64_t r = r0 + i;
      const double x = kAT ? p.a[t * lda + r] : p.a[r * lda + t];
      const V4d av = {x, x, x, x};
      acc[i][0] = acc[i][0] + av * b0;
      acc[i][1] = acc[i][1] + av * b1;
    }
  }
  if (common_e > common_b) {
    for (int i = 0; i < R; ++i) {  // row i's terms after the common range
      const int64_t r = r0 + i;
      for (int64_t t = common_e; t < te[i]; ++t) {
        const double x = kAT ? p.a[t * lda + r] : p.a[r * lda + t];
        const V4d av = {x, x, x, x};
        V4d b0, b1;
        load4d(b0, b + t * ldb);
        load4d(b1, b + t * ldb + 4);
        acc[i][0] = acc[i][0] + av * b0;
        acc[i][1] = acc[i][1] + av * b1;
      }
    }
  }
  for (int i = 0; i < R; ++i) {
    store4d(p.c + (r0 + i) * p.ldc + c0, acc[i][0]);
    store4d(p.c + (r0 + i) * p.ldc + c0 + 4, acc[i][1]);
  }
}

template <bool kAT>
MP_INLINE void row_product_body(const RowProduct& p) {
  for (int64_t r0 = 0; r0 < p.rows; r0 += kTileRows) {
    const int64_t nr = std::min(kTileRows, p.rows - r0);
    const int64_t n = p.causal_cols ? std::min(p.n, r0 + nr) : p.n;
    for (int64_t c0 = 0; c0 < n; c0 += kTileCols) {
      switch (nr) {
        case 4:
          row_product_tile<4, kAT>(p, r0, c0);
          break;
        case 3:
          row_product_tile<3, kAT>(p, r0, c0);
          break;
        case 2:
          row_product_tile<2, kAT>(p, r0, c0);
          break;
        default:
          row_product_tile<1, kAT>(p, r0, c0);
          break;
      }
    }
  }
}

// The same source compiled twice: for AVX2 (one ymm register per 4-lane vector) when the CPU has
// it, else for the base ISA (SSE2 on x86-64: two xmm operations per vector). The choice follows
// the GEMM's (detail::set_cpu_gemm_kernel), so the tests run both.
void row_product_portable(const RowProduct& p) {
  p.a_transposed ? row_product_body<true>(p) : row_product_body<false>(p);
}
#if defined(__x86_64__) || defined(__i386__)
__attribute__((target("avx2"))) void row_product_avx2(const RowProduct& p) {
  p.a_transposed ? row_product_body<true>(p) : row_product_body<false>(p);
}
#endif
#undef MP_INLINE

void row_product(const RowProduct& p) {
#if defined(__x86_64__) || defined(__i386__)
  if (detail::cpu_gemm_kernel() == detail::CpuGemmKernel::kAvx2) return row_product_avx2(p);
#endif
  row_product_portable(p);
}

// Per-thread scratch (virtual ranks are threads): doubles kept across calls, so a step allocates,
// zeroes and frees nothing; a buffer above 32 MiB is released when the call ends.
class Scratch {
 public:
  double* get(size_t n) {
    if (n > cap_) {
      buf_ = std::make_unique<double[]>(n);
      cap_ = n;
    }
    return buf_.get();
  }
  void trim() {
    if (cap_ > kKeepDoubles) {
      buf_.reset();
      cap_ = 0;
    }
  }

 private:
  static constexpr size_t kKeepDoubles = size_t{4} << 20;  // 32 MiB
  std::unique_ptr<double[]> buf_;
  size_t cap_ = 0;
};

struct AttentionScratch {
  Scratch buf[9];
  void trim() {
    for (Scratch& s : buf) s.trim();
  }
};

AttentionScratch& attention_scratch() {
  thread_local AttentionScratch s;
  return s;
}

// dst[t * ld + c] = src row t's `d` columns (row stride w) as double, columns [d, ld) zero.
template <typename T>
void pack_rows(const T* src, int64_t w, int64_t rows, int64_t d, double* dst, int64_t ld) {
  for (int64_t t = 0; t < rows; ++t) {
    const T* s = src + t * w;
    double* o = dst + t * ld;
    for (int64_t c = 0; c < d; ++c) o[c] = static_cast<double>(s[c]);
    for (int64_t c = d; c < ld; ++c) o[c] = 0.0;
  }
}

// dst[c * ld + t] = src row t's column c as double (t < rows), columns [rows, ld) zero.
template <typename T>
void pack_transposed(const T* src, int64_t w, int64_t rows, int64_t d, double* dst, int64_t ld) {
  for (int64_t c = 0; c < d; ++c) {
    double* o = dst + c * ld;
    for (int64_t t = 0; t < rows; ++t) o[t] = static_cast<double>(src[t * w + c]);
    for (int64_t t = rows; t < ld; ++t) o[t] = 0.0;
  }
}

template <typename T>
void attention_forward_cpu(const T* in, const AttentionShape& s, T* o, T* p) {
  const int64_t b_n = s.batch, seq = s.seq, a_n = s.heads, d = s.head_dim, h = a_n * d;
  const int64_t w = s.qkv_width(), kv = s.kv(), r = a_n / kv;
  const int64_t seqp = round_up(seq, kTileCols), dp = round_up(d, kTileCols);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  AttentionScratch& sc = attention_scratch();
  double* kt = sc.buf[0].get(d * seqp);     // k transposed [d, seqp]
  double* vd = sc.buf[1].get(seq * dp);     // v [seq, dp]
  double* qd = sc.buf[2].get(seq * d);      // q [seq, d]
  double* row = sc.buf[3].get(seq * seqp);  // scores, then the rounded probabilities [seq, seqp]
  double* od = sc.buf[4].get(seq * dp);     // out [seq, dp]
  for (int64_t b = 0; b < b_n; ++b) {
    const T* x = in + b * seq * w;
    for (int64_t g = 0; g < kv; ++g) {
      const HeadCols group = head_cols(s, g * r);
      pack_transposed(x + group.k, w, seq, d, kt, seqp);
      pack_rows(x + group.v, w, seq, d, vd, dp);
      for (int64_t a = g * r; a < (g + 1) * r; ++a) {
        pack_rows(x + head_cols(s, a).q, w, seq, d, qd, d);
        // scores: row[i][j] = sum_c q[i][c] k[j][c] (c in order), j <= i.
        row_product({.a = qd,
                     .lda = d,
                     .b = kt,
                     .ldb = seqp,
                     .c = row,
                     .ldc = seqp,
                     .rows = seq,
                     .terms = d,
                     .n = seq,
                     .which = Terms::kAll,
                     .causal_cols = true});
        for (int64_t i = 0; i < seq; ++i) {
          double* ri = row + i * seqp;
          double mx = -INFINITY;
          for (int64_t j = 0; j <= i; ++j) {
            ri[j] = ri[j] * scale;
            mx = std::max(mx, ri[j]);
          }
          double sum = 0;
          for (int64_t j = 0; j <= i; ++j) {
            ri[j] = std::exp(ri[j] - mx);
            sum += ri[j];
          }
          T* pr = p + ((b * a_n + a) * seq + i) * seq;
          for (int64_t j = 0; j <= i; ++j) {
            pr[j] = static_cast<T>(ri[j] / sum);
            ri[j] = static_cast<double>(pr[j]);  // the stored (rounded) probability
          }
          for (int64_t j = i + 1; j < seq; ++j) pr[j] = T(0);
        }
        // out[i][c] = sum_{j <= i} p[i][j] v[j][c] (j in order).
        row_product({.a = row,
                     .lda = seqp,
                     .b = vd,
                     .ldb = dp,
                     .c = od,
                     .ldc = dp,
                     .rows = seq,
                     .terms = seq,
                     .n = d,
                     .which = Terms::kPrefix});
        for (int64_t i = 0; i < seq; ++i) {
          T* orow = o + (b * seq + i) * h + a * d;
          for (int64_t c = 0; c < d; ++c) orow[c] = static_cast<T>(od[i * dp + c]);
        }
      }
    }
  }
  sc.trim();
}

// With P the probabilities and dO the output gradient, per (b, head): dP = dO·Vᵀ, then per query
// row dS = P ∘ (dP - rowsum(P ∘ dP)) · scale, dV += Pᵀ·dO, dQ = dS·K, dK += dSᵀ·Q. A group's dv and
// dk sum over its heads in head order, then over query rows: the accumulating products add one
// head's terms (rows in order) to the sums of the heads before it.
template <typename T>
void attention_backward_cpu(const T* dop, const T* in, const T* p, const AttentionShape& s, T* dg) {
  const int64_t b_n = s.batch, seq = s.seq, a_n = s.heads, d = s.head_dim, h = a_n * d;
  const int64_t w = s.qkv_width(), kv = s.kv(), r = a_n / kv;
  const int64_t seqp = round_up(seq, kTileCols), dp = round_up(d, kTileCols);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  AttentionScratch& sc = attention_scratch();
  double* kd = sc.buf[0].get(seq * dp);    // k [seq, dp]
  double* vt = sc.buf[1].get(d * seqp);    // v transposed [d, seqp]
  double* qd = sc.buf[2].get(seq * dp);    // q [seq, dp]
  double* dod = sc.buf[3].get(seq * dp);   // dout [seq, dp]
  double* pd = sc.buf[4].get(seq * seqp);  // probabilities [seq, seqp]
  double* ds = sc.buf[5].get(seq * seqp);  // dP, then dS [seq, seqp]
  double* dq = sc.buf[6].get(seq * dp);    // [seq, dp]
  double* dk = sc.buf[7].get(seq * dp);    // [seq, dp]
  double* dv = sc.buf[8].get(seq * dp);    // [seq, dp]
  for (int64_t b = 0; b < b_n; ++b) {
    const T* x = in + b * seq * w;
    for (int64_t g = 0; g < kv; ++g) {
      const HeadCols group = head_cols(s, g * r);
      pack_rows(x + group.k, w, seq, d, kd, dp);
      pack_transposed(x + group.v, w, seq, d, vt, seqp);
      std::fill_n(dk, seq * dp, 0.0);
      std::fill_n(dv, seq * dp, 0.0);
      for (int64_t a = g * r; a < (g + 1) * r; ++a) {
        const int64_t q_col = head_cols(s, a).q;
        pack_rows(x + q_col, w, seq, d, qd, dp);
        pack_rows(dop + b * seq * h + a * d, h, seq, d, dod, dp);
        // dP[i][j] = sum_c do[i][c] v[j][c] (c in order), j <= i.
        row_product({.a = dod,
                     .lda = dp,
                     .b = vt,
                     .ldb = seqp,
                     .c = ds,
                     .ldc = seqp,
                     .rows = seq,
                     .terms = d,
                     .n = seq,
                     .which = Terms::kAll,
                     .causal_cols = true});
        for (int64_t i = 0; i < seq; ++i) {
          const T* pr = p + ((b * a_n + a) * seq + i) * seq;
          double* di = ds + i * seqp;
          double* pi = pd + i * seqp;
          double dot_pdp = 0;
          for (int64_t j = 0; j <= i; ++j) {
            pi[j] = static_cast<double>(pr[j]);
            dot_pdp += pi[j] * di[j];
          }
          for (int64_t j = 0; j <= i; ++j) di[j] = pi[j] * (di[j] - dot_pdp) * scale;
        }
        // dv[j][c] += sum_{i >= j} p[i][j] do[i][c] (i in order).
        row_product({.a = pd,
                     .lda = seqp,
                     .a_transposed = true,
                     .b = dod,
                     .ldb = dp,
                     .c = dv,
                     .ldc = dp,
                     .rows = seq,
                     .terms = seq,
                     .n = d,
                     .which = Terms::kSuffix,
                     .accumulate = true});
        // dq[i][c] = sum_{j <= i} ds[i][j] k[j][c] (j in order).
        row_product({.a = ds,
                     .lda = seqp,
                     .b = kd,
                     .ldb = dp,
                     .c = dq,
                     .ldc = dp,
                     .rows = seq,
                     .terms = seq,
                     .n = d,
                     .which = Terms::kPrefix});
        // dk[j][c] += sum_{i >= j} ds[i][j] q[i][c] (i in order).
        row_product({.a = ds,
                     .lda = seqp,
                     .a_transposed = true,
                     .b = qd,
                     .ldb = dp,
                     .c = dk,
                     .ldc = dp,
                     .rows = seq,
                     .terms = seq,
                     .n = d,
                     .which = Terms::kSuffix,
                     .accumulate = true});
        for (int64_t i = 0; i < seq; ++i) {
          T* row = dg + (b * seq + i) * w;
          for (int64_t c = 0; c < d; ++c) row[q_col + c] = static_cast<T>(dq[i * dp + c]);
        }
      }
      for (int64_t i = 0; i < seq; ++i) {
        T* row = dg + (b * seq + i) * w;
        for (int64_t c = 0; c < d; ++c) {
          row[group.k + c] = static_cast<T>(dk[i * dp + c]);
          row[group.v + c] = static_cast<T>(dv[i * dp + c]);
        }
      }
    }
  }
  sc.trim();
}

}  // namespace

void attention_forward(const Tensor& qkv, const AttentionShape& s, Tensor& out, Tensor& probs) {
  constexpr std::string_view op = "attention_forward";
  detail::check_attention_operand(op, qkv, s);
  const int64_t b_n = s.batch, seq = s.seq, a_n = s.heads, h = a_n * s.head_dim;
  detail::check_operand(out, op, "out", b_n * seq * h);
  detail::check_operand(probs, op, "probs", b_n * a_n * seq * seq);
  detail::check_same_dtype(qkv, out, op);
  detail::check_same_dtype(qkv, probs, op);
  if (detail::on_cuda(op, {&qkv, &out, &probs})) {
    check_cuda_shape(op, s);
    MP_OP_CUDA(op,
               launch_attention_forward(qkv.raw_data(), qkv.dtype() == DType::kBFloat16, s.batch,
                                        s.seq, s.heads, s.head_dim, s.kv(), out.raw_data(),
                                        probs.raw_data(), detail::cuda_stream()));
    return;
  }
  detail::dispatch_float(qkv.dtype(), op, [&](auto t) {
    using T = decltype(t);
    attention_forward_cpu<T>(qkv.data<T>(), s, out.data<T>(), probs.data<T>());
  });
}

// With P the probabilities and dO the output gradient, per (b, head):
//   dV = Pᵀ·dO,  dP = dO·Vᵀ,  dS = P ∘ (dP - rowsum(P ∘ dP)),  dQ = scale·dS·K,  dK = scale·dSᵀ·Q.
void attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& probs,
                        const AttentionShape& s, Tensor& dqkv) {
  constexpr std::string_view op = "attention_backward";
  detail::check_attention_operand(op, qkv, s);
  const int64_t b_n = s.batch, seq = s.seq, a_n = s.heads, d = s.head_dim, h = a_n * d;
  const int64_t w = s.qkv_width(), kv = s.kv();
  detail::check_operand(dout, op, "dout", b_n * seq * h);
  detail::check_operand(probs, op, "probs", b_n * a_n * seq * seq);
  detail::check_operand(dqkv, op, "dqkv", b_n * seq * w);
  detail::check_same_dtype(qkv, dout, op);
  detail::check_same_dtype(qkv, dqkv, op);
  if (detail::on_cuda(op, {&dout, &qkv, &probs, &dqkv})) {
    check_cuda_shape(op, s);
    // rowsum(P ∘ dP) per (b, head, row), shared by the two backward kernels; freed stream-ordered.
    Tensor row_scratch = Tensor::empty({b_n * a_n * seq}, DType::kFloat64, qkv.device());
    // dk and dv of each (b, group, key row) summed over the group's heads in double.
    Tensor kv_scratch = Tensor::empty({b_n * kv * seq * 2 * d}, DType::kFloat64, qkv.device());
    MP_OP_CUDA(op, launch_attention_backward(dout.raw_data(), qkv.raw_data(), probs.raw_data(),
                                             qkv.dtype() == DType::kBFloat16, s.batch, s.seq,
                                             s.heads, s.head_dim, kv, row_scratch.data<double>(),
                                             kv_scratch.data<double>(), dqkv.raw_data(),
                                             detail::cuda_stream()));
    return;
  }
  detail::dispatch_float(qkv.dtype(), op, [&](auto t) {
    using T = decltype(t);
    attention_backward_cpu<T>(dout.data<T>(), qkv.data<T>(), probs.data<T>(), s, dqkv.data<T>());
  });
}

namespace {

// The (cos, sign * sin) table on a CUDA device, uploaded once per process for each distinct
// table and reused by every later call: a training step's RoPE calls use the same positions, so
// after the first micro-batch no step uploads anything for RoPE (docs/design.md, "Host-device
// traffic per step"). The key is the table itself (its doubles, computed on the host as before,
// so the values and the kernels' bits are unchanged). The tables live for the process: allocated
// outside any rank's memory tracker and on the device's legacy default stream (a rank's stream
// and tracker end with its run), and synchronised before first use by the counted upload.
// Distinct tables are few (one per (S, d, theta, positions, direction) of the runs in a process).
Tensor device_rope_table(Device device, const std::vector<double>& cs) {
  struct Entry {
    Device device;
    std::vector<double> values;
    Tensor table;
  };
  static std::mutex mu;
  static std::vector<Entry>* cache = new std::vector<Entry>();  // never destroyed: no exit order
  const std::lock_guard<std::mutex> lock(mu);
  for (const Entry& e : *cache)
    if (e.device == device && e.values == cs) return e.table;
  RankContext ctx = current_context();
  ctx.memory = nullptr;
  ctx.stream = nullptr;
  const ScopedRankContext scoped(ctx);
  Tensor table = Tensor::from_vector<double>({static_cast<int64_t>(cs.size())}, cs).to(device);
  cache->push_back(Entry{device, cs, table});
  return table;
}

// Rotates the q and k heads of every row by +angle (sign 1) or -angle (sign -1).
void rope_apply(std::string_view op, Tensor& qkv, const AttentionShape& s, double theta,
                const std::vector<int64_t>& positions, double sign) {
  detail::check_attention_operand(op, qkv, s);
  MP_CHECK(s.head_dim % 2 == 0, "{}: head dim d={} must be even (pairs (2i, 2i+1))", op,
           s.head_dim);
  MP_CHECK(static_cast<int64_t>(positions.size()) == s.seq, "{}: {} positions for S={}", op,
           positions.size(), s.seq);
  MP_CHECK(std::isfinite(theta) && theta > 0, "{}: theta={} must be finite and > 0", op, theta);
  const int64_t d = s.head_dim, half = d / 2, kv = s.kv(), r = s.heads / kv;
  // cos/sin per (s, i) in double: the only transcendental work, shared by every head and row.
  std::vector<double> cs(static_cast<size_t>(s.seq * half * 2));
  for (int64_t t = 0; t < s.seq; ++t)
    for (int64_t i = 0; i < half; ++i) {
      const double angle = static_cast<double>(positions[static_cast<size_t>(t)]) *
                           std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(d));
      cs[static_cast<size_t>((t * half + i) * 2)] = std::cos(angle);
      cs[static_cast<size_t>((t * half + i) * 2 + 1)] = sign * std::sin(angle);
    }
  if (detail::on_cuda(op, {&qkv})) {
    const Tensor table = device_rope_table(qkv.device(), cs);
    MP_OP_CUDA(op, launch_rope(qkv.raw_data(), qkv.dtype() == DType::kBFloat16, s.batch, s.seq,
                               s.heads, d, kv, table.data<double>(), detail::cuda_stream()));
    return;
  }
  const int64_t w = s.qkv_width();
  detail::dispatch_float(qkv.dtype(), op, [&](auto tag) {
    using T = decltype(tag);
    T* x = qkv.data<T>();
    for (int64_t b = 0; b < s.batch; ++b)
      for (int64_t t = 0; t < s.seq; ++t) {
        T* row = x + (b * s.seq + t) * w;
        const double* c = cs.data() + t * half * 2;
        // The group's r query heads and its k head are contiguous: r + 1 heads from the base.
        for (int64_t g = 0; g < kv; ++g)
          for (int64_t hh = 0; hh <= r; ++hh) {
            T* head = row + g * (r + 2) * d + hh * d;
            for (int64_t i = 0; i < half; ++i) {
              const double x0 = static_cast<double>(head[2 * i]);
              const double x1 = static_cast<double>(head[2 * i + 1]);
              const double co = c[2 * i], si = c[2 * i + 1];
              head[2 * i] = static_cast<T>(x0 * co - x1 * si);
              head[2 * i + 1] = static_cast<T>(x0 * si + x1 * co);
            }
          }
      }
  });
}

}  // namespace

void rope_forward(Tensor& qkv, const AttentionShape& shape, double theta,
                  const std::vector<int64_t>& positions) {
  rope_apply("rope_forward", qkv, shape, theta, positions, 1.0);
}

void rope_backward(Tensor& dqkv, const AttentionShape& shape, double theta,
                   const std::vector<int64_t>& positions) {
  rope_apply("rope_backward", dqkv, shape, theta, positions, -1.0);
}

}  // namespace meshproof::kernels
