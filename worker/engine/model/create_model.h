// The model of a config, whichever family it is.
#ifndef SHARDTRAIN_WORKER_ENGINE_MODEL_CREATE_MODEL_H_
#define SHARDTRAIN_WORKER_ENGINE_MODEL_CREATE_MODEL_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/model/llmc_layout.h"
#include "core/model/model_config.h"
#include "worker/engine/model/causal_lm.h"

namespace shardtrain {

// Validates `config` and builds its family's model, initialised from `seed`
// (the same numbers on every rank). Errors: the config's, or LibTorch's
// (e.g. out of memory), as a Status.
absl::StatusOr<CausalLm> CreateCausalLm(const ModelConfig& config,
                                        uint64_t seed);

// Reads every parameter of `model` (on any device) from `read`, whose tensor
// i is the parameter named names[i] (core/checkpoint/checkpoint_export.h's
// ModelWeights: any format). A parameter `names` lacks, or a tensor of
// another size, is refused naming it before anything is read.
absl::Status LoadModelWeights(const WeightReader& read,
                              const std::vector<std::string>& names,
                              CausalLmImpl& model);

}  // namespace shardtrain

#endif  // SHARDTRAIN_WORKER_ENGINE_MODEL_CREATE_MODEL_H_
