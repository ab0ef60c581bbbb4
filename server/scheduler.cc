#include "server/scheduler.h"

#include <algorithm>
#include <climits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace shardtrain {
namespace {

std::string Devices(int n) {
  return absl::StrCat(n, n == 1 ? " device" : " devices");
}

std::string OwnerName(const std::string& owner) {
  return owner.empty() ? "the anonymous user" : owner;
}

// How the head of the queue gets its devices: the jobs to preempt for it
// (none when enough are free or coming back, or when preempting every
// candidate would not be enough), the devices coming back without them,
// and why it waits.
struct Take {
  const RunningJobRef* job = nullptr;
  int shrink_to = 0;  // 0: stopped whole
  int gives = 0;
};

struct HeadPlan {
  std::vector<Take> victims;
  int coming = 0;  // devices of jobs already stopping, and of the victims
  std::string reason;
};

// What `job` gives up for `missing` devices: an elastic job shrinks to the
// largest world it may run at that gives enough (else its smallest), any
// other job stops whole.
Take TakeFrom(const RunningJobRef& job, int missing) {
  Take take{&job, 0, job.devices};
  for (auto w = job.worlds.rbegin(); w != job.worlds.rend(); ++w) {
    if (*w >= job.devices || *w <= 0) continue;
    take = {&job, *w, job.devices - *w};
    if (take.gives >= missing) break;
  }
  return take;
}

HeadPlan PlanHead(const QueuedJobRef& head, int free,
                  const std::vector<RunningJobRef>& running) {
  HeadPlan plan;
  std::vector<std::string> stopping;
  for (const RunningJobRef& job : running) {
    if (!job.stopping) continue;
    plan.coming += job.devices;
    stopping.push_back(job.job_id);
  }
  const std::string needs =
      absl::StrCat("needs ", Devices(head.world_size), ", ", free, " free");
  if (free + plan.coming >= head.world_size) {
    plan.reason = absl::StrCat(needs, "; waiting for ",
                               absl::StrJoin(stopping, ", "), " to stop");
    return plan;
  }
  std::vector<const RunningJobRef*> candidates;
  for (const RunningJobRef& job : running) {
    if (!job.stopping && job.preemptible && job.priority < head.priority) {
      candidates.push_back(&job);
    }
  }
  std::sort(candidates.begin(), candidates.end(),
            [](const RunningJobRef* a, const RunningJobRef* b) {
              if (a->priority != b->priority) return a->priority < b->priority;
              return a->started > b->started;
            });
  int gained = 0;
  std::vector<Take> chosen;
  for (const RunningJobRef* job : candidates) {
    const int missing = head.world_size - (free + plan.coming + gained);
    if (missing <= 0) break;
    chosen.push_back(TakeFrom(*job, missing));
    gained += chosen.back().gives;
  }
  if (free + plan.coming + gained < head.world_size) {
    plan.reason = needs;
    return plan;
  }
  std::vector<std::string> names;
  for (const Take& take : chosen) {
    const RunningJobRef& job = *take.job;
    names.push_back(take.shrink_to > 0
                        ? absl::StrCat("shrinking ", job.job_id, " (priority ",
                                       job.priority, ") from ", job.devices,
                                       " to ", Devices(take.shrink_to))
                        : absl::StrCat("preempting ", job.job_id, " (priority ",
                                       job.priority, ", ", Devices(job.devices),
                                       ")"));
  }
  plan.victims = std::move(chosen);
  plan.coming += gained;
  plan.reason = absl::StrCat(needs, "; ", absl::StrJoin(names, ", "));
  return plan;
}

}  // namespace

int QuotaLedger::held(const std::string& owner) const {
  auto it = held_.find(owner);
  return it == held_.end() ? 0 : it->second;
}

int QuotaLedger::quota(const std::string& owner) const {
  return quota_ ? quota_(owner) : 0;
}

int QuotaLedger::Headroom(const std::string& owner) const {
  const int cap = quota(owner);
  if (cap <= 0) return INT_MAX;
  return std::max(0, cap - held(owner));
}

std::string QuotaLedger::Refusal(const std::string& owner, int more) const {
  return absl::StrCat(OwnerName(owner), " holds ", held(owner), " of ",
                      owner.empty() ? "the" : "their", " ",
                      Devices(quota(owner)), " (quota); this job needs ", more);
}

bool MayGrow(const RunningJobRef& job) {
  return !job.stopping && !job.worlds.empty() &&
         job.worlds.back() > job.devices;
}

namespace {

// With nobody waiting for devices: the elastic jobs running smaller than
// they may, higher priority first, each grown to the largest world the
// devices still free and its owner's quota allow.
void PlanGrowth(const std::vector<RunningJobRef>& running,
                const std::vector<int>& free_devices, QuotaLedger& quotas,
                size_t* next_free, std::vector<Growth>* grow) {
  std::vector<const RunningJobRef*> growable;
  for (const RunningJobRef& job : running) {
    if (MayGrow(job)) growable.push_back(&job);
  }
  std::sort(growable.begin(), growable.end(),
            [](const RunningJobRef* a, const RunningJobRef* b) {
              if (a->priority != b->priority) return a->priority > b->priority;
              return a->started < b->started;
            });
  for (const RunningJobRef* job : growable) {
    const int free = static_cast<int>(free_devices.size() - *next_free);
    int target = 0;
    for (int w : job->worlds) {
      if (w > job->devices && w - job->devices <= free &&
          quotas.MayHold(job->owner, w - job->devices)) {
        target = w;
      }
    }
    if (target == 0) continue;
    quotas.Hold(job->owner, target - job->devices);
    Growth growth{job->job_id, target, {}};
    for (int i = job->devices; i < target; ++i) {
      growth.devices.push_back(free_devices[(*next_free)++]);
    }
    grow->push_back(std::move(growth));
  }
}

// When the head may start (the running jobs that are not stopping ending as
// predicted, in order, until enough devices are free) and how many devices
// beyond its need are free then: what a backfilled job may hold without
// delaying it. nullopt: some job it waits on has no prediction.
struct Shadow {
  absl::Time start;
  int extra = 0;
};

std::optional<Shadow> PredictHeadStart(
    const QueuedJobRef& head, int available, absl::Time now,
    const std::vector<RunningJobRef>& running,
    const std::vector<Take>& victims) {
  if (available >= head.world_size) {
    return Shadow{now, available - head.world_size};
  }
  std::vector<const RunningJobRef*> ending;
  for (const RunningJobRef& job : running) {
    if (job.stopping ||
        std::any_of(victims.begin(), victims.end(),
                    [&](const Take& take) { return take.job == &job; })) {
      continue;
    }
    if (!job.predicted_end.has_value()) return std::nullopt;
    ending.push_back(&job);
  }
  std::sort(ending.begin(), ending.end(),
            [](const RunningJobRef* a, const RunningJobRef* b) {
              return *a->predicted_end < *b->predicted_end;
            });
  for (const RunningJobRef* job : ending) {
    available += job->devices;
    if (available >= head.world_size) {
      return Shadow{std::max(now, *job->predicted_end),
                    available - head.world_size};
    }
  }
  return std::nullopt;  // never fits (not on these devices)
}

}  // namespace

void SortQueue(std::vector<QueuedJobRef>* queue) {
  std::sort(queue->begin(), queue->end(),
            [](const QueuedJobRef& a, const QueuedJobRef& b) {
              if (a.priority != b.priority) return a.priority > b.priority;
              return a.seq < b.seq;
            });
}

ScheduleDecision Schedule(std::vector<QueuedJobRef> queue,
                          const std::vector<int>& free_devices) {
  ScheduleInput input;
  input.queue = std::move(queue);
  input.free_devices = free_devices;
  return Schedule(std::move(input));
}

ScheduleDecision Schedule(ScheduleInput input) {
  SortQueue(&input.queue);
  ScheduleDecision decision;
  QuotaLedger quotas(input.quota);
  for (const RunningJobRef& job : input.running) {
    quotas.Hold(job.owner, job.devices);
  }
  size_t next_free = 0;
  auto free = [&] {
    return static_cast<int>(input.free_devices.size() - next_free);
  };
  auto place = [&](const QueuedJobRef& job, bool backfilled) {
    Placement placement{job.job_id, {}, backfilled};
    for (int r = 0; r < job.world_size; ++r) {
      placement.devices.push_back(input.free_devices[next_free++]);
    }
    quotas.Hold(job.owner, job.world_size);
    decision.start.push_back(std::move(placement));
  };
  const QueuedJobRef* head = nullptr;
  int extra = 0;  // what a backfilled job may take
  std::string head_text;
  for (const QueuedJobRef& job : input.queue) {
    if (!quotas.MayHold(job.owner, job.world_size)) {
      decision.waiting[job.job_id] = quotas.Refusal(job.owner, job.world_size);
      continue;
    }
    if (head == nullptr) {
      if (job.world_size <= free()) {
        place(job, false);
        continue;
      }
      head = &job;
      decision.head = job.job_id;
      HeadPlan plan = PlanHead(job, free(), input.running);
      for (const Take& take : plan.victims) {
        decision.preempt.push_back(
            {take.job->job_id, job.job_id, take.shrink_to});
      }
      std::optional<Shadow> shadow = PredictHeadStart(
          job, free() + plan.coming, input.now, input.running, plan.victims);
      std::string reason = plan.reason;
      if (shadow.has_value()) {
        extra = std::min(shadow->extra, free());
        if (shadow->start > input.now) {
          decision.head_predicted_start = shadow->start;
          absl::StrAppend(&reason, "; predicted to start in ",
                          absl::FormatDuration(absl::Trunc(
                              shadow->start - input.now, absl::Seconds(1))));
        } else {
          // What it waits for ran past its predicted end: no time to show
          // (it would be in the past), but why.
          absl::StrAppend(&reason,
                          "; expected to start any moment: the jobs it waits "
                          "for are past their predicted end");
        }
      }
      decision.waiting[job.job_id] = std::move(reason);
      head_text = absl::StrCat(job.job_id, " (priority ", job.priority, ")");
      continue;
    }
    if (job.world_size <= free() && job.world_size <= extra) {
      extra -= job.world_size;
      place(job, true);
      continue;
    }
    decision.waiting[job.job_id] = absl::StrCat("behind ", head_text);
  }
  if (head == nullptr) {
    PlanGrowth(input.running, input.free_devices, quotas, &next_free,
               &decision.grow);
  }
  return decision;
}

}  // namespace shardtrain
