// Reading the per-rank worker logs (state-dir/jobs/<id>/rank-<r>.log): the
// last lines for failure reports and `logs --tail`, and following a growing
// file for `logs -f`.
#ifndef SHARDTRAIN_SERVER_LOG_FILES_H_
#define SHARDTRAIN_SERVER_LOG_FILES_H_

#include <cstdint>
#include <string>
#include <vector>

namespace shardtrain {

// The last `n` complete or partial lines of the file (fewer when it is
// shorter; none when it is missing). Reads at most the file's last 1 MiB.
std::vector<std::string> ReadLastLines(const std::string& path, int n);

// Follows one file: each Poll() returns the complete lines appended since the
// last call. A missing file reads as empty until it appears.
class LogFollower {
 public:
  // `tail` > 0: start with the last `tail` lines; 0: from the beginning.
  LogFollower(std::string path, int tail);

  std::vector<std::string> Poll();
  // The unterminated last line, if any (call when the writer has finished).
  std::string TakePartial();

 private:
  std::string path_;
  int tail_;
  bool started_ = false;
  int64_t offset_ = 0;
  std::string partial_;
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_SERVER_LOG_FILES_H_
