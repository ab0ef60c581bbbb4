// MemoryPlan: the tensor bytes one rank will need at its peak, predicted
// from the job's configuration before anything is launched (`shardtrain
// plan`, and the compare report's "predicted" column). Torch-free.
//
// The model is this engine's own, not a generic formula: it counts the
// tensors our strategies and our GPT-2 keep alive at the moment the step
// peaks, which for single, DDP, FSDP and HSDP is the end of the forward pass
// (the LM head's last chunk), when all activations saved for backward exist:
//   parameters, gradients, optimizer state  persistent (a replica's, or 1/N
//                                           of the padded flat shards for FSDP)
//   gathered units      FSDP: full buffers of the units still gathered (the
//                       root and the last block; every block without reshard
//                       after forward); bf16 weight casts under autocast
//   activations         what autograd saves per block (counted tensor by
//                       tensor for this model), the embeddings, ln_f
//   logits              one chunk of the chunked LM head, plus wte's gradient
//                       computed in the head's forward (single/DDP)
//   communication       FSDP's vocabulary-parallel head: every rank's hidden
//                       states and their gradient
//   recomputation       activation checkpointing: how far the backward's
//                       recomputation of a block goes past the forward's peak
//   backward            a pipeline stage peaking in a backward
//   gradient norm       on CPU, the norm's double-precision piece (the
//                       step's peak when its activations are small)
// Pipeline stages (PlanPipelineStages) differ from each other, so each is
// planned alone: its own parameters, and its highest moment over its
// schedule's actions (the end of a micro-batch's forward, the backward of
// its last block or of the embeddings, the replicas' all-reduce), with the
// activations of the micro-batches it holds then, the received buffers and
// the sends held until the step ends (communication).
// Tensor parallelism (PlanMemory with tensor_parallel > 1, and within
// pipeline stages): the same tensors of a rank's slice, 1/T inside the
// blocks and whole outside them, the head scoring the rank's rows of wte.
// Checked against the tracking allocator's exact peak on CPU (fp32) within
// 2% (tests/integration/memory_plan_test.cc): gpt2-tiny and gpt2-mini at
// world sizes 1, 2 and 4, and every stage of gpt2-tiny in 2 stages and of
// gpt2-mini in 2 and 4, GPipe and 1F1B, with and without activation
// checkpointing, one replica and DDP; TP 2 and 4 alone, with DDP and FSDP,
// with activation checkpointing, and within pipeline stages. bf16 on CUDA is an
// estimate of the same tensors at their autocast dtypes, not yet measured on a
// GPU.
#ifndef SHARDTRAIN_CORE_PLAN_MEMORY_PLAN_H_
#define SHARDTRAIN_CORE_PLAN_MEMORY_PLAN_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "core/model/model_config.h"
#include "core/run/train_config.h"

namespace shardtrain {

struct MemoryPlan {
  std::string strategy;
  int64_t world_size = 1;
  // Pipeline stages: the plan of one stage's ranks (`stage` of
  // `pipeline_stages`, holding `stage_layers`, e.g. "blocks 0-1,
  // embeddings"), with the most micro-batches whose activations it holds at
  // its peak. 1, 0, "" and 0 without stages.
  int64_t pipeline_stages = 1;
  int64_t stage = 0;
  std::string stage_layers;
  int64_t micro_batches_in_flight = 0;
  int64_t shard_group_size = 0;   // HSDP's G; 0 for the others
  int64_t tensor_parallel = 1;    // T: the rank holds 1/T of each layer
  int64_t recomputed_blocks = 0;  // activation checkpointing
  int64_t parameters = 0;
  int64_t gradients = 0;
  int64_t optimizer_state = 0;
  int64_t gathered_units = 0;
  int64_t activations = 0;
  int64_t logits = 0;
  int64_t communication = 0;
  // Activation checkpointing: how far the backward's recomputation of a
  // block goes past the forward's peak (0 when it does not).
  int64_t recomputation = 0;
  // A pipeline stage peaking in a backward: what that backward makes past
  // the activations it frees (the received gradient is communication).
  int64_t backward = 0;
  // On CPU the gradient norm sums each gradient in double, one piece of up
  // to 1 Mi elements at a time: an 8 MiB temporary at most, the peak of a
  // step whose other moments hold less.
  int64_t gradient_norm = 0;

  // When the step peaks: at the end of the forward (the LM head's last
  // chunk), or, with activation checkpointing, in the backward of the last
  // recomputed block: at its softmax's backward, or at its start with all its
  // rebuilt activations alive (the larger of the two, when it exceeds the
  // head's moment).
  // A pipeline stage without the head peaks at the end of a micro-batch's
  // forward, in the backward of its last block (an MLP weight's gradient or
  // the MLP's gradients), in the embeddings' backward (stage 0: wte's dense
  // gradient is made), or, with data-parallel replicas, in the all-reduce
  // of the stage's gradients (FSDP within the stage: their reduce-scatter).
  enum class Moment {
    kHead,
    kRecomputedSoftmax,
    kRecomputedBlockStart,
    kStageForward,
    kStageBackward,
    kEmbeddingBackward,
    kGradientAllReduce,
    kGradientReduceScatter,
    kGradientNorm,
  };
  Moment peak_moment = Moment::kHead;
  // "the end of the forward (LM head)", ... for sentences and JSON; "LM
  // head", ... for a table's cell.
  std::string PeakMomentName() const;
  std::string PeakMomentShortName() const;

  int64_t total() const;
  // (name, bytes) in the order above, for tables and JSON.
  std::vector<std::pair<std::string, int64_t>> Parts() const;
};

// How the LibTorch the workers run computes attention, which decides what
// autograd saves: a masked softmax (LibTorch 1.x: the [T, T] probabilities
// per head) or fused scaled-dot-product attention (2.x: the output and a
// log-sum-exp per head).
enum class AttentionKind { kMaskedSoftmax, kFused };
// The kind this build's LibTorch uses.
AttentionKind BuiltAttentionKind();

// Per-rank peak for `config` (strategy, batch, seq_len, precision, device,
// FSDP/HSDP options, activation checkpointing, pipeline stages) at
// `world_size` ranks; HSDP's default shard group is the one-node default
// (DefaultShardGroupSize). With pipeline_stages > 1, the plan of the stage
// that needs the most (PlanPipelineStages). Errors: a model spec or
// strategy that does not parse; PlanPipelineStages's.
absl::StatusOr<MemoryPlan> PlanMemory(
    const TrainConfig& config, int64_t world_size,
    AttentionKind attention = BuiltAttentionKind());

// One plan per pipeline stage, in stage order, for `config` with
// pipeline_stages > 1 at `world_size` = stages x data-parallel ranks: each
// stage's parameters, gradients and AdamW state (stage 0 the embeddings, the
// last stage ln_f and its copy of the tied wte, the blocks as
// PartitionPipeline cuts them), and its peak over the step's schedule
// (StageActions over micro_batches x grad_accum micro-batches of batch_size
// / micro_batches rows): the activations of the micro-batches it holds, the
// received activation and gradient buffers, the sends held until the step
// ends, and the last stage's head. With FSDP within the stage, a shard of its
// units kept and the whole stage gathered within the step, its full
// gradients from the first backward to the reduce-scatter; with HSDP the
// same over its shard group (the groups' all-reduce works in place).
// InvalidArgument for what TrainConfig::ValidatePipeline or
// CheckMeshWorld refuses.
absl::StatusOr<std::vector<MemoryPlan>> PlanPipelineStages(
    const TrainConfig& config, int64_t world_size,
    AttentionKind attention = BuiltAttentionKind());

// What a device of `memory` bytes may be planned to: 98% of it, as the plan
// is checked to within 2% of the measured peak (memory_plan_test), so a
// batch chosen by it stays under a cap of `memory`.
inline int64_t PlannableBytes(int64_t memory) { return memory / 50 * 49; }

// The largest per-rank micro-batch (config.batch_size) in [1, max_batch]
// whose planned peak at `world_size` ranks is at most `budget` bytes; 0 when
// not even one sequence fits. With pipeline stages, a multiple of
// config.micro_batches (0 when micro_batches sequences do not fit). The plan
// grows with the batch, so this is a binary search over PlanMemory. Errors:
// PlanMemory's.
absl::StatusOr<int64_t> LargestFittingBatch(TrainConfig config,
                                            int64_t world_size, int64_t budget,
                                            int64_t max_batch = 1 << 16);

}  // namespace shardtrain

#endif  // SHARDTRAIN_CORE_PLAN_MEMORY_PLAN_H_
