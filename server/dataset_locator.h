// Where a job's `data` lives on the coordinator's host. "brown" lives in
// state-dir/data/brown, which the job's ranks prepare the first time
// (shardtrain-worker --prepare-data; the daemon reads no corpus itself);
// anything else must be a directory holding train.bin.
#ifndef SHARDTRAIN_SERVER_DATASET_LOCATOR_H_
#define SHARDTRAIN_SERVER_DATASET_LOCATOR_H_

#include <string>

#include "server/job_manager_types.h"

namespace shardtrain {

// Thread-safe; the Brown preparation runs at most once per process.
DataResolver MakeDatasetLocator(const std::string& state_dir);

}  // namespace shardtrain

#endif  // SHARDTRAIN_SERVER_DATASET_LOCATOR_H_
