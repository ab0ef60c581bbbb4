#include "client/host_load.h"

#include <dirent.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
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

// One process's parent and CPU use (utime + stime, clock ticks).
struct ProcessStat {
  int parent = 0;
  int64_t ticks = 0;
};

// From /proc/<pid>/stat; false when the process is gone.
bool ReadProcessStat(int pid, ProcessStat* stat) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(in)),
                   std::istreambuf_iterator<char>());
  // The command name (field 2) is in parentheses and may hold anything:
  // the fields after it start at the last ')'.
  const size_t close = text.rfind(')');
  if (close == std::string::npos) return false;
  std::vector<std::string> fields =
      absl::StrSplit(text.substr(close + 1), ' ', absl::SkipEmpty());
  // fields[0] is field 3 (state): ppid is field 4, utime and stime 14, 15.
  int64_t utime = 0, stime = 0;
  if (fields.size() < 13 || !absl::SimpleAtoi(fields[1], &stat->parent) ||
      !absl::SimpleAtoi(fields[11], &utime) ||
      !absl::SimpleAtoi(fields[12], &stime)) {
    return false;
  }
  stat->ticks = utime + stime;
  return true;
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

HostLoadSampler::HostLoadSampler(JobPids job_pids, absl::Duration period)
    : job_pids_(std::move(job_pids)), period_(period) {
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
  std::map<int, int64_t> job_ticks;  // the job's processes, last sample
  std::vector<int> ranks;            // as last reported
  bool saw_job = false;              // a process of the job ran on this host
  CpuTicks previous = ReadCpuTicks();
  if (!previous.ok) return;
  auto job_total = [&](bool first) {
    // The job's CPU ticks since the last sample: a process seen before by
    // its difference, a new one (started since) by all it has used.
    if (std::vector<int> reported = job_pids_(); !reported.empty()) {
      ranks = std::move(reported);
    }
    std::map<int, ProcessStat> all;
    for (int pid : Pids()) {
      ProcessStat stat;
      if (ReadProcessStat(pid, &stat)) all[pid] = stat;
    }
    // The ranks and everything descended from them, and this process (not
    // its children: a study's ranks are the coordinator's).
    const std::set<int> ours(ranks.begin(), ranks.end());
    std::map<int, bool> decided;
    const auto is_ours = [&](int pid) {
      std::vector<int> chain;
      bool result = false;
      for (int p = pid; p > 1 && chain.size() < all.size();) {
        if (ours.count(p) != 0) {
          result = true;
          break;
        }
        if (auto known = decided.find(p); known != decided.end()) {
          result = known->second;
          break;
        }
        chain.push_back(p);
        auto it = all.find(p);
        if (it == all.end()) break;
        p = it->second.parent;
      }
      for (int p : chain) decided[p] = result;
      return result;
    };
    int64_t delta = 0;
    std::map<int, int64_t> now;
    for (const auto& [pid, stat] : all) {
      if (pid != self && !is_ours(pid)) continue;
      if (pid != self) saw_job = true;
      now[pid] = stat.ticks;
      auto before = job_ticks.find(pid);
      if (!first)
        delta += stat.ticks - (before != job_ticks.end() ? before->second : 0);
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
