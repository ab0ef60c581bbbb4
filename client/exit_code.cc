#include "client/exit_code.h"

#include <iostream>

#include "client/output_format.h"

namespace shardtrain::cli {

int ReportFailure(const absl::Status& status) {
  return ReportFailure(status.message());
}

int ReportFailure(absl::string_view message) {
  std::cerr << "shardtrain: error: "
            << TerminalSafe(message, /*keep_newlines=*/true) << std::endl;
  return kExitFailure;
}

}  // namespace shardtrain::cli
