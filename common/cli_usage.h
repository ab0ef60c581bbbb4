// Usage errors the same way in every program (shardtrain, shardtrain-train,
// shardtraind): exit 2, the problem named, and for a mistyped option or
// command the nearest one ("did you mean --max-steps?").
#ifndef SHARDTRAIN_COMMON_CLI_USAGE_H_
#define SHARDTRAIN_COMMON_CLI_USAGE_H_

#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/string_view.h"

namespace shardtrain {

// The exit status of a usage error, in every program.
inline constexpr int kUsageExitCode = 2;

// The name in `names` closest to `word` by edit distance, when close enough
// to be a typo of it (at most a third of its letters, and at least 1, off);
// "" when none is.
std::string NearestName(absl::string_view word,
                        const std::vector<std::string>& names);

// Handles what CLI11's parse threw: --help (and --version) printed with
// status 0; anything else printed to stderr as
//   <program>: usage error: <what>[; did you mean <name>?] (run ... --help)
// with status kUsageExitCode.
int ReportParseError(CLI::App& app, const CLI::ParseError& error,
                     absl::string_view program);

}  // namespace shardtrain

#endif  // SHARDTRAIN_COMMON_CLI_USAGE_H_
