#include "worker/engine/train/trainer.h"

#include <fcntl.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <mutex>
#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/atomic_file.h"
#include "common/exit_codes.h"
#include "common/input_file.h"
#include "common/json_excerpt.h"
#include "core/checkpoint/checkpoint_export.h"
#include "core/checkpoint/checkpoint_format.h"
#include "core/model/hf_gpt2.h"
#include "nlohmann/json.hpp"
#include "worker/engine/model/create_model.h"
#include "worker/engine/support/cpu_threads.h"
#include "worker/engine/support/memory_tracker.h"
#include "worker/engine/support/peak_flops.h"

namespace shardtrain {
namespace fs = std::filesystem;
namespace {

using SteadyClock = std::chrono::steady_clock;

double SecondsSince(SteadyClock::time_point start) {
  return std::chrono::duration<double>(SteadyClock::now() - start).count();
}

constexpr char kRngFile[] = "rng_state.bin";

// The settings a checkpoint must agree with to be resumed: what fixes the
// data order, the shapes of the saved state and the schedule. Strategy,
// world size and the per-rank split of the batch are not among them: the
// state is stored by global tensor, and the global batch (sequences per
// step) is kept whatever the split.
nlohmann::json ResumeFingerprint(const TrainConfig& config,
                                 const ModelConfig& model, int64_t global_batch,
                                 int64_t total_steps) {
  return {{"model", model.ToSpec()},      {"seq_len", config.seq_len},
          {"global_batch", global_batch}, {"seed", config.seed},
          {"shuffle", config.shuffle},    {"total_steps", total_steps}};
}

// The flag that sets each fingerprint field, for the refusal's hint.
std::string FlagFor(const std::string& field) {
  if (field == "model") return "--model";
  if (field == "seq_len") return "--seq-len";
  if (field == "seed") return "--seed";
  if (field == "shuffle") return "--shuffle / --no-shuffle";
  if (field == "total_steps") return "--max-steps or --epochs";
  if (field == "global_batch") {
    return "--batch-size x --grad-accum x world size";
  }
  return "--" + field;
}

// The newest checkpoint of `out` whose metadata reads, if any.
std::unique_ptr<CheckpointReader> NewestReadableCheckpoint(
    const std::string& out) {
  for (const std::string& dir : CheckpointStore(out).Candidates()) {
    absl::StatusOr<std::unique_ptr<CheckpointReader>> reader =
        CheckpointReader::Open(dir);
    if (reader.ok()) return *std::move(reader);
  }
  return nullptr;
}

}  // namespace

Trainer::Trainer(const TrainConfig& config, const RankInfo& rank_info,
                 std::unique_ptr<Strategy> strategy, std::ostream* log)
    : config_(config),
      rank_info_(rank_info),
      strategy_(std::move(strategy)),
      log_(log) {}

Trainer::~Trainer() {
  if (metrics_fd_ >= 0) ::close(metrics_fd_);
}

absl::Status CheckDeviceVisible(const torch::Device& device,
                                const std::string& requested) {
  if (!device.is_cuda() || torch::cuda::is_available()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "device: ", requested,
      " requested but this LibTorch sees no CUDA device (no GPU or driver "
      "visible); use --device cpu"));
}

absl::StatusOr<std::unique_ptr<Trainer>> Trainer::Create(
    const TrainConfig& requested, const RankInfo& rank_info,
    std::unique_ptr<Strategy> strategy, std::ostream* log) {
  if (absl::Status s = requested.Validate(); !s.ok()) return s;
  std::unique_ptr<Trainer> trainer(
      new Trainer(requested, rank_info, std::move(strategy), log));
  Trainer& t = *trainer;
  if (requested.resume && !requested.out.empty()) {
    if (absl::Status s = t.KeepCheckpointGlobalBatch(); !s.ok()) return s;
  }
  // From here on: the config as run (a resume may have split the batch
  // differently).
  const TrainConfig& config = t.config_;
  try {
    t.device_ = torch::Device(config.device);
  } catch (const c10::Error& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("device: ", e.what_without_backtrace()));
  }
  if (absl::Status s = CheckDeviceVisible(t.device_, config.device); !s.ok()) {
    return s;
  }

  const int64_t threads = config.ThreadsPerRank(rank_info.world_size);
  if (t.device_.is_cpu()) SetCpuComputeThreads(static_cast<int>(threads));
  RetainFreedHostMemory();
  MemoryTracker::Get();  // count every tensor from here on
  if (absl::Status s =
          MemoryTracker::Get().SetLimit(t.device_, config.memory_cap);
      !s.ok()) {
    return s;
  }

  absl::StatusOr<ModelConfig> model_config = ParseModelSpec(config.model);
  if (!model_config.ok()) return model_config.status();
  t.model_config_ = *model_config;
  std::optional<ModelWeights> init_weights;
  if (!config.init_from.empty()) {
    absl::StatusOr<ModelWeights> saved = OpenModelWeights(config.init_from);
    if (!saved.ok()) {
      const std::string message =
          absl::StrCat("init_from: ", saved.status().message());
      // Malformed (not missing or unreadable): the job's spec is at fault.
      if (absl::IsInvalidArgument(saved.status())) {
        return BadInputError(message);
      }
      return absl::Status(saved.status().code(), message);
    }
    if (!saved->config.SameShape(t.model_config_)) {
      return absl::InvalidArgumentError(
          absl::StrCat("init_from: ", saved->description, " holds model ",
                       saved->config.ToSpec(), " but --model is ",
                       t.model_config_.ToSpec()));
    }
    init_weights = std::move(*saved);
  }

  // Data.
  if (!config.data.empty()) {
    const std::string train_path = config.data + "/train.bin";
    const std::string val_path = config.data + "/val.bin";
    if (absl::Status s = config.CheckDataDirectory(); !s.ok()) return s;
    // Ids past the model's vocabulary would index past its embedding.
    auto within_vocabulary = [&](const TokenFile& file) {
      const auto vocab = static_cast<uint32_t>(t.model_config_.vocab_size);
      if (file.size() == 0 || file.max_id() < vocab) return absl::OkStatus();
      size_t at = 0;
      while (file[at] < vocab) ++at;
      return absl::InvalidArgumentError(absl::StrCat(
          "data: ", file.path(), " holds token id ", file[at], " at position ",
          at, ", past model ", t.model_config_.ToSpec(), "'s vocabulary of ",
          t.model_config_.vocab_size,
          " (prepare the data with the model's tokenizer)"));
    };
    if (!config.eval_only) {
      absl::StatusOr<TokenFile> train = TokenFile::Open(train_path);
      if (!train.ok()) return train.status();
      if (absl::Status s = within_vocabulary(*train); !s.ok()) return s;
      t.train_tokens_.emplace(std::move(*train));
    }
    if (fs::exists(val_path)) {
      absl::StatusOr<TokenFile> val = TokenFile::Open(val_path);
      if (!val.ok()) return val.status();
      if (absl::Status s = within_vocabulary(*val); !s.ok()) return s;
      t.val_tokens_.emplace(std::move(*val));
    }
  }
  if (config.eval_only && !t.val_tokens_) {
    return absl::InvalidArgumentError(
        "eval_only: needs --data DIR holding val.bin");
  }
  if (t.train_tokens_) {
    BatchSamplerOptions sampler_options;
    sampler_options.num_tokens = static_cast<int64_t>(t.train_tokens_->size());
    sampler_options.seq_len = config.seq_len;
    sampler_options.local_batch = config.batch_size;
    sampler_options.world_size = t.strategy_->data_parallel_size();
    sampler_options.grad_accum = config.grad_accum;
    sampler_options.seed = config.seed;
    sampler_options.shuffle = config.shuffle;
    absl::StatusOr<BatchSampler> sampler =
        BatchSampler::Create(sampler_options);
    if (!sampler.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("data: ", sampler.status().message()));
    }
    t.sampler_.emplace(std::move(*sampler));
    t.total_steps_ = config.max_steps > 0
                         ? config.max_steps
                         : config.epochs * t.sampler_->steps_per_epoch();
  }
  // Checked before step 1, not found at the final evaluation.
  if (t.val_tokens_) {
    const int64_t needed = (config.seq_len + 1) * config.batch_size *
                           t.strategy_->data_parallel_size();
    if (static_cast<int64_t>(t.val_tokens_->size()) < needed) {
      return absl::FailedPreconditionError(absl::StrCat(
          "data: ", config.data, "/val.bin has ", t.val_tokens_->size(),
          " tokens, fewer than one evaluation batch needs (", config.batch_size,
          " x ", t.strategy_->data_parallel_size(), " replicas x ",
          config.seq_len + 1, " = ", needed,
          "): prepare more text for validation, lower "
          "--batch-size or --seq-len, or remove val.bin to train without "
          "evaluating"));
    }
  }

  t.schedule_.emplace(config.lr, config.min_lr_ratio, config.warmup_steps,
                      t.total_steps_);

  // Model: identical on every rank (same seed), then handed to the strategy.
  absl::StatusOr<CausalLm> created =
      CreateCausalLm(t.model_config_, config.seed);
  if (!created.ok()) return created.status();
  CausalLm model = *created;
  if (init_weights) {
    if (absl::Status s =
            LoadModelWeights(init_weights->read, init_weights->names, *model);
        !s.ok()) {
      return s;
    }
    init_weights.reset();  // close the file
  }
  absl::StatusOr<int64_t> recompute_every =
      ActivationCheckpointEvery(config.activation_checkpointing);
  if (!recompute_every.ok()) return recompute_every.status();
  model->set_activation_checkpointing(*recompute_every);
  if (absl::Status s = t.strategy_->Setup(model); !s.ok()) return s;

  t.flops_per_token_ = t.model_config_.FlopsPerToken(config.seq_len);
  t.peak_flops_ = config.peak_flops > 0 ? config.peak_flops
                                        : PeakFlops(t.device_, config.precision,
                                                    static_cast<int>(threads));
  if (!config.out.empty()) t.checkpoints_.emplace(config.out);
  if (config.resume) {
    if (absl::Status s = t.Resume(); !s.ok()) return s;
  }
  return trainer;
}

absl::Status Trainer::KeepCheckpointGlobalBatch() {
  std::unique_ptr<CheckpointReader> reader =
      NewestReadableCheckpoint(config_.out);
  if (reader == nullptr) return absl::OkStatus();  // Resume() says why
  const nlohmann::json& training = reader->metadata().training;
  // Data-parallel replicas share the global batch (a pipeline's stages of
  // one replica see the same sequences).
  const int64_t replicas = strategy_->data_parallel_size();
  const int64_t requested = replicas * config_.batch_size * config_.grad_accum;
  const int64_t saved = TrainingInt(training, "global_batch", 0);
  if (saved <= 0 || saved == requested) return absl::OkStatus();
  absl::StatusOr<BatchSplit> split =
      SplitGlobalBatch(saved, replicas, config_.batch_size);
  if (!split.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "resume: checkpoint ", reader->dir(), " trains on ", saved,
        " sequences per step, which ", replicas,
        " data-parallel replicas cannot share equally; resume on a mesh whose "
        "replicas divide ",
        saved));
  }
  const nlohmann::json written = training.contains("written_by")
                                     ? training["written_by"]
                                     : nlohmann::json::object();
  const int64_t world = rank_info_.world_size;
  Log(absl::StrFormat(
      "resume: %s was written by %s on %d rank(s) (batch %d x accum %d per "
      "replica); continuing on %s, %d rank(s) in %d replica(s), with batch %d "
      "x accum %d per replica: the same %d sequences per step",
      reader->dir(), WrittenByMesh(written), TrainingInt(written, "world_size"),
      TrainingInt(written, "batch_size"), TrainingInt(written, "grad_accum"),
      MeshName(config_, world), world, replicas, split->batch, split->accum,
      saved));
  config_.batch_size = split->batch;
  config_.grad_accum = split->accum;
  return config_.Validate();
}

void Trainer::Log(const std::string& line) {
  if (rank_info_.rank == 0 && log_ != nullptr) *log_ << line << std::endl;
}

std::pair<torch::Tensor, torch::Tensor> Trainer::LoadBatch(
    const TokenFile& tokens, const std::vector<int64_t>& starts) const {
  const int64_t batch = static_cast<int64_t>(starts.size());
  const int64_t seq_len = config_.seq_len;
  torch::Tensor inputs = torch::empty({batch, seq_len}, torch::kInt64);
  torch::Tensor targets = torch::empty({batch, seq_len}, torch::kInt64);
  int64_t* in = inputs.data_ptr<int64_t>();
  int64_t* out = targets.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    const size_t window = static_cast<size_t>(starts[b]);
    for (int64_t t = 0; t < seq_len; ++t) {
      in[b * seq_len + t] = tokens[window + t];
      out[b * seq_len + t] = tokens[window + t + 1];
    }
  }
  if (device_.is_cpu()) return {inputs, targets};
  return {inputs.to(device_, /*non_blocking=*/true),
          targets.to(device_, /*non_blocking=*/true)};
}

StepMetrics Trainer::TrainStep(int64_t step) {
  MemoryTracker& memory = MemoryTracker::Get();
  memory.ResetPeak(device_);
  const auto start = SteadyClock::now();
  const double lr = schedule_->At(step);

  // The step's micro-batches, handed to the strategy at once (a pipeline
  // schedules them across its stages).
  std::vector<Batch> batches;
  for (int64_t micro = 0; micro < config_.grad_accum; ++micro) {
    auto [inputs, targets] = LoadBatch(
        *train_tokens_,
        sampler_->WindowStarts(step, micro, strategy_->data_parallel_rank()));
    batches.push_back({std::move(inputs), std::move(targets)});
  }
  const torch::Tensor step_loss = strategy_->ForwardBackwardStep(batches);
  const double grad_norm = strategy_->ClipGradNorm(config_.grad_clip);
  // A non-finite norm would turn every weight into NaN: that update is not
  // applied (the norm is global, so every rank skips alike) and Run() stops
  // the run as diverged.
  if (std::isfinite(grad_norm)) strategy_->OptimizerStep(lr);
  const double local_loss = step_loss.item<double>();
  const double loss = strategy_->AllReduceMean(local_loss);
  const double seconds = SecondsSince(start);

  StepMetrics m;
  m.step = step + 1;
  m.total_steps = total_steps_;
  m.epoch = sampler_->EpochOf(step);
  m.rank = rank_info_.rank;
  m.loss = loss;
  m.grad_norm = grad_norm;
  m.lr = lr;
  m.step_seconds = seconds;
  m.tokens = sampler_->windows_per_step() * config_.seq_len;
  m.tokens_per_second = static_cast<double>(m.tokens) / seconds;
  if (peak_flops_ > 0) {
    m.mfu = flops_per_token_ * m.tokens_per_second /
            (peak_flops_ * static_cast<double>(rank_info_.world_size));
  }
  const MemorySnapshot snapshot = memory.Snapshot(device_);
  m.memory_allocated_bytes = snapshot.allocated_bytes;
  m.memory_peak_bytes = snapshot.peak_bytes;
  m.memory_reserved_bytes = snapshot.reserved_bytes;
  m.model_state_bytes = strategy_->ModelStateBytes();
  const CommStats comm = strategy_->TakeCommStats();
  m.comm_seconds = comm.seconds;
  m.comm_bytes = comm.bytes;
  m.comm_inter_group_bytes = comm.inter_group_bytes;
  m.comm_tensor_parallel_bytes = comm.tensor_parallel_bytes;
  m.pipeline_stage = strategy_->pipeline_stage();
  m.pipeline_bubble_seconds = comm.pipeline_bubble_seconds;
  m.p2p_bytes = comm.p2p_bytes;
  return m;
}

absl::StatusOr<double> Trainer::Evaluate() {
  if (!val_tokens_) {
    return absl::FailedPreconditionError("no val.bin in the data directory");
  }
  const int64_t window = config_.seq_len + 1;
  const int64_t global_batch =
      config_.batch_size * strategy_->data_parallel_size();
  const int64_t available =
      static_cast<int64_t>(val_tokens_->size()) / (window * global_batch);
  const int64_t batches = std::min(config_.eval_steps, available);
  if (batches == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("val.bin has ", val_tokens_->size(),
                     " tokens, fewer than one eval batch (", global_batch,
                     " x ", window, ")"));
  }
  double sum = 0;
  for (int64_t b = 0; b < batches; ++b) {
    std::vector<int64_t> starts(config_.batch_size);
    for (int64_t i = 0; i < config_.batch_size; ++i) {
      starts[i] = (b * global_batch +
                   strategy_->data_parallel_rank() * config_.batch_size + i) *
                  window;
    }
    auto [inputs, targets] = LoadBatch(*val_tokens_, starts);
    sum += strategy_->ForwardLoss(inputs, targets).item<double>();
  }
  return strategy_->AllReduceMean(sum / static_cast<double>(batches));
}

absl::Status Trainer::SaveCheckpoint(int64_t next_step) {
  // Rank 0 stages the directory; every rank writes its slices; rank 0 writes
  // the metadata and commits. Each stage ends in an agreement (a collective
  // every rank reaches even when its own part failed), so a failure on one
  // rank fails the checkpoint on all instead of leaving them waiting.
  const auto agree = [this](const absl::Status& mine,
                            const char* what) -> absl::Status {
    const bool everywhere =
        strategy_->AllReduceMean(mine.ok() ? 1.0 : 0.0) == 1.0;
    if (!mine.ok()) return mine;
    if (!everywhere) {
      return absl::InternalError(
          absl::StrCat("checkpoint: another rank could not ", what));
    }
    return absl::OkStatus();
  };
  absl::StatusOr<std::string> dir =
      rank_info_.rank == 0
          ? checkpoints_->Begin(next_step)
          : absl::StatusOr<std::string>(checkpoints_->StagingDir(next_step));
  if (absl::Status s = agree(dir.status(), "stage it"); !s.ok()) return s;
  const int64_t global_batch = sampler_->windows_per_step();
  const nlohmann::json training = {
      {"step", next_step},
      {"samples_consumed", next_step * global_batch},
      {"global_batch", global_batch},
      {"seq_len", config_.seq_len},
      {"model", model_config_.ToSpec()},
      // Where its tokens came from (meta.json there names the tokenizer,
      // which `checkpoint export` ships with the model).
      {"data", config_.data.empty()
                   ? std::string()
                   : std::filesystem::absolute(config_.data).string()},
      {"written_by",
       {{"strategy", strategy_->name()},
        {"mesh", MeshName(config_, rank_info_.world_size)},
        {"world_size", rank_info_.world_size},
        {"batch_size", config_.batch_size},
        {"grad_accum", config_.grad_accum}}},
      {"rng_file", kRngFile},
      {"fingerprint",
       ResumeFingerprint(config_, model_config_, global_batch, total_steps_)}};
  absl::Status rng = absl::OkStatus();
  if (rank_info_.rank == 0) {
    const torch::Tensor state =
        at::detail::getDefaultCPUGenerator().get_state().contiguous();
    rng = WriteFileAtomically(
        *dir + "/" + kRngFile,
        std::string_view(static_cast<const char*>(state.data_ptr()),
                         static_cast<size_t>(state.nbytes())));
  }
  if (absl::Status s = agree(rng, "write the random state"); !s.ok()) return s;
  // Collective; rank 0 then writes checkpoint.json.
  const absl::Status saved = strategy_->SaveCheckpoint(*dir, training);
  if (absl::Status s = agree(saved, "write its part"); !s.ok()) return s;
  if (rank_info_.rank == 0) return checkpoints_->Commit(next_step);
  return absl::OkStatus();
}

absl::Status Trainer::Resume() {
  const std::vector<std::string> dirs = checkpoints_->Candidates();
  if (dirs.empty()) {
    Log(absl::StrCat("resume: no checkpoint in ", checkpoints_->root(),
                     "; starting at step 0"));
    return absl::OkStatus();
  }
  // Every rank tries the same checkpoint; all must load it, else all fall
  // back to the previous one (a torn or corrupted file, a missing shard).
  std::vector<std::string> problems;
  for (const std::string& dir : dirs) {
    absl::StatusOr<int64_t> step = LoadCheckpointFrom(dir);
    // Decided together: a rank may find alone what is wrong (under FSDP each
    // reads only its own tensors).
    const bool everywhere =
        strategy_->AllReduceMean(step.ok() ? 1.0 : 0.0) == 1.0;
    const bool another_run =
        strategy_->AllReduceMean(
            absl::IsFailedPrecondition(step.status()) ? 1.0 : 0.0) > 0;
    // A checkpoint of another run: older ones are of that run too.
    if (another_run) {
      return absl::IsFailedPrecondition(step.status())
                 ? step.status()
                 : absl::FailedPreconditionError(absl::StrCat(
                       "resume: another rank found ", dir,
                       " to belong to another training (see rank 0's log)"));
    }
    if (everywhere) {
      start_step_ = *step;
      Log(absl::StrCat("resumed from ", dir, " at step ", start_step_));
      return absl::OkStatus();
    }
    const std::string why = step.ok()
                                ? std::string("another rank could not load it")
                                : std::string(step.status().message());
    problems.push_back(why);
    Log(absl::StrCat(
        "resume: ", dir, " is unusable (", why, ")",
        &dir == &dirs.back() ? "" : "; trying the previous checkpoint"));
  }
  return absl::DataLossError(absl::StrCat(
      "resume: none of the ", dirs.size(), " checkpoints in ",
      checkpoints_->root(), " loads (newest: ", problems.front(), ")"));
}

absl::StatusOr<int64_t> Trainer::LoadCheckpointFrom(const std::string& dir) {
  absl::StatusOr<std::unique_ptr<CheckpointReader>> reader =
      CheckpointReader::Open(dir);
  if (!reader.ok()) return reader.status();
  const nlohmann::json& training = (*reader)->metadata().training;
  const int64_t step = TrainingInt(training, "step");
  if (step < 0) {
    return absl::DataLossError(
        absl::StrCat("checkpoint ", dir, " records no step"));
  }
  const int64_t global_batch = sampler_ ? sampler_->windows_per_step()
                                        : strategy_->data_parallel_size() *
                                              config_.batch_size *
                                              config_.grad_accum;
  const nlohmann::json expected =
      ResumeFingerprint(config_, model_config_, global_batch, total_steps_);
  const nlohmann::json saved =
      training.contains("fingerprint") && training["fingerprint"].is_object()
          ? training["fingerprint"]
          : nlohmann::json::object();
  for (const auto& [field, value] : expected.items()) {
    if (saved.contains(field) && saved[field] == value) continue;
    // A longer (or shorter) run continues from the checkpoint; the schedule
    // is the new length's (docs/checkpoints.md).
    if (field == "total_steps" && saved.contains(field) &&
        saved[field].is_number_integer()) {
      if (step >= total_steps_) {
        return absl::FailedPreconditionError(absl::StrCat(
            "resume: checkpoint ", dir, " is at step ", step,
            ", and this run ends at step ", total_steps_,
            ": pass a larger --max-steps (or --epochs) to train longer"));
      }
      Log(absl::StrCat("resume: the checkpoint's run had ",
                       saved[field].get<int64_t>(), " steps, this one has ",
                       total_steps_,
                       ": the learning-rate schedule follows the new length "
                       "from step ",
                       step));
      continue;
    }
    return absl::FailedPreconditionError(absl::StrCat(
        "resume: checkpoint ", dir, " was written with ", field, " ",
        saved.contains(field) ? JsonExcerpt(saved[field]) : "(none)",
        "; this run has ", JsonExcerpt(value), ". Pass the same (",
        FlagFor(field), "), or train into a fresh --out"));
  }
  if (absl::Status s = strategy_->LoadCheckpoint(**reader); !s.ok()) return s;
  at::Generator generator = at::detail::getDefaultCPUGenerator();
  const torch::Tensor current = generator.get_state();
  const auto rng_bytes = static_cast<int64_t>(current.nbytes());
  absl::StatusOr<std::string> read = ReadInputFile(
      absl::StrCat(dir, "/", kRngFile), rng_bytes, "the random state");
  if (!read.ok()) {
    return absl::DataLossError(
        absl::StrCat("checkpoint ", dir, ": ", read.status().message()));
  }
  const std::string& bytes = *read;
  if (static_cast<int64_t>(bytes.size()) != rng_bytes) {
    return absl::DataLossError(absl::StrCat("checkpoint ", dir, ": ", kRngFile,
                                            " has ", bytes.size(),
                                            " bytes, not ", rng_bytes));
  }
  torch::Tensor state = torch::empty_like(current);
  std::memcpy(state.data_ptr(), bytes.data(), bytes.size());
  {
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(state);
  }
  return step;
}

absl::Status Trainer::Run() {
  // Strategies report failed collectives (a lost rank, a timeout) and
  // LibTorch reports its own errors by throwing from inside forward/backward;
  // they end the run as a Status naming the problem.
  try {
    return RunLoop();
  } catch (const c10::Error& e) {
    return absl::InternalError(e.what_without_backtrace());
  } catch (const std::exception& e) {
    return absl::InternalError(e.what());
  }
}

absl::Status Trainer::RunLoop() {
  if (config_.eval_only) {
    absl::StatusOr<double> val_loss = Evaluate();
    if (!val_loss.ok()) return val_loss.status();
    Log(absl::StrFormat("val_loss %.6f", *val_loss));
    return absl::OkStatus();
  }
  if (!config_.out.empty()) {
    std::error_code ec;
    fs::create_directories(config_.out, ec);
    if (ec) {
      return absl::InternalError(absl::StrCat(
          "out: cannot create '", config_.out, "': ", ec.message()));
    }
    const std::string path = config_.out + "/metrics.jsonl";
    metrics_fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (metrics_fd_ < 0) {
      return absl::InternalError(
          absl::StrCat("cannot open ", path, ": ", std::strerror(errno)));
    }
  }
  Log(absl::StrFormat(
      "training %s (%s params) on mesh %s (%s x %d) | %d steps | batch %d x "
      "%d x accum %d x %d replica(s) = %s tokens/step",
      model_config_.name, FormatThousands(model_config_.NumParameters()),
      MeshName(config_, rank_info_.world_size), config_.device,
      rank_info_.world_size, total_steps_, config_.batch_size, config_.seq_len,
      config_.grad_accum, strategy_->data_parallel_size(),
      FormatThousands(sampler_->windows_per_step() * config_.seq_len)));
  if (const std::string layout = strategy_->layout(); !layout.empty()) {
    Log(absl::StrCat(strategy_->name(), ": ", layout));
  }
  if (device_.is_cpu()) {
    Log(absl::StrCat(
        "cpu: ", CpuComputeThreads(), " thread(s) per rank",
        *BlasCoreName() != '\0'
            ? absl::StrCat(", OpenBLAS ", BlasCoreName(), " kernels")
            : "",
        ", ", MallocName()));
  }
  if (config_.activation_checkpointing != "none") {
    Log(absl::StrCat(
        "activation checkpointing: ", config_.activation_checkpointing,
        " (recomputed blocks keep only their input; their "
        "forward runs again in backward)"));
  }

  const SteadyClock::time_point loop_start = SteadyClock::now();
  double val_loss_seen = -1;
  for (int64_t step = start_step_; step < total_steps_; ++step) {
    const bool last_step = step + 1 == total_steps_;
    StepMetrics m = TrainStep(step);

    if (val_tokens_ &&
        ((config_.eval_every > 0 && (step + 1) % config_.eval_every == 0) ||
         last_step)) {
      absl::StatusOr<double> val_loss = Evaluate();
      if (!val_loss.ok()) return val_loss.status();
      m.val_loss = *val_loss;
    }

    if (m.val_loss >= 0) val_loss_seen = m.val_loss;
    if ((step + 1) % config_.log_every == 0 || last_step) {
      // Elapsed, and the rest at this run's pace so far.
      const double elapsed = SecondsSince(loop_start);
      const int64_t done = step + 1 - start_step_;
      Log(absl::StrCat(
          m.FormatLine(), " | elapsed ", FormatDuration(elapsed),
          last_step ? ""
                    : absl::StrCat(" | ETA ",
                                   FormatDuration(elapsed / done *
                                                  (total_steps_ - step - 1)))));
      if (m.val_loss >= 0) Log(absl::StrFormat("val_loss %.6f", m.val_loss));
    }
    if (metrics_fd_ >= 0) {
      const std::string line = m.ToJson() + "\n";
      if (::write(metrics_fd_, line.data(), line.size()) !=
          static_cast<ssize_t>(line.size())) {
        return absl::InternalError(
            absl::StrCat("cannot append to ", config_.out,
                         "/metrics.jsonl: ", std::strerror(errno)));
      }
    }
    history_.push_back(m);
    if (step_callback_) step_callback_(m);
    if (!std::isfinite(m.loss) || !std::isfinite(m.grad_norm)) {
      // Recorded above, then stopped: no checkpoint or model is written
      // from a diverged state, and a restart would only diverge again.
      return DivergedError(absl::StrFormat(
          "training diverged at step %d: loss %g, grad norm %g at lr %.2e; "
          "the step was not applied and no checkpoint was written from it "
          "(lower --lr, raise --warmup-steps or --eps)",
          m.step, m.loss, m.grad_norm, m.lr));
    }

    const bool saved =
        checkpoints_ && config_.checkpoint_every > 0 &&
        ((step + 1) % config_.checkpoint_every == 0 || last_step);
    if (saved) {
      if (absl::Status s = SaveCheckpoint(step + 1); !s.ok()) return s;
    }

    if (stop_requested_ && !last_step &&
        strategy_->AllReduceMean(stop_requested_() ? 1.0 : 0.0) > 0) {
      if (checkpoints_ && !saved) {
        if (absl::Status s = SaveCheckpoint(step + 1); !s.ok()) return s;
      }
      Log(absl::StrCat("stopping after step ", step + 1, " of ", total_steps_,
                       " as asked", checkpoints_ ? "; checkpoint saved" : "",
                       " (the run resumes from it)"));
      return PreemptedError(
          absl::StrCat("stopped after step ", step + 1, " as asked"));
    }
  }

  if (!config_.out.empty()) {
    const std::string model_path =
        config_.out + "/" + ExportedModelFileName(model_config_);
    if (absl::Status s = strategy_->ExportModel(model_path); !s.ok()) return s;
    const std::string model_json = ExportedModelConfigJson(model_config_);
    if (rank_info_.rank == 0 && !model_json.empty()) {
      if (absl::Status s = WriteFileAtomically(
              config_.out + "/" + kHfConfigFile, model_json + "\n");
          !s.ok()) {
        return s;
      }
    }
    Log(absl::StrCat("wrote ", model_path));
  }
  LogSummary(SecondsSince(loop_start), val_loss_seen);
  return absl::OkStatus();
}

void Trainer::LogSummary(double seconds, double val_loss) {
  if (history_.empty()) return;
  const StepMetrics& last = history_.back();
  const int64_t steps = static_cast<int64_t>(history_.size());
  const int64_t tokens =
      steps * (sampler_ ? sampler_->windows_per_step() * config_.seq_len : 0);
  std::string line = absl::StrFormat(
      "done: %d steps in %s (%s tokens/s) | final loss %.4f", steps,
      FormatDuration(seconds),
      FormatThousands(seconds > 0 ? std::llround(tokens / seconds) : 0),
      last.loss);
  if (val_loss >= 0) absl::StrAppendFormat(&line, " | val loss %.4f", val_loss);
  absl::StrAppendFormat(&line, " | peak memory %s (rank %d)",
                        FormatBytes(last.memory_peak_bytes), rank_info_.rank);
  Log(line);
  if (!config_.out.empty()) {
    // checkpoints/ only when this run (or an earlier one) wrote one.
    const bool has_checkpoints =
        checkpoints_ && !checkpoints_->Candidates().empty();
    Log(absl::StrCat(
        "outputs: ", config_.out, "/", ExportedModelFileName(model_config_),
        ", ", config_.out, "/metrics.jsonl",
        has_checkpoints ? absl::StrCat(", ", config_.out, "/checkpoints/")
                        : ""));
  }
}

}  // namespace shardtrain
