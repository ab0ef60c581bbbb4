// JobWatch: one WatchJob subscriber's queue of events. The job manager pushes
// (under its own lock, so nothing is missed between the snapshot a watcher
// starts with and the events after it); the stream handler pops.
#ifndef SHARDTRAIN_SERVER_JOB_WATCH_H_
#define SHARDTRAIN_SERVER_JOB_WATCH_H_

#include <deque>
#include <optional>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "shardtrain/v1/job_service.pb.h"

namespace shardtrain {

class JobWatch {
 public:
  // A watcher that stops reading must not grow the coordinator's memory
  // without bound: past this many unread events, step events are dropped
  // (state changes never are).
  static constexpr size_t kMaxPendingEvents = 100000;

  void Push(v1::WatchJobEvent event);
  // No more events will come (the job ended or the coordinator stops).
  void Close();

  // The next event; nullopt after `timeout` without one, or when closed and
  // drained (then closed_and_drained() is true).
  std::optional<v1::WatchJobEvent> Next(absl::Duration timeout);
  bool closed_and_drained() const;

 private:
  bool HasEventOrClosed() const ABSL_SHARED_LOCKS_REQUIRED(mutex_);

  mutable absl::Mutex mutex_;
  std::deque<v1::WatchJobEvent> events_ ABSL_GUARDED_BY(mutex_);
  bool closed_ ABSL_GUARDED_BY(mutex_) = false;
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_SERVER_JOB_WATCH_H_
