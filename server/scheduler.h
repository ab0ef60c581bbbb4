// Scheduler: which queued jobs start now and on which devices, which running
// jobs are preempted for them, and which small jobs start early in a gap.
// Pure logic; the JobManager's supervisor applies its decisions.
//
// Queue order is priority (higher first), then submission order. A job
// never starts on part of its devices.
// - Quotas: a job whose owner already holds their quota of devices waits
//   (and blocks nobody); a job larger than the quota is refused at submit.
// - Preemption: when the head of the queue does not fit in the free
//   devices, running jobs of lower priority that may be preempted are
//   chosen (lowest priority first, then the most recently started) until
//   enough devices would be free; they are asked to checkpoint and stop.
//   While chosen jobs stop, nobody else is chosen. An elastic job gives up
//   only the devices missing, shrinking to the largest world it may run at
//   that leaves enough (re-meshed instead of stopped).
// - Growth: with nobody waiting for devices, an elastic job running smaller
//   than it asked for grows back to the largest world the free devices
//   and its owner's quota allow.
// - Backfill (EASY): behind a head that waits, a job starts now only on
//   devices the head will not need at its predicted start (the moment the
//   running jobs' predicted ends free enough devices for it), so it never
//   delays the head. Without a prediction for every job the head waits on,
//   nothing overtakes it.
#ifndef SHARDTRAIN_SERVER_SCHEDULER_H_
#define SHARDTRAIN_SERVER_SCHEDULER_H_

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/time/time.h"

namespace shardtrain {

// The devices each user holds, against their quota: the one place that
// decides whether a user may hold more. Every path that gives a job devices
// asks it first: a start, a backfill, a growth (Schedule), an elastic
// restart onto free devices and a relaunch after the coordinator restarted
// (AttemptSupervisor). Shrinking, stopping and restarting on the devices a
// job already holds take nothing new.
class QuotaLedger {
 public:
  using QuotaFn = std::function<int(const std::string& user)>;
  // `quota`: the devices a user may hold at once, 0 for no cap; null: none.
  explicit QuotaLedger(QuotaFn quota) : quota_(std::move(quota)) {}

  void Hold(const std::string& owner, int devices) { held_[owner] += devices; }
  int held(const std::string& owner) const;
  int quota(const std::string& owner) const;  // 0: no cap
  // The most devices `owner` may take besides what they hold (INT_MAX
  // without a cap; never negative).
  int Headroom(const std::string& owner) const;
  bool MayHold(const std::string& owner, int more) const {
    return more <= Headroom(owner);
  }
  // Why `owner` may not take `more`: "alice holds 2 of their 2 devices
  // (quota); this job needs 1".
  std::string Refusal(const std::string& owner, int more) const;

 private:
  QuotaFn quota_;
  std::map<std::string, int> held_;
};

struct QueuedJobRef {
  std::string job_id;
  int priority = 0;
  int64_t seq = 0;  // submission order
  int world_size = 1;
  std::string owner;
};

// A job that holds devices now.
struct RunningJobRef {
  std::string job_id;
  int priority = 0;
  bool preemptible = false;
  std::string owner;
  int devices = 0;
  absl::Time started;  // its current attempt's launch
  // Its ranks are stopping (cancelled, failed or preempted): its devices
  // come back without anyone asking.
  bool stopping = false;
  // When it is predicted to end (its pace so far times the steps left; before
  // its first step, the step-time model's time for its steps); unset when
  // nothing predicts it yet.
  std::optional<absl::Time> predicted_end;
  // An elastic job that may change its mesh: the world sizes it may run at
  // (ascending, its present one among them). Empty: it is stopped whole.
  std::vector<int> worlds;
};

struct ScheduleInput {
  std::vector<QueuedJobRef> queue;  // any order
  std::vector<int> free_devices;    // ascending
  std::vector<RunningJobRef> running;
  // The devices a user's jobs may hold at once; 0: no cap. Null: none.
  std::function<int(const std::string& user)> quota;
  absl::Time now;
};

struct Placement {
  std::string job_id;
  std::vector<int> devices;  // device indices, one per rank
  bool backfilled = false;   // started ahead of a waiting head
};

struct Preemption {
  std::string job_id;
  std::string for_job;  // the queued job it makes room for
  int shrink_to = 0;    // > 0: continues at this world (re-meshed); 0: stops
};

// An elastic job to grow to `to_world`, taking `devices` (free now).
struct Growth {
  std::string job_id;
  int to_world = 0;
  std::vector<int> devices;
};

struct ScheduleDecision {
  std::vector<Placement> start;                // in queue order
  std::map<std::string, std::string> waiting;  // job id -> why it waits
  std::vector<Preemption> preempt;
  std::vector<Growth> grow;
  // The waiting head and its predicted start, when the running jobs'
  // predictions say; never in the past (none while the jobs it waits for
  // run past their predicted end).
  std::string head;
  std::optional<absl::Time> head_predicted_start;
};

ScheduleDecision Schedule(ScheduleInput input);
// Whether Schedule may grow `job`: an elastic job, not stopping, running
// smaller than it may. (Callers skip Schedule when nothing waits and no job
// may grow.)
bool MayGrow(const RunningJobRef& job);
// Without running jobs, quotas or predictions (strict order).
ScheduleDecision Schedule(std::vector<QueuedJobRef> queue,
                          const std::vector<int>& free_devices);

// Sorts `queue` into scheduling order.
void SortQueue(std::vector<QueuedJobRef>* queue);

}  // namespace shardtrain

#endif  // SHARDTRAIN_SERVER_SCHEDULER_H_
