#include "server/failure_reasons.h"

#include <sys/statvfs.h>

#include <cstdint>
#include <initializer_list>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/exit_codes.h"

namespace shardtrain {
namespace {

// Whether a line of `failure`'s log tail holds one of `phrases` (lower case).
bool LogTailSays(const v1::Failure& failure,
                 std::initializer_list<const char*> phrases) {
  for (const std::string& line : failure.log_tail()) {
    const std::string lower = absl::AsciiStrToLower(line);
    for (const char* phrase : phrases) {
      if (lower.find(phrase) != std::string::npos) return true;
    }
  }
  return false;
}

}  // namespace

void SetCoordinatorRestartFailure(v1::Failure* failure, std::string message) {
  failure->set_reason(v1::COORDINATOR_RESTART);
  failure->set_rank(-1);
  failure->set_message(std::move(message));
}

bool MarkOomFromLogTail(v1::Failure& failure) {
  if (failure.reason() == v1::OOM ||
      !LogTailSays(failure, {"out of memory", "outofmemoryerror",
                             "std::bad_alloc", "can't allocate memory"})) {
    return false;
  }
  failure.set_reason(v1::OOM);
  failure.set_message(failure.message() + " (out of memory)");
  return true;
}

void MarkDiskFull(v1::Failure& failure, const std::string& job_dir) {
  bool full =
      LogTailSays(failure, {"no space left on device", "disk quota exceeded"});
  if (struct statvfs fs; !full && statvfs(job_dir.c_str(), &fs) == 0) {
    full =
        static_cast<int64_t>(fs.f_bavail) * static_cast<int64_t>(fs.f_frsize) <
        (int64_t{1} << 20);
  }
  if (!full) return;
  failure.set_message(absl::StrCat(
      failure.message(), " (no space left on device: ENOSPC writing under ",
      job_dir, "; free space on its file system, then resubmit)"));
}

void ClassifyRankExit(v1::Failure& failure, int rank, const ExitStatus& exit,
                      const std::string& job_dir) {
  if (exit.exit_code != 0) MarkDiskFull(failure, job_dir);
  if (!MarkOomFromLogTail(failure) && exit.exit_code == kExitDiverged) {
    // Deterministic: a restart from the last checkpoint would diverge at
    // the same step again.
    failure.set_reason(v1::DIVERGED);
    failure.set_message(absl::StrCat(
        "rank ", rank,
        ": training diverged (a non-finite loss or gradient "
        "norm; its last step is in the metrics, the reason in its log)"));
  } else if (exit.exit_code == kExitBadConfiguration) {
    // Deterministic: the same spec and files are refused again.
    failure.set_reason(v1::INVALID_SPEC);
    failure.set_message(absl::StrCat(
        "rank ", rank,
        ": the job's configuration, or a file it names (a model's "
        "config.json, a tokenizer, the data), was refused (exit code 2); its "
        "log says which and why"));
  } else if (exit.exit_code == kExitInputRefused) {
    failure.set_reason(v1::INVALID_SPEC);
    failure.set_message(absl::StrCat(
        "rank ", rank,
        ": refused a file the job names (outside shardtraind --path-root, or "
        "not readable by the daemon's user); its log says which"));
  }
}

}  // namespace shardtrain
