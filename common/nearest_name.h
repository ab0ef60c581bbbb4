// "Did you mean ...?": the known name nearest a mistyped one, for usage
// errors and for names read from files and specs (model presets, job-spec
// keys).
#ifndef SHARDTRAIN_COMMON_NEAREST_NAME_H_
#define SHARDTRAIN_COMMON_NEAREST_NAME_H_

#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace shardtrain {

// The name in `names` closest to `word` by edit distance, when close enough
// to be a typo of it (at most a third of its letters, and at least 1, off);
// "" when none is.
std::string NearestName(absl::string_view word,
                        const std::vector<std::string>& names);

}  // namespace shardtrain

#endif  // SHARDTRAIN_COMMON_NEAREST_NAME_H_
