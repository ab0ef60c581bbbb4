// The arithmetic the memory plan is built of (memory_plan.cc for one stage
// or a tensor-parallel rank, memory_plan_pipeline.cc for pipeline stages):
// a model's shapes at a micro-step's tokens, and the bytes its activations,
// logits, recomputation and gradient norm hold. Internal to core/plan.
// Torch-free.
#ifndef SHARDTRAIN_CORE_PLAN_MEMORY_PLAN_SHAPES_H_
#define SHARDTRAIN_CORE_PLAN_MEMORY_PLAN_SHAPES_H_

#include <cstdint>

#include "core/model/family_shapes.h"
#include "core/model/model_config.h"
#include "core/plan/memory_plan.h"

namespace shardtrain::memory_plan_detail {

struct Shapes {
  int64_t c = 0, heads = 0, seq = 0, vocab = 0, padded_vocab = 0;
  int64_t block_params = 0;   // one transformer block
  int64_t root_params = 0;    // input_params + output_params
  int64_t input_params = 0;   // GPT-2's wpe
  int64_t output_params = 0;  // the final norm, an untied head
  int64_t wte_params = 0;
  // What the model's family keeps and splits (core/model/family_shapes.h).
  FamilyShapes family;
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

int64_t RoundUp(int64_t value, int64_t multiple);

int64_t BlockBytesPerToken(const Shapes& s, int64_t element_bytes,
                           AttentionKind attention);

int64_t RecomputedBlocks(const Shapes& s, int64_t every);

int64_t ActivationBytes(const Shapes& s, int64_t element_bytes,
                        AttentionKind attention, int64_t recomputed_blocks);

int64_t IdsAndMaskBytes(int64_t tokens, AttentionKind attention,
                        int64_t seq_len);

int64_t HeadLogitsBytes(const Shapes& s, int64_t chunk_budget, bool bf16);

int64_t TensorParallelRecomputeBytes(const Shapes& s, int64_t element_bytes,
                                     AttentionKind attention,
                                     int64_t held_at_softmax,
                                     MemoryPlan::Moment* moment);

int64_t RecomputePeakActivationBytes(const Shapes& s, int64_t element_bytes,
                                     AttentionKind attention, int64_t every,
                                     MemoryPlan::Moment* moment,
                                     int64_t held_at_softmax = 0);

Shapes ModelShapes(const ModelConfig& model, int64_t seq_len, int64_t tokens);

Shapes SliceForTensorParallel(Shapes s, int64_t t);

MemoryPlan WithGradientNorm(MemoryPlan plan, int64_t gradients,
                            int64_t ids_and_mask, int64_t largest, bool cuda);

int64_t BlockBackwardBytes(const Shapes& s);

}  // namespace shardtrain::memory_plan_detail

#endif  // SHARDTRAIN_CORE_PLAN_MEMORY_PLAN_SHAPES_H_
