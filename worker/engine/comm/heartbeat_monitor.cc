#include "worker/engine/comm/heartbeat_monitor.h"

#include <algorithm>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace shardtrain {
namespace {

std::string SecondsText(absl::Duration d) {
  return absl::StrFormat("%.1f s", absl::ToDoubleSeconds(d));
}

}  // namespace

std::string HeartbeatDiagnosis::ToString() const {
  if (store_lost) {
    return absl::StrCat(
        "rank 0 (the store host) lost (store unreachable: ", store_error, ")");
  }
  if (lost.empty()) return "no rank lost (all heartbeats current)";
  std::vector<std::string> ranks;
  std::vector<std::string> silences;
  for (const LostRank& r : lost) {
    ranks.push_back(absl::StrCat(r.rank));
    silences.push_back(absl::StrFormat("%.1f s", r.silent_seconds));
  }
  return absl::StrCat(lost.size() == 1 ? "rank " : "ranks ",
                      absl::StrJoin(ranks, ", "), " lost (no heartbeat for ",
                      absl::StrJoin(silences, ", "), ")");
}

class HeartbeatMonitor::Core {
 public:
  Core(std::unique_ptr<HeartbeatStore> store, int64_t rank, int64_t world_size,
       HeartbeatOptions options)
      : store_(std::move(store)),
        rank_(rank),
        world_size_(world_size),
        interval_(absl::FromChrono(options.interval)),
        stale_after_(absl::FromChrono(options.stale_after)),
        clock_(options.clock != nullptr ? options.clock : SystemClock()),
        observations_(world_size) {}

  // The thread's body: beats every `interval` and, while someone is in
  // Diagnose(), polls the other ranks' heartbeats several times per beat.
  void Run() {
    const absl::Duration poll_every =
        std::max(interval_ / 4, absl::Milliseconds(10));
    absl::Time next_beat = clock_->Now();
    absl::Time next_poll = next_beat;
    absl::MutexLock lock(&mutex_);
    while (!stop_) {
      const absl::Time now = clock_->Now();
      const bool beat = now >= next_beat;
      const bool poll = watchers_ > 0 && now >= next_poll;
      if (beat || poll) {
        mutex_.Unlock();
        Tick(beat, poll);
        mutex_.Lock();
        if (beat) next_beat = now + interval_;
        if (poll) next_poll = clock_->Now() + poll_every;
        cv_.SignalAll();
        continue;
      }
      const absl::Time wake =
          watchers_ > 0 ? std::min(next_beat, next_poll) : next_beat;
      // Woken early by Stop() or a new watcher (both signal); the loop
      // re-checks either way.
      clock_->WaitUntil(&cv_, &mutex_, wake);
    }
    exited_ = true;
    cv_.SignalAll();
  }

  // Asks the thread to stop; true when it has. Store calls take
  // microseconds, so one still running after a whole interval (at least
  // 100 ms) is hung on a frozen host and is not waited for.
  bool Stop() {
    absl::MutexLock lock(&mutex_);
    stop_ = true;
    cv_.SignalAll();
    const absl::Time deadline =
        clock_->Now() + std::max(interval_, absl::Milliseconds(100));
    while (!exited_ && clock_->Now() < deadline) {
      clock_->WaitUntil(&cv_, &mutex_, deadline);
    }
    return exited_;
  }

  HeartbeatDiagnosis Diagnose() {
    absl::MutexLock lock(&mutex_);
    if (watchers_++ == 0) {
      watch_start_ = clock_->Now();
      observations_.assign(world_size_, Observation{});
      store_error_.clear();
    }
    cv_.SignalAll();
    // Alive ranks show a new beat within `interval`; lost ones are known
    // after `stale_after`. The slack covers a poll in progress.
    const absl::Time deadline = watch_start_ + stale_after_ + 2 * interval_;
    // Re-checked on a short period too: when the thread hangs in a store
    // call nobody notifies, yet silence itself is the answer.
    for (absl::Time now = clock_->Now(); !Resolved(now) && now < deadline;
         now = clock_->Now()) {
      clock_->WaitUntil(&cv_, &mutex_,
                        std::min(deadline, now + absl::Milliseconds(20)));
    }
    HeartbeatDiagnosis diagnosis = Conclude(clock_->Now());
    --watchers_;
    return diagnosis;
  }

 private:
  struct Observation {
    bool seen = false;        // a first value was read during this watch
    int64_t first_value = 0;  // that value: a rank is alive once it changes
    int64_t last_value = 0;   // wall-clock ms of its latest heartbeat (0: none)
    absl::Time first_seen;
    bool alive = false;
  };

  // One round with the store, outside the lock: beat if due, poll the
  // others while watched.
  void Tick(bool beat, bool poll) {
    std::string error;
    if (beat) {
      if (absl::Status s =
              store_->Set(Key(rank_), absl::ToUnixMillis(clock_->Now()));
          !s.ok()) {
        error = std::string(s.message());
      }
    }
    if (poll && error.empty()) {
      std::vector<int64_t> values(world_size_, 0);
      for (int64_t r = 0; r < world_size_ && error.empty(); ++r) {
        if (r == rank_) continue;
        absl::StatusOr<int64_t> value = store_->Get(Key(r));
        if (value.ok()) {
          values[r] = *value;
        } else {
          error = std::string(value.status().message());
        }
      }
      if (error.empty()) Observe(values);
    }
    if (!error.empty()) {
      // Errors matter only while someone asks; a store that goes away after
      // rank 0 has finished cleanly is not news.
      absl::MutexLock lock(&mutex_);
      if (watchers_ > 0 && store_error_.empty()) store_error_ = error;
    }
  }

  void Observe(const std::vector<int64_t>& values) {
    const absl::Time now = clock_->Now();
    absl::MutexLock lock(&mutex_);
    for (int64_t r = 0; r < world_size_; ++r) {
      if (r == rank_) continue;
      Observation& o = observations_[r];
      if (!o.seen) {
        o.seen = true;
        o.first_value = values[r];
        o.first_seen = now;
      } else if (values[r] != o.first_value) {
        o.alive = true;
      }
      o.last_value = values[r];
    }
  }

  bool Resolved(absl::Time now) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_) {
    if (!store_error_.empty()) return true;
    for (int64_t r = 0; r < world_size_; ++r) {
      if (r == rank_) continue;
      const Observation& o = observations_[r];
      if (o.alive) continue;
      // Lost, or (never seen) the store has not answered for as long.
      const absl::Time since = o.seen ? o.first_seen : watch_start_;
      if (now - since >= stale_after_) continue;
      return false;
    }
    return true;
  }

  HeartbeatDiagnosis Conclude(absl::Time now) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_) {
    HeartbeatDiagnosis diagnosis;
    if (!store_error_.empty()) {
      diagnosis.store_lost = true;
      diagnosis.store_error = store_error_;
      return diagnosis;
    }
    const int64_t unix_now = absl::ToUnixMillis(now);
    for (int64_t r = 0; r < world_size_; ++r) {
      if (r == rank_) continue;
      const Observation& o = observations_[r];
      if (!o.seen) {
        // The thread is stuck in a store call: the store's host does not
        // answer.
        diagnosis.store_lost = true;
        diagnosis.store_error =
            absl::StrCat("no answer for ", SecondsText(now - watch_start_));
        diagnosis.lost.clear();
        return diagnosis;
      }
      if (o.alive) continue;
      double silent = absl::ToDoubleSeconds(now - o.first_seen);
      if (o.last_value > 0) {
        silent = std::max(silent, (unix_now - o.last_value) / 1000.0);
      }
      diagnosis.lost.push_back({r, silent});
    }
    return diagnosis;
  }

  const std::unique_ptr<HeartbeatStore> store_;
  const int64_t rank_;
  const int64_t world_size_;
  const absl::Duration interval_;
  const absl::Duration stale_after_;
  Clock* const clock_;

  absl::Mutex mutex_;
  absl::CondVar cv_;
  bool stop_ ABSL_GUARDED_BY(mutex_) = false;
  bool exited_ ABSL_GUARDED_BY(mutex_) = false;
  int watchers_ ABSL_GUARDED_BY(mutex_) = 0;
  absl::Time watch_start_ ABSL_GUARDED_BY(mutex_);
  std::vector<Observation> observations_ ABSL_GUARDED_BY(mutex_);
  // The first store error since the watch started (empty: none).
  std::string store_error_ ABSL_GUARDED_BY(mutex_);
};

HeartbeatMonitor::HeartbeatMonitor(std::unique_ptr<HeartbeatStore> store,
                                   int64_t rank, int64_t world_size,
                                   HeartbeatOptions options)
    : core_(
          std::make_shared<Core>(std::move(store), rank, world_size, options)),
      thread_([core = core_] { core->Run(); }) {}

HeartbeatMonitor::~HeartbeatMonitor() {
  if (core_->Stop()) {
    thread_.join();
  } else {
    thread_.detach();  // it owns a reference to the core
  }
}

std::string HeartbeatMonitor::Key(int64_t rank) {
  return absl::StrCat("shardtrain/heartbeat/", rank);
}

HeartbeatDiagnosis HeartbeatMonitor::Diagnose() { return core_->Diagnose(); }

}  // namespace shardtrain
