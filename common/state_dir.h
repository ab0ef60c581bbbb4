// Where shardtraind keeps its state by default, and where the CLI looks for
// a local daemon: $XDG_CACHE_HOME/shardtrain/state, else
// ~/.cache/shardtrain/state. Header-only so the CLI needs no server library.
#ifndef SHARDTRAIN_COMMON_STATE_DIR_H_
#define SHARDTRAIN_COMMON_STATE_DIR_H_

#include <cstdlib>
#include <string>

namespace shardtrain {

inline std::string DefaultStateDir() {
  if (const char* cache = std::getenv("XDG_CACHE_HOME"); cache && *cache) {
    return std::string(cache) + "/shardtrain/state";
  }
  if (const char* home = std::getenv("HOME"); home && *home) {
    return std::string(home) + "/.cache/shardtrain/state";
  }
  return "/var/lib/shardtrain";
}

}  // namespace shardtrain

#endif  // SHARDTRAIN_COMMON_STATE_DIR_H_
