// The memory plan of each pipeline stage (PlanPipelineStages): a rank's
// chunks, what they hold, and the highest moment of its schedule.
#include <algorithm>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/model/model_config.h"
#include "core/plan/memory_plan.h"
#include "core/plan/memory_plan_shapes.h"
#include "core/plan/pipeline_plan.h"
#include "core/run/strategy_kinds.h"

namespace shardtrain {

using namespace memory_plan_detail;  // NOLINT: the plan's own arithmetic

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

// zb-h1: bytes per token and block a micro-batch keeps from its B to its W
// (FamilyShapes::deferred: each projection's input and output gradient).
int64_t DeferredBytesPerToken(const Shapes& s, int64_t element_bytes) {
  const FamilyShapes& f = s.family;
  return element_bytes *
         (f.deferred + (element_bytes < 4 ? f.deferred_low_precision : 0));
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

}  // namespace shardtrain
