#include "worker/engine/model/create_model.h"

#include <c10/util/Exception.h>

#include <new>

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

}  // namespace shardtrain
