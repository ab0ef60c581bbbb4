#include "core/plan/memory_plan_shapes.h"

#include <algorithm>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/model/model_config.h"
#include "core/plan/pipeline_plan.h"
#include "core/run/strategy_kinds.h"

namespace shardtrain::memory_plan_detail {

int64_t RoundUp(int64_t value, int64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

// Bytes per token autograd keeps for one block: what its family keeps
// (FamilyShapes, counted tensor by tensor for each model's code), a
// tensor-parallel rank's share of what it splits, and the attention's state:
// the probabilities (heads x T) for a masked softmax, or the output and a
// log-sum-exp per head (C + heads) fused, 1/T of the heads on a
// tensor-parallel rank. Checked against the tracking allocator
// (memory_plan_test: gpt2-tiny, gpt2-mini and llama-tiny on every
// data-parallel mesh, TP 2 and PP 2).
int64_t BlockBytesPerToken(const Shapes& s, int64_t element_bytes,
                           AttentionKind attention) {
  const int64_t t = s.tensor_parallel;
  const bool masked = attention == AttentionKind::kMaskedSoftmax;
  const int64_t attention_floats =
      masked ? s.heads / t * s.seq : (s.c + s.heads) / t;
  const FamilyShapes& f = s.family;
  // The masked-softmax build is LibTorch 1.x's.
  const int64_t fp32 = f.kept_fp32 + (masked ? f.kept_fp32_torch1 : 0);
  return element_bytes * (f.kept_whole + f.kept_split / t) +
         4 * (fp32 + attention_floats);
}

// The blocks [first_block, first_block + layers) that activation
// checkpointing every `every` blocks recomputes (Gpt2Impl::IsRecomputed).
int64_t RecomputedBlocks(const Shapes& s, int64_t every) {
  if (every <= 0) return 0;
  return (s.first_block + s.layers) / every - s.first_block / every;
}

// Bytes autograd keeps for backward at the end of one micro-step's forward
// over `s`'s blocks: BlockBytesPerToken per block, the blocks' input (the
// embeddings, or a stage's received fp32 activation, C) and, with the head,
// ln_f's output and statistics (C + 2). The batch's token ids and the
// attention mask are the step's, not a micro-batch's: IdsAndMaskBytes.
//
// A recomputed block (activation checkpointing) keeps only its output (C,
// fp32: the residual stream), which the next block saves as its input.
// The vocabulary-parallel embedding (tensor parallelism) keeps each token's
// local row and whether it is the rank's (9 bytes).
int64_t ActivationBytes(const Shapes& s, int64_t element_bytes,
                        AttentionKind attention, int64_t recomputed_blocks) {
  const int64_t input =
      s.embeddings ? element_bytes * s.c + (s.tensor_parallel > 1 ? 9 : 0)
                   : 4 * s.c;
  const int64_t per_token =
      (s.layers - recomputed_blocks) *
          BlockBytesPerToken(s, element_bytes, attention) +
      recomputed_blocks * 4 * s.c + input +
      (s.head ? element_bytes * s.c + 4 * 2 : 0);
  return s.tokens * per_token;
}

// The token ids of `tokens` (inputs and targets, int64) and, for a masked
// softmax, the [T, T] causal mask of sequences of `seq_len`.
int64_t IdsAndMaskBytes(int64_t tokens, AttentionKind attention,
                        int64_t seq_len) {
  return tokens * 2 * 8 + (attention == AttentionKind::kMaskedSoftmax
                               ? seq_len * seq_len * 4
                               : 0);
}

// The chunked head (model/gpt2.cc LmHeadLoss) over `s.tokens` rows: one
// chunk of fp32 logits (and its bf16 product), wte's gradient computed in
// forward, the hidden states' gradient and per-row losses.
// Tensor parallelism's vocabulary-parallel head (strategy/vocab_parallel.cc)
// scores one chunk of the rank's rows at a time and adds wte's gradient
// into its leaf's (the persistent gradients); the hidden states' gradient
// is whole (all-reduced in place).
int64_t HeadLogitsBytes(const Shapes& s, int64_t chunk_budget, bool bf16) {
  if (s.tensor_parallel > 1) {
    const int64_t rows_held = s.padded_vocab / s.tensor_parallel;
    const int64_t rows = std::min(
        s.tokens, std::max<int64_t>(1, chunk_budget / (rows_held * 4)));
    int64_t bytes =
        rows * rows_held * (bf16 ? 6 : 4) + 4 * s.tokens * s.c + 4 * s.tokens;
    if (bf16) bytes += 2 * rows_held * s.c + 2 * s.tokens * s.c;
    return bytes;
  }
  const int64_t rows =
      std::min(s.tokens, std::max<int64_t>(1, chunk_budget / (s.vocab * 4)));
  int64_t bytes = rows * s.vocab * (bf16 ? 6 : 4) + 4 * s.wte_params +
                  4 * s.tokens * s.c + 4 * s.tokens;
  if (bf16) bytes += 2 * s.vocab * s.c;  // the cast head weight
  return bytes;
}

// The backward of the last recomputed block of a tensor-parallel rank, past
// the activations saved before it: RecomputePeakActivationBytes's two
// moments with the rank's 1/T of the heads and hidden units. Measured with
// the tracking allocator (fp32, 4-block models of C 128 to 384 with 4 and 8
// heads at T 2 and 4, 256 to 4096 tokens), exact to 0.1 C floats per token:
//   the softmax's backward   4 * (3C + 4C / T + 2 + 3 x heads / T x seq)
//                            per token (without the heads' terms: fused)
//   the block's start        its rebuilt activations, and the larger of its
//                            output and incoming gradient (2C floats per
//                            token, whole) or its MLP's first gradients
//                            (4C / T floats per token and c_fc's weight
//                            gradient, 4C / T x C)
int64_t TensorParallelRecomputeBytes(const Shapes& s, int64_t element_bytes,
                                     AttentionKind attention,
                                     int64_t held_at_softmax,
                                     MemoryPlan::Moment* moment) {
  const int64_t t = s.tensor_parallel;
  const int64_t softmax =
      s.tokens *
      (4 * (3 * s.c + 4 * s.c / t + 2) + held_at_softmax +
       (attention == AttentionKind::kMaskedSoftmax ? 12 * s.heads / t * s.seq
                                                   : 0));
  const int64_t block_start =
      s.tokens * BlockBytesPerToken(s, element_bytes, attention) +
      std::max(4 * 2 * s.c * s.tokens, 16 * s.c * (s.tokens + s.c) / t);
  *moment = block_start > softmax ? MemoryPlan::Moment::kRecomputedBlockStart
                                  : MemoryPlan::Moment::kRecomputedSoftmax;
  return std::max(softmax, block_start);
}

// The backward of a recomputed block (activation checkpointing) runs its
// forward again and then its backward, so the step has a second peak: at
// the last recomputed block j, whose backward comes first among them, with
// the saved inputs of the blocks before j still alive, the head's buffers
// and the activations of the blocks after j freed, and j's activations
// rebuilt plus the gradients its backward makes. Those transients, measured
// with the tracking allocator (bytes per token): a masked softmax 4 * (7C +
// 3 x heads x T) (the probabilities, their gradient and the scores'
// gradient dominate; j's own rebuilt activations are in it, partly freed by
// then); fused attention 4 * 7C.
// Returns the activation bytes of one micro-step alive at that moment
// (without the parameters, gradients, optimizer state, ids and mask); 0
// when none of `s`'s blocks is recomputed.
// `held_at_softmax`: bytes per token held at the softmax's backward only
// (FSDP: the head's gradient of every rank's hidden states; at the start of
// the block's backward the measured figure already has this rank's).
// `moment`: which of the two moments below holds more.
int64_t RecomputePeakActivationBytes(const Shapes& s, int64_t element_bytes,
                                     AttentionKind attention, int64_t every,
                                     MemoryPlan::Moment* moment,
                                     int64_t held_at_softmax) {
  const int64_t recomputed = RecomputedBlocks(s, every);
  if (recomputed == 0) return 0;
  const int64_t end = s.first_block + s.layers;
  const int64_t last = end / every * every - 1;  // j
  const int64_t after = end - 1 - last;          // not recomputed, freed
  const int64_t per_token_block =
      BlockBytesPerToken(s, element_bytes, attention);
  const int64_t saved =
      ActivationBytes(s, element_bytes, attention, recomputed) -
      s.tokens * (after * per_token_block +
                  (s.head ? element_bytes * s.c + 4 * 2 : 0));
  if (s.tensor_parallel > 1) {
    return saved + TensorParallelRecomputeBytes(s, element_bytes, attention,
                                                held_at_softmax, moment);
  }
  // Two moments compete: the softmax's backward (above), and the start of
  // j's backward, with all of j's rebuilt activations alive and the first
  // gradients made (measured: 4.25 C floats per token more; gpt2-mini at
  // sequence 64 and 128, batch 77 to 320, single and DDP) or, for a few
  // tokens, its MLP weights' gradients (5 C x C floats and 2C per token
  // more; gpt2-mini's pipeline stages at 64 and 128 tokens per micro-batch).
  const int64_t softmax_backward =
      s.tokens * ((attention == AttentionKind::kMaskedSoftmax
                       ? 4 * (7 * s.c + 2 + 3 * s.heads * s.seq)
                       : 4 * (7 * s.c + 2)) +
                  held_at_softmax);
  const int64_t block_backward =
      std::max(s.tokens * (per_token_block + 17 * s.c),
               s.tokens * (per_token_block + 4 * 2 * s.c) + 4 * 5 * s.c * s.c);
  *moment = block_backward > softmax_backward
                ? MemoryPlan::Moment::kRecomputedBlockStart
                : MemoryPlan::Moment::kRecomputedSoftmax;
  return saved + std::max(softmax_backward, block_backward);
}

// The whole model's shapes at `seq_len`, for `tokens` tokens per micro-step.
Shapes ModelShapes(const ModelConfig& model, int64_t seq_len, int64_t tokens) {
  Shapes s;
  s.c = model.n_embd;
  s.heads = model.n_head;
  s.layers = model.n_layer;
  s.seq = seq_len;
  s.vocab = model.vocab_size;
  s.padded_vocab = model.padded_vocab_size;
  s.block_params = model.BlockParameters();
  s.wte_params = s.padded_vocab * s.c;
  s.input_params = model.InputParameters();
  s.output_params = model.OutputParameters();
  s.root_params = s.input_params + s.output_params;
  s.family = ShapesOf(model);
  s.tokens = tokens;
  return s;
}

// `s` as a rank of a tensor-parallel group of T holds it: 1/T of every
// block's parameters but those its family keeps whole (norms, row-parallel
// biases), of wte's rows and of an untied head's.
Shapes SliceForTensorParallel(Shapes s, int64_t t) {
  if (t <= 1) return s;
  s.tensor_parallel = t;
  const FamilyShapes& f = s.family;
  s.block_params =
      (s.block_params - f.block_whole_params) / t + f.block_whole_params;
  if (s.output_params > f.final_norm_params) {
    s.output_params = s.padded_vocab / t * s.c + f.final_norm_params;
  }
  s.root_params = s.input_params + s.output_params;
  s.wte_params = s.padded_vocab / t * s.c;
  return s;
}

// The gradient norm (strategy.cc SumOfSquares) runs after the backward,
// with the activations freed but for the step's token ids: on CPU it sums
// each gradient in double, one piece of up to 1 Mi elements at a time. The
// larger of `plan` and that moment, `largest` the most elements of one
// gradient tensor the rank holds.
// `gradients`: the rank's gradients after they are synchronized.
MemoryPlan WithGradientNorm(MemoryPlan plan, int64_t gradients,
                            int64_t ids_and_mask, int64_t largest, bool cuda) {
  if (cuda) return plan;
  MemoryPlan norm = plan;
  norm.gradients = gradients;
  norm.gathered_units = 0;
  norm.activations = ids_and_mask;
  norm.logits = 0;
  norm.communication = 0;
  norm.recomputation = 0;
  norm.backward = 0;
  norm.gradient_norm = 8 * std::min<int64_t>(largest, int64_t{1} << 20);
  norm.peak_moment = MemoryPlan::Moment::kGradientNorm;
  return norm.total() > plan.total() ? norm : plan;
}

// The backward of a block that is not recomputed, past the activations it
// saved and frees as it goes: the larger of two moments, an MLP weight's
// gradient (4C x C floats, made before it is added to the parameter's) with
// 4C floats per token of the residual stream's gradients, or 7C floats per
// token within the MLP's backward; and a LayerNorm's C + 2. Measured with the
// tracking allocator where it is a stage's peak (the middle stages of
// gpt2-mini and of 4-block models of C 128 at T 64 and 128, 4 and 8 heads,
// 64 to 256 tokens per micro-batch): exact but for the second moment, 0.2%
// over.
// A tensor-parallel rank's: the weight's gradient and the MLP's are 1/T,
// as in its recomputed block (TensorParallelRecomputeBytes).
int64_t BlockBackwardBytes(const Shapes& s) {
  const int64_t t = s.tensor_parallel;
  return 4 * (std::max((4 * s.c * s.c + 4 * s.c * s.tokens) / t,
                       (3 * s.c + 4 * s.c / t) * s.tokens -
                           (t > 1 ? 2 * s.c * s.tokens : 0)) +
              s.c + 2);
}

}  // namespace shardtrain::memory_plan_detail
