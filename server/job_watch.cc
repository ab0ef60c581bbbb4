#include "server/job_watch.h"

namespace shardtrain {

void JobWatch::Push(v1::WatchJobEvent event) {
  absl::MutexLock lock(&mutex_);
  if (closed_) return;
  if (event.has_step() && events_.size() >= kMaxPendingEvents) return;
  events_.push_back(std::move(event));
}

void JobWatch::Close() {
  absl::MutexLock lock(&mutex_);
  closed_ = true;
}

std::optional<v1::WatchJobEvent> JobWatch::Next(absl::Duration timeout) {
  absl::MutexLock lock(&mutex_);
  mutex_.AwaitWithTimeout(absl::Condition(this, &JobWatch::HasEventOrClosed),
                          timeout);
  if (events_.empty()) return std::nullopt;
  v1::WatchJobEvent event = std::move(events_.front());
  events_.pop_front();
  return event;
}

bool JobWatch::HasEventOrClosed() const { return !events_.empty() || closed_; }

bool JobWatch::closed_and_drained() const {
  absl::MutexLock lock(&mutex_);
  return closed_ && events_.empty();
}

}  // namespace shardtrain
