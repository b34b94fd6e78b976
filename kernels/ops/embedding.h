// Token + position embedding (docs/design.md section 3): x[b*S + s, :] = tok[ids[b, s], :] + pos[s,
// :].
//   ids: int32 [B, S]; tok: [V, H]; pos: [P, H] with P >= S; x: [B*S, H].
// Backward ACCUMULATES into dtok/dpos (float32/float64 parameter gradients, whatever dx's dtype;
// rows summed in a fixed order: deterministic).
#pragma once

#include "kernels/core/tensor.h"

namespace meshproof::kernels {

void embedding_forward(const Tensor& ids, const Tensor& tok, const Tensor& pos, Tensor& x);
void embedding_backward(const Tensor& dx, const Tensor& ids, Tensor& dtok, Tensor& dpos);

// The general form (docs/design.md section 24): tok holds the vocabulary rows
// [vocab_begin, vocab_begin + rows) of a vocabulary of `vocab` ids (a vocabulary-parallel shard;
// vocab_begin 0 and rows = vocab for the whole table). Ids outside the rows contribute a zero row
// (the masked lookup whose all-reduce over tp completes x); pos may be null (RoPE: no position
// table). Backward adds into the rows of dtok the ids it holds, and into dpos every position;
// either may be null (not computed).
void embedding_forward(const Tensor& ids, const Tensor& tok, const Tensor* pos, int64_t vocab_begin,
                       int64_t vocab, Tensor& x);
void embedding_backward(const Tensor& dx, const Tensor& ids, int64_t vocab_begin, int64_t vocab,
                        Tensor* dtok, Tensor* dpos);

}  // namespace meshproof::kernels
