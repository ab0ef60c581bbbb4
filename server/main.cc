// shardtraind: the coordinator. Flags -> CoordinatorOptions -> Coordinator;
// runs until SIGTERM or SIGINT, then shuts down gracefully; SIGHUP re-reads
// --auth-token-file.
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>

#include <cstdlib>
#include <iostream>
#include <string>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "common/cli_usage.h"
#include "common/startup_signals.h"
#include "common/state_dir.h"
#include "server/backends.h"
#include "server/coordinator.h"

namespace shardtrain {
namespace {

// The durations shardtraind's flags take in seconds.
struct FlagSeconds {
  double metrics_retention = 300;
  double grace = 10;
  double heartbeat_interval = 2;
  double heartbeat_timeout = 30;
  double rendezvous_timeout = 300;
  double preempt_grace = 60;
};

// The coordinator's own flags (a backend adds its own).
void AddCoordinatorFlags(CLI::App* app, CoordinatorOptions* options,
                         FlagSeconds* seconds) {
  app->add_option("--listen", options->listen,
                  absl::StrCat("address:port for clients (default 127.0.0.1:",
                               kDefaultPort, "; port 0 picks a free one)"));
  app->add_option("--metrics-listen", options->metrics_listen,
                  "Prometheus endpoint address:port (/metrics); empty: none")
      ->capture_default_str();
  app->add_option("--metrics-retention", seconds->metrics_retention,
                  "seconds a finished job's series stay on /metrics")
      ->capture_default_str();
  app->add_option("--state-dir", options->state_dir,
                  "SQLite database, job logs and checkpoints")
      ->capture_default_str();
  app->add_option("--grace-period", seconds->grace,
                  "seconds between SIGTERM and SIGKILL when stopping workers")
      ->capture_default_str();
  app->add_option("--device-kind", options->devices.kind,
                  "auto (GPUs via NVML, else CPU slots) | gpu | cpu")
      ->capture_default_str();
  app->add_option("--cpu-slots", options->devices.cpu_slots,
                  "CPU devices to schedule onto (0: one per core)")
      ->capture_default_str();
  app->add_option("--worker-binary", options->worker_binary,
                  "shardtrain-worker to launch (default: beside shardtraind)");
  app->add_option("--heartbeat-interval", seconds->heartbeat_interval,
                  "seconds between worker heartbeats")
      ->capture_default_str();
  app->add_option("--heartbeat-timeout", seconds->heartbeat_timeout,
                  "seconds without a heartbeat before a job fails with HANG")
      ->capture_default_str();
  app->add_option("--rendezvous-timeout", seconds->rendezvous_timeout,
                  "seconds for all ranks to join before RENDEZVOUS_TIMEOUT")
      ->capture_default_str();
  app->add_option("--auth-token-file", options->auth_token_file,
                  "require 'authorization: Bearer <token>' on every call; "
                  "one token, or lines token,user,role[,max_devices] "
                  "(role admin|user); re-read on SIGHUP");
  app->add_option("--default-quota", options->default_quota,
                  "devices one user's jobs may hold at once unless the token "
                  "file gives theirs (0: no cap)")
      ->capture_default_str();
  app->add_option("--priority-class", options->priority_classes,
                  "NAME=PRIORITY[,preemptible=false][,open=true]: a class "
                  "jobs name in priority_class (repeatable); only admins "
                  "may name it unless open=true");
  app->add_option("--preempt-grace", seconds->preempt_grace,
                  "seconds a preempted job's ranks have to checkpoint and "
                  "stop before they are killed")
      ->capture_default_str();
  app->add_option("--tls-cert", options->tls_cert,
                  "PEM certificate (enables TLS)");
  app->add_option("--tls-key", options->tls_key, "PEM private key");
  app->add_flag("--insecure", options->insecure,
                "allow a --listen beyond loopback without --auth-token-file");
  app->add_flag("--metrics-public", options->metrics_public,
                "allow a --metrics-listen beyond loopback (/metrics has no "
                "token)");
  app->add_option("--path-root", options->path_roots,
                  "directory jobs may read data and init_from from "
                  "(repeatable; none: anywhere this user can read)");
  app->add_option("--max-streams-per-client", options->max_streams_per_client,
                  "open watch/log streams one client connection may hold")
      ->capture_default_str();
  app->add_option("--max-streams-per-peer", options->max_streams_per_peer,
                  "open watch/log streams of one client over all its "
                  "connections (a local user, or a remote address)")
      ->capture_default_str();
  app->add_option("--max-streams", options->max_streams,
                  "open watch/log streams for all clients together")
      ->capture_default_str();
  app->add_option("--min-free-mb", options->min_free_mb,
                  "refuse submissions while the state dir has less free space")
      ->capture_default_str();
  app->add_option("--max-connections-per-peer",
                  options->max_connections_per_peer,
                  "connections one client (a local user, or a remote "
                  "address) may hold on --listen; the newest beyond it are "
                  "shut down")
      ->capture_default_str();
  app->add_option("--max-message-bytes", options->max_message_bytes,
                  "largest request accepted")
      ->capture_default_str();
}

int Main(int argc, char** argv) {
  // Started through shardtraind (server/daemon_entry.cc), this program is
  // shardtraind-server; it answers to shardtraind in ps and /proc/PID/comm,
  // which `shardtrain daemon stop` checks before it signals a pid.
  prctl(PR_SET_NAME, "shardtraind");
  // Everything shardtraind and its workers create (the state directory, the
  // database, job specs, logs, checkpoints) is for this user only; another
  // local user must not read a token-protected daemon's jobs.
  umask(077);
  // Blocked in every thread (threads inherit the mask), taken by sigwait
  // below, and blocked already from before main: a SIGHUP or SIGTERM that
  // comes while the daemon starts waits for the sigwait loop
  // (common/startup_signals.h). The launcher sets the workers' own mask.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGHUP);  // reload --auth-token-file
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  // Held since exec (SHARDTRAIN_HOLD_SIGNALS_FROM_START below); the daemon
  // takes no SIGUSR1 of its own.
  sigset_t usr1;
  sigemptyset(&usr1);
  sigaddset(&usr1, SIGUSR1);
  pthread_sigmask(SIG_UNBLOCK, &usr1, nullptr);
  signal(SIGPIPE, SIG_IGN);
  // Every connection holds a descriptor: take the hard limit the operator
  // allows rather than the soft default, so a flood needs many more.
  rlimit files{};
  if (getrlimit(RLIMIT_NOFILE, &files) == 0 &&
      files.rlim_cur < files.rlim_max) {
    files.rlim_cur = files.rlim_max;
    (void)setrlimit(RLIMIT_NOFILE, &files);
  }

  CoordinatorOptions options;
  options.state_dir = DefaultStateDir();
  FlagSeconds seconds;
  CLI::App app{"shardtraind: the shardtrain coordinator (gRPC control plane)"};
  app.option_defaults()->always_capture_default();
  AddCoordinatorFlags(&app, &options, &seconds);
  BackendRegistry backends = BuiltinBackends();
  options.backends = &backends;
  app.add_option("--launcher", options.launcher, backends.LauncherHelp())
      ->capture_default_str();
  app.add_option("--worker-listen", options.worker_listen,
                 "address:port the workers report to (default: a Unix socket "
                 "in the state dir; ranks on other hosts need an address "
                 "they reach)");
  backends.AddFlags(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return ReportParseError(app, e, "shardtraind");
  }
  options.grace_period = absl::Seconds(seconds.grace);
  options.metrics_retention = absl::Seconds(seconds.metrics_retention);
  options.heartbeat_interval = absl::Seconds(seconds.heartbeat_interval);
  options.heartbeat_timeout = absl::Seconds(seconds.heartbeat_timeout);
  options.rendezvous_timeout = absl::Seconds(seconds.rendezvous_timeout);
  options.preempt_grace = absl::Seconds(seconds.preempt_grace);

  absl::StatusOr<std::unique_ptr<Coordinator>> coordinator =
      Coordinator::Start(options);
  if (!coordinator.ok()) {
    std::cerr << "shardtraind: " << coordinator.status().message() << "\n";
    return absl::IsInvalidArgument(coordinator.status()) ? 2 : 1;
  }
  int signal_number = 0;
  while (sigwait(&stop_signals, &signal_number) == 0 &&
         signal_number == SIGHUP) {
    (void)(*coordinator)->ReloadUsers();  // says what it did on stderr
  }
  std::cerr << "shardtraind: received " << sigabbrev_np(signal_number)
            << "; stopping workers and shutting down" << std::endl;
  (*coordinator)->Shutdown();
  coordinator->reset();
  std::cerr << "shardtraind: stopped" << std::endl;
  return 0;
}

}  // namespace
}  // namespace shardtrain

SHARDTRAIN_HOLD_SIGNALS_FROM_START();

int main(int argc, char** argv) { return shardtrain::Main(argc, argv); }
