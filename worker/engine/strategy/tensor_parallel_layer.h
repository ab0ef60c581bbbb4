// The tensor-parallel layer's parts, over any model's tensor-parallel plan
// (causal_lm.h): Megatron's f and g over a group, the vocabulary-parallel
// view of a rank's rows of the token embedding, and a rank's slices as
// ranges of the global tensors (checkpoints, export). The tensor-parallel
// strategy and the pipeline's tensor-parallel stages both apply it.
#ifndef SHARDTRAIN_WORKER_ENGINE_STRATEGY_TENSOR_PARALLEL_LAYER_H_
#define SHARDTRAIN_WORKER_ENGINE_STRATEGY_TENSOR_PARALLEL_LAYER_H_

#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "worker/engine/comm/communicator.h"
#include "worker/engine/model/causal_lm.h"
#include "worker/engine/strategy/strategy.h"
#include "worker/engine/strategy/vocab_parallel.h"

namespace shardtrain {

// Megatron's f and g over `group` (the ranks of one tensor-parallel group,
// which must outlive the result).
std::unique_ptr<TensorParallelOps> MakeTensorParallelOps(Communicator* group);

// The vocabulary-parallel view of a tensor-parallel rank's rows of the
// token embedding (or, with `head`, of the head's weight, the same tensor
// when tied): shared batch over `group`, the products in bf16 for CUDA mixed
// precision.
// With `rows_held`, the view is of the embedding's weight and a zeroed gradient
// made for it; without (the rows sharded in an FsdpUnit), weight and gradient
// are left for the caller to point at the gathered rows. Throws c10::Error.
VocabShard TensorParallelVocabShard(CausalLmImpl& model, Communicator* group,
                                    const StrategyOptions& options,
                                    bool rows_held, bool head = false);

class FsdpUnit;

// A tensor-parallel rank's vocabulary-parallel ends: its rows of the token
// embedding, which the embedding's lookup reads, and of the head's weight,
// which the head scores with (the same rows when the head is tied). Held
// (rows_held), they are views of the parameters with zeroed gradients made
// for them; sharded over replicas, of the units that hold them: pointed at
// the gathered rows within a step (UseGatheredUnits), their gradients buffers
// of their own handed to the units before the reduce-scatter
// (HandGradientsToUnits).
class VocabParallelEnds {
 public:
  VocabParallelEnds() = default;
  // The ends this rank runs: `embedding` (a pipeline's first stage),
  // `head` (its last). Throws c10::Error.
  VocabParallelEnds(CausalLmImpl& model, Communicator* group,
                    const StrategyOptions& options, bool rows_held,
                    bool embedding = true, bool head = true);

  VocabShard& embedding() { return embedding_; }
  VocabShard& head() { return tied_ ? embedding_ : head_; }

  // Whether the unit named `unit` (FsdpUnit names: a parameter's module
  // path) holds one of the ends' rows, which the vocabulary-parallel paths
  // read in fp32.
  bool IsEndUnit(const std::string& unit) const;
  // Finds the units that hold the ends among `units`.
  void FindUnits(const std::vector<std::unique_ptr<FsdpUnit>>& units);
  // After the units' gathers: the rows are views of the gathered buffers
  // and, under grad mode, gradients of their own. UseGatheredUnit: the same
  // for `unit` alone, when it holds one of the ends (nothing otherwise), as
  // a pipeline stage gathers its units one by one.
  void UseGatheredUnits();
  void UseGatheredUnit(const FsdpUnit* unit);
  // Before the units' reduce-scatters: those gradients become the units'.
  void HandGradientsToUnits();
  // After the units are freed.
  void ReleaseUnits();
  // Held rows whose gradients a bucket now owns: their .grad() views.
  void UseGradientViews(CausalLmImpl& model);

 private:
  bool tied_ = true;
  std::string embedding_unit_name_, head_unit_name_;
  VocabShard embedding_, head_;
  FsdpUnit* embedding_unit_ = nullptr;
  FsdpUnit* head_unit_ = nullptr;
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_WORKER_ENGINE_STRATEGY_TENSOR_PARALLEL_LAYER_H_
