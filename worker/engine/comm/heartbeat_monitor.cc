#include "worker/engine/comm/heartbeat_monitor.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace shardtrain {
namespace {

int64_t UnixMillis() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

double Seconds(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double>(d).count();
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

HeartbeatMonitor::HeartbeatMonitor(std::unique_ptr<HeartbeatStore> store,
                                   int64_t rank, int64_t world_size,
                                   HeartbeatOptions options)
    : store_(std::move(store)),
      rank_(rank),
      world_size_(world_size),
      options_(options),
      observations_(world_size),
      thread_([this] { Run(); }) {}

HeartbeatMonitor::~HeartbeatMonitor() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

std::string HeartbeatMonitor::Key(int64_t rank) {
  return absl::StrCat("shardtrain/heartbeat/", rank);
}

void HeartbeatMonitor::Run() {
  // Polls several times per beat while watched, so a change is seen soon
  // after it happens.
  const auto poll_every =
      std::max(options_.interval / 4, std::chrono::milliseconds(10));
  Clock::time_point next_beat = Clock::now();
  Clock::time_point next_poll = Clock::now();
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stop_) {
    const Clock::time_point now = Clock::now();
    const bool beat = now >= next_beat;
    const bool poll = watchers_ > 0 && now >= next_poll;
    if (beat || poll) {
      lock.unlock();
      Tick(beat, poll);
      lock.lock();
      if (beat) next_beat = now + options_.interval;
      if (poll) next_poll = Clock::now() + poll_every;
      cv_.notify_all();
      continue;
    }
    const Clock::time_point wake =
        watchers_ > 0 ? std::min(next_beat, next_poll) : next_beat;
    const int watchers = watchers_;
    cv_.wait_until(lock, wake, [&] { return stop_ || watchers_ > watchers; });
  }
}

void HeartbeatMonitor::Tick(bool beat, bool poll) {
  std::string error;
  if (beat) {
    if (absl::Status s = store_->Set(Key(rank_), UnixMillis()); !s.ok()) {
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
    if (error.empty()) {
      const Clock::time_point now = Clock::now();
      std::lock_guard<std::mutex> lock(mutex_);
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
  }
  if (!error.empty()) {
    // Errors matter only while someone asks; a store that goes away after a
    // clean shutdown of rank 0 is not news.
    std::lock_guard<std::mutex> lock(mutex_);
    if (watchers_ > 0 && store_error_.empty()) store_error_ = error;
  }
}

bool HeartbeatMonitor::Resolved(Clock::time_point now) const {
  if (!store_error_.empty()) return true;
  for (int64_t r = 0; r < world_size_; ++r) {
    if (r == rank_) continue;
    const Observation& o = observations_[r];
    if (o.alive) continue;
    if (o.seen && now - o.first_seen >= options_.stale_after) continue;
    return false;
  }
  return true;
}

HeartbeatDiagnosis HeartbeatMonitor::Conclude(Clock::time_point now) const {
  HeartbeatDiagnosis diagnosis;
  if (!store_error_.empty()) {
    diagnosis.store_lost = true;
    diagnosis.store_error = store_error_;
    return diagnosis;
  }
  const int64_t unix_now = UnixMillis();
  for (int64_t r = 0; r < world_size_; ++r) {
    if (r == rank_) continue;
    const Observation& o = observations_[r];
    if (!o.seen) {
      // The heartbeat thread is stuck in a store call: the store's host is
      // not answering.
      diagnosis.store_lost = true;
      diagnosis.store_error =
          absl::StrFormat("no answer for %.1f s", Seconds(now - watch_start_));
      diagnosis.lost.clear();
      return diagnosis;
    }
    if (o.alive) continue;
    double silent = Seconds(now - o.first_seen);
    if (o.last_value > 0) {
      silent = std::max(silent, (unix_now - o.last_value) / 1000.0);
    }
    diagnosis.lost.push_back({r, silent});
  }
  return diagnosis;
}

HeartbeatDiagnosis HeartbeatMonitor::Diagnose() {
  std::unique_lock<std::mutex> lock(mutex_);
  if (watchers_++ == 0) {
    watch_start_ = Clock::now();
    observations_.assign(world_size_, Observation{});
    store_error_.clear();
  }
  cv_.notify_all();
  // Alive ranks show a new beat within `interval`; lost ones are known after
  // `stale_after`. The slack covers a poll in progress.
  const Clock::time_point deadline =
      watch_start_ + options_.stale_after + 2 * options_.interval;
  cv_.wait_until(lock, deadline, [&] { return Resolved(Clock::now()); });
  HeartbeatDiagnosis diagnosis = Conclude(Clock::now());
  --watchers_;
  return diagnosis;
}

}  // namespace shardtrain
