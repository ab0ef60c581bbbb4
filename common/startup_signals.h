// The signals that ask a shardtrain process to act — SIGHUP (shardtraind:
// re-read the token file), SIGINT and SIGTERM (stop), SIGUSR1 (a rank:
// checkpoint and stop) — are taken only once the process is ready for them.
// Until then they wait, blocked, and are delivered when it is: never lost,
// never fatal because they came early (a token rotation's SIGHUP racing a
// daemon restart, a preemption's SIGUSR1 reaching a rank just relaunched).
//   - A program of ours that another of ours starts (SpawnSubprocess's
//     held_signals: SIGUSR1 for the daemon's ranks, all four for the
//     daemon that `shardtrain daemon` starts) begins with them blocked: the
//     mask survives exec.
//   - Each such program blocks them again before any library initialiser
//     runs (SHARDTRAIN_HOLD_SIGNALS_FROM_START in its main.cc: an ELF
//     .preinit_array entry), which covers starts by a shell, systemd or a
//     container runtime from the moment the dynamic loader is done.
//   - Once its handlers are installed it calls ReleaseStartupSignals() (or
//     takes them with sigwait).
#ifndef SHARDTRAIN_COMMON_STARTUP_SIGNALS_H_
#define SHARDTRAIN_COMMON_STARTUP_SIGNALS_H_

#include <signal.h>

namespace shardtrain {

// SIGHUP, SIGINT, SIGTERM and SIGUSR1.
sigset_t StartupSignals();
// Blocks StartupSignals() in the calling thread (threads started after
// inherit it). Async-signal-safe.
void HoldStartupSignals();
// Unblocks StartupSignals() in the calling thread; one already pending is
// delivered now.
void ReleaseStartupSignals();

}  // namespace shardtrain

// In a program's main.cc, at namespace scope: StartupSignals() blocked
// before any library's initialiser and before main.
#define SHARDTRAIN_HOLD_SIGNALS_FROM_START()                                 \
  namespace {                                                                \
  void ShardtrainHoldSignalsAtStart(int, char**, char**) {                   \
    ::shardtrain::HoldStartupSignals();                                      \
  }                                                                          \
  __attribute__((section(".preinit_array"),                                  \
                 used)) void (*const kShardtrainHold)(int, char**, char**) = \
      ShardtrainHoldSignalsAtStart;                                          \
  }                                                                          \
  static_assert(true, "")

#endif  // SHARDTRAIN_COMMON_STARTUP_SIGNALS_H_
