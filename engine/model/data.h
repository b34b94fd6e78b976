// Seeded synthetic token source with a known entropy rate (docs/design.md section 3): an order-k
// Markov chain over V tokens. Every context (the previous k tokens) ranks the V next tokens by a
// context-specific permutation (Fisher-Yates driven by Philox), and the token of rank r has
// probability decay^r / Z. All contexts share the same distribution up to relabelling, so the
// entropy of the next token given its full context is H = -sum_r p_r ln p_r for every context:
// that is the entropy rate and the loss floor (in nats) for every position with k tokens of
// context; the first k-1 predictions of a sequence see less context and sit above it.
// Tokens depend only on (data.seed, step, global row, position), so a data-parallel rank generates
// its rows [j*B/dp, (j+1)*B/dp) alone. The data seed is separate from the init/dropout seed
// (Config::seed), so a scenario can change its data without changing its model and vice versa.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "engine/config/config.h"
#include "kernels/core/tensor.h"
#include "kernels/random/markov.h"

namespace meshproof::engine {

// Entropy rate in nats per token of the source with `vocab` tokens and rank decay `decay`:
// H = -sum_r p_r ln p_r with p_r = decay^r / Z. It does not depend on the order or the seed. The
// reports show it as the loss floor.
double markov_entropy_rate(int64_t vocab, double decay);

class MarkovSource {
 public:
  // `device`: where rows() makes the tokens. On a CUDA device the tables are uploaded once, here,
  // and every batch is made there by kernels::markov_rows (bitwise the host's tokens), so a
  // training step uploads no tokens (docs/design.md, "Host-device traffic per step").
  MarkovSource(int64_t vocab, const DataConfig& data, int64_t batch, int64_t seq_len,
               kernels::Device device = kernels::Device::cpu());

  // int32 [row_end - row_begin, S + 1] on the source's device: rows [row_begin, row_end) of step
  // `step`'s global batch.
  kernels::Tensor rows(int64_t step, int64_t row_begin, int64_t row_end) const;
  // Data-parallel rank j of dp (over dp_replicate x dp_shard) takes rows [j*B/dp, (j+1)*B/dp);
  // dp must divide B (input error naming training.batch otherwise).
  kernels::Tensor rank_rows(int64_t step, int64_t rank, int64_t dp) const;
  // The whole global batch of a step: int32 [B, S + 1].
  kernels::Tensor batch(int64_t step) const { return rows(step, 0, batch_); }
  // Entropy rate in nats per token (the loss floor).
  double entropy_rate() const { return entropy_; }

  // The host tables, a function of (vocab, data.markov_order, data.decay, data.seed) alone.
  struct Tables {
    std::vector<double> cdf;      // [V] cumulative probabilities by rank
    std::vector<int32_t> ranked;  // [V^k, V] token of rank r for each context
  };
  // Builds them (no sharing).
  static std::shared_ptr<const Tables> build_tables(int64_t vocab, const DataConfig& data);
  // The process's one copy for these arguments, built by the first caller and shared read-only
  // while any source holds it: the virtual ranks of a run are threads of one process, and each
  // would otherwise build the same V^k x V table (docs/design.md section 36).
  static std::shared_ptr<const Tables> shared_tables(int64_t vocab, const DataConfig& data);
  const Tables& tables() const { return *tables_; }

 private:
  int64_t vocab_, order_, batch_, seq_len_;
  uint64_t seed_;
  std::shared_ptr<const Tables> tables_;
  kernels::Device device_;
  kernels::MarkovTables device_tables_;  // tables_ on device_ (CUDA only)
  double entropy_ = 0;
};

}  // namespace meshproof::engine
