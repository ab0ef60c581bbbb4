// Why an attempt failed, as the job shows it (Job.failure): a rank's exit
// and its log tail turned into a FailureReason and a message a person can
// act on. Pure but for one statvfs of the job's directory.
#ifndef SHARDTRAIN_SERVER_FAILURE_REASONS_H_
#define SHARDTRAIN_SERVER_FAILURE_REASONS_H_

#include <string>

#include "server/process_spawner.h"
#include "shardtrain/v1/job.pb.h"

namespace shardtrain {

// The job failed as a whole (no rank) because the coordinator restarted.
void SetCoordinatorRestartFailure(v1::Failure* failure, std::string message);

// Turns `failure` into OOM when its log tail shows an out-of-memory error
// (as LibTorch, CUDA and the C++ runtime word it); whether it did.
bool MarkOomFromLogTail(v1::Failure& failure);

// Names a full disk in `failure`'s message when its log tail says so
// (ENOSPC, EDQUOT), or when `job_dir` is on a file system with under 1 MiB
// left: a rank that cannot write its log leaves no tail to read.
void MarkDiskFull(v1::Failure& failure, const std::string& job_dir);

// What rank `rank`'s `exit` means for `failure` (made by
// JobTable::RankFailure, its log tail in it): a full disk, OOM, DIVERGED
// (kExitDiverged), INVALID_SPEC (kExitBadConfiguration, kExitInputRefused),
// else as it is.
void ClassifyRankExit(v1::Failure& failure, int rank, const ExitStatus& exit,
                      const std::string& job_dir);

}  // namespace shardtrain

#endif  // SHARDTRAIN_SERVER_FAILURE_REASONS_H_
