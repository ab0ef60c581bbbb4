#include "common/startup_signals.h"

#include <pthread.h>

namespace shardtrain {

sigset_t StartupSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGHUP);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGUSR1);
  return set;
}

void HoldStartupSignals() {
  const sigset_t set = StartupSignals();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

void ReleaseStartupSignals() {
  const sigset_t set = StartupSignals();
  pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
}

}  // namespace shardtrain
