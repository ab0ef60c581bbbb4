// FakeAttemptLauncher: a AttemptLauncher backend of its own, as a third one (a
// cluster scheduler whose ranks run elsewhere) would be: it starts nothing,
// learns no pids, and lets a test say what each attempt's ranks do.
#ifndef SHARDTRAIN_TESTS_FAKES_FAKE_ATTEMPT_LAUNCHER_H_
#define SHARDTRAIN_TESTS_FAKES_FAKE_ATTEMPT_LAUNCHER_H_

#include <signal.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "server/attempt_launcher.h"

namespace shardtrain {

class FakeAttemptLauncher : public AttemptLauncher {
 public:
  struct Started {
    RankLaunch launch;
    Attempt attempt;
    std::vector<std::pair<std::vector<int>, int>> signals;  // ranks, signal
    AttemptReport next;  // handed out by the next Poll, then cleared
  };

  std::string name() const override { return "fake"; }
  absl::Duration poll_interval() const override { return absl::ZeroDuration(); }

  absl::Status Start(const RankLaunch& launch, int number,
                     Attempt* attempt) override {
    absl::MutexLock lock(&mutex_);
    if (!refuse_.empty()) return absl::UnavailableError(refuse_);
    *attempt = NewAttempt(launch, number);
    attempt->handle = absl::StrCat("fake-", next_handle_++);
    attempt->summary = absl::StrCat("fake job ", attempt->handle);
    started_[attempt->handle] = {launch, *attempt, {}, {}};
    order_.push_back(attempt->handle);
    return absl::OkStatus();
  }
  absl::StatusOr<AttemptReport> Poll(
      const Attempt& attempt, const std::vector<bool>& running) override {
    absl::MutexLock lock(&mutex_);
    Started& started = started_.at(attempt.handle);
    AttemptReport report = std::move(started.next);
    started.next = AttemptReport{};
    // Exits of ranks no longer running are not reported twice.
    std::vector<RankEnd> exits;
    for (const RankEnd& exit : report.exits) {
      if (running.at(exit.rank)) exits.push_back(exit);
    }
    report.exits = std::move(exits);
    return report;
  }
  void Signal(const Attempt& attempt, const std::vector<int>& ranks,
              int signal) override {
    absl::MutexLock lock(&mutex_);
    Started& started = started_.at(attempt.handle);
    started.signals.push_back({ranks, signal});
    if (signal == SIGKILL || exit_on_sigterm_) {
      for (int r : ranks) started.next.exits.push_back({r, {-1, signal}});
    }
  }
  void EndLeftovers(const std::string& job_id, const std::string&,
                    const std::vector<int>&) override {
    absl::MutexLock lock(&mutex_);
    leftovers_ended_.push_back(job_id);
  }

  // --- for tests ---
  // What the next Poll of attempt `handle` reports.
  void Report(const std::string& handle, AttemptReport report) {
    absl::MutexLock lock(&mutex_);
    started_.at(handle).next = std::move(report);
  }
  void set_exit_on_sigterm(bool value) {
    absl::MutexLock lock(&mutex_);
    exit_on_sigterm_ = value;
  }
  void set_refuse(std::string message) {
    absl::MutexLock lock(&mutex_);
    refuse_ = std::move(message);
  }
  std::vector<std::string> handles() {
    absl::MutexLock lock(&mutex_);
    return order_;
  }
  Started started(const std::string& handle) {
    absl::MutexLock lock(&mutex_);
    return started_.at(handle);
  }
  std::vector<std::string> leftovers_ended() {
    absl::MutexLock lock(&mutex_);
    return leftovers_ended_;
  }

 private:
  absl::Mutex mutex_;
  int next_handle_ = 1;
  bool exit_on_sigterm_ = true;
  std::string refuse_;
  std::map<std::string, Started> started_;
  std::vector<std::string> order_;
  std::vector<std::string> leftovers_ended_;
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_TESTS_FAKES_FAKE_ATTEMPT_LAUNCHER_H_
