#include "worker/calibration.h"

#include <stdlib.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <filesystem>
#include <memory>
#include <random>
#include <sstream>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/data/gpt2_vocab.h"
#include "core/data/token_file.h"
#include "core/model/model_config.h"
#include "core/plan/pipeline_plan.h"
#include "core/plan/step_time_plan.h"
#include "core/run/step_metrics.h"
#include "worker/engine/comm/c10d_communicator.h"
#include "worker/engine/support/adamw.h"
#include "worker/engine/support/cpu_threads.h"
#include "worker/training_run.h"

namespace shardtrain {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

// Waits for the device: reading a value back waits for every kernel queued.
void Sync(const torch::Tensor& t) { (void)t.sum().item<double>(); }

// The best of `runs` timings of `fn` after one warm-up: the rate a quiet
// moment gives, as the peak FLOP/s cache keeps its best.
template <typename Fn>
double BestSeconds(int runs, Fn fn) {
  fn();
  double best = 1e30;
  for (int i = 0; i < runs; ++i) {
    const Clock::time_point start = Clock::now();
    fn();
    best = std::min(best, Seconds(start));
  }
  return best;
}

struct ComputeRates {
  double flops_per_second = 0;
  double seconds_per_parameter = 0;  // the whole step's, AdamW included
  double pass_overhead_seconds = 0;  // per micro-batch pass
};

// Training FLOP/s of the model on one thread, and what a step costs per
// parameter besides: real single-device steps of the trainer (on random
// tokens) at B and 2B sequences, so that t = fixed + FLOPs / rate splits
// into the FLOPs' rate (counted as the step-time model counts them: three
// forwards of every block and of the head) and a part that does not grow
// with the tokens (AdamW, dense gradients zeroed and accumulated), per
// parameter; and a step of 2B one-sequence micro-batches against the one
// of 2B sequences at once, whose extra time over its 2B - 1 extra passes is
// what a pass costs besides its FLOPs.
absl::StatusOr<ComputeRates> MeasureTraining(const TrainConfig& base) {
  absl::StatusOr<ModelConfig> model_config = ParseModelSpec(base.model);
  if (!model_config.ok()) return model_config.status();
  const int64_t seq = std::min(base.seq_len, model_config->block_size);
  const int64_t batch = std::max<int64_t>(1, base.batch_size);
  constexpr int64_t kSteps = 6;
  std::error_code ec;
  std::string pattern =
      (std::filesystem::temp_directory_path(ec) / "shardtrain_calibrate_XXXXXX")
          .string();
  if (::mkdtemp(pattern.data()) == nullptr) {
    return absl::InternalError(
        absl::StrCat("--calibrate: cannot make a folder ", pattern));
  }
  const std::filesystem::path dir = pattern;
  // Removed whatever happens below.
  struct Remove {
    std::filesystem::path dir;
    ~Remove() {
      std::error_code ignored;
      std::filesystem::remove_all(dir, ignored);
    }
  } remove{dir};
  std::mt19937 rng(7);
  std::vector<uint16_t> tokens(
      static_cast<size_t>((kSteps + 2) * 2 * batch * (seq + 1) + 1));
  // Ids any model and a 16-bit token file take: the timing does not
  // depend on which ids.
  const uint32_t ids = static_cast<uint32_t>(
      std::min<int64_t>(model_config->vocab_size, kGpt2VocabSize));
  for (uint16_t& t : tokens) t = static_cast<uint16_t>(rng() % ids);
  absl::Status wrote = WriteTokenFile((dir / "train.bin").string(), tokens);
  auto time_batch = [&](int64_t b,
                        int64_t accumulation = 1) -> absl::StatusOr<double> {
    TrainConfig c;
    c.model = base.model;
    c.device = base.device;
    c.precision = base.precision;
    c.strategy = "single";
    c.data = dir.string();
    c.batch_size = b;
    c.grad_accum = accumulation;
    c.seq_len = seq;
    c.max_steps = kSteps;
    c.threads = 1;
    c.log_every = kSteps;
    double best = 1e30;
    TrainingHooks hooks;
    hooks.on_step = [&](const StepMetrics& m) {
      if (m.step > 2) best = std::min(best, m.step_seconds);
    };
    std::ostringstream quiet;
    if (absl::Status s = RunTrainingRank(c, DistEnv{}, &quiet, hooks);
        !s.ok()) {
      return s;
    }
    return best;
  };
  absl::StatusOr<double> t1 = wrote.ok() ? time_batch(batch) : wrote;
  absl::StatusOr<double> t2 = t1.ok() ? time_batch(2 * batch) : t1;
  absl::StatusOr<double> passes = t2.ok() ? time_batch(1, 2 * batch) : t2;
  if (!passes.ok()) return passes.status();
  absl::StatusOr<std::vector<PipelineStage>> whole =
      PartitionPipeline(*model_config, seq, 1, {});
  if (!whole.ok()) return whole.status();
  const double flops =
      3 * whole->front().flops_per_token * static_cast<double>(batch * seq);
  ComputeRates rates;
  // The marginal rate; the whole step's when noise hides it.
  const double marginal = *t2 - *t1;
  if (marginal > 0.2 * *t1) {
    rates.flops_per_second = flops / marginal;
    rates.seconds_per_parameter =
        std::max(0.0, *t1 - marginal) /
        static_cast<double>(model_config->NumParameters());
  } else {
    rates.flops_per_second = flops / *t1;
  }
  rates.pass_overhead_seconds =
      std::max(0.0, (*passes - *t2) / static_cast<double>(2 * batch - 1));
  return rates;
}

// AdamW's seconds per parameter: steps over 4M parameters.
double MeasureAdamW(const torch::Device& device) {
  constexpr int64_t kParams = int64_t{1} << 22;
  torch::Tensor p =
      torch::zeros({kParams}, torch::TensorOptions().device(device))
          .requires_grad_(true);
  p.mutable_grad() = torch::randn({kParams}, p.options().requires_grad(false));
  AdamW adamw({AdamW::Group{{p}, 0.1}}, AdamWOptions{});
  const double seconds = BestSeconds(3, [&] {
    adamw.Step(1e-3);
    Sync(p);
  });
  return seconds / static_cast<double>(kParams);
}

// Latency and bandwidth of the ring all-reduce between the group's ranks:
// the median of 25 all-reduces of a small tensor and of 7 of a large one,
// solved for
// t = 2(N-1) latency + 2(N-1)/N bytes / bandwidth.
absl::StatusOr<LinkRates> MeasureAllReduce(Communicator& comm,
                                           const torch::Device& device) {
  const double n = static_cast<double>(comm.world_size());
  auto median_seconds = [&](int64_t floats,
                            int runs) -> absl::StatusOr<double> {
    torch::Tensor t =
        torch::ones({floats}, torch::TensorOptions().device(device));
    std::vector<double> times;
    for (int i = 0; i < runs + 2; ++i) {
      if (absl::Status s = comm.Barrier(); !s.ok()) return s;
      const Clock::time_point start = Clock::now();
      if (absl::Status s = comm.AllReduce(t)->Wait(); !s.ok()) return s;
      Sync(t);
      if (i >= 2) times.push_back(Seconds(start));
    }
    std::sort(times.begin(), times.end());
    return times[times.size() / 2];
  };
  constexpr int64_t kSmall = 256;               // 1 KiB
  constexpr int64_t kLarge = int64_t{1} << 22;  // 16 MiB
  absl::StatusOr<double> small = median_seconds(kSmall, 25);
  if (!small.ok()) return small.status();
  absl::StatusOr<double> large = median_seconds(kLarge, 7);
  if (!large.ok()) return large.status();
  const double steps = 2 * (n - 1);
  const double wire_large = 2 * (n - 1) / n * kLarge * 4;
  const double wire_small = 2 * (n - 1) / n * kSmall * 4;
  LinkRates link;
  const double per_byte =
      std::max(1e-13, (*large - *small) / (wire_large - wire_small));
  link.bytes_per_second = 1.0 / per_byte;
  link.latency_seconds =
      std::max(0.0, (*small - wire_small * per_byte) / steps);
  return link;
}

std::string NowUtc() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char text[32];
  std::strftime(text, sizeof(text), "%Y-%m-%d %H:%M UTC", &tm);
  return text;
}

}  // namespace

absl::Status RunCalibrationRank(const TrainConfig& config, const DistEnv& env,
                                std::ostream* log) {
  if (env.world_size < 2) {
    return absl::InvalidArgumentError(
        "--calibrate measures collectives between ranks: run it with "
        "--nproc 2 (or more)");
  }
  torch::Device device(config.device == "cuda"
                           ? "cuda:" + std::to_string(env.local_rank)
                           : config.device);
  const bool gpu = device.is_cuda();
  // One thread per rank: the rate the model scales by each rank's threads.
  if (!gpu) SetCpuComputeThreads(1);
  HostRates rates;
  rates.device = gpu ? "cuda" : "cpu";
  rates.cores = std::max<int64_t>(1, std::thread::hardware_concurrency());
  rates.compute_model = config.model;
  // Compute and AdamW on rank 0 alone, before the group forms: the other
  // ranks wait in the rendezvous, idle.
  if (env.rank == 0) {
    absl::StatusOr<ComputeRates> compute = MeasureTraining(config);
    if (!compute.ok()) return compute.status();
    rates.flops_per_thread = compute->flops_per_second;
    rates.pass_overhead_seconds = compute->pass_overhead_seconds;
    rates.optimizer_seconds_per_parameter = MeasureAdamW(device);
    rates.gradient_seconds_per_parameter =
        std::max(0.0, compute->seconds_per_parameter -
                          rates.optimizer_seconds_per_parameter);
  }
  absl::StatusOr<std::unique_ptr<C10dCommunicator>> comm =
      C10dCommunicator::Create(env, std::chrono::seconds(config.comm_timeout),
                               device);
  if (!comm.ok()) {
    return absl::Status(
        comm.status().code(),
        absl::StrCat("rank ", env.rank, ": ", comm.status().message()));
  }
  if (absl::Status s = (*comm)->Barrier(); !s.ok()) return s;
  // Ranks on several hosts (LOCAL_WORLD_SIZE below the world size, ranks
  // numbered host by host, as torchrun and srun's block distribution do):
  // the all-reduce among host 0's ranks is the intra-node link, the one
  // between each host's first rank the inter-node link.
  const int64_t per_host = env.local_world_size;
  const bool hosts = per_host > 0 && per_host < env.world_size &&
                     env.world_size % per_host == 0;
  absl::StatusOr<LinkRates> link = absl::UnknownError("not measured");
  absl::StatusOr<LinkRates> between = absl::UnknownError("not measured");
  if (!hosts) {
    link = MeasureAllReduce(**comm, device);
    if (!link.ok()) return link.status();
  } else {
    if (per_host >= 2 && env.rank < per_host) {
      std::vector<int64_t> members;
      for (int64_t r = 0; r < per_host; ++r) members.push_back(r);
      absl::StatusOr<std::unique_ptr<Communicator>> host =
          (*comm)->NewGroup("calibrate-intra-node", members);
      if (!host.ok()) return host.status();
      link = MeasureAllReduce(**host, device);
      if (!link.ok()) return link.status();
    }
    if (env.rank % per_host == 0) {
      std::vector<int64_t> firsts;
      for (int64_t r = 0; r < env.world_size; r += per_host) {
        firsts.push_back(r);
      }
      absl::StatusOr<std::unique_ptr<Communicator>> across =
          (*comm)->NewGroup("calibrate-inter-node", firsts);
      if (!across.ok()) return across.status();
      between = MeasureAllReduce(**across, device);
      if (!between.ok()) return between.status();
    }
    if (absl::Status s = (*comm)->Barrier(); !s.ok()) return s;
  }
  if (env.rank != 0) return absl::OkStatus();
  // What this run could not measure stays as cached: the link between
  // hosts after a calibration on one, the link within one after a
  // calibration with one rank per host.
  const absl::StatusOr<HostRates> cached =
      LoadHostRates(rates.device, rates.compute_model);
  if (between.ok()) {
    rates.inter_node = *between;
  } else if (cached.ok() && cached->compute_model == rates.compute_model) {
    rates.inter_node = cached->inter_node;
  }
  if (link.ok()) {
    rates.intra_node = *link;
  } else if (cached.ok() && cached->compute_model == rates.compute_model) {
    rates.intra_node = cached->intra_node;
  } else {
    return absl::FailedPreconditionError(
        "--calibrate with one rank per host measures only the link between "
        "hosts: run two ranks or more per host, or calibrate on one host "
        "first");
  }
  rates.measured_at = NowUtc();
  if (absl::Status s = SaveHostRates(rates); !s.ok()) return s;
  if (log != nullptr) {
    *log << absl::StrFormat(
        "calibrated %s (%d cores) on %s, batch %d and %d x %d: %.2f GFLOP/s "
        "per %s in training + %.2f ns per parameter + %.1f ms per "
        "micro-batch pass, AdamW %.2f ns per "
        "parameter, all-reduce between %d ranks %.1f us + %s/s\nsaved to "
        "%s\n",
        rates.device, rates.cores, config.model, config.batch_size,
        2 * config.batch_size, config.seq_len, rates.flops_per_thread / 1e9,
        gpu ? "device" : "thread", rates.gradient_seconds_per_parameter * 1e9,
        rates.pass_overhead_seconds * 1e3,
        rates.optimizer_seconds_per_parameter * 1e9,
        hosts ? per_host : env.world_size,
        rates.intra_node.latency_seconds * 1e6,
        FormatBytes(static_cast<int64_t>(rates.intra_node.bytes_per_second)),
        HostRatesCachePath());
    if (between.ok()) {
      *log << absl::StrFormat(
          "between %d hosts (one rank each): %.1f us + %s/s\n",
          env.world_size / per_host, between->latency_seconds * 1e6,
          FormatBytes(static_cast<int64_t>(between->bytes_per_second)));
    }
  }
  return absl::OkStatus();
}

}  // namespace shardtrain
