#include "kernels/ops/embedding.h"

#include <cstdint>

#include "kernels/ops/op_util.h"

namespace meshproof::kernels {
namespace {

void check_ids(std::string_view op, const Tensor& ids, int64_t vocab, int64_t positions) {
  detail::check_operand(ids, op, "ids");
  MP_CHECK(ids.dtype() == DType::kInt32 && ids.shape().rank() == 2,
           "{}: ids must be int32 [B, S], got {}", op, ids.describe());
  MP_CHECK(ids.shape()[1] <= positions, "{}: sequence length {} exceeds {} positions", op,
           ids.shape()[1], positions);
  if (ids.device().is_cuda()) {  // scanned on the device: one 8-byte word comes back
    detail::check_ids_on_device(op, "token id", "flat index", ids, vocab);
    return;
  }
  const int32_t* p = ids.data<int32_t>();
  const int64_t n = ids.numel().value;  // hoisted out of the loop
  for (int64_t i = 0; i < n; ++i)
    MP_CHECK_INPUT(p[i] >= 0 && p[i] < vocab, "{}: token id {} at flat index {} outside [0, {})",
                   op, p[i], i, vocab);
}

}  // namespace

namespace detail {

double download_scalar(const Tensor& t) {
  MP_CHECK(t.defined() && t.dtype() == DType::kFloat64 && t.numel().value == 1,
           "download_scalar: expected one float64, got {}",
           t.defined() ? t.describe() : "undefined");
  double v = 0;
  copy_bytes(&v, Device::cpu(), t.raw_data(), t.device(), Bytes(sizeof(double)));
  return v;
}

void check_ids_on_device(std::string_view op, std::string_view what, std::string_view where,
                         const Tensor& ids, int64_t limit) {
  MP_CHECK(ids.dtype() == DType::kInt32 && ids.device().is_cuda(),
           "{}: the device id check takes int32 CUDA ids, got {}", op, ids.describe());
  const int64_t n = ids.numel().value;
  // The launcher packs (index << 32 | id) into one 64-bit word.
  MP_CHECK(n < (int64_t{1} << 31), "{}: {} {}s exceed the device check's 2^31", op, n, what);
  if (n == 0) return;
  Tensor first = Tensor::empty({1}, DType::kInt64, ids.device());
  MP_OP_CUDA(op, launch_first_id_outside(ids.data<int32_t>(), n, limit,
                                         static_cast<unsigned long long*>(first.raw_data()),
                                         cuda_stream()));
  uint64_t word = 0;
  copy_bytes(&word, Device::cpu(), first.raw_data(), first.device(), Bytes(sizeof(word)));
  if (word == ~uint64_t{0}) return;
  const int64_t index = static_cast<int64_t>(word >> 32);
  const auto id = static_cast<int32_t>(static_cast<uint32_t>(word & 0xffffffffu));
  MP_CHECK_INPUT(false, "{}: {} {} at {} {} outside [0, {})", op, what, id, where, index, limit);
}

}  // namespace detail

void embedding_forward(const Tensor& ids, const Tensor& tok, const Tensor& pos, Tensor& x) {
  embedding_forward(ids, tok, &pos, 0, tok.shape()[0], x);
}

void embedding_backward(const Tensor& dx, const Tensor& ids, Tensor& dtok, Tensor& dpos) {
  embedding_backward(dx, ids, 0, dtok.shape()[0], &dtok, &dpos);
}

void embedding_forward(const Tensor& ids, const Tensor& tok, const Tensor* pos, int64_t vocab_begin,
                       int64_t vocab, Tensor& x) {
  constexpr std::string_view op = "embedding_forward";
  detail::check_operand(tok, op, "tok");
  detail::check_float(tok, op, "tok");
  const int64_t h = tok.shape().last(), rows = tok.shape()[0];
  MP_CHECK(vocab_begin >= 0 && vocab_begin + rows <= vocab,
           "{}: tok {} holds rows [{}, {}) outside the vocabulary of {}", op, tok.describe(),
           vocab_begin, vocab_begin + rows, vocab);
  if (pos) {
    detail::check_operand(*pos, op, "pos");
    detail::check_same_dtype(tok, *pos, op);
    MP_CHECK(pos->shape().last() == h, "{}: tok {} and pos {} disagree on H", op, tok.describe(),
             pos->describe());
  }
  check_ids(op, ids, vocab, pos ? pos->shape()[0] : ids.shape()[1]);
  const int64_t bn = ids.shape()[0], seq = ids.shape()[1];
  detail::check_operand(x, op, "x", bn * seq * h);
  detail::check_same_dtype(tok, x, op);
  if (pos ? detail::on_cuda(op, {&ids, &tok, pos, &x}) : detail::on_cuda(op, {&ids, &tok, &x})) {
    MP_OP_CUDA(op, launch_embedding_forward(ids.data<int32_t>(), tok.raw_data(),
                                            pos ? pos->raw_data() : nullptr, vocab_begin, rows,
                                            tok.dtype() == DType::kBFloat16, bn, seq, h,
                                            x.raw_data(), detail::cuda_stream()));
    return;
  }
  detail::dispatch_float(tok.dtype(), op, [&](auto t) {
    using T = decltype(t);
    const int32_t* id = ids.data<int32_t>();
    const T* tp = tok.data<T>();
    const T* pp = pos ? pos->data<T>() : nullptr;
    T* xp = x.data<T>();
    for (int64_t b = 0; b < bn; ++b)
      for (int64_t s = 0; s < seq; ++s) {
        const int64_t row = static_cast<int64_t>(id[b * seq + s]) - vocab_begin;
        T* xr = xp + (b * seq + s) * h;
        if (row < 0 || row >= rows) {  // another shard's id: a zero row (plus the position)
          for (int64_t c = 0; c < h; ++c) xr[c] = pp ? pp[s * h + c] : T(0);
          continue;
        }
        const T* tr = tp + row * h;
        if (pp) {
          for (int64_t c = 0; c < h; ++c) xr[c] = tr[c] + pp[s * h + c];
        } else {
          for (int64_t c = 0; c < h; ++c) xr[c] = tr[c];
        }
      }
  });
}

void embedding_backward(const Tensor& dx, const Tensor& ids, int64_t vocab_begin, int64_t vocab,
                        Tensor* dtok, Tensor* dpos) {
  constexpr std::string_view op = "embedding_backward";
  MP_CHECK(dtok || dpos, "{}: neither dtok nor dpos asked for", op);
  if (dtok) detail::check_grad(*dtok, op, "dtok", dtok->numel().value);
  if (dpos) detail::check_grad(*dpos, op, "dpos", dpos->numel().value);
  if (dtok && dpos) detail::check_same_dtype(*dtok, *dpos, op);
  detail::check_float(dx, op, "dx");
  const Tensor& any = dtok ? *dtok : *dpos;
  const int64_t h = any.shape().last(), rows = dtok ? dtok->shape()[0] : 0;
  if (dtok)
    MP_CHECK(vocab_begin >= 0 && vocab_begin + rows <= vocab,
             "{}: dtok {} holds rows [{}, {}) outside the vocabulary of {}", op, dtok->describe(),
             vocab_begin, vocab_begin + rows, vocab);
  check_ids(op, ids, vocab, dpos ? dpos->shape()[0] : ids.shape()[1]);
  const int64_t bn = ids.shape()[0], seq = ids.shape()[1];
  detail::check_operand(dx, op, "dx", bn * seq * h);
  if (detail::on_cuda(op, {&dx, &ids, &any})) {
    if (dtok && dpos) detail::on_cuda(op, {&dx, dtok, dpos});
    // The flat positions are grouped by token row on the device (a stable counting sort in the
    // launcher's scratch), so each row's gradients are added in the CPU's order without atomics
    // and nothing crosses to the host. Ids outside this shard's rows are left out.
    const int64_t n = bn * seq;
    MP_CHECK(n < (int64_t{1} << 31) && rows < (int64_t{1} << 30),
             "{}: {} positions and {} rows exceed the device grouping's int32 indices", op, n,
             rows);
    Tensor scratch = Tensor::empty({dtok ? 2 * rows + 1 + n : 1}, DType::kInt32, dx.device());
    MP_OP_CUDA(
        op, launch_embedding_backward(dx.raw_data(), dx.dtype() == DType::kBFloat16, bn, seq, h,
                                      ids.data<int32_t>(), vocab_begin, dtok ? rows : 0,
                                      scratch.data<int32_t>(), dtok ? dtok->data<float>() : nullptr,
                                      dpos ? dpos->data<float>() : nullptr, detail::cuda_stream()));
    return;
  }
  detail::dispatch_float(dx.dtype(), op, [&](auto t) {
    using T = decltype(t);
    detail::dispatch_grad(any.dtype(), op, [&](auto g) {
      using G = decltype(g);
      const int32_t* id = ids.data<int32_t>();
      const T* d = dx.data<T>();
      G* dt = dtok ? dtok->data<G>() : nullptr;
      G* dp = dpos ? dpos->data<G>() : nullptr;
      for (int64_t b = 0; b < bn; ++b)
        for (int64_t s = 0; s < seq; ++s) {
          const T* dr = d + (b * seq + s) * h;
          const int64_t row = static_cast<int64_t>(id[b * seq + s]) - vocab_begin;
          G* tr = dt && row >= 0 && row < rows ? dt + row * h : nullptr;
          for (int64_t c = 0; c < h; ++c) {
            if (tr) tr[c] += static_cast<G>(dr[c]);
            if (dp) dp[s * h + c] += static_cast<G>(dr[c]);
          }
        }
    });
  });
}

}  // namespace meshproof::kernels
