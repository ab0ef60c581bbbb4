#include "core/plan/memory_plan.h"

#include <algorithm>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/model/model_config.h"
#include "core/plan/memory_plan_shapes.h"
#include "core/plan/pipeline_plan.h"
#include "core/run/strategy_kinds.h"

namespace shardtrain {

using namespace memory_plan_detail;  // NOLINT: the plan's own arithmetic

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
