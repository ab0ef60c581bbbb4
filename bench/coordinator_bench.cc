// coordinator_bench: shardtraind's control-plane speed, measured against a
// real daemon on loopback (child process, own state dir, fake workers).
//
//   SubmitJob latency  N submissions (1 client, then 8 concurrent clients)
//                      while one held job keeps every submission queued, so
//                      each call is validate + SQLite insert + answer.
//   Step ingestion     W fake workers report S steps each, (a) batched by the
//                      worker's ProgressReporter as real workers do, and
//                      (b) one synchronous ReportProgress per step; rate =
//                      rows stored / time from job start to job end.
//
// Targets: SubmitJob p99 < 10 ms; >= 20,000 step reports/s stored.
// Usage: coordinator_bench [--submissions N] [--workers W] [--steps S]
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "tests/integration/daemon_harness.h"

namespace shardtrain {
namespace {

struct Latency {
  double p50_ms, p99_ms, max_ms, mean_ms;
};

Latency Summarise(std::vector<double> ms) {
  std::sort(ms.begin(), ms.end());
  auto at = [&](double q) {
    return ms[std::min(ms.size() - 1, static_cast<size_t>(q * ms.size()))];
  };
  double sum = 0;
  for (double v : ms) sum += v;
  return {at(0.50), at(0.99), ms.back(), sum / ms.size()};
}

v1::JobSpec Spec(const std::string& mode, const std::string& data, int world) {
  v1::JobSpec spec;
  spec.set_name(mode);
  spec.set_model("gpt2-tiny");
  spec.set_data(data);
  spec.mutable_strategy()->set_name(world == 1 ? "single" : "ddp");
  spec.set_world_size(world);
  spec.mutable_trainer()->set_max_steps(1);
  (*spec.mutable_labels())["bench"] = "submit";
  return spec;
}

int Main(int argc, char** argv) {
  int submissions = 2000, workers = 8, steps = 20000;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    int value = 0;
    if (!absl::SimpleAtoi(argv[i + 1], &value) || value <= 0) {
      std::fprintf(stderr,
                   "coordinator_bench: %s: expected a positive number\n",
                   flag.c_str());
      return 2;
    }
    if (flag == "--submissions")
      submissions = value;
    else if (flag == "--workers")
      workers = value;
    else if (flag == "--steps")
      steps = value;
    else {
      std::fprintf(stderr, "coordinator_bench: unknown flag %s\n",
                   flag.c_str());
      return 2;
    }
  }
  test::TempDir dir;
  std::filesystem::create_directories(dir / "data");
  test::WriteFile(dir / "data/train.bin", "x");
  const std::string data = dir / "data";

  // --- SubmitJob latency -------------------------------------------------
  {
    test::DaemonOptions options;
    options.cpu_slots = 1;
    options.worker_binary = test::FakeWorker();
    test::Daemon daemon(dir / "submit-state", options);
    std::string error;
    if (!daemon.Start(&error)) {
      std::fprintf(stderr, "%s\n", error.c_str());
      return 1;
    }
    v1::Job held;
    daemon.Submit(Spec("hold", data, 1), &held);
    daemon.WaitFor(
        held.id(), [](const v1::Job& j) { return j.state() == v1::RUNNING; },
        absl::Seconds(30));
    for (int clients : {1, 8}) {
      std::vector<std::vector<double>> per_client(clients);
      std::atomic<int> failed{0};
      std::vector<std::thread> threads;
      const absl::Time start = absl::Now();
      for (int c = 0; c < clients; ++c) {
        threads.emplace_back([&, c] {
          auto stub = v1::JobService::NewStub(daemon.channel());
          for (int i = c; i < submissions; i += clients) {
            v1::SubmitJobRequest request;
            *request.mutable_spec() = Spec("quick", data, 1);
            request.mutable_spec()->set_priority(i % 3);
            grpc::ClientContext context;
            v1::Job job;
            const absl::Time t0 = absl::Now();
            const bool ok = stub->SubmitJob(&context, request, &job).ok();
            per_client[c].push_back(
                absl::ToDoubleMilliseconds(absl::Now() - t0));
            if (!ok) ++failed;
          }
        });
      }
      for (std::thread& t : threads) t.join();
      const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
      std::vector<double> all;
      for (auto& v : per_client) all.insert(all.end(), v.begin(), v.end());
      const Latency l = Summarise(all);
      std::printf(
          "| SubmitJob, %d client%s | %d calls | p50 %.2f ms | p99 %.2f ms | "
          "max "
          "%.2f ms | mean %.2f ms | %.0f calls/s | %d failed |\n",
          clients, clients == 1 ? "" : "s", submissions, l.p50_ms, l.p99_ms,
          l.max_ms, l.mean_ms, submissions / seconds, failed.load());
    }
    std::fflush(stdout);
  }

  // --- Step-report ingestion ---------------------------------------------
  for (const std::string mode : {"flood", "trickle"}) {
    const int n = mode == "flood" ? steps : steps / 10;
    test::DaemonOptions options;
    options.cpu_slots = workers;
    options.worker_binary = test::FakeWorker();
    test::Daemon daemon(dir / (mode + "-state"), options);
    std::string error;
    if (!daemon.Start(&error)) {
      std::fprintf(stderr, "%s\n", error.c_str());
      return 1;
    }
    v1::Job job;
    const grpc::Status submitted =
        daemon.Submit(Spec(absl::StrCat(mode, ":", n), data, workers), &job);
    if (!submitted.ok()) {
      std::fprintf(stderr, "submit: %s\n", submitted.error_message().c_str());
      return 1;
    }
    job = daemon.WaitFor(job.id(), test::IsTerminal, absl::Minutes(10));
    const size_t rows = daemon.Metrics(job.id()).size();
    const double seconds =
        (job.end_time_unix_ms() - job.start_time_unix_ms()) / 1000.0;
    std::printf(
        "| ingestion, %s | %d workers x %d steps | %zu rows stored | %.2f s | "
        "%.0f step reports/s | job %s |\n",
        mode == "flood" ? "batched (ProgressReporter)" : "one step per call",
        workers, n, rows, seconds, rows / seconds,
        v1::JobState_Name(job.state()).c_str());
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace
}  // namespace shardtrain

int main(int argc, char** argv) { return shardtrain::Main(argc, argv); }
