// Scheduler: which queued jobs start now and on which devices. Pure logic.
//
// Queue order is priority (higher first), then submission order. The head of
// the queue starts when its world size fits the free devices; a job never
// starts on part of its devices, and nothing behind a waiting head starts
// before it (no backfill), so order is strict and no large job starves.
#ifndef SHARDTRAIN_SERVER_SCHEDULER_H_
#define SHARDTRAIN_SERVER_SCHEDULER_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace shardtrain {

struct QueuedJobRef {
  std::string job_id;
  int priority = 0;
  int64_t seq = 0;  // submission order
  int world_size = 1;
};

struct Placement {
  std::string job_id;
  std::vector<int> devices;  // device indices, one per rank
};

struct ScheduleDecision {
  std::vector<Placement> start;                // in queue order
  std::map<std::string, std::string> waiting;  // job id -> why it waits
};

// `free_devices`: indices of the devices no job holds, ascending.
ScheduleDecision Schedule(std::vector<QueuedJobRef> queue,
                          const std::vector<int>& free_devices);

// Sorts `queue` into scheduling order.
void SortQueue(std::vector<QueuedJobRef>* queue);

}  // namespace shardtrain

#endif  // SHARDTRAIN_SERVER_SCHEDULER_H_
