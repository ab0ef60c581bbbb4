// Comparing secrets (bearer tokens, an attempt's worker secret) without
// letting the time taken say how much of a guess was right.
#ifndef SHARDTRAIN_COMMON_SECRETS_H_
#define SHARDTRAIN_COMMON_SECRETS_H_

#include "absl/strings/string_view.h"

namespace shardtrain {

// Whether `a` and `b` are equal, looking at every byte of the shorter
// whatever the first difference (a length difference alone is not hidden).
bool SecretsEqual(absl::string_view a, absl::string_view b);

}  // namespace shardtrain

#endif  // SHARDTRAIN_COMMON_SECRETS_H_
