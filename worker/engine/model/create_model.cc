#include "worker/engine/model/create_model.h"

#include <c10/util/Exception.h>
#include <torch/types.h>

#include <map>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "worker/engine/model/gpt2.h"
#include "worker/engine/model/llama.h"

namespace shardtrain {

absl::StatusOr<CausalLm> CreateCausalLm(const ModelConfig& config,
                                        uint64_t seed) {
  if (absl::Status s = config.Validate(); !s.ok()) return s;
  try {
    if (config.is_llama()) return CausalLm(Llama(config, seed));
    return CausalLm(Gpt2(config, seed));
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("building model ", config.ToSpec(),
                                            ": ", e.what_without_backtrace()));
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(
        absl::StrCat("building model ", config.ToSpec(), ": out of memory (",
                     config.NumParameters(), " parameters)"));
  }
}

absl::Status LoadModelWeights(const WeightReader& read,
                              const std::vector<std::string>& names,
                              CausalLmImpl& model) {
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < names.size(); ++i) index[names[i]] = i;
  std::vector<std::pair<size_t, torch::Tensor>> targets;
  for (auto& item : model.named_parameters()) {
    auto it = index.find(item.key());
    if (it == index.end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "loading weights: the source has no tensor ", item.key()));
    }
    targets.emplace_back(it->second, item.value());
  }
  if (targets.size() != names.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("loading weights: the source holds ", names.size(),
                     " tensors, the model ", targets.size()));
  }
  try {
    torch::NoGradGuard no_grad;
    for (auto& [i, p] : targets) {
      // Straight into the parameter when it is CPU fp32, else via a staging
      // tensor that copy_() moves to the parameter's device and dtype.
      const bool direct =
          p.is_cpu() && p.scalar_type() == torch::kFloat && p.is_contiguous();
      torch::Tensor dest =
          direct ? p : torch::empty(p.sizes(), torch::dtype(torch::kFloat));
      if (absl::Status s = read(i, dest.data_ptr<float>()); !s.ok()) return s;
      if (!direct) p.copy_(dest);
    }
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat("loading weights: ", e.what_without_backtrace()));
  }
  return absl::OkStatus();
}

}  // namespace shardtrain
