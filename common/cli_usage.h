// Usage errors the same way in every program (shardtrain, shardtrain-train,
// shardtraind): exit 2, the problem named, and for a mistyped option or
// command the nearest one ("did you mean --max-steps?").
#ifndef SHARDTRAIN_COMMON_CLI_USAGE_H_
#define SHARDTRAIN_COMMON_CLI_USAGE_H_

#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/string_view.h"
#include "common/nearest_name.h"

namespace shardtrain {

// The exit status of a usage error, in every program.
inline constexpr int kUsageExitCode = 2;

// Handles what CLI11's parse threw: --help (and --version) printed with
// status 0; anything else printed to stderr as
//   <program>: usage error: <what>[; did you mean <name>?] (run ... --help)
// with status kUsageExitCode.
int ReportParseError(CLI::App& app, const CLI::ParseError& error,
                     absl::string_view program);

}  // namespace shardtrain

#endif  // SHARDTRAIN_COMMON_CLI_USAGE_H_
