// CheckpointStore: the checkpoints of one run under OUT/checkpoints/.
//
//   OUT/checkpoints/step_00000100/   one directory per checkpoint
//                                    (checkpoint_format.h: checkpoint.json
//                                    and one data file per rank)
//   OUT/checkpoints/latest           name of the newest complete checkpoint
//
// A checkpoint is written into a hidden temporary directory and renamed into
// place only once complete, and `latest` is replaced atomically after that,
// so a crash at any moment leaves the previous checkpoint usable.
#ifndef SHARDTRAIN_CORE_CHECKPOINT_CHECKPOINT_STORE_H_
#define SHARDTRAIN_CORE_CHECKPOINT_CHECKPOINT_STORE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace shardtrain {

class CheckpointStore {
 public:
  // `keep`: complete checkpoints kept; older ones are deleted on Commit.
  CheckpointStore(std::string out_dir, int keep = 2);

  // The directory to write the checkpoint of `step` into (created, emptied).
  absl::StatusOr<std::string> Begin(int64_t step);
  // Publishes the checkpoint written since Begin(step).
  absl::Status Commit(int64_t step);
  // The newest complete checkpoint directory; NotFound when there is none.
  absl::StatusOr<std::string> Latest() const;
  // What a resume may try, best first: Latest(), then the older complete
  // checkpoints, newest first (when `latest` is unreadable: every complete
  // checkpoint, newest first). Empty when there is none.
  std::vector<std::string> Candidates() const;

  std::string root() const { return root_; }
  // Where the checkpoint of `step` is written before Commit (what Begin
  // returns); other ranks write their parts there too.
  std::string StagingDir(int64_t step) const;

 private:
  std::string FinalDir(int64_t step) const;

  std::string root_;
  int keep_;
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_CORE_CHECKPOINT_CHECKPOINT_STORE_H_
