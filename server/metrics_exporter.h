// MetricsExporter: shardtraind's Prometheus endpoint (prometheus-cpp
// metrics, served by MetricsEndpoint on --metrics-listen). Hears every job
// change, step report and heartbeat from the JobManager (as its JobObserver)
// and refreshes the queue, heartbeat ages and GPU readings once a second.
// docs/metrics.md lists every metric; names follow Prometheus conventions
// (shardtrain_ prefix, base units, _total counters) and labels stay bounded:
// a finished job's series are dropped `retention` after it ended.
#ifndef SHARDTRAIN_SERVER_METRICS_EXPORTER_H_
#define SHARDTRAIN_SERVER_METRICS_EXPORTER_H_

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "server/device_inventory.h"
#include "server/job_manager.h"
#include "server/metrics_endpoint.h"

namespace shardtrain {

class Nvml;

struct MetricsExporterOptions {
  std::string listen = "127.0.0.1:9464";  // port 0 picks a free one
  absl::Duration retention = absl::Minutes(5);
  absl::Duration refresh = absl::Seconds(1);
  std::string version;
  std::vector<DeviceInfo> devices;
  const Nvml* nvml = nullptr;  // GPU readings when present
};

class MetricsExporter : public JobObserver {
 public:
  // Binds the HTTP server; an error names the address.
  static absl::StatusOr<std::unique_ptr<MetricsExporter>> Start(
      MetricsExporterOptions options);
  ~MetricsExporter() override;

  // Where the queue and device occupancy come from (the JobManager); the
  // refresh thread starts with the first call.
  void set_cluster_source(std::function<ClusterView()> source);
  // Seeds the per-state job counts with jobs loaded from the store (not
  // counted as submissions).
  void Seed(const std::vector<v1::Job>& jobs);

  // "127.0.0.1:9464", the port actually bound.
  const std::string& address() const { return address_; }

  // JobObserver.
  void OnJobChanged(const v1::Job& job) override;
  void OnSteps(const v1::Job& job,
               const std::vector<v1::StepMetrics>& steps) override;
  void OnHeartbeat(const std::string& job_id, int rank,
                   absl::Time time) override;

  // One refresh round (the thread calls it every options.refresh).
  void Refresh();
  // Stops the refresh thread (before the cluster source goes away).
  void StopRefresh();

 private:
  // A step field's series for one rank: the one its kind makes.
  struct StepSeries {
    prometheus::Gauge* gauge = nullptr;
    prometheus::Counter* counter = nullptr;
    prometheus::Histogram* histogram = nullptr;
  };
  struct RankSeries {
    // Indexed as StepFields(); empty for a field without a series, and for
    // an optional or per-stage one until a step carries it.
    std::vector<StepSeries> fields;
    prometheus::Gauge* heartbeat_age = nullptr;
    absl::Time last_heartbeat;
  };
  // The families of the step fields' series, indexed as StepFields().
  struct StepFamily {
    prometheus::Family<prometheus::Gauge>* gauge = nullptr;
    prometheus::Family<prometheus::Counter>* counter = nullptr;
    prometheus::Family<prometheus::Histogram>* histogram = nullptr;
  };
  struct JobSeries {
    std::string strategy;
    std::string mesh;  // JobMeshName at the attempt's world size
    v1::JobState state = v1::JOB_STATE_UNSPECIFIED;
    prometheus::Gauge* restarts = nullptr;
    std::map<int, RankSeries> ranks;
    absl::Time ended = absl::InfiniteFuture();
    absl::Time queued_at = absl::InfinitePast();  // last entered QUEUED
    int preemptions = 0;     // Job.preemptions already counted
    int remeshes = 0;        // Job.remeshes already counted
    double remesh_lost = 0;  // Job.remesh_seconds_lost already counted
    prometheus::Gauge* goodput = nullptr;
    std::string owner;
    double held = 0;  // Job.device_seconds_held and _kept, last seen
    double kept = 0;
  };

  // Start's registrations: job and queue series, per-rank step series,
  // NVML's per-GPU series.
  void RegisterJobMetrics();
  void RegisterStepMetrics();
  void RegisterGpuMetrics();
  explicit MetricsExporter(MetricsExporterOptions options);
  void RefreshLoop();
  // The job's and its owner's goodput from its latest counts.
  void UpdateGoodput(const v1::Job& job, JobSeries& series)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  RankSeries& Rank(const std::string& job_id, JobSeries& job, int rank)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Sets (a gauge), adds to (a counter) or observes (the histogram) each
  // field of `m` that has a series, making any not made yet.
  void Record(const std::string& job_id, const JobSeries& job, RankSeries& s,
              const v1::StepMetrics& m) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  void RemoveJobSeries(JobSeries& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  void CountState(v1::JobState from, v1::JobState to)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);

  const MetricsExporterOptions options_;
  std::string address_;
  std::shared_ptr<prometheus::Registry> registry_;
  // After registry_: its thread, which collects the registry, stops first.
  std::unique_ptr<MetricsEndpoint> http_server_;

  // Families (owned by registry_).
  prometheus::Family<prometheus::Gauge>* jobs_;
  prometheus::Counter* submissions_;
  prometheus::Family<prometheus::Counter>* failures_;
  prometheus::Counter* restarts_total_;
  prometheus::Family<prometheus::Counter>* preemptions_;
  prometheus::Family<prometheus::Counter>* remeshes_;
  prometheus::Family<prometheus::Counter>* remesh_lost_;
  prometheus::Family<prometheus::Gauge>* job_goodput_;
  prometheus::Family<prometheus::Gauge>* user_goodput_;
  // Per user: device-seconds held and kept over the jobs this daemon knows.
  std::map<std::string, std::pair<double, double>> user_seconds_;
  prometheus::Histogram* queue_wait_;
  prometheus::Gauge* queue_length_;
  prometheus::Gauge* queue_oldest_wait_;
  prometheus::Gauge* devices_in_use_;
  prometheus::Family<prometheus::Gauge>* job_restarts_;
  std::vector<StepFamily> step_families_;
  prometheus::Family<prometheus::Gauge>* heartbeat_age_;
  std::vector<prometheus::Gauge*> gpu_utilization_;
  std::vector<prometheus::Gauge*> gpu_memory_used_;
  std::vector<prometheus::Gauge*> gpu_power_;

  absl::Mutex mutex_;
  std::map<std::string, JobSeries> series_ ABSL_GUARDED_BY(mutex_);
  std::map<v1::JobState, int> state_counts_ ABSL_GUARDED_BY(mutex_);
  std::function<ClusterView()> cluster_source_ ABSL_GUARDED_BY(mutex_);

  absl::Notification stop_;
  std::thread refresher_;
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_SERVER_METRICS_EXPORTER_H_
