#include "server/dataset_locator.h"

#include <sys/stat.h>

#include <filesystem>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/input_file.h"
#include "core/data/asset_paths.h"
#include "core/data/bpe_tokenizer.h"
#include "core/data/brown_corpus.h"
#include "core/data/dataset_preparer.h"

namespace shardtrain {
namespace {

constexpr size_t kMaxPathLength = 4096;

absl::Status PrepareBrown(const std::string& dir) {
  absl::StatusOr<BpeTokenizer> tokenizer = BpeTokenizer::LoadDefault();
  if (!tokenizer.ok()) return tokenizer.status();
  absl::StatusOr<std::string> corpus_dir = BrownCorpusDir();
  if (!corpus_dir.ok()) return corpus_dir.status();
  absl::StatusOr<Corpus> corpus = LoadBrownCorpus(*corpus_dir);
  if (!corpus.ok()) return corpus.status();
  // Prepared next to the final place and renamed, so a crash never leaves a
  // half-written dataset that later jobs would trust.
  const std::string staging = dir + ".staging";
  std::error_code ec;
  std::filesystem::remove_all(staging, ec);
  absl::StatusOr<DatasetSummary> summary =
      PrepareDataset(*corpus, *tokenizer, staging);
  if (!summary.ok()) return summary.status();
  std::filesystem::rename(staging, dir, ec);
  if (ec) {
    return absl::InternalError(absl::StrCat("cannot rename ", staging, " to ",
                                            dir, ": ", ec.message()));
  }
  return absl::OkStatus();
}

}  // namespace

DataResolver MakeDatasetLocator(const std::string& state_dir) {
  struct Shared {
    absl::Mutex mutex;
    bool brown_ready ABSL_GUARDED_BY(mutex) = false;
  };
  auto shared = std::make_shared<Shared>();
  const std::string brown_dir = state_dir + "/data/brown";
  return [shared,
          brown_dir](const std::string& data) -> absl::StatusOr<std::string> {
    if (data == kBuiltinDataset) {
      absl::MutexLock lock(&shared->mutex);
      if (!shared->brown_ready) {
        if (!std::filesystem::exists(brown_dir + "/train.bin")) {
          std::error_code ec;
          std::filesystem::create_directories(
              std::filesystem::path(brown_dir).parent_path(), ec);
          if (absl::Status s = PrepareBrown(brown_dir); !s.ok()) {
            return absl::FailedPreconditionError(absl::StrCat(
                "data: 'brown' could not be prepared: ", s.message()));
          }
        }
        shared->brown_ready = true;
      }
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
