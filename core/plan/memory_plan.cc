#include "core/plan/memory_plan.h"

#include <algorithm>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/model/model_config.h"
#include "core/plan/pipeline_plan.h"
#include "core/run/strategy_kinds.h"

namespace shardtrain {
namespace {

int64_t RoundUp(int64_t value, int64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

struct Shapes {
  int64_t c = 0, heads = 0, seq = 0, vocab = 0, padded_vocab = 0;
  int64_t block_params = 0;   // one transformer block
  int64_t root_params = 0;    // input_params + output_params
  int64_t input_params = 0;   // GPT-2's wpe
  int64_t output_params = 0;  // the final norm, an untied head
  int64_t wte_params = 0;
  // Llama: key/value width (kv heads x head size) and MLP hidden units.
  bool llama = false;
  int64_t kv = 0, mlp = 0;
  // The blocks this rank runs: [first_block, first_block + layers); the
  // whole model but for a pipeline stage.
  int64_t first_block = 0, layers = 0;
  bool embeddings = true;  // runs the embeddings (else receives its input)
  bool head = true;        // runs ln_f and the LM head
  int64_t tokens = 0;  // per rank per micro-step (pipeline: per micro-batch)
  // T: a tensor-parallel rank holds 1/T of the heads, the hidden units and
  // wte's rows (strategy/tensor_parallel_strategy.h); block_params and
  // wte_params are then the rank's.
  int64_t tensor_parallel = 1;
};

// Bytes per token autograd keeps for one Llama block, counted tensor by
// tensor for model/llama.cc (and checked by walking the autograd graph of
// the same ops):
//   each RMSNorm (computed in fp32): the normalised input, kept by the
//   weight's product (C), its reciprocal root (1 float) and, on LibTorch
//   1.x, whose mean keeps its input, the squares (C; 2.x keeps the shape);
//   its output, kept by the projections that read it (C);
//   attention: the rotated queries made contiguous, the keys and values
//   repeated to every query head (C + C + C; the rotary products keep only
//   their constant tables), the probabilities (heads x T) for a masked
//   softmax or the output and a log-sum-exp per head (C + heads) fused, and
//   the heads merged back, kept by o_proj (C);
//   the residual after attention (C), kept by the second norm;
//   the MLP's gate (kept by SiLU), its SiLU and up (kept by their product)
//   and the product (kept by down_proj): 4 x I;
//   the block's output (C, the next block's input).
// A tensor-parallel rank holds 1/T of the attention's and the MLP's tensors;
// the norms' tensors, their outputs, the residual and the block's output
// are whole. Checked against the tracking allocator (memory_plan_test:
// llama-tiny on every data-parallel mesh, TP 2 and PP 2).
int64_t LlamaBlockBytesPerToken(const Shapes& s, int64_t element_bytes,
                                AttentionKind attention) {
  const int64_t t = s.tensor_parallel;
  const bool masked = attention == AttentionKind::kMaskedSoftmax;
  const int64_t attention_floats =
      masked ? s.heads / t * s.seq : (s.c + s.heads) / t;
  // The norms' fp32 tensors: normalised inputs, and the squares on 1.x
  // (the masked-softmax build).
  const int64_t norm_floats = (masked ? 4 : 2) * s.c + 2;
  const int64_t whole = 4 * s.c;  // norm outputs, residual, block output
  const int64_t split = (4 * s.c + 4 * s.mlp) / t;
  return element_bytes * (whole + split) + 4 * (norm_floats + attention_floats);
}

// Bytes per token autograd keeps for one transformer block, counted tensor
// by tensor for model/gpt2.cc:
//   ln_1 and ln_2: mean and rstd (2 + 2 floats); their outputs, saved by
//   c_attn and c_fc (C + C); qkv, laid out head-major (3C); attention: the
//   probabilities (heads x T) for a masked softmax, or the output and a
//   log-sum-exp per head (C + heads) fused; the heads merged back, saved by
//   c_proj (C); the residual after attention (C); c_fc's output and its GELU
//   (4C + 4C); the block's output (C, the next block's input).
// A tensor-parallel rank: the LayerNorms' statistics and outputs, the
// residual after attention and the block's output are whole (4 + 4C); qkv,
// the heads' attention state, the merged heads, c_fc's output and its GELU
// are 1/T (12C / T and the heads' part).
int64_t BlockBytesPerToken(const Shapes& s, int64_t element_bytes,
                           AttentionKind attention) {
  const int64_t t = s.tensor_parallel;
  if (s.llama) return LlamaBlockBytesPerToken(s, element_bytes, attention);
  const int64_t attention_floats = attention == AttentionKind::kMaskedSoftmax
                                       ? s.heads / t * s.seq
                                       : (s.c + s.heads) / t;
  return element_bytes * (4 * s.c + 12 * s.c / t) + 4 * (4 + attention_floats);
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
                                     int64_t held_at_softmax = 0) {
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

}  // namespace

AttentionKind BuiltAttentionKind() {
#if defined(SHARDTRAIN_TORCH_FUSED_ATTENTION)
  return AttentionKind::kFused;
#else
  return AttentionKind::kMaskedSoftmax;
#endif
}

namespace {

// Each Moment's names, in the enum's order: for sentences and JSON, and for
// a table's cell.
struct MomentNames {
  const char* name;
  const char* short_name;
};
constexpr MomentNames kMomentNames[] = {
    {"the end of the forward (LM head)", "LM head"},
    {"the softmax backward of the last recomputed block", "recompute: softmax"},
    {"the start of the last recomputed block's backward",
     "recompute: block start"},
    {"the end of a micro-batch's forward", "forward"},
    {"the backward of a micro-batch's last block", "backward"},
    {"the embeddings' backward", "embeddings' backward"},
    {"the replicas' gradient all-reduce", "gradient all-reduce"},
    {"the reduce-scatter of the stage's gradients", "reduce-scatter"},
    {"the gradient norm", "gradient norm"},
};
static_assert(std::size(kMomentNames) ==
              static_cast<size_t>(MemoryPlan::Moment::kGradientNorm) + 1);

}  // namespace

std::string MemoryPlan::PeakMomentName() const {
  return kMomentNames[static_cast<size_t>(peak_moment)].name;
}

std::string MemoryPlan::PeakMomentShortName() const {
  return kMomentNames[static_cast<size_t>(peak_moment)].short_name;
}

int64_t MemoryPlan::total() const {
  int64_t sum = 0;
  for (const auto& [name, bytes] : Parts()) sum += bytes;
  return sum;
}

std::vector<std::pair<std::string, int64_t>> MemoryPlan::Parts() const {
  return {{"parameters", parameters},
          {"gradients", gradients},
          {"optimizer_state", optimizer_state},
          {"gathered_units", gathered_units},
          {"activations", activations},
          {"logits", logits},
          {"communication", communication},
          {"recomputation", recomputation},
          {"backward", backward},
          {"gradient_norm", gradient_norm}};
}

namespace {

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
  s.llama = model.is_llama();
  s.kv = model.kv_heads() * model.head_size();
  s.mlp = model.mlp_hidden();
  s.tokens = tokens;
  return s;
}

// `s` as a rank of a tensor-parallel group of T holds it: 1/T of every
// block's matrices and column-parallel biases (the LayerNorms and the
// row-parallel biases whole, 6C) and of wte's rows.
Shapes SliceForTensorParallel(Shapes s, int64_t t) {
  if (t <= 1) return s;
  s.tensor_parallel = t;
  if (s.llama) {
    // Every matrix and q, k, v's biases split; the two norms whole.
    s.block_params = (s.block_params - 2 * s.c) / t + 2 * s.c;
    if (s.output_params > s.c) s.output_params = s.padded_vocab / t * s.c + s.c;
    s.root_params = s.input_params + s.output_params;
  } else {
    s.block_params = (12 * s.c * s.c + 7 * s.c) / t + 6 * s.c;
  }
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

}  // namespace

// A rank of D replicas x T tensor-parallel ranks (strategy/tensor_parallel_
// strategy.h): 1/T of every block's matrices and column-parallel biases and
// of wte's rows, the rest whole.
//
// Its activations: ActivationBytes, HeadLogitsBytes and
// RecomputePeakActivationBytes of its slice (SliceForTensorParallel).
// With D > 1 the gradients are averaged over the replicas in place, in
// their own buckets: no further moment.
absl::StatusOr<MemoryPlan> PlanTensorParallel(const TrainConfig& config,
                                              const ModelConfig& model,
                                              int64_t world_size,
                                              AttentionKind attention) {
  const int64_t t = config.tensor_parallel;
  if (absl::Status s = config.ValidateTensorParallel(model); !s.ok()) return s;
  if (absl::Status s = config.CheckMeshWorld(world_size); !s.ok()) return s;
  absl::StatusOr<int64_t> every =
      ActivationCheckpointEvery(config.activation_checkpointing);
  if (!every.ok()) return every.status();
  const Shapes s = SliceForTensorParallel(
      ModelShapes(model, config.seq_len, config.batch_size * config.seq_len),
      t);
  const int64_t c = s.c;
  const int64_t recomputed = RecomputedBlocks(s, *every);
  const int64_t wte_rows = s.padded_vocab / t;
  const int64_t local_params =
      s.layers * s.block_params + s.wte_params + s.root_params;
  const bool cuda = config.device.rfind("cuda", 0) == 0;
  const bool bf16 = cuda && config.precision == "bf16";
  const int64_t eb = bf16 ? 2 : 4;
  const int64_t ids_and_mask =
      IdsAndMaskBytes(s.tokens, attention, config.seq_len);

  MemoryPlan plan;
  plan.strategy = config.strategy;
  plan.world_size = world_size;
  plan.tensor_parallel = t;
  plan.recomputed_blocks = recomputed;
  plan.parameters = 4 * local_params;
  plan.gradients = 4 * local_params;
  plan.optimizer_state = 8 * local_params;
  if (bf16) plan.gathered_units = 2 * s.layers * 12 * c * c / t;
  plan.activations =
      ActivationBytes(s, eb, attention, recomputed) + ids_and_mask;
  // The head's buffers; its gradient of the hidden states is all-reduced
  // in place (communication).
  plan.communication = 4 * s.tokens * c;
  plan.logits =
      HeadLogitsBytes(
          s, HeadChunkBytes(cuda, config.ThreadsPerRank(world_size)), bf16) -
      plan.communication;
  // Activation checkpointing: the backward of the last recomputed block,
  // with the head's buffers and the blocks after it freed.
  if (recomputed > 0) {
    MemoryPlan::Moment moment;
    const int64_t backward =
        RecomputePeakActivationBytes(s, eb, attention, *every, &moment) +
        ids_and_mask;
    plan.recomputation = std::max<int64_t>(
        0, backward - plan.activations - plan.logits - plan.communication);
    if (plan.recomputation > 0) plan.peak_moment = moment;
  }
  const StrategyKind* kind = FindStrategyKind(config.strategy);
  // HSDP: shard groups of G replicas (a group of one replicates, as DDP).
  const int64_t group =
      kind != nullptr && kind->layout == StateLayout::kShardedInGroups
          ? ResolveShardGroupSize(config.shard_group_size, world_size / t,
                                  /*ranks_per_node=*/0)
          : 0;
  if (group > 0) plan.shard_group_size = group;
  if (kind != nullptr && (kind->layout == StateLayout::kSharded || group > 1)) {
    // FSDP over the D replicas (TensorParallelStrategy::ShardOverReplicas),
    // or HSDP within each group of G (d = G; the groups' average of the
    // shards' gradients works in place): a unit per block, one for wte's
    // rows, one for wpe and ln_f, each padded to a multiple of d; a rank
    // keeps a shard of each, the units are whole within the step. At the
    // head, wte's whole gradient buffer exists (made with the gather), the
    // blocks' not yet; at the end of the backward every unit's full
    // gradient does, reduce-scattered into a shard-sized output.
    const int64_t d = group > 1 ? group : world_size / t;
    const int64_t block_local = s.block_params;
    const int64_t wte_local = RoundUp(wte_rows * c, d);
    const int64_t others =
        s.layers * RoundUp(block_local, d) + RoundUp(s.root_params, d);
    const int64_t shard = (others + wte_local) / d;
    plan.parameters = 4 * shard;
    plan.gradients = 4 * shard + 4 * wte_rows * c;
    plan.optimizer_state = 8 * shard;
    plan.gathered_units = eb * others + 4 * wte_local;
    if (plan.recomputation > 0) {
      // In the last recomputed block's backward, its gradient (a unit's,
      // whole) is made too.
      plan.recomputation += 4 * RoundUp(block_local, d);
      // The backward reduce-scatters each unit as it completes, one in
      // flight (UnitSchedule): in the next recomputed block's backward the
      // last block's holds its shard-sized output and, on CPU, its ring's
      // buffer while the ring runs, where that block's saved input is
      // gone (every block recomputed; otherwise the whole activations of
      // the blocks between are gone too, more than it holds). Whether the
      // ring still runs at that moment is timing: the measured peak varies
      // by that buffer between runs (0.75 MiB, 1.9% in memory_plan_test).
      const int64_t unit_shard = 4 * RoundUp(block_local, d) / d;
      if (*every == 1 && s.layers > 1) {
        plan.recomputation += std::max<int64_t>(
            0, unit_shard + (cuda ? 0 : (d > 2 ? 2 : 1) * unit_shard) -
                   4 * c * s.tokens);
      }
    }
    MemoryPlan end = plan;
    end.activations = ids_and_mask;
    end.logits = 0;
    end.recomputation = 0;
    end.gradients = 4 * shard + 4 * (others + wte_local);
    // Launched together, every unit's shard-sized output; on CPU, Gloo's
    // ring (comm/c10d_communicator.cc RingReduceScatter) also holds one
    // (two beyond two ranks) buffers of the unit's shard it is reducing,
    // at worst the largest unit's.
    end.communication = 4 * shard;
    if (!cuda) {
      end.communication += (d > 2 ? 2 : 1) * 4 *
                           std::max(RoundUp(block_local, d), wte_local) / d;
    }
    end.peak_moment = MemoryPlan::Moment::kGradientReduceScatter;
    // The norm sums each parameter's piece of a shard.
    return WithGradientNorm(end.total() > plan.total() ? end : plan, 4 * shard,
                            ids_and_mask,
                            std::max(4 * c * c / t, wte_local / d), cuda);
  }
  // The replicas average in place, in the gradients' own buckets
  // (GradientBuckets): nothing more is held for it.
  return WithGradientNorm(plan, plan.gradients, ids_and_mask,
                          std::max(s.wte_params, 4 * c * c / t), cuda);
}

namespace {

// What PlanPipelineStages reads from `config` and shares between its stages:
// the step's schedule and precision, one micro-batch's shapes and how a
// stage's state is sharded.
struct PipelineStep {
  int64_t pipeline_stages = 0;
  PipelineSchedule schedule = PipelineSchedule::kOneFOneB;
  std::vector<PipelineStage> stages;  // the model stages, as cut
  int64_t every = 0;                  // ActivationCheckpointEvery
  bool tied_head = false;
  AttentionKind attention = AttentionKind::kMaskedSoftmax;
  bool cuda = false, bf16 = false;
  int64_t eb = 4;  // bytes per activation element
  int64_t chunk_budget = 0;
  int64_t micro_batches = 0;
  int64_t ids_and_mask = 0;
  Shapes whole;
  bool tensor_parallel = false;
  int64_t t = 0;  // tokens per micro-batch
  // One [rows, T, C] buffer as it crosses between stages: in the compute
  // dtype (PipelineOptions::wire_dtype), bf16 under CUDA mixed precision.
  int64_t activation = 0;
  int64_t replicas = 1;
  int64_t shards = 1;
  bool sharded = false;
  bool shard_groups = false;  // HSDP
  int64_t chunks = 1;
};

// The refusals of PlanPipelineStages, in its order, and what `config`'s
// model, checkpointing, schedule and split parse to.
absl::StatusOr<PipelineStep> ParsePipelineStep(const TrainConfig& config,
                                               int64_t world_size) {
  absl::StatusOr<ModelConfig> model = ParseModelSpec(config.model);
  if (!model.ok()) return model.status();
  if (config.pipeline_stages <= 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "pipeline_stages: got ", config.pipeline_stages,
        "; a pipeline plan needs at least 2 stages (PlanMemory plans one "
        "without)"));
  }
  if (absl::Status s = config.ValidatePipeline(*model); !s.ok()) return s;
  if (absl::Status s = config.CheckMeshWorld(world_size); !s.ok()) {
    return s;
  }
  absl::StatusOr<int64_t> every =
      ActivationCheckpointEvery(config.activation_checkpointing);
  if (!every.ok()) return every.status();
  absl::StatusOr<PipelineSchedule> schedule =
      ParsePipelineSchedule(config.pipeline_schedule);
  if (!schedule.ok()) return schedule.status();
  std::vector<int64_t> split;
  if (!config.pipeline_split.empty()) {
    absl::StatusOr<std::vector<int64_t>> parsed =
        ParsePipelineSplit(config.pipeline_split);
    if (!parsed.ok()) return parsed.status();
    split = *std::move(parsed);
  }
  absl::StatusOr<std::vector<PipelineStage>> stages =
      PartitionPipeline(*model, config.seq_len, config.pipeline_stages, split,
                        config.virtual_stages);
  if (!stages.ok()) return stages.status();

  PipelineStep step;
  step.pipeline_stages = config.pipeline_stages;
  step.schedule = *schedule;
  step.stages = *std::move(stages);
  step.every = *every;
  step.tied_head = model->tied_head();
  // With tensor parallelism, each rank of a stage holds 1/T of its layers.
  step.whole = SliceForTensorParallel(
      ModelShapes(*model, config.seq_len,
                  config.batch_size / config.micro_batches * config.seq_len),
      config.tensor_parallel);
  return step;
}

// The rest of `step`: the step's precision and micro-batches, and how a
// stage's state is sharded.
void AddPipelineStepSizes(const TrainConfig& config, int64_t world_size,
                          AttentionKind attention, PipelineStep* step) {
  step->attention = attention;
  step->cuda = config.device.rfind("cuda", 0) == 0;
  step->bf16 = step->cuda && config.precision == "bf16";
  step->eb = step->bf16 ? 2 : 4;
  step->chunk_budget =
      HeadChunkBytes(step->cuda, config.ThreadsPerRank(world_size));
  // Every micro-batch of the step goes through one schedule
  // (PipelineStrategy::ForwardBackwardStep), and every stage loads the
  // step's batches.
  step->micro_batches = config.micro_batches * config.grad_accum;
  step->ids_and_mask =
      IdsAndMaskBytes(config.batch_size * config.seq_len * config.grad_accum,
                      attention, config.seq_len);
  step->tensor_parallel = step->whole.tensor_parallel > 1;
  step->t = step->whole.tokens;
  step->activation = (step->bf16 ? 2 : 4) * step->t * step->whole.c;

  // A stage's ranks replicate it (single, ddp), shard it (fsdp) or shard it
  // within groups (hsdp).
  const StrategyKind* kind = FindStrategyKind(config.strategy);
  // FSDP within the stage (PipelineStrategy::ShardStage): one unit per
  // block, wte alone, the other root tensors together, each padded to a
  // multiple of the ranks it is sharded over (the stage's D; HSDP: its
  // shard group's G, the groups' all-reduce working in place); a rank
  // keeps a shard of each, and the whole stage is gathered (and its full
  // gradients made) within a step.
  step->replicas = config.DataParallelSize(world_size);
  step->shards =
      kind == nullptr                         ? 1
      : kind->layout == StateLayout::kSharded ? step->replicas
      : kind->layout == StateLayout::kShardedInGroups
          ? ResolveShardGroupSize(config.shard_group_size, step->replicas,
                                  /*ranks_per_node=*/0)
          : 1;
  // A shard group of one replicates the stage, as DDP does.
  step->sharded = step->shards > 1;
  step->shard_groups =
      kind != nullptr && kind->layout == StateLayout::kShardedInGroups;
  // Interleaved, a rank runs several chunks (model stages rank, rank + S,
  // ...): it holds all of their state, and each chunk's micro-batches hold
  // that chunk's activations from its forward to its backward.
  step->chunks = std::max<int64_t>(1, config.virtual_stages);
}

// One chunk of a rank: what it holds, and what a micro-batch costs it.
struct PipelineChunk {
  Shapes s;
  int64_t params = 0;      // elements, whole
  int64_t recomputed = 0;  // blocks recomputed in backward
  int64_t full = 0;        // sharded: its padded units, in elements
  int64_t wte_padded = 0;  // sharded: wte's gradient not in its units'
  bool wte = false;        // holds wte (the embeddings or the head)
  // One micro-batch at the end of its forward, and held from then until
  // its backward: the head's ln_f output is freed, its gradients of the
  // hidden states and of wte (computed in forward) kept.
  int64_t forwarded = 0, held = 0, held_head = 0;
  // The backward of one micro-batch, past what it holds: the gradient
  // received from the next stage, and the most of its last block's
  // backward (its recomputation with activation checkpointing) and, on
  // stage 0, the embeddings' backward with wte's dense gradient.
  int64_t received = 0, recompute = 0, embedding_backward = 0;
  MemoryPlan::Moment recompute_moment = MemoryPlan::Moment::kStageBackward;
  bool top_recomputed = false;
  // zb-h1: what a micro-batch keeps from its B to its W (its projections'
  // inputs and output gradients, WeightGradients).
  int64_t deferred = 0;
  // Over the schedule: micro-batches forwarded and not yet backwarded,
  // forwarded, and backwarded; under zb-h1, backwarded and not yet W'd.
  int64_t in_flight = 0, forwarded_count = 0, done = 0, deferred_count = 0;
};

// zb-h1: bytes per token and block a micro-batch keeps from its B to its W:
// each projection's input and output gradient. GPT-2: the inputs of c_attn,
// attention's c_proj, c_fc and the MLP's c_proj (C, C, C, 4C) and their
// output gradients (3C, C, 4C, C). Llama: the norms' outputs (each read by
// two or three projections, kept once), attention's output and the MLP's
// hidden units (C, C, C, I), and the gradients of q, k, v, o, gate, up and
// down (C, kv, kv, C, I, I, C). Under bf16 each projection keeps its own
// cast of the fp32 norm output: three copies and two.
int64_t DeferredBytesPerToken(const Shapes& s, int64_t element_bytes) {
  const int64_t c = s.c;
  if (s.llama) {
    const int64_t norm_outputs = element_bytes < 4 ? 5 : 2;
    return element_bytes * ((norm_outputs + 4) * c + 2 * s.kv + 3 * s.mlp);
  }
  return element_bytes * 16 * c;
}

// The elements `s` holds (whole) and, sharded, its padded units.
void AddChunkParameters(const PipelineStep& step, PipelineChunk* part) {
  const Shapes& s = part->s;
  part->params =
      s.layers * s.block_params +
      (s.embeddings ? s.wte_params + s.input_params : 0) +
      (s.head ? (step.tied_head ? s.wte_params : 0) + s.output_params : 0);
  part->recomputed = RecomputedBlocks(s, step.every);
  if (step.sharded) {
    part->full = s.layers * RoundUp(s.block_params, step.shards);
    if (s.embeddings || (s.head && step.tied_head)) {
      part->full += RoundUp(s.wte_params, step.shards);
    }
    if (s.embeddings) part->full += RoundUp(s.input_params, step.shards);
    if (s.head) part->full += RoundUp(s.output_params, step.shards);
  }
  // The full gradients of a sharded stage exist from its first backward
  // of the step to the reduce-scatter; in the first backward of the
  // head stage, wte's is the gradient its head made in forward (already
  // counted with the micro-batch), taken over by the leaf. With tensor
  // parallelism, the vocabulary-parallel paths add wte's into a buffer
  // of their own, made with the gather: whole within the step.
  part->wte = s.embeddings || s.head;
  part->wte_padded = step.sharded && (step.tensor_parallel ? part->wte : s.head)
                         ? RoundUp(s.wte_params, step.shards)
                         : 0;
}

// What one micro-batch of `part` holds from its forward to its backward,
// and what its backward makes past that.
void AddChunkMicroBatchBytes(const PipelineStep& step,
                             const PipelineStage& stage, PipelineChunk* part) {
  const Shapes& s = part->s;
  const int64_t eb = step.eb;
  const int64_t t = step.t;
  part->forwarded = ActivationBytes(s, eb, step.attention, part->recomputed);
  part->held_head =
      s.head ? 4 * t * s.c + (step.tensor_parallel ? 0 : 4 * s.wte_params) : 0;
  part->held = part->forwarded - (s.head ? t * eb * s.c : 0);
  // Tensor-parallel projections are not deferred.
  if (step.schedule == PipelineSchedule::kZeroBubble && !step.tensor_parallel) {
    part->deferred = t * s.layers * DeferredBytesPerToken(s, eb);
  }
  part->received = s.head ? 0 : step.activation;
  part->recompute =
      RecomputePeakActivationBytes(s, eb, step.attention, step.every,
                                   &part->recompute_moment) -
      part->held;
  part->top_recomputed =
      part->recomputed > 0 && stage.end_block % step.every == 0;
  // Tensor parallelism: the gradient's rows of this rank's tokens, added
  // into wte's gradient in place.
  part->embedding_backward =
      !s.embeddings ? 0
      : step.tensor_parallel
          ? 4 * t * s.c + 4 * t * s.c / s.tensor_parallel - part->held
          : 4 * s.wte_params + 4 * t * s.c - part->held;
}

PipelineChunk MakePipelineChunk(const PipelineStep& step,
                                const PipelineStage& stage) {
  PipelineChunk part;
  Shapes& s = part.s;
  s = step.whole;
  s.first_block = stage.first_block;
  s.layers = stage.end_block - stage.first_block;
  s.embeddings = stage.embeddings;
  s.head = stage.head;
  AddChunkParameters(step, &part);
  AddChunkMicroBatchBytes(step, stage, &part);
  return part;
}

// A pipeline rank's chunks, and what they hold together.
struct RankChunks {
  std::vector<PipelineChunk> parts;
  std::vector<std::string> layers;  // DescribeStage of each
  int64_t params = 0, full = 0, recomputed = 0, block_layers = 0;
  bool has_wte = false, any_embeddings = false;
  int64_t shard = 0;  // sharded: the elements the rank keeps
};

RankChunks MakeRankChunks(const PipelineStep& step, int64_t rank) {
  RankChunks rank_chunks;
  for (int64_t v = 0; v < step.chunks; ++v) {
    const PipelineStage& stage =
        step.stages[ModelStageOf(step.pipeline_stages, rank, v)];
    PipelineChunk part = MakePipelineChunk(step, stage);
    rank_chunks.params += part.params;
    rank_chunks.full += part.full;
    rank_chunks.recomputed += part.recomputed;
    rank_chunks.block_layers += part.s.layers;
    rank_chunks.has_wte = rank_chunks.has_wte || part.wte;
    rank_chunks.any_embeddings =
        rank_chunks.any_embeddings || part.s.embeddings;
    rank_chunks.layers.push_back(DescribeStage(stage));
    rank_chunks.parts.push_back(std::move(part));
  }
  rank_chunks.shard = rank_chunks.full / step.shards;
  return rank_chunks;
}

// What rank `rank` holds throughout the step: its parameters, gradients,
// optimizer state and gathered units.
MemoryPlan StageBasePlan(const TrainConfig& config, int64_t world_size,
                         const PipelineStep& step, int64_t rank,
                         const RankChunks& chunks) {
  const Shapes& whole = step.whole;
  MemoryPlan base;
  base.strategy = config.strategy;
  base.world_size = world_size;
  base.pipeline_stages = config.pipeline_stages;
  base.stage = rank;
  base.stage_layers = absl::StrJoin(chunks.layers, "; ");
  base.recomputed_blocks = chunks.recomputed;
  base.tensor_parallel = whole.tensor_parallel;
  if (step.shard_groups) base.shard_group_size = step.shards;
  base.parameters = 4 * chunks.params;
  base.gradients = 4 * chunks.params;
  base.optimizer_state = 8 * chunks.params;
  if (step.bf16) {
    base.gathered_units = 2 * chunks.block_layers * 12 * whole.c * whole.c /
                          whole.tensor_parallel;
  }
  if (step.sharded) {
    base.parameters = 4 * chunks.shard;
    base.gradients = 4 * chunks.shard;
    base.optimizer_state = 8 * chunks.shard;
    base.gathered_units = (step.bf16 ? 2 : 4) * chunks.full;
  }
  if (step.sharded && step.tensor_parallel && chunks.has_wte) {
    base.gradients += 4 * whole.wte_params;
  }
  return base;
}

// The full gradients of the chunks whose backward has begun (`current`:
// the chunk whose backward runs now, or -1).
int64_t FullGradientBytes(const PipelineStep& step,
                          const std::vector<PipelineChunk>& parts,
                          int64_t current) {
  int64_t bytes = 0;
  for (int64_t v = 0; v < step.chunks; ++v) {
    const PipelineChunk& part = parts[v];
    if (part.done == 0 && v != current) continue;
    bytes +=
        4 * (part.full -
             (part.done == 0 || step.tensor_parallel ? part.wte_padded : 0));
  }
  return bytes;
}

// What the micro-batches in flight hold (their activations, the head's
// kept gradients) and the sends not yet taken: a non-last stage's
// outputs (fp32: the activation itself while its micro-batch is held;
// bf16: a copy in the wire's dtype) and a later stage's gradients of its
// inputs.
int64_t MicroBatchesInFlight(const std::vector<PipelineChunk>& parts) {
  int64_t count = 0;
  for (const PipelineChunk& part : parts) count += part.in_flight;
  return count;
}

int64_t HeldBytes(const std::vector<PipelineChunk>& parts) {
  int64_t bytes = 0;
  for (const PipelineChunk& part : parts) {
    bytes += part.in_flight * part.held + part.deferred_count * part.deferred;
  }
  return bytes;
}

int64_t HeldHeadBytes(const std::vector<PipelineChunk>& parts) {
  int64_t bytes = 0;
  for (const PipelineChunk& part : parts) {
    bytes += part.in_flight * part.held_head;
  }
  return bytes;
}

int64_t PendingSendBytes(const PipelineStep& step,
                         const std::vector<PipelineChunk>& parts) {
  int64_t bytes = 0;
  for (const PipelineChunk& part : parts) {
    if (!part.s.head) {
      bytes += (step.bf16 ? part.forwarded_count : part.done) * step.activation;
    }
    if (!part.s.embeddings) bytes += part.done * step.activation;
  }
  return bytes;
}

// The highest of the moments considered: `base` until the first is.
struct StagePeak {
  explicit StagePeak(MemoryPlan base) : best(std::move(base)) {}
  void Consider(MemoryPlan candidate) {
    if (candidate.total() > best_total) {
      best_total = candidate.total();
      best = std::move(candidate);
    }
  }
  MemoryPlan best;
  int64_t best_total = -1;
};

// The end of a forward of chunk `chunk`, whose micro-batch is in flight
// from then on.
void ConsiderForward(const PipelineStep& step, const MemoryPlan& base,
                     int64_t chunk, std::vector<PipelineChunk>* parts,
                     StagePeak* peak) {
  PipelineChunk& part = (*parts)[chunk];
  const Shapes& s = part.s;
  MemoryPlan at = base;
  at.activations = step.ids_and_mask + HeldBytes(*parts) + part.forwarded;
  at.logits = HeldHeadBytes(*parts) +
              (s.head ? HeadLogitsBytes(s, step.chunk_budget, step.bf16) : 0);
  ++part.in_flight;
  ++part.forwarded_count;
  at.micro_batches_in_flight = MicroBatchesInFlight(*parts);
  at.communication = PendingSendBytes(step, *parts);
  if (step.sharded) at.gradients += FullGradientBytes(step, *parts, -1);
  at.peak_moment =
      s.head ? MemoryPlan::Moment::kHead : MemoryPlan::Moment::kStageForward;
  peak->Consider(at);
}

// The moments of a backward of chunk `chunk` (its last block's, its
// recomputation's, the embeddings'), whose micro-batch is done after it.
void ConsiderBackward(const PipelineStep& step, const MemoryPlan& base,
                      int64_t chunk, std::vector<PipelineChunk>* parts,
                      StagePeak* peak) {
  PipelineChunk& part = (*parts)[chunk];
  const Shapes& s = part.s;
  MemoryPlan at = base;
  at.micro_batches_in_flight = MicroBatchesInFlight(*parts);
  at.activations = step.ids_and_mask + HeldBytes(*parts);
  at.logits = HeldHeadBytes(*parts);
  at.communication = PendingSendBytes(step, *parts) + part.received;
  if (step.sharded) at.gradients += FullGradientBytes(step, *parts, chunk);
  if (!part.top_recomputed) {
    MemoryPlan in_block = at;
    // A sharded block's gradient arrives as one flat tensor, made
    // from its parameters' before it is added to the unit's.
    in_block.backward =
        BlockBackwardBytes(s) +
        (step.sharded ? 4 * RoundUp(s.block_params, step.shards) : 0);
    in_block.peak_moment = MemoryPlan::Moment::kStageBackward;
    peak->Consider(in_block);
  }
  if (part.recomputed > 0) {
    MemoryPlan in_block = at;
    in_block.recomputation = std::max<int64_t>(0, part.recompute);
    in_block.peak_moment = part.recompute_moment;
    peak->Consider(in_block);
  }
  if (s.embeddings) {
    at.backward = std::max<int64_t>(0, part.embedding_backward);
    at.peak_moment = MemoryPlan::Moment::kEmbeddingBackward;
    peak->Consider(at);
  }
  --part.in_flight;
  ++part.done;
  // Under zb-h1 it keeps what its W needs until then.
  if (step.schedule == PipelineSchedule::kZeroBubble) ++part.deferred_count;
}

// Rank `rank`'s schedule, action by action.
void ConsiderSchedule(const PipelineStep& step, const MemoryPlan& base,
                      int64_t rank, std::vector<PipelineChunk>* parts,
                      StagePeak* peak) {
  for (const PipelineAction& action :
       StageActions(step.schedule, step.pipeline_stages, rank,
                    step.micro_batches, step.chunks)) {
    if (action.kind == PipelineAction::Kind::kForward) {
      ConsiderForward(step, base, action.chunk, parts, peak);
    } else if (action.kind == PipelineAction::Kind::kBackward) {
      ConsiderBackward(step, base, action.chunk, parts, peak);
    } else {
      --(*parts)[action.chunk].deferred_count;  // zb-h1's W
    }
  }
}

// After the schedule: the replicas' synchronization of the stage's
// gradients.
void ConsiderGradientSync(const PipelineStep& step, const MemoryPlan& base,
                          const RankChunks& chunks, StagePeak* peak) {
  if (step.sharded) {
    // After the schedule, the units are reduce-scattered into shard-sized
    // outputs while still gathered. The blocks' went as the last backward
    // completed each, one in flight (UnitSchedule): all are done but the
    // last the backward completed, the stage's first unit (wpe's on GPT-2's
    // first stage, else its first block's); the units whose gradients the
    // strategy hands over (the embedding's and the head's rows) go now,
    // with their full gradients. On CPU, Gloo's ring also holds one (two
    // beyond two ranks) buffers of the shard it is reducing, at worst the
    // largest unit's.
    int64_t blocks_full = 0;
    for (const PipelineChunk& part : chunks.parts) {
      blocks_full += part.s.layers * RoundUp(part.s.block_params, step.shards);
    }
    const bool first_is_input =
        chunks.any_embeddings && step.whole.input_params > 0;
    const int64_t last_unit =
        blocks_full == 0 ? 0
        : first_is_input ? RoundUp(step.whole.input_params, step.shards)
                         : RoundUp(step.whole.block_params, step.shards);
    MemoryPlan at = base;
    at.activations = step.ids_and_mask;
    at.gradients += FullGradientBytes(step, chunks.parts, -1) -
                    4 * blocks_full + 4 * last_unit;
    at.communication = 4 * (chunks.shard - blocks_full / step.shards +
                            last_unit / step.shards);
    if (!step.cuda) {
      const int64_t largest_unit = std::max(
          RoundUp(step.whole.block_params, step.shards),
          chunks.has_wte ? RoundUp(step.whole.wte_params, step.shards) : 0);
      at.communication +=
          (step.shards > 2 ? 2 : 1) * 4 * largest_unit / step.shards;
    }
    at.peak_moment = MemoryPlan::Moment::kGradientReduceScatter;
    peak->Consider(at);
  }
  // Replicas of a stage average in place, in the gradients' own buckets
  // (GradientBuckets): nothing more is held for it; with tensor ranks,
  // after the schedule through one flat copy of the gradients.
  if (!step.sharded && step.replicas > 1 && step.tensor_parallel) {
    MemoryPlan at = base;
    at.activations = step.ids_and_mask;
    at.communication = 4 * chunks.params;
    at.peak_moment = MemoryPlan::Moment::kGradientAllReduce;
    peak->Consider(at);
  }
}

// `best`, or the gradient norm's moment where it holds more.
MemoryPlan WithStageGradientNorm(const PipelineStep& step,
                                 const RankChunks& chunks, MemoryPlan best) {
  // The norm sums whole gradients, or each unit's shard (with tensor
  // parallelism, each parameter's piece of it); wte's on stage 0 only.
  const bool norm_wte = chunks.any_embeddings;
  const Shapes& s = step.whole;
  const int64_t shards = step.shards;
  const int64_t largest =
      !step.sharded ? std::max(norm_wte ? s.wte_params : 0,
                               4 * s.c * s.c / s.tensor_parallel)
      : step.tensor_parallel
          ? std::max(norm_wte ? s.wte_params / shards : 0,
                     4 * s.c * s.c / s.tensor_parallel)
          : std::max(RoundUp(s.block_params, shards),
                     norm_wte ? RoundUp(s.wte_params, shards) : 0) /
                shards;
  return WithGradientNorm(std::move(best),
                          step.sharded ? 4 * chunks.shard : 4 * chunks.params,
                          step.ids_and_mask, largest, step.cuda);
}

}  // namespace

absl::StatusOr<std::vector<MemoryPlan>> PlanPipelineStages(
    const TrainConfig& config, int64_t world_size, AttentionKind attention) {
  absl::StatusOr<PipelineStep> step = ParsePipelineStep(config, world_size);
  if (!step.ok()) return step.status();
  AddPipelineStepSizes(config, world_size, attention, &*step);
  std::vector<MemoryPlan> plans;
  for (int64_t rank = 0; rank < config.pipeline_stages; ++rank) {
    RankChunks chunks = MakeRankChunks(*step, rank);
    const MemoryPlan base =
        StageBasePlan(config, world_size, *step, rank, chunks);
    StagePeak peak(base);
    ConsiderSchedule(*step, base, rank, &chunks.parts, &peak);
    ConsiderGradientSync(*step, base, chunks, &peak);
    plans.push_back(WithStageGradientNorm(*step, chunks, std::move(peak.best)));
  }
  return plans;
}

absl::StatusOr<MemoryPlan> PlanMemory(const TrainConfig& config,
                                      int64_t world_size,
                                      AttentionKind attention) {
  absl::StatusOr<ModelConfig> model = ParseModelSpec(config.model);
  if (!model.ok()) return model.status();
  if (world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("world size must be >= 1, got ", world_size));
  }
  absl::StatusOr<int64_t> every =
      ActivationCheckpointEvery(config.activation_checkpointing);
  if (!every.ok()) return every.status();
  const int64_t recomputed = *every > 0 ? model->n_layer / *every : 0;
  const StrategyKind* kind = FindStrategyKind(config.strategy);
  if (kind == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "strategy: got ", config.strategy, "; allowed: ", StrategyNameList()));
  }
  if (config.tensor_parallel > 1) {
    return PlanTensorParallel(config, *model, world_size, attention);
  }
  if (config.pipeline_stages > 1) {
    absl::StatusOr<std::vector<MemoryPlan>> stages =
        PlanPipelineStages(config, world_size, attention);
    if (!stages.ok()) return stages.status();
    return *std::max_element(stages->begin(), stages->end(),
                             [](const MemoryPlan& a, const MemoryPlan& b) {
                               return a.total() < b.total();
                             });
  }
  if (!kind->distributed && world_size != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("strategy ", kind->name, " runs at world size 1"));
  }
  const Shapes s =
      ModelShapes(*model, config.seq_len, config.batch_size * config.seq_len);
  const int64_t params = model->NumParameters();
  const int64_t ids_and_mask =
      IdsAndMaskBytes(s.tokens, attention, config.seq_len);

  const bool cuda = config.device.rfind("cuda", 0) == 0;
  const bool bf16 = cuda && config.precision == "bf16";
  // The LM head's logits budget per chunk, as the ranks will pick it.
  const int64_t chunk_budget =
      HeadChunkBytes(cuda, config.ThreadsPerRank(world_size));

  MemoryPlan plan;
  plan.strategy = config.strategy;
  plan.world_size = world_size;
  plan.recomputed_blocks = recomputed;
  const StateLayout layout = kind->layout;
  if (layout == StateLayout::kReplicated) {
    plan.parameters = 4 * params;
    plan.gradients = 4 * params;
    plan.optimizer_state = 8 * params;
    // Autocast keeps one bf16 copy of every block weight it casts.
    if (bf16) plan.gathered_units = 2 * s.layers * 12 * s.c * s.c;
    plan.activations =
        ActivationBytes(s, bf16 ? 2 : 4, attention, recomputed) + ids_and_mask;
    plan.logits = HeadLogitsBytes(s, chunk_budget, bf16);
    if (*every > 0) {
      MemoryPlan::Moment moment;
      const int64_t backward =
          RecomputePeakActivationBytes(s, bf16 ? 2 : 4, attention, *every,
                                       &moment) +
          ids_and_mask;
      plan.recomputation =
          std::max<int64_t>(0, backward - plan.activations - plan.logits);
      if (plan.recomputation > 0) plan.peak_moment = moment;
    }
    return WithGradientNorm(plan, plan.gradients, ids_and_mask, s.wte_params,
                            cuda);
  }

  // FSDP: each unit's flat buffer padded to the world size (wte to whole
  // rows per rank); a rank holds 1/N of each. HSDP: the same within its
  // shard group of G ranks (the replicas' all-reduce works in place).
  if (layout == StateLayout::kShardedInGroups) {
    const int64_t g = ResolveShardGroupSize(config.shard_group_size, world_size,
                                            /*ranks_per_node=*/0);
    if (g > world_size || world_size % g != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("hsdp: the shard group size ", g,
                       " must divide the world size ", world_size));
    }
    plan.shard_group_size = g;
    world_size = g;
  }
  const int64_t block_padded = RoundUp(s.block_params, world_size);
  const int64_t root_padded = RoundUp(s.root_params, world_size);
  const int64_t wte_rows = RoundUp(s.padded_vocab, world_size) / world_size;
  const int64_t shard = s.layers * block_padded / world_size +
                        root_padded / world_size + wte_rows * s.c;
  plan.parameters = 4 * shard;
  plan.gradients = 4 * shard;
  plan.optimizer_state = 8 * shard;
  if (config.fsdp_no_sync && config.grad_accum > 1) {
    // Full fp32 gradients of the blocks and root, held across micro-steps.
    plan.gradients += 4 * (s.layers * block_padded + root_padded);
  }
  const int64_t unit_bytes = bf16 ? 2 : 4;
  // At the head: the root (positions, ln_f) and the last block are gathered
  // (the last block's backward comes first); without resharding, all blocks.
  const int64_t gathered_blocks = config.reshard_after_forward ? 1 : s.layers;
  plan.gathered_units =
      unit_bytes * (root_padded + gathered_blocks * block_padded);
  plan.activations =
      ActivationBytes(s, unit_bytes, attention, recomputed) + ids_and_mask;
  // The vocabulary-parallel head (strategy/vocab_parallel.cc): every rank's
  // tokens against this rank's rows, one chunk at a time.
  const int64_t all_tokens = world_size * s.tokens;
  const int64_t rows =
      std::min(all_tokens, std::max<int64_t>(1, chunk_budget / (wte_rows * 4)));
  plan.logits = rows * wte_rows * (bf16 ? 6 : 4) + 4 * all_tokens;
  if (bf16) plan.logits += 2 * wte_rows * s.c + 2 * all_tokens * s.c;
  // Every rank's hidden states, their gradient (partial over this rank's
  // columns) and targets.
  plan.communication = 4 * all_tokens * s.c * 2 + 8 * all_tokens;
  if (*every > 0) {
    // In backward the block before the recomputed one is prefetched: one
    // block more gathered than at the head.
    const int64_t last = s.layers / *every * *every - 1;
    const int64_t prefetched =
        config.prefetch && config.reshard_after_forward && last >= 1
            ? unit_bytes * block_padded
            : 0;
    // The vocabulary-parallel head's gradient of every rank's hidden states
    // is still held at the softmax's backward of the first recomputed block
    // (measured); at the start of that block's backward, only as much as
    // the measured figure has (gpt2-mini FSDP b101: 473.4 MiB, planned
    // 475.3).
    MemoryPlan::Moment moment;
    const int64_t backward =
        prefetched + ids_and_mask +
        RecomputePeakActivationBytes(s, unit_bytes, attention, *every, &moment,
                                     4 * world_size * s.c);
    plan.recomputation = std::max<int64_t>(
        0, backward - plan.activations - plan.logits - plan.communication);
    if (plan.recomputation > 0) plan.peak_moment = moment;
  }
  // The norm sums each unit's shard.
  return WithGradientNorm(plan, 4 * shard, ids_and_mask,
                          std::max({wte_rows * s.c, block_padded / world_size,
                                    root_padded / world_size}),
                          cuda);
}

absl::StatusOr<int64_t> LargestFittingBatch(TrainConfig config,
                                            int64_t world_size, int64_t budget,
                                            int64_t max_batch) {
  // A pipeline's batch is cut into micro_batches equal pieces: search over
  // the multiples of it.
  const int64_t unit = config.pipeline_stages > 1
                           ? std::max<int64_t>(1, config.micro_batches)
                           : 1;
  max_batch /= unit;
  if (max_batch < 1) return 0;
  auto fits = [&](int64_t units) -> absl::StatusOr<bool> {
    config.batch_size = units * unit;
    absl::StatusOr<MemoryPlan> plan = PlanMemory(config, world_size);
    if (!plan.ok()) return plan.status();
    return plan->total() <= budget;
  };
  absl::StatusOr<bool> one = fits(1);
  if (!one.ok()) return one.status();
  if (!*one) return 0;
  int64_t lo = 1, hi = max_batch;  // fits(lo); fits(hi) unknown
  absl::StatusOr<bool> top = fits(hi);
  if (!top.ok()) return top.status();
  if (*top) return hi * unit;
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    absl::StatusOr<bool> f = fits(mid);
    if (!f.ok()) return f.status();
    (*f ? lo : hi) = mid;
  }
  return lo * unit;
}

}  // namespace shardtrain
