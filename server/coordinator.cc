#include "server/coordinator.h"

#include <fcntl.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <map>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/atomic_file.h"
#include "common/flag_file.h"
#include "common/subprocess.h"
#include "server/backends.h"
#include "server/connection_trimmer.h"
#include "server/dataset_locator.h"
#include "server/grpc_status.h"
#include "server/listener_probe.h"

namespace shardtrain {
namespace {

constexpr size_t kMaxUnixSocketPath = 107;  // sun_path minus the NUL
// The listeners' self-check (Coordinator::SelfCheckLoop): a probe a second,
// each given two seconds to be accepted and answered; three failures in a
// row (a listener that stopped accepting for good, as gRPC's does after a
// descriptor flood) serve anew.
constexpr absl::Duration kSelfCheckInterval = absl::Seconds(1);
constexpr absl::Duration kSelfCheckTimeout = absl::Seconds(2);
constexpr int kFailuresBeforeRebuild = 3;
constexpr absl::Duration kTrimLogEvery = absl::Seconds(10);
// Connections that never complete the HTTP/2 handshake are dropped after it.
constexpr absl::Duration kServerHandshakeTimeout = absl::Seconds(5);

// Locks state-dir/LOCK for this process's lifetime.
absl::StatusOr<int> LockStateDir(const std::string& state_dir) {
  const std::string path = state_dir + "/LOCK";
  const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) {
    return absl::PermissionDeniedError(
        absl::StrCat("--state-dir: cannot open ", path));
  }
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    char pid[32] = {};
    (void)!pread(fd, pid, sizeof(pid) - 1, 0);
    close(fd);
    return absl::FailedPreconditionError(absl::StrCat(
        "--state-dir: ", state_dir, " is in use by another shardtraind (pid ",
        std::string(pid), ")"));
  }
  const std::string me = std::to_string(getpid());
  (void)!ftruncate(fd, 0);
  (void)!pwrite(fd, me.data(), me.size(), 0);
  return fd;
}

// The coordinator's settings and parts its backend may use.
BackendContext MakeBackendContext(const CoordinatorOptions& options,
                                  const Nvml* nvml, ProcessSpawner* processes) {
  BackendContext context;
  context.devices = options.devices;
  context.nvml = nvml;
  context.processes = processes;
  context.worker_listen = options.worker_listen;
  return context;
}

// Every option that can be checked before anything is opened or bound, the
// backend's own among them.
absl::Status ValidateOptions(const CoordinatorOptions& options,
                             const BackendKind& backend) {
  if (options.state_dir.empty()) {
    return absl::InvalidArgumentError("--state-dir: required");
  }
  if (options.tls_cert.empty() != options.tls_key.empty()) {
    return absl::InvalidArgumentError(
        "--tls-cert and --tls-key: give both or neither");
  }
  if (options.grace_period < absl::ZeroDuration() ||
      options.heartbeat_interval <= absl::ZeroDuration() ||
      options.heartbeat_timeout <= options.heartbeat_interval ||
      options.rendezvous_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "timeouts: need --grace-period >= 0, --heartbeat-interval > 0, "
        "--heartbeat-timeout > --heartbeat-interval, --rendezvous-timeout > 0");
  }
  if (absl::Status s = CheckMetricsListenAllowed(options.metrics_listen,
                                                 options.metrics_public);
      !s.ok()) {
    return s;
  }
  // The workers' listener serves the same services as --listen: the same
  // rule (the token file itself is read below).
  if (!options.worker_listen.empty()) {
    if (absl::Status s = CheckListenAllowed(options.worker_listen,
                                            !options.auth_token_file.empty(),
                                            options.insecure);
        !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--worker-listen: ", absl::StripPrefix(s.message(), "--listen: ")));
    }
  }
  if (options.max_connections_per_peer < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-connections-per-peer must be >= 1; got ",
                     options.max_connections_per_peer));
  }
  if (options.max_streams_per_client < 1 || options.max_streams_per_peer < 1 ||
      options.max_streams < 1 || options.max_message_bytes < 1024) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max-streams-per-client, --max-streams-per-peer and --max-streams "
        "must be >= 1 and --max-message-bytes >= 1024; got ",
        options.max_streams_per_client, ", ", options.max_streams_per_peer,
        ", ", options.max_streams, " and ", options.max_message_bytes));
  }
  return backend.Validate(MakeBackendContext(options, nullptr, nullptr));
}

// Creates the state directory (absolute, private) and finds the worker
// binary; both are written back into `options`.
absl::Status PrepareStateDir(CoordinatorOptions& options) {
  std::error_code ec;
  std::filesystem::create_directories(options.state_dir + "/jobs", ec);
  if (ec) {
    return absl::PermissionDeniedError(absl::StrCat(
        "--state-dir: cannot create ", options.state_dir, ": ", ec.message()));
  }
  options.state_dir = std::filesystem::absolute(options.state_dir).string();
  // Jobs, logs and the database are this user's: a state directory made by
  // an older version (0755) is closed too. New files are 0600 (shardtraind's
  // umask, server/main.cc).
  if (chmod(options.state_dir.c_str(), 0700) != 0) {
    return absl::PermissionDeniedError(
        absl::StrCat("--state-dir: cannot make ", options.state_dir,
                     " private (chmod 700): ", std::strerror(errno)));
  }
  if (options.worker_binary.empty())
    options.worker_binary = SiblingProgram("shardtrain-worker");
  if (access(options.worker_binary.c_str(), X_OK) != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--worker-binary: '", options.worker_binary, "' is not executable"));
  }
  return absl::OkStatus();
}

// --auth-token-file's users (none without one), once --listen is allowed
// with or without them.
absl::StatusOr<std::unique_ptr<UserDirectory>> ReadUsers(
    const CoordinatorOptions& options) {
  std::unique_ptr<UserDirectory> users = std::make_unique<UserDirectory>();
  if (!options.auth_token_file.empty()) {
    absl::StatusOr<std::unique_ptr<UserDirectory>> read =
        UserDirectory::Load(options.auth_token_file);
    if (!read.ok()) return read.status();
    users = std::move(*read);
  }
  if (absl::Status s = CheckListenAllowed(options.listen, users->enabled(),
                                          options.insecure);
      !s.ok()) {
    return s;
  }
  return users;
}

// The clients' credentials: TLS from --tls-cert and --tls-key, or none.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentials(
    const CoordinatorOptions& options) {
  std::shared_ptr<grpc::ServerCredentials> credentials =
      grpc::InsecureServerCredentials();
  if (!options.tls_cert.empty()) {
    absl::StatusOr<std::string> cert =
        ReadFlagFile("--tls-cert", options.tls_cert);
    if (!cert.ok()) return cert.status();
    // A certificate is public; its key is a secret.
    absl::StatusOr<std::string> key = ReadFlagFile(
        "--tls-key", options.tls_key, FlagFileOptions::Secret(1 << 20));
    if (!key.ok()) return key.status();
    // gRPC only fails later, at BuildAndStart, without saying why: check
    // that each file is the PEM it should be.
    if (!absl::StrContains(*cert, "-----BEGIN CERTIFICATE-----")) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--tls-cert: '", options.tls_cert,
          "' holds no PEM certificate (-----BEGIN CERTIFICATE-----)"));
    }
    if (!absl::StrContains(*key, "-----BEGIN") ||
        !absl::StrContains(*key, "PRIVATE KEY-----")) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--tls-key: '", options.tls_key,
          "' holds no PEM private key (-----BEGIN ... PRIVATE KEY-----)"));
    }
    grpc::SslServerCredentialsOptions ssl;
    ssl.pem_key_cert_pairs.push_back({*key, *cert});
    credentials = grpc::SslServerCredentials(ssl);
  }
  return credentials;
}

// The workers' channel: a Unix socket only this user can reach, or the
// address given (--worker-listen; ranks on other hosts need one they can
// reach).
std::string WorkerListenAddress(const CoordinatorOptions& options) {
  std::error_code ec;
  const std::string socket_path = options.state_dir + "/shardtraind.sock";
  std::string worker_listen;
  if (!options.worker_listen.empty()) {
    worker_listen = options.worker_listen;
  } else if (socket_path.size() <= kMaxUnixSocketPath) {
    std::filesystem::remove(socket_path, ec);  // left by a killed coordinator
    worker_listen = "unix:" + socket_path;
  } else {
    worker_listen = "127.0.0.1:0";
  }
  return worker_listen;
}

JobManagerOptions ManagerOptions(const CoordinatorOptions& options,
                                 const std::vector<DeviceInfo>& devices,
                                 const PathRoots& roots,
                                 const std::string& worker_listen) {
  JobManagerOptions manager_options;
  manager_options.state_dir = options.state_dir;
  manager_options.worker_binary = options.worker_binary;
  manager_options.devices = devices;
  manager_options.cpu_cores = UsableCores();
  manager_options.grace_period = options.grace_period;
  manager_options.heartbeat_interval = options.heartbeat_interval;
  manager_options.heartbeat_timeout = options.heartbeat_timeout;
  manager_options.rendezvous_timeout = options.rendezvous_timeout;
  manager_options.resolve_data = MakeDatasetLocator(options.state_dir);
  manager_options.path_roots = roots;
  manager_options.min_free_bytes =
      static_cast<int64_t>(options.min_free_mb * 1048576.0);
  manager_options.worker_address = worker_listen;
  manager_options.preempt_grace = options.preempt_grace;
  return manager_options;
}

// The exporter starts from every stored job, and reads the cluster from the
// manager.
void SeedExporter(MetricsExporter& exporter, JobManager& manager) {
  std::vector<v1::Job> all;
  ListJobsQuery query;
  query.page_size = 1000;
  do {
    absl::StatusOr<ListJobsPage> page = manager.List(query);
    if (!page.ok()) break;
    all.insert(all.end(), page->jobs.begin(), page->jobs.end());
    query.page_token = page->next_page_token;
  } while (!query.page_token.empty());
  exporter.Seed(all);
  exporter.set_cluster_source([&manager] { return manager.Cluster(); });
}

}  // namespace

Coordinator::Coordinator(CoordinatorOptions options)
    : options_(std::move(options)) {}

Coordinator::~Coordinator() {
  Shutdown();
  if (lock_fd_ >= 0) {
    // No pid left behind for a process that may later take the number.
    (void)!ftruncate(lock_fd_, 0);
    close(lock_fd_);
  }
}

absl::StatusOr<std::unique_ptr<Coordinator>> Coordinator::Start(
    CoordinatorOptions options) {
  BackendRegistry builtin;
  if (options.backends == nullptr) {
    builtin = BuiltinBackends();
    options.backends = &builtin;
  }
  absl::StatusOr<BackendKind*> backend =
      options.backends->Get(options.launcher);
  if (!backend.ok()) return backend.status();
  if (absl::Status s = ValidateOptions(options, **backend); !s.ok()) return s;
  if (absl::Status s = PrepareStateDir(options); !s.ok()) return s;
  options.backends = nullptr;  // read here only
  std::unique_ptr<Coordinator> c(new Coordinator(options));
  absl::StatusOr<int> lock = LockStateDir(options.state_dir);
  if (!lock.ok()) return lock.status();
  c->lock_fd_ = *lock;
  if (absl::Status s = c->StartBackend(**backend); !s.ok()) return s;
  const std::vector<DeviceInfo>& devices = c->backend_->devices();
  if (absl::Status s = c->StartExporter(devices); !s.ok()) return s;
  if (absl::Status s = c->OpenStore(); !s.ok()) return s;
  absl::StatusOr<std::unique_ptr<UserDirectory>> users = ReadUsers(options);
  if (!users.ok()) return users.status();
  absl::StatusOr<std::map<std::string, PriorityClass>> classes =
      ParsePriorityClasses(options.priority_classes);
  if (!classes.ok()) return classes.status();
  absl::StatusOr<PathRoots> roots = PathRoots::Create(options.path_roots);
  if (!roots.ok()) return roots.status();
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
      ServerCredentials(options);
  if (!credentials.ok()) return credentials.status();
  c->streams_ = std::make_unique<StreamLimiter>(options.max_streams_per_client,
                                                options.max_streams_per_peer,
                                                options.max_streams);
  c->users_ = std::move(*users);
  c->authorizer_ = std::make_unique<RequestAuthorizer>(c->users_.get());
  JobManagerOptions manager_options =
      ManagerOptions(options, devices, *roots, WorkerListenAddress(options));
  manager_options.priority_classes = std::move(*classes);
  manager_options.device_quota =
      [users = c->users_.get(), fallback = options.default_quota](
          const std::string& user) { return users->QuotaOf(user, fallback); };
  if (absl::Status s = c->Serve(*credentials, std::move(manager_options));
      !s.ok()) {
    return s;
  }
  c->Publish();
  // Serving for sure: only now may jobs the last coordinator left active
  // use up a restart.
  c->manager_->ResumeInterruptedJobs();
  c->manager_->Start();
  std::cerr
      << "shardtraind " << SHARDTRAIN_VERSION << ": listening on "
      << c->address_ << (options.tls_cert.empty() ? "" : " (TLS)")
      << (c->users_->enabled()
              ? absl::StrCat(" with token auth (", c->users_->size(),
                             c->users_->size() == 1 ? " user)" : " users)")
              : "")
      << (c->exporter_
              ? "; metrics on http://" + c->exporter_->address() + "/metrics"
              : "")
      << "; " << devices.size() << " "
      << (!devices.empty() && devices.front().kind == v1::GPU ? "GPU(s)"
                                                              : "CPU slot(s)")
      << " (" << options.launcher << " backend)"
      << "; state in " << options.state_dir << std::endl;
  return c;
}

absl::Status Coordinator::StartBackend(BackendKind& kind) {
  nvml_ = Nvml::Load();
  absl::StatusOr<std::unique_ptr<Backend>> backend =
      kind.Create(MakeBackendContext(options_, nvml_.get(), &processes_));
  if (!backend.ok()) return backend.status();
  if ((*backend)->devices().empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("--launcher ", kind.name(),
                     ": the backend offers no device to run on"));
  }
  backend_ = std::move(*backend);
  return absl::OkStatus();
}

absl::Status Coordinator::StartExporter(
    const std::vector<DeviceInfo>& devices) {
  if (options_.metrics_listen.empty()) return absl::OkStatus();
  MetricsExporterOptions metrics;
  metrics.listen = options_.metrics_listen;
  metrics.retention = options_.metrics_retention;
  metrics.version = SHARDTRAIN_VERSION;
  metrics.devices = devices;
  metrics.nvml = nvml_.get();
  absl::StatusOr<std::unique_ptr<MetricsExporter>> exporter =
      MetricsExporter::Start(metrics);
  if (!exporter.ok()) return exporter.status();
  exporter_ = std::move(*exporter);
  return absl::OkStatus();
}

absl::Status Coordinator::OpenStore() {
  absl::StatusOr<std::unique_ptr<JobStore>> store =
      JobStore::Open(options_.state_dir + "/shardtraind.db");
  if (!store.ok()) return store.status();
  store_ = std::move(*store);
  for (const char* suffix : {"", "-wal", "-shm"}) {
    // Owner-only, also when an older version made them 0644.
    (void)chmod((options_.state_dir + "/shardtraind.db" + suffix).c_str(),
                0600);
  }
  return absl::OkStatus();
}

std::unique_ptr<grpc::Server> Coordinator::BuildServer(
    const std::string& listen, const std::string& worker_listen,
    int* public_port, int* worker_port) {
  grpc::ServerBuilder builder;
  builder.SetMaxReceiveMessageSize(options_.max_message_bytes);
  // A connection that has not completed the HTTP/2 handshake (a client that
  // never sends the preface) gives its descriptor back within seconds.
  builder.AddChannelArgument(
      GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS,
      static_cast<int>(absl::ToInt64Milliseconds(kServerHandshakeTimeout)));
  {
    std::vector<
        std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
        interceptors;
    interceptors.push_back(MakeMalformedRequestInterceptorFactory());
    builder.experimental().SetInterceptorCreators(std::move(interceptors));
  }
  // One daemon per address: gRPC would otherwise bind with SO_REUSEPORT,
  // and a second daemon on the same port would share its connections
  // (and so its submissions) with the first.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddListeningPort(listen, credentials_, public_port);
  builder.AddListeningPort(worker_listen, grpc::InsecureServerCredentials(),
                           worker_port);
  builder.RegisterService(job_service_.get());
  builder.RegisterService(cluster_service_.get());
  builder.RegisterService(worker_service_.get());
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server != nullptr) {
    for (const char* service :
         {"", "shardtrain.v1.JobService", "shardtrain.v1.ClusterService",
          "shardtrain.v1.WorkerService"}) {
      server->GetHealthCheckService()->SetServingStatus(service, true);
    }
  }
  return server;
}

// Binds both listeners, builds the manager and the services over them, and
// starts serving. The manager needs the workers' address before the server
// runs, but the port of a TCP fallback is known only after BuildAndStart:
// that case binds first and tells the manager afterwards.
absl::Status Coordinator::Serve(
    const std::shared_ptr<grpc::ServerCredentials>& credentials,
    JobManagerOptions manager_options) {
  const std::string worker_listen = manager_options.worker_address;
  credentials_ = credentials;
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();

  absl::StatusOr<std::unique_ptr<JobManager>> manager =
      JobManager::Create(manager_options, store_.get(), &backend_->launcher(),
                         &clock_, exporter_.get());
  if (!manager.ok()) return manager.status();
  manager_ = std::move(*manager);
  if (exporter_ != nullptr) SeedExporter(*exporter_, *manager_);

  job_service_ = std::make_unique<JobServiceImpl>(
      manager_.get(), authorizer_.get(), streams_.get());
  cluster_service_ = std::make_unique<ClusterServiceImpl>(
      manager_.get(), authorizer_.get(), backend_.get(), options_.launcher);
  worker_service_ = std::make_unique<WorkerServiceImpl>(manager_.get());
  int public_port = 0;
  int worker_port = 0;
  std::unique_ptr<grpc::Server> server =
      BuildServer(options_.listen, worker_listen, &public_port, &worker_port);
  if (server == nullptr || public_port == 0 || worker_port == 0) {
    // Whoever holds the port, named (another shardtraind, most often).
    std::string holder;
    if (int port = 0;
        !absl::StartsWith(options_.listen, "unix") &&
        absl::SimpleAtoi(options_.listen.substr(options_.listen.rfind(':') + 1),
                         &port) &&
        port > 0) {
      holder = DescribeListener(port);
    }
    if (!holder.empty()) {
      return absl::UnavailableError(
          absl::StrCat("--listen: ", options_.listen, " is taken by ", holder,
                       "; stop it or choose another --listen"));
    }
    return absl::UnavailableError(absl::StrCat(
        "--listen: cannot listen on ", options_.listen,
        public_port == 0 ? "" : absl::StrCat(" (or on ", worker_listen, ")"),
        ": the port is taken (another shardtraind?), the address is not one "
        "of this host's",
        options_.tls_cert.empty()
            ? ""
            : ", or the TLS certificate and key do not belong together"));
  }
  worker_address_ = worker_listen;
  if (!absl::StartsWith(worker_listen, "unix:")) {
    // A TCP listener: tell the workers the port actually bound.
    const std::string worker_host =
        worker_listen.substr(0, worker_listen.rfind(':'));
    worker_address_ = absl::StrCat(worker_host, ":", worker_port);
    manager_->set_worker_address(worker_address_);
  }
  if (absl::StartsWith(options_.listen, "unix:") ||
      absl::StartsWith(options_.listen, "unix-abstract:")) {
    address_ = options_.listen;  // no port to fill in
  } else {
    const std::string host =
        options_.listen.substr(0, options_.listen.rfind(':'));
    address_ = absl::StrCat(host, ":", public_port);
  }
  {
    absl::MutexLock lock(&server_mutex_);
    server_ = std::move(server);
  }
  self_check_ = std::thread([this] { SelfCheckLoop(); });
  return absl::OkStatus();
}

void Coordinator::SelfCheckLoop() {
  int failures = 0;
  // A TCP --listen's port: its connections are bounded per peer.
  int port = 0;
  if (!absl::StartsWith(address_, "unix")) {
    (void)absl::SimpleAtoi(address_.substr(address_.rfind(':') + 1), &port);
  }
  absl::Time last_trim_log = absl::InfinitePast();
  int trimmed_unlogged = 0;
  while (!stop_self_check_.WaitForNotificationWithTimeout(kSelfCheckInterval)) {
    if (port > 0) {
      const TrimResult trim =
          TrimConnectionsPerPeer(port, options_.max_connections_per_peer);
      trimmed_unlogged += trim.shut_down;
      // Said at most every 10 s: a peer that keeps trying costs no log.
      if (trimmed_unlogged > 0 && absl::Now() - last_trim_log > kTrimLogEvery) {
        std::cerr << "shardtraind: shut down " << trimmed_unlogged
                  << " connection(s) beyond --max-connections-per-peer "
                  << options_.max_connections_per_peer << " (the most from "
                  << trim.busiest << ")" << std::endl;
        trimmed_unlogged = 0;
        last_trim_log = absl::Now();
      }
    }
    absl::Status status = ProbeListener(address_, kSelfCheckTimeout);
    if (status.ok()) status = ProbeListener(worker_address_, kSelfCheckTimeout);
    if (status.ok()) {
      failures = 0;
      continue;
    }
    if (++failures < kFailuresBeforeRebuild) continue;
    std::cerr << "shardtraind: self-check: " << status.message()
              << "; serving anew on the same addresses" << std::endl;
    if (RebuildServer()) {
      failures = 0;
      std::cerr << "shardtraind: serving anew on " << address_ << std::endl;
    }
  }
}

bool Coordinator::RebuildServer() {
  absl::MutexLock lock(&server_mutex_);
  if (shut_down_) return false;
  if (server_ != nullptr) {
    // Calls in flight end (streams see their context cancelled); the jobs,
    // the manager and the store do not notice.
    server_->Shutdown(std::chrono::system_clock::now() +
                      std::chrono::seconds(1));
    server_->Wait();
    server_.reset();
  }
  int public_port = 0;
  int worker_port = 0;
  std::unique_ptr<grpc::Server> server =
      BuildServer(address_, worker_address_, &public_port, &worker_port);
  if (server == nullptr || public_port == 0 || worker_port == 0) {
    // Descriptors still short: the next self-check tries again.
    std::cerr << "shardtraind: cannot listen on " << address_ << " and "
              << worker_address_ << " yet; trying again" << std::endl;
    return false;
  }
  server_ = std::move(server);
  return true;
}

// The addresses clients find in the state directory (best effort: clients
// fall back to the default address).
void Coordinator::Publish() {
  auto publish = [this](const std::string& name, const std::string& address) {
    (void)WriteFileAtomically(options_.state_dir + "/" + name, address + "\n");
  };
  // metrics_endpoint first: a client that sees `endpoint` finds both.
  if (exporter_ != nullptr) publish("metrics_endpoint", exporter_->address());
  publish("endpoint", address_);
}

absl::Status Coordinator::ReloadUsers() {
  if (users_ == nullptr) return absl::OkStatus();
  absl::Status s = users_->Reload();
  std::cerr << "shardtraind: "
            << (s.ok() ? absl::StrCat("reloaded --auth-token-file (",
                                      users_->size(), " users)")
                       : absl::StrCat(s.message(),
                                      "; the users loaded before stay"))
            << std::endl;
  return s;
}

void Coordinator::Shutdown() {
  if (shut_down_) return;
  if (self_check_.joinable()) {
    stop_self_check_.Notify();
    self_check_.join();
  }
  absl::MutexLock lock(&server_mutex_);
  shut_down_ = true;
  // The exporter's refresh reads the manager: stop it first.
  if (exporter_ != nullptr) exporter_->StopRefresh();
  if (server_ != nullptr) {
    server_->GetHealthCheckService()->SetServingStatus(false);
    // Streams (WatchJob, StreamLogs -f) end once the manager closes them;
    // the deadline bounds any other call still running.
    manager_->Shutdown();
    server_->Shutdown(std::chrono::system_clock::now() +
                      std::chrono::seconds(2));
    server_->Wait();
  } else if (manager_ != nullptr) {
    manager_->Shutdown();
  }
  std::error_code ec;
  std::filesystem::remove(options_.state_dir + "/endpoint", ec);
  std::filesystem::remove(options_.state_dir + "/metrics_endpoint", ec);
}

}  // namespace shardtrain
