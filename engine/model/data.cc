#include "engine/model/data.h"

#include <bit>
#include <cmath>
#include <map>
#include <mutex>
#include <tuple>

#include "kernels/core/error.h"
#include "kernels/random/philox.h"

namespace meshproof::engine {

namespace {
constexpr uint64_t kTableStream = kernels::philox_stream("data.table");
constexpr uint64_t kTokenStream = kernels::philox_stream("data.tokens");
}  // namespace

double markov_entropy_rate(int64_t vocab, double decay) {
  MP_CHECK_INPUT(vocab >= 1, "entropy rate of a vocabulary of {} tokens", vocab);
  std::vector<double> p(static_cast<size_t>(vocab));
  double z = 0;
  for (int64_t r = 0; r < vocab; ++r) z += (p[r] = std::pow(decay, static_cast<double>(r)));
  double h = 0;
  for (int64_t r = 0; r < vocab; ++r) {
    const double q = p[r] / z;
    if (q > 0) h -= q * std::log(q);
  }
  return h;
}

std::shared_ptr<const MarkovSource::Tables> MarkovSource::build_tables(int64_t vocab,
                                                                       const DataConfig& data) {
  MP_CHECK_INPUT(vocab >= 1, "Markov source over a vocabulary of {} tokens", vocab);
  auto t = std::make_shared<Tables>();
  int64_t contexts = 1;
  for (int64_t i = 0; i < data.markov_order; ++i) contexts *= vocab;
  // Rank probabilities p_r = decay^r / Z.
  std::vector<double> p(vocab);
  double z = 0;
  for (int64_t r = 0; r < vocab; ++r) z += (p[r] = std::pow(data.decay, static_cast<double>(r)));
  t->cdf.resize(vocab);
  double acc = 0;
  for (int64_t r = 0; r < vocab; ++r) {
    p[r] /= z;
    acc += p[r];
    t->cdf[r] = acc;
  }
  t->cdf.back() = 1.0;
  // A Fisher-Yates permutation per context.
  t->ranked.resize(static_cast<size_t>(contexts * vocab));
  for (int64_t c = 0; c < contexts; ++c) {
    int32_t* perm = t->ranked.data() + c * vocab;
    for (int64_t i = 0; i < vocab; ++i) perm[i] = static_cast<int32_t>(i);
    for (int64_t i = vocab - 1; i > 0; --i) {
      const double u =
          kernels::philox_uniform(data.seed, kTableStream, static_cast<uint64_t>(c * vocab + i));
      const int64_t j = std::min<int64_t>(i, static_cast<int64_t>(u * static_cast<double>(i + 1)));
      std::swap(perm[i], perm[j]);
    }
  }
  return t;
}

std::shared_ptr<const MarkovSource::Tables> MarkovSource::shared_tables(int64_t vocab,
                                                                        const DataConfig& data) {
  // Keyed by the decay's bits: the tables are a function of the exact value.
  using Key = std::tuple<int64_t, int64_t, uint64_t, uint64_t>;
  static std::mutex mu;
  static std::map<Key, std::weak_ptr<const Tables>> cache;
  const Key key{vocab, data.markov_order, std::bit_cast<uint64_t>(data.decay), data.seed};
  // Under the lock: the other ranks of the run wait for the first one's tables instead of
  // building their own.
  std::lock_guard<std::mutex> lk(mu);
  std::erase_if(cache, [](const auto& kv) { return kv.second.expired(); });
  if (auto it = cache.find(key); it != cache.end()) {
    if (std::shared_ptr<const Tables> t = it->second.lock()) return t;
  }
  std::shared_ptr<const Tables> t = build_tables(vocab, data);
  cache[key] = t;
  return t;
}

MarkovSource::MarkovSource(int64_t vocab, const DataConfig& data, int64_t batch, int64_t seq_len,
                           kernels::Device device)
    : vocab_(vocab),
      order_(data.markov_order),
      batch_(batch),
      seq_len_(seq_len),
      seed_(data.seed),
      tables_(shared_tables(vocab, data)),
      device_(device) {
  entropy_ = markov_entropy_rate(vocab_, data.decay);
  if (device_.is_cuda()) {
    device_tables_.cdf = kernels::Tensor::from_vector<double>({vocab_}, tables_->cdf).to(device_);
    device_tables_.ranked = kernels::Tensor::from_vector<int32_t>(
                                {static_cast<int64_t>(tables_->ranked.size())}, tables_->ranked)
                                .to(device_);
  }
}

kernels::Tensor MarkovSource::rows(int64_t step, int64_t row_begin, int64_t row_end) const {
  MP_CHECK(0 <= row_begin && row_begin <= row_end && row_end <= batch_,
           "MarkovSource: rows [{}, {}) outside the global batch of {}", row_begin, row_end,
           batch_);
  const int64_t width = seq_len_ + 1;
  kernels::Tensor out =
      kernels::Tensor::empty({row_end - row_begin, width}, kernels::DType::kInt32, device_);
  if (device_.is_cuda()) {
    kernels::markov_rows(device_tables_,
                         {.vocab = vocab_,
                          .order = order_,
                          .batch = batch_,
                          .width = width,
                          .seed = seed_,
                          .stream = kTokenStream},
                         step, row_begin, out);
    return out;
  }
  int32_t* t = out.data<int32_t>();
  for (int64_t r = row_begin; r < row_end; ++r)
    kernels::markov_fill_row(t + (r - row_begin) * width, width, order_, vocab_, seed_,
                             kTokenStream, static_cast<uint64_t>((step * batch_ + r) * width),
                             tables_->cdf.data(), tables_->ranked.data());
  return out;
}

kernels::Tensor MarkovSource::rank_rows(int64_t step, int64_t rank, int64_t dp) const {
  MP_CHECK_INPUT(dp >= 1 && batch_ % dp == 0,
                 "training.batch = {} is not divisible by the data-parallel size {}", batch_, dp);
  MP_CHECK(0 <= rank && rank < dp, "data-parallel rank {} outside [0, {})", rank, dp);
  return rows(step, rank * batch_ / dp, (rank + 1) * batch_ / dp);
}

}  // namespace meshproof::engine
