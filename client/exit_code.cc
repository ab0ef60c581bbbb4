#include "client/exit_code.h"

#include <iostream>

namespace shardtrain::cli {

int ReportFailure(const absl::Status& status) {
  return ReportFailure(status.message());
}

int ReportFailure(absl::string_view message) {
  std::cerr << "shardtrain: error: " << message << std::endl;
  return kExitFailure;
}

}  // namespace shardtrain::cli
