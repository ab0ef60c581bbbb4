// LocalRanks: `shardtrain-train --nproc N` starts N ranks of a program on
// this host, the way torchrun's standalone mode does. Each rank gets RANK,
// WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT (a
// free loopback port); its stdout and stderr come back line by line prefixed
// "[rank r] ". When a rank exits non-zero or is killed, the others get
// SIGTERM, then SIGKILL after a grace period, and the launcher reports which
// rank failed first and how. SIGINT/SIGTERM to the launcher stop all ranks.
// Ranks die with the launcher (SIGKILL on parent death, common/subprocess.h).
// Torch-free.
#ifndef SHARDTRAIN_WORKER_LOCAL_RANKS_H_
#define SHARDTRAIN_WORKER_LOCAL_RANKS_H_

#include <chrono>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace shardtrain {

struct LocalRanksOptions {
  int nproc = 1;  // ranks on this host
  // Hosts in the run and this one's index, like torchrun --nnodes /
  // --node-rank: this host's ranks are node_rank * nproc + 0 .. nproc-1 of
  // nnodes * nproc. With nnodes > 1 every host runs the same command with
  // its own node_rank, master_addr names host 0 (required) and master_port
  // defaults to 29500.
  int nnodes = 1;
  int node_rank = 0;
  // Executable to run and its argv (argv[0] included), the same for every
  // rank; ranks tell themselves apart by RANK.
  std::string program;
  std::vector<std::string> argv;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;  // 0: a free port, found by binding port 0
  // Between SIGTERM and SIGKILL when stopping ranks.
  std::chrono::milliseconds grace{5000};
  // While no rank has printed a line, a progress line this often: many
  // ranks on few cores load and join their process group slowly.
  std::chrono::milliseconds progress_every{10000};
};

// How one rank ended.
struct RankExit {
  int rank = -1;
  int exit_code = 0;  // when it exited
  int signal = 0;     // when a signal killed it (exit_code is then 0)

  bool ok() const { return signal == 0 && exit_code == 0; }
  // "exit code 3" or "signal KILL".
  std::string Describe() const;
};

struct LocalRanksResult {
  // 0 when every rank exited 0; otherwise the first failed rank's exit code,
  // or 128 + signal number when a signal killed it or stopped the launcher.
  int exit_code = 0;
  // The rank that failed first; rank is -1 when none failed (or the launcher
  // was interrupted before any did).
  RankExit first_failure;
  // How each of this host's ranks ended, in order (RankExit::rank is the
  // global rank).
  std::vector<RankExit> ranks;
  int interrupted_by = 0;  // the signal that stopped the launcher, if any
};

class LocalRanks {
 public:
  // Ranks' output goes to `out` (their stdout) and `err` (their stderr and
  // the launcher's own reports). Both must outlive the launcher.
  LocalRanks(LocalRanksOptions options, std::ostream& out, std::ostream& err);

  // Starts the ranks and returns when all have ended. Installs SIGINT,
  // SIGTERM and SIGCHLD handlers for its duration (one Run at a time per
  // process). Ranks die with the calling thread, so call it from a thread
  // that outlives them (the main thread). An error means the ranks could not
  // all be started; those that were are stopped first.
  absl::StatusOr<LocalRanksResult> Run();

 private:
  // One start of every rank with MASTER_PORT `port`.
  absl::StatusOr<LocalRanksResult> RunOnce(int port);

  const LocalRanksOptions options_;
  std::ostream& out_;
  std::ostream& err_;
};

// `program --nproc N ...` as a launcher: reruns this executable
// (/proc/self/exe) with the same arguments as this host's ranks (`options`:
// nproc, nnodes, node_rank, master_addr/port; program and argv are filled
// in), forwarding their output to stdout/stderr. Returns the process exit
// code.
int RunLocalRanks(LocalRanksOptions options, int argc, char** argv);

}  // namespace shardtrain

#endif  // SHARDTRAIN_WORKER_LOCAL_RANKS_H_
