// The CLI's exit codes and its one way of reporting a failure.
#ifndef SHARDTRAIN_CLIENT_EXIT_CODE_H_
#define SHARDTRAIN_CLIENT_EXIT_CODE_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace shardtrain::cli {

enum ExitCode : int {
  kExitOk = 0,
  kExitFailure = 1,  // the command ran and failed (bad input, missing files,
                     // the job failed or was cancelled)
  kExitUsage = 2,    // the command line itself is wrong
  kExitUnreachable = 3,  // no daemon answered at the address
};

// Prints "shardtrain: error: <message>" as one line on stderr and returns
// kExitFailure.
int ReportFailure(const absl::Status& status);
int ReportFailure(absl::string_view message);

}  // namespace shardtrain::cli

#endif  // SHARDTRAIN_CLIENT_EXIT_CODE_H_
