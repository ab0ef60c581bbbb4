#include "client/host_load.h"

#include <dirent.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <map>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"

namespace shardtrain::cli {
namespace {

// The host's CPU time so far, in clock ticks, from /proc/stat's first line.
struct CpuTicks {
  bool ok = false;
  int cores = 0;
  uint64_t total = 0;  // every state, idle included
  uint64_t busy = 0;   // total less idle and I/O wait
};

CpuTicks ReadCpuTicks() {
  CpuTicks ticks;
  std::ifstream in("/proc/stat");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("cpu", 0) != 0) break;
    if (line.size() > 3 && std::isdigit(static_cast<unsigned char>(line[3]))) {
      ++ticks.cores;
      continue;
    }
    // cpu user nice system idle iowait irq softirq steal guest guest_nice:
    // guest time is already inside user, so the first eight are the total.
    std::vector<std::string> fields =
        absl::StrSplit(line, ' ', absl::SkipEmpty());
    if (fields.size() < 9) return ticks;
    uint64_t value[8];
    for (int i = 0; i < 8; ++i) {
      if (!absl::SimpleAtoi(fields[i + 1], &value[i])) return ticks;
      ticks.total += value[i];
    }
    ticks.busy = ticks.total - value[3] - value[4];
    ticks.ok = true;
  }
  ticks.ok = ticks.ok && ticks.cores > 0;
  return ticks;
}

// utime + stime of one process, in clock ticks; -1 when it is gone.
int64_t ProcessTicks(int pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(in)),
                   std::istreambuf_iterator<char>());
  // The command name (field 2) is in parentheses and may hold anything:
  // the fields after it start at the last ')'.
  const size_t close = text.rfind(')');
  if (close == std::string::npos) return -1;
  std::vector<std::string> fields =
      absl::StrSplit(text.substr(close + 1), ' ', absl::SkipEmpty());
  // fields[0] is field 3 (state); utime and stime are fields 14 and 15.
  int64_t utime = 0, stime = 0;
  if (fields.size() < 13 || !absl::SimpleAtoi(fields[11], &utime) ||
      !absl::SimpleAtoi(fields[12], &stime)) {
    return -1;
  }
  return utime + stime;
}

// Whether `pid`'s command line holds the argument pair "--job-id <job_id>".
bool RunsJob(int pid, const std::string& job_id) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/cmdline");
  std::string text((std::istreambuf_iterator<char>(in)),
                   std::istreambuf_iterator<char>());
  std::vector<std::string> args = absl::StrSplit(text, '\0');
  for (size_t i = 0; i + 1 < args.size(); ++i) {
    if (args[i] == "--job-id" && args[i + 1] == job_id) return true;
  }
  return false;
}

std::vector<int> Pids() {
  std::vector<int> pids;
  DIR* dir = opendir("/proc");
  if (dir == nullptr) return pids;
  while (const dirent* entry = readdir(dir)) {
    int pid = 0;
    if (absl::SimpleAtoi(entry->d_name, &pid) && pid > 0) pids.push_back(pid);
  }
  closedir(dir);
  return pids;
}

}  // namespace

bool Disturbs(const HostLoad& load) {
  return load.measured && load.cores > 0 &&
         load.other_cores_mean >= std::max(0.2, 0.1 * load.cores);
}

HostLoadSampler::HostLoadSampler(std::string job_id, absl::Duration period)
    : job_id_(std::move(job_id)), period_(period) {
  thread_ = std::thread([this] { Run(); });
}

HostLoadSampler::~HostLoadSampler() { Stop(); }

HostLoad HostLoadSampler::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
  std::lock_guard<std::mutex> lock(mu_);
  return load_;
}

void HostLoadSampler::Run() {
  const int self = static_cast<int>(getpid());
  std::map<int, bool> ours;          // pid -> runs the job (decided once)
  std::map<int, int64_t> job_ticks;  // the job's processes, last sample
  bool saw_job = false;              // a process of the job ran on this host
  CpuTicks previous = ReadCpuTicks();
  if (!previous.ok) return;
  auto job_total = [&](bool first) {
    // The job's CPU ticks since the last sample: a process seen before by
    // its difference, a new one (started since) by all it has used.
    int64_t delta = 0;
    std::map<int, int64_t> now;
    for (int pid : Pids()) {
      auto [it, inserted] = ours.try_emplace(pid, false);
      if (inserted) it->second = pid == self || RunsJob(pid, job_id_);
      if (!it->second) continue;
      if (pid != self) saw_job = true;
      const int64_t ticks = ProcessTicks(pid);
      if (ticks < 0) continue;
      now[pid] = ticks;
      auto before = job_ticks.find(pid);
      if (!first)
        delta += ticks - (before != job_ticks.end() ? before->second : 0);
    }
    job_ticks = std::move(now);
    return std::max<int64_t>(0, delta);
  };
  job_total(/*first=*/true);
  double other_core_ticks = 0, job_core_ticks = 0, elapsed_ticks = 0;
  bool stopping = false;
  while (!stopping) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      stopping = wake_.wait_for(lock, absl::ToChronoNanoseconds(period_),
                                [this] { return stop_; });
    }
    const CpuTicks now = ReadCpuTicks();
    if (!now.ok) break;
    const double job = static_cast<double>(job_total(/*first=*/false));
    const double total = static_cast<double>(now.total - previous.total);
    const double busy = static_cast<double>(now.busy - previous.busy);
    // Each core adds one tick per tick of wall time to the total.
    const double elapsed = total / now.cores;
    previous = now;
    if (elapsed <= 0) continue;
    const double other = std::max(0.0, busy - job);
    std::lock_guard<std::mutex> lock(mu_);
    other_core_ticks += other;
    job_core_ticks += job;
    elapsed_ticks += elapsed;
    // Ranks on other hosts (a cluster backend): this host says nothing of
    // theirs.
    load_.measured = saw_job;
    load_.cores = now.cores;
    load_.seconds = elapsed_ticks / static_cast<double>(sysconf(_SC_CLK_TCK));
    load_.other_cores_mean = other_core_ticks / elapsed_ticks;
    load_.job_cores_mean = job_core_ticks / elapsed_ticks;
    // A short last period (the stop) is too coarse to count as a peak.
    if (!stopping) {
      load_.other_cores_peak =
          std::max(load_.other_cores_peak, other / elapsed);
    }
  }
}

}  // namespace shardtrain::cli
