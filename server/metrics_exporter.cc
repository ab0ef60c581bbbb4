#include "server/metrics_exporter.h"

#include <algorithm>
#include <optional>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "core/run/step_metrics.h"
#include "proto/job_config.h"
#include "server/nvml.h"

namespace shardtrain {
namespace {

using prometheus::BuildCounter;
using prometheus::BuildGauge;
using prometheus::BuildHistogram;

const v1::JobState kStates[] = {v1::QUEUED,     v1::STARTING,  v1::RUNNING,
                                v1::RESTARTING, v1::PREEMPTED, v1::SUCCEEDED,
                                v1::FAILED,     v1::CANCELLED};

std::string Lower(const std::string& name) {
  return absl::AsciiStrToLower(name);
}

std::string KindLabel(v1::DeviceKind kind) {
  return kind == v1::GPU ? "gpu" : "cpu";
}

prometheus::Histogram::BucketBoundaries StepBuckets() {
  return {0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60};
}

}  // namespace

MetricsExporter::MetricsExporter(MetricsExporterOptions options)
    : options_(std::move(options)),
      registry_(std::make_shared<prometheus::Registry>()) {}

absl::StatusOr<std::unique_ptr<MetricsExporter>> MetricsExporter::Start(
    MetricsExporterOptions options) {
  std::unique_ptr<MetricsExporter> e(new MetricsExporter(std::move(options)));
  // Not prometheus-cpp's Exposer: each of civetweb's worker threads (8 of
  // them, with a 3 s request timeout) is held by one idle, half-sent
  // connection, so 16 such connections delayed a scrape to 5.5 s and 64 past
  // Prometheus's 10 s timeout. MetricsEndpoint serves every connection
  // from one libmicrohttpd event loop and bounds what idle ones hold (its
  // header says how).
  absl::StatusOr<std::unique_ptr<MetricsEndpoint>> server =
      MetricsEndpoint::Start(e->options_.listen);
  if (!server.ok()) {
    return absl::UnavailableError(
        absl::StrCat("--metrics-listen: cannot listen on ", e->options_.listen,
                     ": ", server.status().message()));
  }
  e->http_server_ = std::move(*server);
  const std::string& listen = e->options_.listen;
  e->address_ = absl::StrCat(listen.substr(0, listen.rfind(':')), ":",
                             e->http_server_->port());
  e->RegisterJobMetrics();
  e->RegisterStepMetrics();
  if (e->options_.nvml != nullptr) e->RegisterGpuMetrics();
  e->http_server_->RegisterCollectable(e->registry_);
  return e;
}

void MetricsExporter::RegisterJobMetrics() {
  prometheus::Registry& r = *registry_;
  BuildGauge()
      .Name("shardtrain_build_info")
      .Help("Always 1; the version label says which shardtraind runs")
      .Register(r)
      .Add({{"version", options_.version}})
      .Set(1);
  jobs_ = &BuildGauge()
               .Name("shardtrain_jobs")
               .Help("Jobs currently in each state")
               .Register(r);
  for (v1::JobState state : kStates) {
    jobs_->Add({{"state", Lower(v1::JobState_Name(state))}}).Set(0);
  }
  submissions_ = &BuildCounter()
                      .Name("shardtrain_job_submissions_total")
                      .Help("Jobs accepted by SubmitJob")
                      .Register(r)
                      .Add({});
  failures_ = &BuildCounter()
                   .Name("shardtrain_job_failures_total")
                   .Help("Jobs that ended FAILED, by failure reason")
                   .Register(r);
  // Every reason from the start, so queries over them have data at zero.
  for (int r = v1::FailureReason_MIN; r <= v1::FailureReason_MAX; ++r) {
    if (r == v1::FAILURE_REASON_UNSPECIFIED || !v1::FailureReason_IsValid(r))
      continue;
    failures_->Add({{"reason", Lower(v1::FailureReason_Name(
                                   static_cast<v1::FailureReason>(r)))}});
  }
  restarts_total_ = &BuildCounter()
                         .Name("shardtrain_job_restarts_total")
                         .Help("Job restarts from a checkpoint")
                         .Register(r)
                         .Add({});
  preemptions_ = &BuildCounter()
                      .Name("shardtrain_job_preemptions_total")
                      .Help(
                          "Jobs preempted (asked to checkpoint and stop for "
                          "a higher-priority job), by the job's owner")
                      .Register(r);
  // The anonymous user's from the start, so rates over it have data at 0.
  preemptions_->Add({{"user", ""}});
  remeshes_ = &BuildCounter()
                   .Name("shardtrain_job_remeshes_total")
                   .Help(
                       "Elastic jobs whose mesh changed while they ran "
                       "(shrunk for a higher-priority job, grown back), by "
                       "the job's owner")
                   .Register(r);
  remeshes_->Add({{"user", ""}});
  remesh_lost_ = &BuildCounter()
                      .Name("shardtrain_job_remesh_lost_seconds_total")
                      .Help(
                          "Seconds elastic jobs went without a step across "
                          "their re-meshes (ranks stopped on the old mesh to "
                          "the first step on the new one), by the job's owner")
                      .Register(r);
  remesh_lost_->Add({{"user", ""}});
  queue_wait_ = &BuildHistogram()
                     .Name("shardtrain_queue_wait_seconds")
                     .Help(
                         "Seconds a job waited in the queue before it "
                         "started (each time, after a preemption too)")
                     .Register(r)
                     .Add({}, prometheus::Histogram::BucketBoundaries{
                                  1, 5, 15, 60, 300, 900, 3600, 14400, 86400});
  queue_length_ = &BuildGauge()
                       .Name("shardtrain_queue_length")
                       .Help("Jobs waiting in the queue")
                       .Register(r)
                       .Add({});
  queue_oldest_wait_ =
      &BuildGauge()
           .Name("shardtrain_queue_oldest_wait_seconds")
           .Help("How long the longest-waiting queued job has waited")
           .Register(r)
           .Add({});
  const std::string kind = options_.devices.empty()
                               ? "cpu"
                               : KindLabel(options_.devices.front().kind);
  BuildGauge()
      .Name("shardtrain_devices")
      .Help("Devices the coordinator schedules onto")
      .Register(r)
      .Add({{"kind", kind}})
      .Set(static_cast<double>(options_.devices.size()));
  devices_in_use_ = &BuildGauge()
                         .Name("shardtrain_devices_in_use")
                         .Help("Devices held by a job")
                         .Register(r)
                         .Add({{"kind", kind}});
  job_restarts_ = &BuildGauge()
                       .Name("shardtrain_job_restarts")
                       .Help("Restarts of this job so far")
                       .Register(r);
  job_goodput_ = &BuildGauge()
                      .Name("shardtrain_job_goodput_ratio")
                      .Help(
                          "Device-seconds of the job's kept steps over the "
                          "device-seconds its devices were held")
                      .Register(r);
  user_goodput_ = &BuildGauge()
                       .Name("shardtrain_user_goodput_ratio")
                       .Help(
                           "Goodput over all of a user's jobs this daemon "
                           "has seen: kept over held device-seconds")
                       .Register(r);
  // The anonymous user's from the start (at 0), so queries over it have data.
  user_goodput_->Add({{"user", ""}});
}

void MetricsExporter::RegisterStepMetrics() {
  prometheus::Registry& r = *registry_;
  for (const StepField& f : StepFields()) {
    StepFamily family;
    switch (f.series) {
      case StepField::Series::kGauge:
        family.gauge =
            &BuildGauge().Name(f.series_name).Help(f.help).Register(r);
        break;
      case StepField::Series::kCounter:
        family.counter =
            &BuildCounter().Name(f.series_name).Help(f.help).Register(r);
        break;
      case StepField::Series::kHistogram:
        family.histogram =
            &BuildHistogram().Name(f.series_name).Help(f.help).Register(r);
        break;
      case StepField::Series::kNone:
        break;
    }
    step_families_.push_back(family);
  }
  heartbeat_age_ =
      &BuildGauge()
           .Name("shardtrain_heartbeat_age_seconds")
           .Help("Seconds since the rank's last heartbeat or report")
           .Register(r);
}

void MetricsExporter::RegisterGpuMetrics() {
  prometheus::Registry& r = *registry_;
  auto& utilization = BuildGauge()
                          .Name("shardtrain_gpu_utilization_ratio")
                          .Help("GPU busy share over NVML's last sample period")
                          .Register(r);
  auto& memory = BuildGauge()
                     .Name("shardtrain_gpu_memory_used_bytes")
                     .Help("GPU memory in use (all processes)")
                     .Register(r);
  auto& power = BuildGauge()
                    .Name("shardtrain_gpu_power_watts")
                    .Help("GPU power draw")
                    .Register(r);
  for (const DeviceInfo& d : options_.devices) {
    if (d.kind != v1::GPU) continue;
    const prometheus::Labels labels = {{"gpu", std::to_string(d.index)}};
    gpu_utilization_.push_back(&utilization.Add(labels));
    gpu_memory_used_.push_back(&memory.Add(labels));
    gpu_power_.push_back(&power.Add(labels));
  }
}

MetricsExporter::~MetricsExporter() { StopRefresh(); }

void MetricsExporter::StopRefresh() {
  if (!stop_.HasBeenNotified()) stop_.Notify();
  if (refresher_.joinable()) refresher_.join();
}

void MetricsExporter::set_cluster_source(std::function<ClusterView()> source) {
  {
    absl::MutexLock lock(&mutex_);
    cluster_source_ = std::move(source);
  }
  if (!refresher_.joinable()) {
    refresher_ = std::thread([this] { RefreshLoop(); });
  }
}

void MetricsExporter::RefreshLoop() {
  while (!stop_.WaitForNotificationWithTimeout(options_.refresh)) Refresh();
}

void MetricsExporter::Seed(const std::vector<v1::Job>& jobs) {
  absl::MutexLock lock(&mutex_);
  for (const v1::Job& job : jobs) {
    JobSeries& series = series_[job.id()];
    if (series.state != v1::JOB_STATE_UNSPECIFIED) continue;
    series.strategy = job.spec().strategy().name();
    series.mesh = JobMesh(job);
    // Counted by an earlier daemon.
    series.preemptions = job.preemptions();
    series.remeshes = job.remeshes();
    series.remesh_lost = job.remesh_seconds_lost();
    CountState(v1::JOB_STATE_UNSPECIFIED, job.state());
    series.state = job.state();
    if (IsTerminalJobState(job.state())) {
      // Finished before this coordinator started: nothing per-job to show.
      series.ended = absl::InfinitePast();
    }
  }
}

void MetricsExporter::CountState(v1::JobState from, v1::JobState to) {
  if (from == to) return;
  if (from != v1::JOB_STATE_UNSPECIFIED) {
    jobs_->Add({{"state", Lower(v1::JobState_Name(from))}})
        .Set(--state_counts_[from]);
  }
  jobs_->Add({{"state", Lower(v1::JobState_Name(to))}})
      .Set(++state_counts_[to]);
}

void MetricsExporter::OnJobChanged(const v1::Job& job) {
  absl::MutexLock lock(&mutex_);
  JobSeries& series = series_[job.id()];
  const v1::JobState before = series.state;
  series.strategy = job.spec().strategy().name();
  series.mesh = JobMesh(job);
  if (before == v1::JOB_STATE_UNSPECIFIED) {
    // Counted by an earlier daemon.
    series.preemptions = job.preemptions();
    series.remeshes = job.remeshes();
    series.remesh_lost = job.remesh_seconds_lost();
  } else {
    // The job's own counts are the one source: a shrink or a growth (which
    // stops the ranks too) is a re-mesh, not a preemption.
    if (job.preemptions() > series.preemptions) {
      preemptions_->Add({{"user", job.owner()}})
          .Increment(job.preemptions() - series.preemptions);
      series.preemptions = job.preemptions();
    }
    if (job.remeshes() > series.remeshes) {
      remeshes_->Add({{"user", job.owner()}})
          .Increment(job.remeshes() - series.remeshes);
      series.remeshes = job.remeshes();
    }
    if (job.remesh_seconds_lost() > series.remesh_lost) {
      remesh_lost_->Add({{"user", job.owner()}})
          .Increment(job.remesh_seconds_lost() - series.remesh_lost);
      series.remesh_lost = job.remesh_seconds_lost();
    }
  }
  UpdateGoodput(job, series);
  if (before == job.state()) return;
  if (before == v1::JOB_STATE_UNSPECIFIED && job.state() == v1::QUEUED) {
    submissions_->Increment();
  }
  CountState(before, job.state());
  series.state = job.state();
  if (job.state() == v1::RESTARTING) restarts_total_->Increment();
  if (job.state() == v1::QUEUED) series.queued_at = absl::Now();
  if (before == v1::QUEUED && job.state() == v1::STARTING &&
      series.queued_at != absl::InfinitePast()) {
    queue_wait_->Observe(absl::ToDoubleSeconds(absl::Now() - series.queued_at));
  }
  if (job.state() == v1::FAILED) {
    failures_
        ->Add(
            {{"reason", Lower(v1::FailureReason_Name(job.failure().reason()))}})
        .Increment();
  }
  if (job.state() == v1::STARTING || job.state() == v1::RUNNING ||
      job.state() == v1::RESTARTING) {
    if (series.restarts == nullptr) {
      series.restarts = &job_restarts_->Add({{"job", job.id()},
                                             {"strategy", series.strategy},
                                             {"mesh", series.mesh}});
    }
    series.restarts->Set(job.restarts());
    series.ended = absl::InfiniteFuture();
  }
  if (IsTerminalJobState(job.state())) {
    if (series.restarts != nullptr) series.restarts->Set(job.restarts());
    series.ended = absl::Now();
  }
}

MetricsExporter::RankSeries& MetricsExporter::Rank(const std::string& job_id,
                                                   JobSeries& job, int rank) {
  auto it = job.ranks.find(rank);
  if (it != job.ranks.end()) return it->second;
  RankSeries s;
  s.fields.resize(StepFields().size());
  s.heartbeat_age = &heartbeat_age_->Add({{"job", job_id},
                                          {"strategy", job.strategy},
                                          {"mesh", job.mesh},
                                          {"rank", std::to_string(rank)}});
  s.last_heartbeat = absl::Now();
  RankSeries& added = job.ranks.emplace(rank, s).first->second;
  // Every series a step always carries exists from the rank's first report
  // (a heartbeat may come first), at 0.
  v1::StepMetrics zero;
  zero.set_rank(rank);
  Record(job_id, job, added, zero);
  return added;
}

void MetricsExporter::Record(const std::string& job_id, const JobSeries& job,
                             RankSeries& s, const v1::StepMetrics& p) {
  const StepMetrics m = StepMetricsFromProto(p);
  const std::vector<StepField>& fields = StepFields();
  for (size_t i = 0; i < fields.size(); ++i) {
    const StepField& f = fields[i];
    if (f.series == StepField::Series::kNone || !f.PresentIn(m)) continue;
    StepSeries& series = s.fields[i];
    const StepFamily& family = step_families_[i];
    if (series.gauge == nullptr && series.counter == nullptr &&
        series.histogram == nullptr) {
      prometheus::Labels labels = {{"job", job_id},
                                   {"strategy", job.strategy},
                                   {"mesh", job.mesh},
                                   {"rank", std::to_string(m.rank)}};
      if (f.presence == StepField::Presence::kWithStage) {
        labels["stage"] = std::to_string(m.pipeline_stage);
      }
      if (family.gauge != nullptr) series.gauge = &family.gauge->Add(labels);
      if (family.counter != nullptr) {
        series.counter = &family.counter->Add(labels);
      }
      if (family.histogram != nullptr) {
        series.histogram = &family.histogram->Add(labels, StepBuckets());
      }
    }
    const double value = f.Value(m);
    if (series.gauge != nullptr) series.gauge->Set(value);
    if (series.counter != nullptr) series.counter->Increment(value);
    // The zero step that makes a rank's series is no observation.
    if (series.histogram != nullptr && m.step > 0) {
      series.histogram->Observe(value);
    }
  }
}

void MetricsExporter::OnSteps(const v1::Job& job,
                              const std::vector<v1::StepMetrics>& steps) {
  absl::MutexLock lock(&mutex_);
  JobSeries& series = series_[job.id()];
  if (series.strategy.empty()) {
    series.strategy = job.spec().strategy().name();
    series.mesh = JobMesh(job);
  }
  for (const v1::StepMetrics& m : steps) {
    RankSeries& s = Rank(job.id(), series, m.rank());
    Record(job.id(), series, s, m);
    s.last_heartbeat = absl::Now();
    s.heartbeat_age->Set(0);
  }
  UpdateGoodput(job, series);
}

void MetricsExporter::UpdateGoodput(const v1::Job& job, JobSeries& series) {
  const double held = job.device_seconds_held();
  const double kept = job.device_seconds_kept();
  if (held <= 0) return;
  if (series.goodput == nullptr) {
    series.goodput = &job_goodput_->Add({{"job", job.id()},
                                         {"strategy", series.strategy},
                                         {"mesh", series.mesh}});
  }
  series.goodput->Set(std::min(1.0, kept / held));
  auto& [user_held, user_kept] = user_seconds_[job.owner()];
  user_held += held - series.held;
  user_kept += kept - series.kept;
  series.held = held;
  series.kept = kept;
  if (user_held > 0) {
    user_goodput_->Add({{"user", job.owner()}})
        .Set(std::min(1.0, user_kept / user_held));
  }
}

void MetricsExporter::OnHeartbeat(const std::string& job_id, int rank,
                                  absl::Time time) {
  absl::MutexLock lock(&mutex_);
  auto it = series_.find(job_id);
  if (it == series_.end()) return;
  RankSeries& s = Rank(job_id, it->second, rank);
  s.last_heartbeat = time;
  s.heartbeat_age->Set(0);
}

void MetricsExporter::RemoveJobSeries(JobSeries& job) {
  for (auto& [rank, s] : job.ranks) {
    for (size_t i = 0; i < s.fields.size(); ++i) {
      const StepSeries& series = s.fields[i];
      const StepFamily& family = step_families_[i];
      if (series.gauge != nullptr) family.gauge->Remove(series.gauge);
      if (series.counter != nullptr) family.counter->Remove(series.counter);
      if (series.histogram != nullptr) {
        family.histogram->Remove(series.histogram);
      }
    }
    heartbeat_age_->Remove(s.heartbeat_age);
  }
  job.ranks.clear();
  if (job.goodput != nullptr) {
    job_goodput_->Remove(job.goodput);
    job.goodput = nullptr;
  }
  if (job.restarts != nullptr) {
    job_restarts_->Remove(job.restarts);
    job.restarts = nullptr;
  }
}

void MetricsExporter::Refresh() {
  std::function<ClusterView()> source;
  {
    absl::MutexLock lock(&mutex_);
    source = cluster_source_;
  }
  // Outside our lock: the source takes the job manager's, and the manager
  // calls into this object while holding it.
  std::optional<ClusterView> view;
  if (source) view = source();
  const absl::Time now = absl::Now();
  absl::MutexLock lock(&mutex_);
  if (view.has_value()) {
    queue_length_->Set(static_cast<double>(view->queue.size()));
    int64_t oldest = 0;
    for (const v1::Job& job : view->queue) {
      oldest = oldest == 0 ? job.submit_time_unix_ms()
                           : std::min(oldest, job.submit_time_unix_ms());
    }
    queue_oldest_wait_->Set(
        oldest == 0 ? 0
                    : std::max(0.0, absl::ToDoubleSeconds(
                                        now - absl::FromUnixMillis(oldest))));
    int in_use = 0;
    for (const ClusterView::Holder& h : view->holders)
      in_use += !h.job_id.empty();
    devices_in_use_->Set(in_use);
  }
  for (auto it = series_.begin(); it != series_.end();) {
    JobSeries& job = it->second;
    if (IsTerminalJobState(job.state)) {
      if (now - job.ended >= options_.retention) {
        RemoveJobSeries(job);
        it = series_.erase(it);  // a finished job changes no more
      } else {
        ++it;
      }
      continue;
    }
    ++it;
    for (auto& [rank, s] : job.ranks) {
      s.heartbeat_age->Set(absl::ToDoubleSeconds(now - s.last_heartbeat));
    }
  }
  if (options_.nvml != nullptr) {
    for (size_t i = 0; i < gpu_utilization_.size(); ++i) {
      if (auto usage = options_.nvml->Usage(static_cast<int>(i))) {
        gpu_utilization_[i]->Set(usage->utilization_ratio);
        gpu_memory_used_[i]->Set(static_cast<double>(usage->memory_used_bytes));
        gpu_power_[i]->Set(usage->power_watts);
      }
    }
  }
}

}  // namespace shardtrain
