#include "core/train/memory_plan.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "core/model/gpt2_config.h"
#include "core/train/strategy_kinds.h"

namespace shardtrain {
namespace {

int64_t RoundUp(int64_t value, int64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

struct Shapes {
  int64_t c = 0, heads = 0, layers = 0, seq = 0, vocab = 0, padded_vocab = 0;
  int64_t block_params = 0;  // one transformer block
  int64_t root_params = 0;   // wpe + ln_f
  int64_t wte_params = 0;
  int64_t tokens = 0;  // per rank per micro-step
};

// Bytes autograd keeps for backward at the end of one micro-step's forward,
// counted tensor by tensor for model/gpt2.cc (per token of one block):
//   ln_1 and ln_2: mean and rstd (2 + 2 floats); their outputs, saved by
//   c_attn and c_fc (C + C); qkv, laid out head-major (3C); attention: the
//   probabilities (heads x T) for a masked softmax, or the output and a
//   log-sum-exp per head (C + heads) fused; the heads merged back, saved by
//   c_proj (C); the residual after attention (C); c_fc's output and its GELU
//   (4C + 4C); the block's output (C, the next block's input).
// Plus the embeddings (C), ln_f's output and statistics (C + 2), the batch's
// token ids (two int64) and, for a masked softmax, the [block, block] mask.
//
// A recomputed block (activation checkpointing) keeps only its output (C,
// fp32: the residual stream), which the next block saves as its input.
int64_t ActivationBytes(const Shapes& s, int64_t element_bytes,
                        AttentionKind attention, int64_t block_size,
                        int64_t recomputed_blocks) {
  const int64_t attention_floats = attention == AttentionKind::kMaskedSoftmax
                                       ? s.heads * s.seq
                                       : s.c + s.heads;
  const int64_t per_token_block =
      element_bytes * (16 * s.c) + 4 * (4 + attention_floats);
  const int64_t per_token = (s.layers - recomputed_blocks) * per_token_block +
                            recomputed_blocks * 4 * s.c +
                            element_bytes * 2 * s.c + 4 * 2 + 2 * 8;
  int64_t bytes = s.tokens * per_token;
  if (attention == AttentionKind::kMaskedSoftmax) {
    bytes += block_size * block_size * 4;
  }
  return bytes;
}

// The backward of a recomputed block (activation checkpointing) runs its
// forward again and then its backward, so the step has a second peak: at
// the last recomputed block j, whose backward comes first among them, with
// the saved inputs of blocks 0..j still alive, the head's buffers and the
// activations of the blocks after j freed, and j's activations rebuilt plus
// the gradients its backward makes. Those transients, measured with the
// tracking allocator (bytes per token): a masked softmax 4 * (7C + 3 x
// heads x T) (the probabilities, their gradient and the scores' gradient
// dominate; j's own rebuilt activations are in it, partly freed by then);
// fused attention 4 * 7C.
// Returns the activation bytes alive at that moment (without the
// parameters, gradients and optimizer state).
// `held_at_softmax`: bytes per token held at the softmax's backward only
// (FSDP: the head's gradient of every rank's hidden states; at the start of
// the block's backward the measured figure already has this rank's).
// `moment`: which of the two moments below holds more.
int64_t RecomputePeakActivationBytes(const Shapes& s, int64_t element_bytes,
                                     AttentionKind attention,
                                     int64_t block_size, int64_t every,
                                     MemoryPlan::Moment* moment,
                                     int64_t held_at_softmax = 0) {
  const int64_t recomputed = s.layers / every;
  const int64_t last = recomputed * every - 1;  // j
  const int64_t after = s.layers - 1 - last;    // not recomputed, freed
  const int64_t attention_floats = attention == AttentionKind::kMaskedSoftmax
                                       ? s.heads * s.seq
                                       : s.c + s.heads;
  const int64_t per_token_block =
      element_bytes * (16 * s.c) + 4 * (4 + attention_floats);
  const int64_t saved =
      ActivationBytes(s, element_bytes, attention, block_size, recomputed) -
      s.tokens * (after * per_token_block + element_bytes * s.c + 4 * 2);
  // Two moments compete: the softmax's backward (above), and the start of
  // j's backward, with all of j's rebuilt activations alive and the first
  // gradients made (measured: 4.25 C floats per token more; gpt2-mini at
  // sequence 64 and 128, batch 77 to 320, single and DDP).
  const int64_t softmax_backward = attention == AttentionKind::kMaskedSoftmax
                                       ? 4 * (7 * s.c + 2 + 3 * s.heads * s.seq)
                                       : 4 * (7 * s.c + 2);
  const int64_t block_backward = per_token_block + 17 * s.c;
  *moment = block_backward > softmax_backward + held_at_softmax
                ? MemoryPlan::Moment::kRecomputedBlockStart
                : MemoryPlan::Moment::kRecomputedSoftmax;
  return saved + s.tokens * std::max(softmax_backward + held_at_softmax,
                                     block_backward);
}

}  // namespace

AttentionKind BuiltAttentionKind() {
#if defined(SHARDTRAIN_TORCH_FUSED_ATTENTION)
  return AttentionKind::kFused;
#else
  return AttentionKind::kMaskedSoftmax;
#endif
}

std::string MemoryPlan::PeakMomentName() const {
  switch (peak_moment) {
    case Moment::kHead:
      return "the end of the forward (LM head)";
    case Moment::kRecomputedSoftmax:
      return "the softmax backward of the last recomputed block";
    case Moment::kRecomputedBlockStart:
      return "the start of the last recomputed block's backward";
  }
  return "";
}

int64_t MemoryPlan::total() const {
  int64_t sum = 0;
  for (const auto& [name, bytes] : Parts()) sum += bytes;
  return sum;
}

std::vector<std::pair<std::string, int64_t>> MemoryPlan::Parts() const {
  return {
      {"parameters", parameters},           {"gradients", gradients},
      {"optimizer_state", optimizer_state}, {"gathered_units", gathered_units},
      {"activations", activations},         {"logits", logits},
      {"communication", communication},     {"recomputation", recomputation}};
}

absl::StatusOr<MemoryPlan> PlanMemory(const TrainConfig& config,
                                      int64_t world_size,
                                      AttentionKind attention) {
  absl::StatusOr<Gpt2Config> model = ParseModelSpec(config.model);
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
  if (config.pipeline_stages > 1) {
    // A rank holds its stage's blocks and the activations of the
    // micro-batches in flight, which this plan does not count yet.
    return absl::UnimplementedError(absl::StrCat(
        "the memory plan does not cover pipeline stages yet (pipeline_stages ",
        config.pipeline_stages, ")"));
  }
  if (!kind->distributed && world_size != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("strategy ", kind->name, " runs at world size 1"));
  }
  Shapes s;
  s.c = model->n_embd;
  s.heads = model->n_head;
  s.layers = model->n_layer;
  s.seq = config.seq_len;
  s.vocab = model->vocab_size;
  s.padded_vocab = model->padded_vocab_size;
  s.block_params = 12 * s.c * s.c + 13 * s.c;
  s.wte_params = s.padded_vocab * s.c;
  s.root_params = model->block_size * s.c + 2 * s.c;
  s.tokens = config.batch_size * config.seq_len;
  const int64_t params = model->NumParameters();

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
    plan.activations = ActivationBytes(s, bf16 ? 2 : 4, attention,
                                       model->block_size, recomputed);
    // The chunked head (model/gpt2.cc LmHeadLoss): one chunk of fp32 logits
    // (and its bf16 product), wte's gradient computed in forward, the hidden
    // states' gradient and per-row losses.
    const int64_t rows =
        std::min(s.tokens, std::max<int64_t>(1, chunk_budget / (s.vocab * 4)));
    plan.logits = rows * s.vocab * (bf16 ? 6 : 4) + 4 * s.wte_params +
                  4 * s.tokens * s.c + 4 * s.tokens;
    if (bf16) plan.logits += 2 * s.vocab * s.c;  // the cast head weight
    if (*every > 0) {
      MemoryPlan::Moment moment;
      const int64_t backward = RecomputePeakActivationBytes(
          s, bf16 ? 2 : 4, attention, model->block_size, *every, &moment);
      plan.recomputation =
          std::max<int64_t>(0, backward - plan.activations - plan.logits);
      if (plan.recomputation > 0) plan.peak_moment = moment;
    }
    return plan;
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
      ActivationBytes(s, unit_bytes, attention, model->block_size, recomputed);
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
        prefetched + RecomputePeakActivationBytes(
                         s, unit_bytes, attention, model->block_size, *every,
                         &moment, 4 * world_size * s.c);
    plan.recomputation = std::max<int64_t>(
        0, backward - plan.activations - plan.logits - plan.communication);
    if (plan.recomputation > 0) plan.peak_moment = moment;
  }
  return plan;
}

absl::StatusOr<int64_t> LargestFittingBatch(TrainConfig config,
                                            int64_t world_size, int64_t budget,
                                            int64_t max_batch) {
  auto fits = [&](int64_t batch) -> absl::StatusOr<bool> {
    config.batch_size = batch;
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
  if (*top) return hi;
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    absl::StatusOr<bool> f = fits(mid);
    if (!f.ok()) return f.status();
    (*f ? lo : hi) = mid;
  }
  return lo;
}

}  // namespace shardtrain
