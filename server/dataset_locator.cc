#include "server/dataset_locator.h"

#include <sys/stat.h>

#include <filesystem>

#include "absl/strings/str_cat.h"
#include "common/input_file.h"
#include "core/data/builtin_dataset.h"

namespace shardtrain {
namespace {

constexpr size_t kMaxPathLength = 4096;

}  // namespace

DataResolver MakeDatasetLocator(const std::string& state_dir) {
  const std::string brown_dir = state_dir + "/data/brown";
  return [brown_dir](const std::string& data) -> absl::StatusOr<std::string> {
    if (data == kBuiltinDataset) {
      // Prepared by the job's ranks (--prepare-data), not here.
      return brown_dir;
    }
    if (data.empty()) {
      return absl::InvalidArgumentError(
          "data: required; a prepared directory (train.bin, val.bin) or "
          "'brown'");
    }
    if (data.size() > kMaxPathLength) {
      return absl::InvalidArgumentError(
          absl::StrCat("data: got a path of ", data.size(),
                       " characters; at most ", kMaxPathLength));
    }
    std::error_code ec;
    if (!std::filesystem::is_directory(data, ec)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "data: got '", data,
          "'; no such directory on the coordinator's host (expected a "
          "prepared directory with train.bin, or 'brown')"));
    }
    // stat() follows links without opening: a FIFO is named, not waited on.
    struct stat train;
    if (::stat((data + "/train.bin").c_str(), &train) == 0 &&
        !S_ISREG(train.st_mode)) {
      return absl::InvalidArgumentError(
          absl::StrCat("data: '", data, "/train.bin' is ",
                       FileKindName(train.st_mode), ", not a regular file"));
    }
    if (!std::filesystem::is_regular_file(data + "/train.bin", ec)) {
      return absl::InvalidArgumentError(
          absl::StrCat("data: '", data,
                       "' has no train.bin (prepare it with "
                       "`shardtrain data prepare`)"));
    }
    return std::filesystem::absolute(data).string();
  };
}

}  // namespace shardtrain
