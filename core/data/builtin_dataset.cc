#include "core/data/builtin_dataset.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "core/data/asset_paths.h"
#include "core/data/bpe_tokenizer.h"
#include "core/data/brown_corpus.h"
#include "core/data/dataset_preparer.h"

namespace shardtrain {
namespace {

absl::Status PrepareBrown(const std::string& dir) {
  absl::StatusOr<BpeTokenizer> tokenizer = BpeTokenizer::LoadDefault();
  if (!tokenizer.ok()) return tokenizer.status();
  absl::StatusOr<std::string> corpus_dir = BrownCorpusDir();
  if (!corpus_dir.ok()) return corpus_dir.status();
  absl::StatusOr<Corpus> corpus = LoadBrownCorpus(*corpus_dir);
  if (!corpus.ok()) return corpus.status();
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

absl::Status PrepareBuiltinDataset(const std::string& name,
                                   const std::string& dir) {
  if (name != kBuiltinDataset) {
    return absl::InvalidArgumentError(
        absl::StrCat("data: '", name, "' is not a built-in dataset (only '",
                     kBuiltinDataset, "')"));
  }
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(dir).parent_path(),
                                      ec);
  const std::string lock_path = dir + ".lock";
  const int lock =
      ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (lock < 0) {
    return absl::PermissionDeniedError(absl::StrCat(
        "data: cannot open ", lock_path, ": ", std::strerror(errno)));
  }
  // Released when the descriptor closes, also if this process dies.
  while (::flock(lock, LOCK_EX) != 0 && errno == EINTR) {
  }
  absl::Status status = absl::OkStatus();
  if (!std::filesystem::exists(dir + "/train.bin", ec)) {
    status = PrepareBrown(dir);
    if (!status.ok()) {
      status = absl::FailedPreconditionError(absl::StrCat(
          "data: 'brown' could not be prepared: ", status.message()));
    }
  }
  ::close(lock);
  return status;
}

}  // namespace shardtrain
