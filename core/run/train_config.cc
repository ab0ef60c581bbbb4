#include "core/run/train_config.h"

#include <algorithm>
#include <filesystem>
#include <functional>
#include <map>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/strip.h"
#include "common/flag_file.h"
#include "common/nearest_name.h"
#include "core/model/model_config.h"
#include "core/plan/pipeline_plan.h"
#include "core/run/step_metrics.h"
#include "core/run/strategy_kinds.h"
#include "yaml-cpp/yaml.h"

namespace shardtrain {
namespace {

template <typename T>
absl::Status FieldError(absl::string_view field, const T& value,
                        absl::string_view allowed) {
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": got ", value, "; ", allowed));
}

bool IsCudaDevice(const std::string& device) {
  if (device == "cuda") return true;
  if (device.rfind("cuda:", 0) != 0 || device.size() == 5) return false;
  for (char c : device.substr(5)) {
    if (c < '0' || c > '9') return false;
  }
  return true;
}

constexpr int64_t kMaxBatchSize = int64_t{1} << 20;
constexpr int64_t kMaxGradAccum = int64_t{1} << 16;
constexpr int64_t kMaxSteps = int64_t{1} << 40;
constexpr int64_t kMaxEpochs = int64_t{1} << 20;
// A week; c10d converts it to milliseconds, and the worker refused values
// this check let through.
constexpr int64_t kMaxCommTimeoutSeconds = 7 * 24 * 3600;
// As the job's world size: every stage needs a rank.
constexpr int64_t kMaxPipelineStages = 1024;
constexpr int64_t kMaxTensorParallel = 1024;
constexpr int64_t kMaxMicroBatches = int64_t{1} << 16;
constexpr int64_t kMaxVirtualStages = 64;

}  // namespace

int64_t TrainConfig::ThreadsPerRank(int64_t world_size) const {
  if (threads > 0) return threads;
  return std::max<int64_t>(
      1, static_cast<int64_t>(std::thread::hardware_concurrency()) /
             std::max<int64_t>(1, world_size));
}

absl::Status TrainConfig::Validate() const {
  absl::StatusOr<ModelConfig> model_config = ParseModelSpec(model);
  if (!model_config.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("model: ", model_config.status().message()));
  }
  if (data.empty() && !eval_only) {
    return absl::InvalidArgumentError(
        "data: missing; give a directory holding train.bin (see `shardtrain "
        "data prepare`)");
  }
  // Upper bounds far beyond any machine, so that every product of them
  // (windows per step = world x batch x accumulation, tokens, steps x
  // windows) stays well inside int64: 2^62 passed before and a rank died of
  // SIGFPE.
  if (batch_size <= 0 || batch_size > kMaxBatchSize) {
    return FieldError("batch_size", batch_size,
                      absl::StrCat("must be in [1, ", kMaxBatchSize, "]"));
  }
  if (seq_len <= 0 || seq_len > model_config->block_size) {
    return FieldError("seq_len", seq_len,
                      absl::StrCat("must be in [1, ", model_config->block_size,
                                   "] (block size of ", model, ")"));
  }
  if (grad_accum <= 0 || grad_accum > kMaxGradAccum) {
    return FieldError("grad_accum", grad_accum,
                      absl::StrCat("must be in [1, ", kMaxGradAccum, "]"));
  }
  if (max_steps < 0 || max_steps > kMaxSteps) {
    return FieldError(
        "max_steps", max_steps,
        absl::StrCat("must be in [0, ", kMaxSteps, "] (0: use epochs)"));
  }
  if (epochs > kMaxEpochs) {
    return FieldError("epochs", epochs,
                      absl::StrCat("must be at most ", kMaxEpochs));
  }
  if (eval_only && init_from.empty()) {
    return absl::InvalidArgumentError(
        "eval_only: needs --init-from MODEL.bin, the model to evaluate "
        "(without one it would score a randomly initialised model); "
        "`shardtrain checkpoint export DIR --to MODEL.bin` makes one from a "
        "checkpoint");
  }
  if (max_steps == 0 && epochs <= 0 && !eval_only) {
    return FieldError("epochs", epochs,
                      "must be positive when max_steps is not set");
  }
  if (!(lr > 0) || lr > 10) return FieldError("lr", lr, "must be in (0, 10]");
  if (!(min_lr_ratio >= 0 && min_lr_ratio <= 1)) {
    return FieldError("min_lr_ratio", min_lr_ratio, "must be in [0, 1]");
  }
  if (warmup_steps < 0 || warmup_steps > kMaxSteps) {
    return FieldError("warmup_steps", warmup_steps,
                      absl::StrCat("must be in [0, ", kMaxSteps, "]"));
  }
  if (!(weight_decay >= 0)) {
    return FieldError("weight_decay", weight_decay, "must be >= 0");
  }
  if (!(beta1 >= 0 && beta1 < 1)) {
    return FieldError("beta1", beta1, "must be in [0, 1)");
  }
  if (!(beta2 >= 0 && beta2 < 1)) {
    return FieldError("beta2", beta2, "must be in [0, 1)");
  }
  if (!(eps > 0)) return FieldError("eps", eps, "must be > 0");
  if (grad_clip != grad_clip) {
    return FieldError("grad_clip", grad_clip, "must be a number");
  }
  if (FindStrategyKind(strategy) == nullptr) {
    return FieldError("strategy", strategy,
                      absl::StrCat("allowed: ", StrategyNameList()));
  }
  if (device != "cpu" && !IsCudaDevice(device)) {
    return FieldError("device", device, "allowed: cpu, cuda, cuda:N");
  }
  if (precision != "fp32" && precision != "bf16") {
    return FieldError("precision", precision, "allowed: fp32, bf16");
  }
  if (precision == "bf16" && device == "cpu") {
    return FieldError("precision", precision,
                      "bf16 needs a CUDA device; use fp32 on cpu");
  }
  if (threads < 0) return FieldError("threads", threads, "must be >= 0");
  if (!(bucket_mb > 0 && bucket_mb <= 4096)) {
    return FieldError("bucket_mb", bucket_mb, "must be in (0, 4096]");
  }
  if (comm_timeout <= 0 || comm_timeout > kMaxCommTimeoutSeconds) {
    return FieldError(
        "comm_timeout", comm_timeout,
        absl::StrCat("must be in [1, ", kMaxCommTimeoutSeconds, "] seconds"));
  }
  if (!(peak_flops >= 0)) {
    return FieldError("peak_flops", peak_flops, "must be >= 0");
  }
  if (eval_every < 0) {
    return FieldError("eval_every", eval_every, "must be >= 0");
  }
  if (eval_steps <= 0 || eval_steps > kMaxSteps) {
    return FieldError("eval_steps", eval_steps,
                      absl::StrCat("must be in [1, ", kMaxSteps, "]"));
  }
  if (checkpoint_every < 0) {
    return FieldError("checkpoint_every", checkpoint_every, "must be >= 0");
  }
  if (checkpoint_every > 0 && out.empty()) {
    return FieldError("out", "\"\"", "checkpoints need an output directory");
  }
  if (resume && out.empty()) {
    return FieldError("out", "\"\"", "--resume reads checkpoints from out");
  }
  if (log_every <= 0) {
    return FieldError("log_every", log_every, "must be a positive integer");
  }
  if (memory_cap < 0) {
    return FieldError("memory_cap", memory_cap, "must be >= 0 (0: no cap)");
  }
  if (shard_group_size < 0 || shard_group_size > 1 << 20) {
    return FieldError("shard_group_size", shard_group_size,
                      "must be >= 0 (0: ranks per node)");
  }
  if (absl::StatusOr<int64_t> every =
          ActivationCheckpointEvery(activation_checkpointing);
      !every.ok()) {
    return every.status();
  }
  if (absl::Status s = ValidatePipeline(*model_config); !s.ok()) return s;
  return ValidateTensorParallel(*model_config);
}

absl::Status TrainConfig::ValidateTensorParallel(
    const ModelConfig& model_config) const {
  if (tensor_parallel < 1 || tensor_parallel > kMaxTensorParallel) {
    return FieldError("tensor_parallel", tensor_parallel,
                      absl::StrCat("must be in [1, ", kMaxTensorParallel,
                                   "] (1: no tensor parallelism)"));
  }
  if (tensor_parallel == 1) return absl::OkStatus();
  if (model_config.n_head % tensor_parallel != 0) {
    return FieldError(
        "tensor_parallel", tensor_parallel,
        absl::StrCat("must divide the model's ", model_config.n_head,
                     " attention heads (each rank runs whole heads)"));
  }
  if (model_config.kv_heads() % tensor_parallel != 0) {
    return FieldError(
        "tensor_parallel", tensor_parallel,
        absl::StrCat("must divide the model's ", model_config.kv_heads(),
                     " key/value heads (each rank holds whole key/value "
                     "heads)"));
  }
  if (model_config.mlp_hidden() % tensor_parallel != 0) {
    return FieldError(
        "tensor_parallel", tensor_parallel,
        absl::StrCat("must divide the model's ", model_config.mlp_hidden(),
                     " MLP hidden units"));
  }
  return absl::OkStatus();
}

absl::Status TrainConfig::ValidatePipeline(
    const ModelConfig& model_config) const {
  if (pipeline_stages < 1 || pipeline_stages > kMaxPipelineStages) {
    return FieldError("pipeline_stages", pipeline_stages,
                      absl::StrCat("must be in [1, ", kMaxPipelineStages,
                                   "] (1: no pipeline)"));
  }
  if (micro_batches < 1 || micro_batches > kMaxMicroBatches) {
    return FieldError("micro_batches", micro_batches,
                      absl::StrCat("must be in [1, ", kMaxMicroBatches, "]"));
  }
  if (batch_size % micro_batches != 0) {
    return FieldError(
        "micro_batches", micro_batches,
        absl::StrCat("must divide batch_size (", batch_size, ")"));
  }
  absl::StatusOr<PipelineSchedule> schedule =
      ParsePipelineSchedule(pipeline_schedule);
  if (!schedule.ok()) return schedule.status();
  if (*schedule == PipelineSchedule::kZeroBubble && pipeline_stages > 1 &&
      tensor_parallel > 1) {
    return FieldError("pipeline_schedule", "\"zb-h1\"",
                      "zb-h1 splits the projections' backward, which "
                      "tensor-parallel layers do not; use 1f1b with "
                      "tensor_parallel > 1");
  }
  if (virtual_stages < 1 || virtual_stages > kMaxVirtualStages) {
    return FieldError("virtual_stages", virtual_stages,
                      absl::StrCat("must be in [1, ", kMaxVirtualStages,
                                   "] (1: no interleaving)"));
  }
  std::vector<int64_t> split;
  if (!pipeline_split.empty()) {
    absl::StatusOr<std::vector<int64_t>> parsed =
        ParsePipelineSplit(pipeline_split);
    if (!parsed.ok()) return parsed.status();
    split = *std::move(parsed);
  }
  if (pipeline_stages == 1) {
    if (micro_batches > 1) {
      return FieldError("micro_batches", micro_batches,
                        "micro-batches flow through pipeline stages; set "
                        "pipeline_stages > 1");
    }
    if (!pipeline_split.empty()) {
      return FieldError(
          "pipeline_split",
          absl::StrCat("\"", absl::CHexEscape(pipeline_split), "\""),
          "a split cuts the model into pipeline stages; set pipeline_stages "
          "> 1");
    }
    if (virtual_stages > 1) {
      return FieldError("virtual_stages", virtual_stages,
                        "chunks interleave pipeline stages; set "
                        "pipeline_stages > 1");
    }
    return absl::OkStatus();
  }
  if (absl::Status s = CheckVirtualStages(*schedule, pipeline_stages,
                                          micro_batches, virtual_stages);
      !s.ok()) {
    return s;
  }
  if (absl::StatusOr<std::vector<PipelineStage>> stages = PartitionPipeline(
          model_config, seq_len, pipeline_stages, split, virtual_stages);
      !stages.ok()) {
    return stages.status();
  }
  return absl::OkStatus();
}

absl::Status TrainConfig::CheckMeshWorld(int64_t world_size,
                                         absl::string_view field) const {
  if (tensor_parallel > 1) {
    // Tensor parallelism, within pipeline stages or not: replicas of
    // ModelParallelSize() ranks.
    const int64_t model_parallel = ModelParallelSize();
    if (world_size < model_parallel || world_size % model_parallel != 0) {
      return FieldError(
          field, world_size,
          pipeline_stages > 1
              ? absl::StrCat("must be a multiple of pipeline_stages x "
                             "tensor_parallel (",
                             pipeline_stages, " x ", tensor_parallel, " = ",
                             model_parallel,
                             "): each data-parallel replica runs that many "
                             "ranks")
              : absl::StrCat(
                    "must be a multiple of tensor_parallel (", tensor_parallel,
                    "): each data-parallel replica runs that many ranks"));
    }
    const StrategyKind* kind = FindStrategyKind(strategy);
    if (kind != nullptr && kind->layout == StateLayout::kSharded &&
        world_size < 2 * model_parallel) {
      return FieldError(
          field, world_size,
          absl::StrCat("strategy ", kind->name, " with tensor_parallel ",
                       tensor_parallel,
                       " shards each slice over the data-parallel replicas: "
                       "it needs at least two (",
                       2 * model_parallel, " ranks)"));
    }
    if (kind != nullptr && !kind->distributed && world_size != model_parallel) {
      return FieldError(
          field, world_size,
          absl::StrCat(
              "strategy ", kind->name, " with tensor_parallel ",
              tensor_parallel,
              pipeline_stages > 1
                  ? absl::StrCat(" and ", pipeline_stages, " pipeline stages")
                  : "",
              " runs on ", model_parallel, " ranks (use ddp for ",
              world_size / model_parallel, " data-parallel replicas)"));
    }
    return absl::OkStatus();
  }
  if (pipeline_stages <= 1) {
    // Without a mesh a strategy that is not distributed runs on one rank.
    const StrategyKind* kind = FindStrategyKind(strategy);
    if (kind != nullptr && !kind->distributed && world_size != 1) {
      return FieldError(field, world_size,
                        absl::StrCat("strategy ", kind->name,
                                     " trains on one device (use ddp, fsdp "
                                     "or hsdp)"));
    }
    return absl::OkStatus();
  }
  if (world_size < pipeline_stages || world_size % pipeline_stages != 0) {
    return FieldError(
        field, world_size,
        absl::StrCat("must be a multiple of pipeline_stages (", pipeline_stages,
                     "): each data-parallel replica runs one rank per stage"));
  }
  const StrategyKind* kind = FindStrategyKind(strategy);
  if (kind != nullptr && !kind->distributed && world_size != pipeline_stages) {
    return FieldError(
        field, world_size,
        absl::StrCat("strategy ", kind->name, " with ", pipeline_stages,
                     " pipeline stages runs on ", pipeline_stages,
                     " ranks (use ddp for ", world_size / pipeline_stages,
                     " data-parallel replicas per stage)"));
  }
  // HSDP within a stage: its shard groups divide the stage's ranks.
  const int64_t per_stage = world_size / pipeline_stages;
  if (kind != nullptr && kind->layout == StateLayout::kShardedInGroups &&
      shard_group_size > 0 && per_stage % shard_group_size != 0) {
    return FieldError(
        "shard_group_size", shard_group_size,
        absl::StrCat("must divide the ", per_stage,
                     " ranks of each pipeline stage (", field, " ", world_size,
                     " / ", pipeline_stages, " stages)"));
  }
  return absl::OkStatus();
}

absl::Status TrainConfig::CheckDataDirectory() const {
  std::error_code ec;
  if (data.empty() || std::filesystem::is_directory(data, ec)) {
    return absl::OkStatus();
  }
  return absl::NotFoundError(absl::StrCat(
      "data: directory '", data,
      "' does not exist (prepare one with `shardtrain data prepare`)"));
}

absl::StatusOr<int64_t> ActivationCheckpointEvery(absl::string_view value) {
  if (value == "none") return 0;
  if (value == "all") return 1;
  int64_t every = 0;
  absl::string_view n = value;
  if (absl::ConsumePrefix(&n, "every-") && absl::SimpleAtoi(n, &every) &&
      every >= 1 && every <= 1 << 20) {
    return every;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "activation_checkpointing: got \"", absl::CHexEscape(value),
      "\"; allowed: none, all, every-N (N >= 1: every N-th block)"));
}

namespace {

using Setter = std::function<void(const YAML::Node&, TrainConfig*)>;

template <typename T>
Setter Set(T TrainConfig::*field) {
  return [field](const YAML::Node& node, TrainConfig* config) {
    config->*field = node.as<T>();
  };
}

const std::map<std::string, Setter>& YamlSetters() {
  static const auto* setters = new std::map<std::string, Setter>{
      {"model", Set(&TrainConfig::model)},
      {"data", Set(&TrainConfig::data)},
      {"init_from", Set(&TrainConfig::init_from)},
      {"batch_size", Set(&TrainConfig::batch_size)},
      {"seq_len", Set(&TrainConfig::seq_len)},
      {"grad_accum", Set(&TrainConfig::grad_accum)},
      {"max_steps", Set(&TrainConfig::max_steps)},
      {"epochs", Set(&TrainConfig::epochs)},
      {"lr", Set(&TrainConfig::lr)},
      {"min_lr_ratio", Set(&TrainConfig::min_lr_ratio)},
      {"warmup_steps", Set(&TrainConfig::warmup_steps)},
      {"weight_decay", Set(&TrainConfig::weight_decay)},
      {"beta1", Set(&TrainConfig::beta1)},
      {"beta2", Set(&TrainConfig::beta2)},
      {"eps", Set(&TrainConfig::eps)},
      {"grad_clip", Set(&TrainConfig::grad_clip)},
      {"strategy", Set(&TrainConfig::strategy)},
      {"device", Set(&TrainConfig::device)},
      {"precision", Set(&TrainConfig::precision)},
      {"seed", Set(&TrainConfig::seed)},
      {"threads", Set(&TrainConfig::threads)},
      {"peak_flops", Set(&TrainConfig::peak_flops)},
      {"shuffle", Set(&TrainConfig::shuffle)},
      {"memory_cap",
       [](const YAML::Node& node, TrainConfig* config) {
         // A size with a unit ("512MiB") or a number of bytes.
         absl::StatusOr<int64_t> bytes = ParseBytes(node.as<std::string>());
         if (!bytes.ok()) throw YAML::Exception(YAML::Mark(), "size");
         config->memory_cap = *bytes;
       }},
      {"bucket_mb", Set(&TrainConfig::bucket_mb)},
      {"reshard_after_forward", Set(&TrainConfig::reshard_after_forward)},
      {"prefetch", Set(&TrainConfig::prefetch)},
      {"fsdp_no_sync", Set(&TrainConfig::fsdp_no_sync)},
      {"comm_timeout", Set(&TrainConfig::comm_timeout)},
      {"shard_group_size", Set(&TrainConfig::shard_group_size)},
      {"activation_checkpointing", Set(&TrainConfig::activation_checkpointing)},
      {"pipeline_stages", Set(&TrainConfig::pipeline_stages)},
      {"tensor_parallel", Set(&TrainConfig::tensor_parallel)},
      {"pipeline_split",
       [](const YAML::Node& node, TrainConfig* config) {
         // "4,8" or a list [4, 8].
         if (node.IsSequence()) {
           std::vector<std::string> blocks;
           for (const YAML::Node& block : node) {
             blocks.push_back(std::to_string(block.as<int64_t>()));
           }
           config->pipeline_split = absl::StrJoin(blocks, ",");
         } else {
           config->pipeline_split = node.as<std::string>();
         }
       }},
      {"micro_batches", Set(&TrainConfig::micro_batches)},
      {"pipeline_schedule", Set(&TrainConfig::pipeline_schedule)},
      {"virtual_stages", Set(&TrainConfig::virtual_stages)},
      {"eval_every", Set(&TrainConfig::eval_every)},
      {"eval_steps", Set(&TrainConfig::eval_steps)},
      {"checkpoint_every", Set(&TrainConfig::checkpoint_every)},
      {"out", Set(&TrainConfig::out)},
      {"eval_only", Set(&TrainConfig::eval_only)},
      {"resume", Set(&TrainConfig::resume)},
      {"log_every", Set(&TrainConfig::log_every)},
  };
  return *setters;
}

}  // namespace

absl::Status ApplyYamlTrainConfig(const std::string& yaml_text,
                                  TrainConfig* config) {
  YAML::Node root;
  try {
    root = YAML::Load(yaml_text);
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("config is not valid YAML: ", e.what()));
  }
  if (root.IsNull()) return absl::OkStatus();
  if (!root.IsMap()) {
    return absl::InvalidArgumentError(
        "config must be a YAML mapping of flag names to values");
  }
  const auto& setters = YamlSetters();
  TrainConfig updated = *config;
  for (const auto& entry : root) {
    // A key must be a plain scalar; a sequence or mapping as a key (legal
    // YAML: "{a: 1}: x", "[a]: x") is no flag name.
    if (!entry.first.IsScalar()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "config: a key must be a flag name, got ",
          entry.first.IsSequence() ? "a sequence" : "a mapping or null"));
    }
    const std::string& name = entry.first.Scalar();
    const std::string key = absl::StrReplaceAll(name, {{"-", "_"}});
    auto it = setters.find(key);
    if (it == setters.end()) {
      std::vector<std::string> known;
      for (const auto& [known_name, unused] : setters) {
        known.push_back(known_name);
      }
      const std::string near = NearestName(key, known);
      return absl::InvalidArgumentError(absl::StrCat(
          "config: unknown key '", absl::CHexEscape(name), "'",
          near.empty() ? "" : absl::StrCat(" (did you mean ", near, "?)"),
          "; known keys: ", absl::StrJoin(known, ", ")));
    }
    try {
      it->second(entry.second, &updated);
    } catch (const YAML::Exception&) {
      return absl::InvalidArgumentError(absl::StrCat(
          "config: key '", key,
          "' has a value of the wrong type: ", YAML::Dump(entry.second)));
    }
  }
  *config = updated;
  return absl::OkStatus();
}

std::vector<std::string> YamlTrainConfigKeys() {
  std::vector<std::string> keys;
  for (const auto& [key, unused] : YamlSetters()) keys.push_back(key);
  std::sort(keys.begin(), keys.end());
  return keys;
}

absl::Status LoadYamlTrainConfigFile(const std::string& path,
                                     TrainConfig* config) {
  // A directory, a FIFO or an endless device is refused by name (a
  // directory once ran with no config at all).
  absl::StatusOr<std::string> text = ReadFlagFile("config", path);
  if (!text.ok()) return text.status();
  absl::Status status = ApplyYamlTrainConfig(*text, config);
  if (!status.ok()) {
    return absl::Status(status.code(),
                        absl::StrCat(path, ": ", status.message()));
  }
  return absl::OkStatus();
}

absl::StatusOr<BatchSplit> SplitGlobalBatch(int64_t global, int64_t world,
                                            int64_t preferred_batch) {
  if (global <= 0 || world <= 0 || global % world != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(global, " sequences per step cannot be shared equally by ",
                     world, " ranks"));
  }
  const int64_t share = global / world;
  int64_t batch = std::max<int64_t>(1, std::min(preferred_batch, share));
  while (share % batch != 0) --batch;
  return BatchSplit{batch, share / batch};
}

std::string MeshName(const TrainConfig& config, int64_t world_size) {
  const int64_t data = config.DataParallelSize(world_size);
  std::string name;
  if (config.pipeline_stages > 1) {
    name = absl::StrCat("pp", config.pipeline_stages);
  }
  if (data > 1 || (name.empty() && config.tensor_parallel <= 1)) {
    absl::StrAppend(&name, name.empty() ? "" : "x", config.strategy,
                    data > 1 ? absl::StrCat(data) : "");
  }
  if (config.tensor_parallel > 1) {
    absl::StrAppend(&name, name.empty() ? "" : "x", "tp",
                    config.tensor_parallel);
  }
  return name;
}

}  // namespace shardtrain
