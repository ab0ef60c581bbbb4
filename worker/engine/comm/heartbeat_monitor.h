// HeartbeatMonitor: tells which ranks are lost when a collective fails.
//
// A collective that fails only says "connection closed" or "timed out"; it
// does not say who stopped. Every rank therefore runs a monitor whose thread
// writes this rank's heartbeat (the wall clock, in ms) to a shared key-value
// store every `interval`. When a collective fails, Diagnose() watches the
// other ranks' heartbeats: a rank whose heartbeat changes is alive, one whose
// heartbeat stays unchanged for `stale_after` is lost, and a store that stops
// answering means its host (rank 0) is lost. Only the heartbeat thread talks
// to the store, so Diagnose() returns within about stale_after + interval
// even when the store hangs. Torch-free: the store is a small interface.
#ifndef SHARDTRAIN_WORKER_ENGINE_COMM_HEARTBEAT_MONITOR_H_
#define SHARDTRAIN_WORKER_ENGINE_COMM_HEARTBEAT_MONITOR_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/clock.h"

namespace shardtrain {

// The part of a key-value store (c10d's TCPStore in production) the monitor
// uses. Called from the monitor's thread only.
class HeartbeatStore {
 public:
  virtual ~HeartbeatStore() = default;
  virtual absl::Status Set(const std::string& key, int64_t value) = 0;
  // The value of `key`, or 0 when it was never set; must not block waiting
  // for the key to appear.
  virtual absl::StatusOr<int64_t> Get(const std::string& key) = 0;
};

struct HeartbeatOptions {
  std::chrono::milliseconds interval{1000};
  // A rank whose heartbeat does not change for this long is lost. Must be
  // well above `interval`.
  std::chrono::milliseconds stale_after{3000};
  // What the monitor reads the time from and waits on; null: the real
  // clock. Heartbeat values are this clock's Unix milliseconds.
  Clock* clock = nullptr;
};

// What Diagnose() found.
struct HeartbeatDiagnosis {
  struct LostRank {
    int64_t rank;
    double silent_seconds;  // since its last heartbeat
  };
  std::vector<LostRank> lost;
  // The store did not answer (its host, rank 0, is lost); `lost` then lists
  // no one else, since nothing could be read.
  bool store_lost = false;
  std::string store_error;

  bool any_lost() const { return store_lost || !lost.empty(); }
  // "rank 1 lost (no heartbeat for 3.2 s)", "ranks 1, 2 lost (...)",
  // "rank 0 (the store host) lost (store unreachable: ...)", or
  // "no rank lost (all heartbeats current)".
  std::string ToString() const;
};

class HeartbeatMonitor {
 public:
  // Starts beating at once. `store` is used only by the monitor's thread.
  HeartbeatMonitor(std::unique_ptr<HeartbeatStore> store, int64_t rank,
                   int64_t world_size, HeartbeatOptions options = {});
  // Stops the thread. A store call in progress normally returns at once; one
  // that hangs (a frozen store host: c10d's client has no receive timeout)
  // is not waited for beyond `interval`: the thread is then left to end with
  // that call, keeping its own state alive until it does.
  ~HeartbeatMonitor();
  HeartbeatMonitor(const HeartbeatMonitor&) = delete;
  HeartbeatMonitor& operator=(const HeartbeatMonitor&) = delete;

  // The store key holding `rank`'s heartbeat.
  static std::string Key(int64_t rank);

  // Watches the other ranks' heartbeats until each is alive or lost (at most
  // about stale_after + interval). Thread-safe; concurrent callers share the
  // watch.
  HeartbeatDiagnosis Diagnose();

 private:
  class Core;  // everything the thread touches, shared with it

  std::shared_ptr<Core> core_;
  std::thread thread_;
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_WORKER_ENGINE_COMM_HEARTBEAT_MONITOR_H_
