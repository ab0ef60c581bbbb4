// FakeProcessSpawner: records what the job manager starts and signals, and
// lets a test decide when and how each "process" ends.
#ifndef SHARDTRAIN_TESTS_FAKES_FAKE_PROCESS_SPAWNER_H_
#define SHARDTRAIN_TESTS_FAKES_FAKE_PROCESS_SPAWNER_H_

#include <signal.h>

#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "common/exit_codes.h"
#include "server/process_spawner.h"

namespace shardtrain {

class FakeProcessSpawner : public ProcessSpawner {
 public:
  struct Process {
    ProcessSpec spec;
    std::optional<ExitStatus> exit;
    std::vector<int> signals;
  };

  // When false, SIGTERM is recorded but the process keeps running (a worker
  // stuck in a collective); SIGKILL always ends it.
  void set_exit_on_sigterm(bool value) { exit_on_sigterm_ = value; }
  // When true (the default), SIGUSR1 ends the process with kExitPreempted,
  // as a worker that saved its checkpoint; when false it is recorded only
  // (the test ends the process itself).
  void set_checkpoint_on_usr1(bool value) {
    absl::MutexLock lock(&mutex_);
    checkpoint_on_usr1_ = value;
  }

  // Spawn fails once `n` more processes have been started; -1: never.
  void FailSpawnAfter(int n) {
    absl::MutexLock lock(&mutex_);
    spawns_left_ = n;
  }

  absl::StatusOr<int> Spawn(const ProcessSpec& spec) override {
    absl::MutexLock lock(&mutex_);
    if (spawns_left_ == 0) {
      return absl::ResourceExhaustedError(
          "fork: Resource temporarily unavailable");
    }
    if (spawns_left_ > 0) --spawns_left_;
    const int pid = next_pid_++;
    processes_[pid].spec = spec;
    spawned_.push_back(pid);
    return pid;
  }
  std::optional<ExitStatus> TryWait(int pid) override {
    absl::MutexLock lock(&mutex_);
    Process& p = processes_.at(pid);
    if (!p.exit || reaped_.count(pid)) return std::nullopt;
    reaped_[pid] = true;
    return p.exit;
  }
  void Signal(int pid, int /*pgid*/, int signal) override {
    absl::MutexLock lock(&mutex_);
    Process& p = processes_.at(pid);
    p.signals.push_back(signal);
    if (!p.exit &&
        (signal == SIGKILL || (signal == SIGTERM && exit_on_sigterm_))) {
      p.exit = ExitStatus{-1, signal};
    }
    if (!p.exit && signal == SIGUSR1 && checkpoint_on_usr1_) {
      p.exit = ExitStatus{kExitPreempted, 0};
    }
  }
  void KillOrphan(int pid, const std::string& marker, absl::Duration) override {
    absl::MutexLock lock(&mutex_);
    orphans_killed_.push_back({pid, marker});
  }

  // Test controls.
  void Exit(int pid, ExitStatus status) {
    absl::MutexLock lock(&mutex_);
    processes_.at(pid).exit = status;
  }
  std::vector<int> spawned() {
    absl::MutexLock lock(&mutex_);
    return spawned_;
  }
  Process process(int pid) {
    absl::MutexLock lock(&mutex_);
    return processes_.at(pid);
  }
  std::vector<std::pair<int, std::string>> orphans_killed() {
    absl::MutexLock lock(&mutex_);
    return orphans_killed_;
  }
  // The value of an environment variable the process was given.
  std::string Env(int pid, const std::string& key) {
    absl::MutexLock lock(&mutex_);
    for (const auto& [k, v] : processes_.at(pid).spec.env)
      if (k == key) return v;
    return "";
  }

 private:
  absl::Mutex mutex_;
  int next_pid_ = 1000;
  int spawns_left_ = -1;
  bool exit_on_sigterm_ = true;
  bool checkpoint_on_usr1_ = true;
  std::map<int, Process> processes_;
  std::map<int, bool> reaped_;
  std::vector<int> spawned_;
  std::vector<std::pair<int, std::string>> orphans_killed_;
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_TESTS_FAKES_FAKE_PROCESS_SPAWNER_H_
