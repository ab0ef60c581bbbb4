// Where a job's `data` lives on the coordinator's host. "brown" is prepared
// once (from the corpus scripts/setup installs) into state-dir/data/brown;
// anything else must be a directory holding train.bin.
#ifndef SHARDTRAIN_SERVER_DATASET_LOCATOR_H_
#define SHARDTRAIN_SERVER_DATASET_LOCATOR_H_

#include <string>

#include "server/job_manager.h"

namespace shardtrain {

// Thread-safe; the Brown preparation runs at most once per process.
DataResolver MakeDatasetLocator(const std::string& state_dir);

}  // namespace shardtrain

#endif  // SHARDTRAIN_SERVER_DATASET_LOCATOR_H_
