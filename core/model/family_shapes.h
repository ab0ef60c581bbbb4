// FamilyShapes: what the memory and step-time plans (core/plan) need to know
// of a model family's tensors, counted once per family beside its model
// code, so that the planners hold no branch per family. A new family is its
// model file (worker/engine/model), its tensor-parallel plan and one
// function here that fills these numbers from its ModelConfig.
#ifndef SHARDTRAIN_CORE_MODEL_FAMILY_SHAPES_H_
#define SHARDTRAIN_CORE_MODEL_FAMILY_SHAPES_H_

#include <cstdint>

#include "core/model/model_config.h"

namespace shardtrain {

struct FamilyShapes {
  // Elements per token autograd keeps for one block's backward, at the
  // compute dtype: those every tensor-parallel rank keeps whole (norm
  // outputs, residuals, the block's output) and those split over its T
  // ranks (the attention's and the MLP's tensors).
  int64_t kept_whole = 0;
  int64_t kept_split = 0;
  // fp32 values per token kept whatever the compute dtype (the norms'
  // statistics, and their normalised inputs where a norm computes in fp32),
  // and those LibTorch 1.x keeps besides (its mean keeps its input: the
  // squares of an RMSNorm). The attention's state is counted apart (it
  // depends on the attention kernel: AttentionKind).
  int64_t kept_fp32 = 0;
  int64_t kept_fp32_torch1 = 0;

  // Parameters of one block that tensor parallelism keeps whole on every
  // rank (norms, row-parallel biases); the rest is split over the ranks.
  int64_t block_whole_params = 0;
  // Parameters of one block that are not matrices (norms, biases): the
  // matrices are the block's FLOPs.
  int64_t block_vector_params = 0;
  // The final norm's parameters.
  int64_t final_norm_params = 0;
  // Output width of a block's column-parallel matrices (those whose output
  // a tensor-parallel rank computes a slice of, f's backward sums behind).
  int64_t column_parallel_width = 0;

  // zb-h1 (pipeline_plan.h): elements per token a block keeps from a
  // micro-batch's B to its W (each projection's input and output
  // gradient), and those a low-precision compute adds (a projection's own
  // cast of an fp32 norm output).
  int64_t deferred = 0;
  int64_t deferred_low_precision = 0;
};

// The shapes of `model`'s family at its dimensions.
FamilyShapes ShapesOf(const ModelConfig& model);

}  // namespace shardtrain

#endif  // SHARDTRAIN_CORE_MODEL_FAMILY_SHAPES_H_
