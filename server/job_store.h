// JobStore: shardtraind's durable state, one SQLite database (WAL) under
// --state-dir. Three tables: jobs (the v1::Job as it is now, plus what the
// coordinator needs to find its workers again), job_events (one row per state
// change) and job_metrics (one row per rank per step). The schema is
// versioned (PRAGMA user_version) and upgraded by numbered migrations.
//
// Durability: every write is committed before the call returns. With WAL and
// synchronous=NORMAL a killed coordinator loses nothing that was committed;
// only a power cut may drop the last transactions.
//
// Thread-safe. AppendMetrics is a group commit: calls that arrive while a
// transaction is being written are committed together in the next one, and
// each call returns once its own rows are durable.
#ifndef SHARDTRAIN_SERVER_JOB_STORE_H_
#define SHARDTRAIN_SERVER_JOB_STORE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "shardtrain/v1/job.pb.h"

namespace shardtrain {

// A job as stored: the public record plus the coordinator's private fields.
struct StoredJob {
  v1::Job job;
  int64_t seq = 0;     // submission order, unique, increasing
  std::string secret;  // the job's worker secret (never returned to clients)
  // Worker processes of the current attempt (pid per rank) and their process
  // group, so a restarted coordinator can stop leftovers. Empty when none.
  std::vector<int> worker_pids;
  int worker_pgid = 0;
};

class JobStore {
 public:
  // The newest schema version this build writes.
  static constexpr int kSchemaVersion = 1;

  // Opens (creating if needed) the database at `path` and migrates it to
  // kSchemaVersion. FailedPrecondition when the file was written by a newer
  // schema; the error names the path and both versions.
  static absl::StatusOr<std::unique_ptr<JobStore>> Open(
      const std::string& path);

  ~JobStore();
  JobStore(const JobStore&) = delete;
  JobStore& operator=(const JobStore&) = delete;

  // Stores a new job and its first event in one transaction.
  // AlreadyExists when job.id() or seq is taken.
  absl::Status InsertJob(const StoredJob& job, const v1::JobEvent& event);

  // Replaces the job's record (job, worker pids/pgid; seq and secret are
  // kept) and, when `event` is given, appends it, in one transaction.
  // NotFound for an unknown id.
  absl::Status UpdateJob(const StoredJob& job,
                         const std::optional<v1::JobEvent>& event);

  // Every job, in submission order.
  absl::StatusOr<std::vector<StoredJob>> LoadJobs() const;

  // The largest seq stored, 0 when empty.
  absl::StatusOr<int64_t> MaxSeq() const;

  // The job's events, oldest first.
  absl::StatusOr<std::vector<v1::JobEvent>> GetEvents(
      const std::string& job_id) const;

  // Stores step reports (keyed by job, rank, step: a step reported again,
  // e.g. after a restart from a checkpoint, replaces the earlier row).
  absl::Status AppendMetrics(const std::string& job_id,
                             const std::vector<v1::StepMetrics>& steps);

  // Stored steps of a job with step >= from_step, for one rank or all,
  // ordered by step then rank.
  absl::StatusOr<std::vector<v1::StepMetrics>> GetMetrics(
      const std::string& job_id, std::optional<int> rank,
      int64_t from_step) const;

  // Number of job_metrics rows (all jobs); for tests and benchmarks.
  absl::StatusOr<int64_t> CountMetrics() const;

 private:
  struct Impl;
  explicit JobStore(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_SERVER_JOB_STORE_H_
