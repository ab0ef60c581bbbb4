// Coordinator: shardtraind assembled. Builds the store, launcher, job manager
// and gRPC services from CoordinatorOptions and serves them; owns nothing
// else. Members are declared in dependency order, so they are destroyed in
// reverse.
//
// Listens on options.listen (TLS when a certificate is given) and, for its
// own workers, on a Unix socket in the state dir (state-dir/shardtraind.sock;
// a loopback port when the path is too long for a socket). The address bound
// on options.listen is written to state-dir/endpoint for local clients.
#ifndef SHARDTRAIN_SERVER_COORDINATOR_H_
#define SHARDTRAIN_SERVER_COORDINATOR_H_

#include <grpcpp/server.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "server/access_policy.h"
#include "server/backend.h"
#include "server/cluster_service.h"
#include "server/device_inventory.h"
#include "server/job_manager.h"
#include "server/job_service.h"
#include "server/job_store.h"
#include "server/metrics_exporter.h"
#include "server/nvml.h"
#include "server/process_spawner.h"
#include "server/request_authorizer.h"
#include "server/worker_service.h"

namespace shardtrain {

// The port shardtraind listens on by default (127.0.0.1 only).
inline constexpr int kDefaultPort = 50551;

struct CoordinatorOptions {
  std::string listen = "127.0.0.1:50551";
  // Prometheus endpoint; empty: none. The bound address goes to
  // state-dir/metrics_endpoint.
  std::string metrics_listen = "127.0.0.1:9464";
  absl::Duration metrics_retention = absl::Minutes(5);
  std::string state_dir;
  std::string worker_binary;  // empty: shardtrain-worker beside shardtraind
  DeviceOptions devices;
  absl::Duration grace_period = absl::Seconds(10);
  absl::Duration heartbeat_interval = absl::Seconds(2);
  absl::Duration heartbeat_timeout = absl::Seconds(30);
  absl::Duration rendezvous_timeout = absl::Seconds(300);
  // Users and their tokens (server/user_directory.h); re-read by
  // ReloadUsers (shardtraind on SIGHUP).
  std::string auth_token_file;
  // Devices a user's jobs may hold at once unless the token file gives
  // theirs; 0: no cap.
  int default_quota = 0;
  // --priority-class values: "urgent=100" or "prod=50,preemptible=false".
  std::vector<std::string> priority_classes;
  // How long a preempted job's ranks have to save their checkpoint and
  // stop before they are killed.
  absl::Duration preempt_grace = absl::Seconds(60);
  std::string tls_cert;
  std::string tls_key;
  // Listen beyond loopback without a token (server/access_policy.h).
  bool insecure = false;
  bool metrics_public = false;  // --metrics-listen beyond loopback
  // Directories a job's data and init_from must lie in; empty: anywhere.
  std::vector<std::string> path_roots;
  int max_streams_per_client = 64;  // per connection
  int max_streams_per_peer = 128;   // per local user or remote address
  int max_streams = 512;            // for the whole daemon
  // Connections one peer may hold on --listen (the self-check shuts down
  // the newest beyond it; server/connection_trimmer.h).
  int max_connections_per_peer = 1024;
  // Largest request accepted (a JobSpec is a few KiB; a worker's progress
  // report a few hundred steps).
  int max_message_bytes = 4 << 20;
  // Free space the state directory must keep for a submission to be taken.
  double min_free_mb = 64;
  // The backend that runs ranks: a row of `backends` (server/backend.h),
  // whose own flags and settings that row holds.
  std::string launcher = "local";
  // Null: the built-in ones (server/backends.h). Read by Start only.
  BackendRegistry* backends = nullptr;
  // Where the workers reach the coordinator. Empty: a Unix socket in the
  // state dir. A backend whose ranks run on other hosts needs a TCP address
  // they can reach, e.g. 10.0.0.1:50552 (port 0: any free one).
  std::string worker_listen;
};

class Coordinator {
 public:
  // Everything up and serving, or an error naming what failed (a flag, the
  // state dir, the listen address).
  static absl::StatusOr<std::unique_ptr<Coordinator>> Start(
      CoordinatorOptions options);

  ~Coordinator();
  Coordinator(const Coordinator&) = delete;
  Coordinator& operator=(const Coordinator&) = delete;

  // Stops accepting calls, stops the workers, closes the store. Idempotent.
  void Shutdown();

  // The address bound on options.listen ("127.0.0.1:50551").
  const std::string& address() const { return address_; }
  // The Prometheus endpoint's address; empty without one.
  std::string metrics_address() const {
    return exporter_ ? exporter_->address() : "";
  }
  JobManager& manager() { return *manager_; }

  // Re-reads --auth-token-file (users, roles, quotas); on an error the
  // users already loaded stay and the error says why.
  absl::Status ReloadUsers();

 private:
  explicit Coordinator(CoordinatorOptions options);
  // The steps of Start, in order.
  absl::Status StartBackend(BackendKind& kind);
  absl::Status StartExporter(const std::vector<DeviceInfo>& devices);
  absl::Status OpenStore();
  absl::Status Serve(
      const std::shared_ptr<grpc::ServerCredentials>& credentials,
      JobManagerOptions manager_options);
  // A server over the services on `listen` and `worker_listen`; the ports
  // bound in *public_port and *worker_port (0: not bound).
  std::unique_ptr<grpc::Server> BuildServer(const std::string& listen,
                                            const std::string& worker_listen,
                                            int* public_port, int* worker_port);
  void Publish();
  // The self-check: every second, probe both listeners through their own
  // addresses (server/listener_probe.h); after kFailuresBeforeRebuild
  // probes in a row find one not accepting, serve anew on the same
  // addresses. Jobs, the store and the manager are untouched: only calls in
  // flight end (clients reconnect).
  void SelfCheckLoop();
  bool RebuildServer();

  const CoordinatorOptions options_;
  int lock_fd_ = -1;  // flock on state-dir/LOCK: one coordinator per state dir
  std::unique_ptr<Nvml> nvml_;
  std::unique_ptr<JobStore> store_;
  PosixProcessSpawner processes_;
  std::unique_ptr<Backend> backend_;  // may spawn through processes_
  RealClock clock_;
  std::unique_ptr<UserDirectory> users_;
  std::unique_ptr<RequestAuthorizer> authorizer_;
  std::unique_ptr<StreamLimiter> streams_;
  std::unique_ptr<MetricsExporter> exporter_;
  std::unique_ptr<JobManager> manager_;
  std::unique_ptr<JobServiceImpl> job_service_;
  std::unique_ptr<ClusterServiceImpl> cluster_service_;
  std::unique_ptr<WorkerServiceImpl> worker_service_;
  std::shared_ptr<grpc::ServerCredentials> credentials_;
  std::string worker_address_;  // as bound (a TCP listener's port filled in)
  absl::Mutex server_mutex_;    // replacing server_ vs. shutting it down
  std::unique_ptr<grpc::Server> server_ ABSL_GUARDED_BY(server_mutex_);
  std::string address_;
  absl::Notification stop_self_check_;
  std::thread self_check_;
  bool shut_down_ = false;
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_SERVER_COORDINATOR_H_
