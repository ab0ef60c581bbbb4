#include "server/scheduler.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace shardtrain {

void SortQueue(std::vector<QueuedJobRef>* queue) {
  std::sort(queue->begin(), queue->end(),
            [](const QueuedJobRef& a, const QueuedJobRef& b) {
              if (a.priority != b.priority) return a.priority > b.priority;
              return a.seq < b.seq;
            });
}

ScheduleDecision Schedule(std::vector<QueuedJobRef> queue,
                          const std::vector<int>& free_devices) {
  SortQueue(&queue);
  ScheduleDecision decision;
  size_t next_free = 0;
  const QueuedJobRef* blocker = nullptr;
  for (const QueuedJobRef& job : queue) {
    const size_t free = free_devices.size() - next_free;
    if (blocker != nullptr) {
      decision.waiting[job.job_id] = absl::StrCat(
          "behind ", blocker->job_id, " (priority ", blocker->priority, ")");
      continue;
    }
    if (static_cast<size_t>(job.world_size) > free) {
      decision.waiting[job.job_id] = absl::StrCat(
          "needs ", job.world_size,
          job.world_size == 1 ? " device, " : " devices, ", free, " free");
      blocker = &job;
      continue;
    }
    Placement placement{job.job_id, {}};
    for (int r = 0; r < job.world_size; ++r) {
      placement.devices.push_back(free_devices[next_free++]);
    }
    decision.start.push_back(std::move(placement));
  }
  return decision;
}

}  // namespace shardtrain
