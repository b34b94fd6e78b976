#include "kernels/embedding.h"

#include <vector>

#include "kernels/op_util.h"

namespace meshproof::kernels {
namespace {

void check_ids(std::string_view op, const Tensor& ids, int64_t vocab, int64_t positions) {
  detail::check_operand(ids, op, "ids");
  MP_CHECK(ids.dtype() == DType::kInt32 && ids.shape().rank() == 2,
           "{}: ids must be int32 [B, S], got {}", op, ids.describe());
  MP_CHECK(ids.shape()[1] <= positions, "{}: sequence length {} exceeds {} positions", op,
           ids.shape()[1], positions);
  // CUDA ids are validated on a host copy before any kernel reads them.
  const std::vector<int32_t> host =
      ids.device().is_cpu() ? std::vector<int32_t>() : ids.to_vector<int32_t>();
  const int32_t* p = ids.device().is_cpu() ? ids.data<int32_t>() : host.data();
  const int64_t n = ids.numel().value;  // hoisted out of the loop
  for (int64_t i = 0; i < n; ++i)
    MP_CHECK_INPUT(p[i] >= 0 && p[i] < vocab, "{}: token id {} at flat index {} outside [0, {})",
                   op, p[i], i, vocab);
}

}  // namespace

void embedding_forward(const Tensor& ids, const Tensor& tok, const Tensor& pos, Tensor& x) {
  constexpr std::string_view op = "embedding_forward";
  detail::check_operand(tok, op, "tok");
  detail::check_float(tok, op, "tok");
  detail::check_operand(pos, op, "pos");
  detail::check_same_dtype(tok, pos, op);
  const int64_t h = tok.shape().last();
  MP_CHECK(pos.shape().last() == h, "{}: tok {} and pos {} disagree on H", op, tok.describe(),
           pos.describe());
  check_ids(op, ids, tok.shape()[0], pos.shape()[0]);
  const int64_t bn = ids.shape()[0], seq = ids.shape()[1];
  detail::check_operand(x, op, "x", bn * seq * h);
  detail::check_same_dtype(tok, x, op);
  if (detail::on_cuda(op, {&ids, &tok, &pos, &x})) {
    MP_OP_CUDA(op, launch_embedding_forward(ids.data<int32_t>(), tok.raw_data(), pos.raw_data(),
                                            tok.dtype() == DType::kBFloat16, bn, seq, h,
                                            x.raw_data(), detail::cuda_stream()));
    return;
  }
  detail::dispatch_float(tok.dtype(), op, [&](auto t) {
    using T = decltype(t);
    const int32_t* id = ids.data<int32_t>();
    const T* tp = tok.data<T>();
    const T* pp = pos.data<T>();
    T* xp = x.data<T>();
    for (int64_t b = 0; b < bn; ++b)
      for (int64_t s = 0; s < seq; ++s) {
        const T* tr = tp + static_cast<int64_t>(id[b * seq + s]) * h;
        T* xr = xp + (b * seq + s) * h;
        for (int64_t c = 0; c < h; ++c) xr[c] = tr[c] + pp[s * h + c];
      }
  });
}

void embedding_backward(const Tensor& dx, const Tensor& ids, Tensor& dtok, Tensor& dpos) {
  constexpr std::string_view op = "embedding_backward";
  detail::check_grad(dtok, op, "dtok", dtok.numel().value);
  detail::check_grad(dpos, op, "dpos", dpos.numel().value);
  detail::check_same_dtype(dtok, dpos, op);
  detail::check_float(dx, op, "dx");
  const int64_t h = dtok.shape().last();
  check_ids(op, ids, dtok.shape()[0], dpos.shape()[0]);
  const int64_t bn = ids.shape()[0], seq = ids.shape()[1];
  detail::check_operand(dx, op, "dx", bn * seq * h);
  if (detail::on_cuda(op, {&dx, &ids, &dtok, &dpos})) {
    // Group the flat positions by token row (counting sort, positions increasing within a row) so
    // the kernel adds each row's gradients in the CPU's order without atomics.
    const std::vector<int32_t> id = ids.to_vector<int32_t>();
    const int64_t vocab = dtok.shape()[0];
    std::vector<int32_t> count(static_cast<size_t>(vocab), 0);
    for (int32_t t : id) ++count[static_cast<size_t>(t)];
    std::vector<int32_t> row_ids, row_start{0};
    for (int64_t t = 0; t < vocab; ++t) {
      if (count[static_cast<size_t>(t)] == 0) continue;
      row_ids.push_back(static_cast<int32_t>(t));
      row_start.push_back(row_start.back() + count[static_cast<size_t>(t)]);
    }
    std::vector<int32_t> slot(static_cast<size_t>(vocab), -1);  // t -> index into row_ids
    for (size_t k = 0; k < row_ids.size(); ++k)
      slot[static_cast<size_t>(row_ids[k])] = static_cast<int32_t>(k);
    std::vector<int32_t> fill(row_start.begin(), row_start.end() - 1);
    std::vector<int32_t> row_pos(id.size());
    for (size_t f = 0; f < id.size(); ++f)
      row_pos[static_cast<size_t>(fill[static_cast<size_t>(slot[static_cast<size_t>(id[f])])]++)] =
          static_cast<int32_t>(f);
    const auto upload = [&](const std::vector<int32_t>& v) {
      return Tensor::from_vector<int32_t>({static_cast<int64_t>(v.size())}, v).to(dx.device());
    };
    const Tensor d_ids = upload(row_ids), d_start = upload(row_start), d_pos = upload(row_pos);
    MP_OP_CUDA(op, launch_embedding_backward(dx.raw_data(), dx.dtype() == DType::kBFloat16, bn, seq,
                                             h, d_ids.data<int32_t>(), d_start.data<int32_t>(),
                                             d_pos.data<int32_t>(), d_ids.numel().value,
                                             dtok.data<float>(), dpos.data<float>(),
                                             detail::cuda_stream()));
    return;
  }
  detail::dispatch_float(dx.dtype(), op, [&](auto t) {
    using T = decltype(t);
    detail::dispatch_grad(dtok.dtype(), op, [&](auto g) {
      using G = decltype(g);
      const int32_t* id = ids.data<int32_t>();
      const T* d = dx.data<T>();
      G* dt = dtok.data<G>();
      G* dp = dpos.data<G>();
      for (int64_t b = 0; b < bn; ++b)
        for (int64_t s = 0; s < seq; ++s) {
          const T* dr = d + (b * seq + s) * h;
          G* tr = dt + static_cast<int64_t>(id[b * seq + s]) * h;
          for (int64_t c = 0; c < h; ++c) {
            tr[c] += static_cast<G>(dr[c]);
            dp[s * h + c] += static_cast<G>(dr[c]);
          }
        }
    });
  });
}

}  // namespace meshproof::kernels
