// Vocabulary-parallel embedding and LM-head loss over FSDP's row-sharded
// token embedding.
//
// The tied token embedding [V_pad, C] is most of a small model (80% of the
// smallest preset's parameters). Gathered the ZeRO-3 way it costs every rank a
// full replica for the embedding and the head, plus a full gradient in
// backward: FSDP would then save little memory. Instead FSDP shards it by rows
// (rank r owns rows [r*R, (r+1)*R)) and never gathers it; each of its two uses
// goes to the rows (as Megatron-LM's vocabulary-parallel embedding and
// cross-entropy do):
//
//   embedding  the ids of all ranks are all-gathered; each rank looks up those
//              that fall in its rows (zero elsewhere) and a reduce-scatter
//              hands every rank the sum for its own tokens: exact, since one
//              term is non-zero. Backward all-gathers the output gradient and
//              each rank adds the rows of its ids into its shard gradient.
//   head+loss  the final hidden states are all-gathered; each rank scores its
//              vocabulary columns for every token, a chunk of rows at a time;
//              per row, the maximum, the sum of exponentials and the target
//              logit of every rank (all-gathered, 3 numbers a row) give all
//              ranks the log-sum-exp, hence the loss. The gradient of its
//              columns goes straight into the rank's shard gradient; the
//              hidden states' gradient (a partial sum over columns) is
//              reduce-scattered to the token's rank.
//
// Under tensor parallelism (shared_batch) the ranks of the group see the same
// tokens, so nothing is gathered: the embedding's partial lookups are summed
// by one all-reduce and its backward adds the (equal) output gradient of the
// rank's ids into its rows; the head scores the rank's columns for the
// group's tokens and one all-reduce sums the hidden states' gradient. Only
// the softmax statistics are all-gathered, as before.
//
// Per step and rank this moves O(world * tokens * C) activations instead of
// O(V * C) weights twice (gather for forward and backward) plus their
// reduce-scatter: less traffic while the global batch has fewer tokens than
// the vocabulary (every CPU run here), more for very large GPU batches.
// Memory: no full replica, no full gradient, at most one chunk of logits.
//
// The head computes its gradients during its forward pass (the loss ends the
// graph): the shard gradient is updated there with the scale the caller will
// backpropagate (checked in backward), the hidden states' gradient is saved
// and scaled in backward. Every rank must call both functions the same number
// of times with the same shapes (they are collective). Collective failures
// throw c10::Error.
#ifndef SHARDTRAIN_WORKER_ENGINE_STRATEGY_VOCAB_PARALLEL_H_
#define SHARDTRAIN_WORKER_ENGINE_STRATEGY_VOCAB_PARALLEL_H_

#include <torch/types.h>

#include <cstdint>

#include "worker/engine/comm/communicator.h"

namespace shardtrain {

// This rank's rows of the token embedding and where they sit. The tensors are
// views of the FSDP unit's flat shard and shard gradient; all must outlive
// their use.
struct VocabShard {
  Communicator* comm = nullptr;
  torch::Tensor weight;    // [R, C] fp32: rows [row_begin, row_begin + R)
  torch::Tensor grad;      // [R, C] fp32: their gradient, accumulated into
  int64_t row_begin = 0;   // rank * R
  int64_t vocab_size = 0;  // rows at or past it are padding, never scored
  // The dtype of the products (bf16 under CUDA mixed precision).
  torch::ScalarType compute_dtype = torch::kFloat;
  // Logits per chunk of the head: LmHeadChunkBytes() of the device when 0.
  int64_t chunk_bytes = 0;
  // Every rank of `comm` holds the same batch (tensor parallelism): the
  // tokens are not gathered, and each rank's loss and gradients are those of
  // the whole batch (no 1 / world).
  bool shared_batch = false;
  // A leaf that requires grad: ties the embedding's output into the graph so
  // that its backward runs (the shard itself is not an autograd leaf).
  torch::Tensor anchor;
};

// embedding(ids): ids [B, T] int64 in [0, vocab_size), the same shape on every
// rank; returns [B, T, C] in the compute dtype. Backward adds
// (1 / world) * sum over ranks of each rank's output gradient, by row, into
// shard.grad (the mean over ranks, as FSDP's reduce-scatter); with
// shared_batch, the output gradient itself (the same on every rank).
torch::Tensor VocabParallelEmbedding(const torch::Tensor& ids,
                                     const VocabShard& shard);

// Mean cross-entropy of the tied head over this rank's tokens: hidden
// [B, T, C] (after the final norm), targets [B, T]; the same shapes on every
// rank. When hidden requires grad, forward adds (grad_scale / world) times the
// gradient of every rank's mean loss with respect to this rank's rows into
// shard.grad (with shared_batch: grad_scale times that of the one batch's
// mean loss), and the caller must backpropagate exactly grad_scale into the
// returned loss (checked).
torch::Tensor VocabParallelLoss(const torch::Tensor& hidden,
                                const torch::Tensor& targets,
                                const VocabShard& shard, double grad_scale);

}  // namespace shardtrain

#endif  // SHARDTRAIN_WORKER_ENGINE_STRATEGY_VOCAB_PARALLEL_H_
