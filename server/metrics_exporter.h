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
  struct RankSeries {
    prometheus::Gauge* step;
    prometheus::Gauge* loss;
    prometheus::Gauge* val_loss;  // created at the first eval
    prometheus::Gauge* grad_norm;
    prometheus::Gauge* lr;
    prometheus::Gauge* tokens_per_second;
    prometheus::Gauge* mfu;
    prometheus::Gauge* memory_allocated;
    prometheus::Gauge* memory_peak;
    prometheus::Gauge* memory_reserved;
    prometheus::Gauge* heartbeat_age;
    prometheus::Counter* tokens;
    prometheus::Counter* comm_seconds;
    prometheus::Counter* comm_bytes;
    prometheus::Counter* comm_inter_group_bytes;
    prometheus::Counter* comm_tensor_parallel_bytes;
    // With pipeline stages (labelled with the stage), from the first step.
    prometheus::Gauge* pipeline_bubble = nullptr;
    prometheus::Counter* p2p_bytes = nullptr;
    prometheus::Histogram* step_duration;
    absl::Time last_heartbeat;
  };
  struct JobSeries {
    std::string strategy;
    std::string mesh;  // JobMeshName at the attempt's world size
    v1::JobState state = v1::JOB_STATE_UNSPECIFIED;
    prometheus::Gauge* restarts = nullptr;
    std::map<int, RankSeries> ranks;
    absl::Time ended = absl::InfiniteFuture();
  };

  // Start's registrations: job and queue series, per-rank step series,
  // NVML's per-GPU series.
  void RegisterJobMetrics();
  void RegisterStepMetrics();
  void RegisterGpuMetrics();
  explicit MetricsExporter(MetricsExporterOptions options);
  void RefreshLoop();
  RankSeries& Rank(const std::string& job_id, JobSeries& job, int rank)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
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
  prometheus::Gauge* queue_length_;
  prometheus::Gauge* queue_oldest_wait_;
  prometheus::Gauge* devices_in_use_;
  prometheus::Family<prometheus::Gauge>* job_restarts_;
  prometheus::Family<prometheus::Gauge>* step_;
  prometheus::Family<prometheus::Gauge>* loss_;
  prometheus::Family<prometheus::Gauge>* val_loss_;
  prometheus::Family<prometheus::Gauge>* grad_norm_;
  prometheus::Family<prometheus::Gauge>* lr_;
  prometheus::Family<prometheus::Gauge>* tokens_per_second_;
  prometheus::Family<prometheus::Gauge>* mfu_;
  prometheus::Family<prometheus::Gauge>* memory_allocated_;
  prometheus::Family<prometheus::Gauge>* memory_peak_;
  prometheus::Family<prometheus::Gauge>* memory_reserved_;
  prometheus::Family<prometheus::Gauge>* heartbeat_age_;
  prometheus::Family<prometheus::Counter>* tokens_;
  prometheus::Family<prometheus::Counter>* comm_seconds_;
  prometheus::Family<prometheus::Counter>* comm_bytes_;
  prometheus::Family<prometheus::Counter>* comm_inter_group_bytes_;
  prometheus::Family<prometheus::Counter>* comm_tensor_parallel_bytes_;
  prometheus::Family<prometheus::Gauge>* pipeline_bubble_;
  prometheus::Family<prometheus::Counter>* p2p_bytes_;
  prometheus::Family<prometheus::Histogram>* step_duration_;
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
