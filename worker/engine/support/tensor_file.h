// Named tensors to and from one file, written atomically (temp + rename), in
// PyTorch's pickle format: `torch.load(path)` in Python reads it as a dict.
#ifndef SHARDTRAIN_WORKER_ENGINE_SUPPORT_TENSOR_FILE_H_
#define SHARDTRAIN_WORKER_ENGINE_SUPPORT_TENSOR_FILE_H_

#include <torch/types.h>

#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace shardtrain {

using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

absl::Status SaveTensorFile(const std::string& path,
                            const NamedTensors& tensors);
absl::StatusOr<NamedTensors> LoadTensorFile(const std::string& path);

}  // namespace shardtrain

#endif  // SHARDTRAIN_WORKER_ENGINE_SUPPORT_TENSOR_FILE_H_
