// ProgressReporter: a worker's line to shardtraind. Registers the rank once
// the process group has formed, sends every step's metrics (steps that pile
// up while a report is in flight travel together in the next one) and a
// heartbeat every interval from its own thread, so a rank that freezes is
// noticed even between steps. Torch-free.
#ifndef SHARDTRAIN_WORKER_PROGRESS_REPORTER_H_
#define SHARDTRAIN_WORKER_PROGRESS_REPORTER_H_

#include <grpcpp/channel.h>

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "shardtrain/v1/worker_service.grpc.pb.h"

namespace shardtrain {

struct ReporterOptions {
  std::string address;  // SHARDTRAIN_COORDINATOR
  std::string job_id;   // SHARDTRAIN_JOB_ID
  std::string secret;   // SHARDTRAIN_JOB_SECRET
  int rank = 0;
  int pid = 0;
  absl::Duration heartbeat_interval = absl::Seconds(2);
};

class ProgressReporter {
 public:
  // Options from the variables the coordinator sets (plus RANK and getpid()).
  // InvalidArgument names a missing or malformed variable.
  static absl::StatusOr<ReporterOptions> OptionsFromEnvironment();

  explicit ProgressReporter(ReporterOptions options);
  // Stops the threads; unsent steps are dropped (call Flush first).
  ~ProgressReporter();
  ProgressReporter(const ProgressReporter&) = delete;
  ProgressReporter& operator=(const ProgressReporter&) = delete;

  // Registers this rank (retrying for up to `timeout` while the coordinator
  // is unreachable) and starts the heartbeat and sender threads.
  absl::Status Register(absl::Duration timeout);

  // Queues one step's metrics; never blocks on the network.
  void Report(v1::StepMetrics step);

  // Returns once every queued step is stored by the coordinator, or an error
  // after `timeout`.
  absl::Status Flush(absl::Duration timeout);

  // Called (once, from a reporter thread) when the coordinator asks the
  // worker to stop.
  void set_on_cancel(std::function<void()> on_cancel);

 private:
  void SenderLoop();
  void HeartbeatLoop();
  v1::WorkerIdentity Identity() const;
  void NoteCancel(bool cancel);

  const ReporterOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::WorkerService::Stub> stub_;

  absl::Mutex mutex_;
  std::vector<v1::StepMetrics> pending_ ABSL_GUARDED_BY(mutex_);
  int64_t queued_ ABSL_GUARDED_BY(mutex_) = 0;  // steps ever queued
  int64_t stored_ ABSL_GUARDED_BY(mutex_) = 0;  // steps acknowledged
  absl::Status last_error_ ABSL_GUARDED_BY(mutex_);
  bool stopping_ ABSL_GUARDED_BY(mutex_) = false;
  std::function<void()> on_cancel_ ABSL_GUARDED_BY(mutex_);
  std::atomic<bool> cancelled_{false};

  std::thread sender_;
  std::thread heartbeat_;
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_WORKER_PROGRESS_REPORTER_H_
