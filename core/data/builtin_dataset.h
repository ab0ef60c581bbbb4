// The built-in dataset a job names as `data: brown`: the Brown Corpus (from
// the assets scripts/setup installs), tokenized with GPT-2's BPE into a
// prepared directory the first time a job needs it.
//
// Prepared by the job's own ranks (shardtrain-worker --prepare-data brown),
// never by shardtraind: tokenizing is job work, and a failure fails the job
// with its reason instead of stalling a daemon thread.
#ifndef SHARDTRAIN_CORE_DATA_BUILTIN_DATASET_H_
#define SHARDTRAIN_CORE_DATA_BUILTIN_DATASET_H_

#include <string>

#include "absl/status/status.h"

namespace shardtrain {

// The name a JobSpec's `data` gives the built-in dataset.
inline constexpr char kBuiltinDataset[] = "brown";

// Makes `dir` the prepared Brown Corpus (train.bin, val.bin) unless it
// already is. Safe to call from every rank of every job at once: one
// preparer holds `dir`.lock while the others wait for it, and the dataset is
// written next to `dir` and renamed, so a crash never leaves a half-written
// one that later jobs would trust.
absl::Status PrepareBuiltinDataset(const std::string& name,
                                   const std::string& dir);

}  // namespace shardtrain

#endif  // SHARDTRAIN_CORE_DATA_BUILTIN_DATASET_H_
