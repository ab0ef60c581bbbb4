#include "core/plan/step_time_plan.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/atomic_file.h"
#include "common/input_file.h"
#include "core/model/model_config.h"
#include "core/plan/pipeline_plan.h"
#include "core/run/strategy_kinds.h"
#include "nlohmann/json.hpp"

namespace shardtrain {
namespace {

constexpr int64_t kFloatBytes = 4;
constexpr int64_t kIdBytes = 8;  // token ids travel as int64

// One kind of collective a rank issues `calls` times in a step, over a group
// of `ranks`, each carrying `bytes` (the full tensor: an all-reduce's, an
// all-gather's output, a reduce-scatter's input; a send's message).
enum class Op { kAllReduce, kAllGather, kReduceScatter, kSend };

struct Traffic {
  int64_t calls = 0;
  int64_t counted = 0;
  int64_t wire = 0;
  int64_t latency_steps = 0;

  void Add(Op op, int64_t ranks, int64_t calls_, double bytes_each) {
    if (ranks <= 1 && op != Op::kSend) return;
    const double n = static_cast<double>(ranks);
    const double b = bytes_each * static_cast<double>(calls_);
    calls += calls_;
    switch (op) {
      case Op::kAllReduce:  // ring: reduce-scatter then all-gather
        counted += static_cast<int64_t>(b);
        wire += static_cast<int64_t>(2 * (n - 1) / n * b);
        latency_steps += calls_ * 2 * (ranks - 1);
        break;
      case Op::kAllGather:  // the rank's input is 1/n of the output
        counted += static_cast<int64_t>(b / n);
        wire += static_cast<int64_t>((n - 1) / n * b);
        latency_steps += calls_ * (ranks - 1);
        break;
      case Op::kReduceScatter:
        counted += static_cast<int64_t>(b);
        wire += static_cast<int64_t>((n - 1) / n * b);
        latency_steps += calls_ * (ranks - 1);
        break;
      case Op::kSend:
        counted += static_cast<int64_t>(b);
        wire += static_cast<int64_t>(b);
        latency_steps += calls_;
        break;
    }
  }
};

MeshTraffic Finish(const std::string& dimension, int64_t ranks,
                   const Traffic& t, const LinkRates& link, double slowdown) {
  MeshTraffic out;
  out.dimension = dimension;
  out.ranks = ranks;
  out.calls = t.calls;
  out.counted_bytes = t.counted;
  out.wire_bytes = t.wire;
  out.seconds = (static_cast<double>(t.latency_steps) * link.latency_seconds +
                 static_cast<double>(t.wire) / link.bytes_per_second) *
                slowdown;
  return out;
}

int64_t BlockParameters(const ModelConfig& m) { return m.BlockParameters(); }

// What tensor parallelism keeps whole on every rank of the group: GPT-2's
// wpe, LayerNorms and row-parallel biases, Llama's RMSNorms; their gradients
// are all-reduced over the group once per step.
int64_t TensorParallelReplicated(const ModelConfig& m) {
  if (m.is_llama()) return (2 * m.n_layer + 1) * m.n_embd;
  return m.block_size * m.n_embd + m.n_layer * 6 * m.n_embd + 2 * m.n_embd;
}

// FSDP over `ranks` of units of `unit_params` each (the blocks), the root
// (`root_params`, gathered once and kept) and the vocabulary-parallel wte
// over the same ranks, for one micro-step of `tokens` per rank; reduce the
// gradients when `reduce`.
void AddFsdp(Traffic* t, int64_t ranks, int64_t blocks, int64_t block_params,
             int64_t root_params, bool reshard, bool reduce, int64_t tokens,
             int64_t c, int64_t head_chunks, bool embeddings, bool head) {
  const double block_bytes = static_cast<double>(block_params * kFloatBytes);
  const double root_bytes = static_cast<double>(root_params * kFloatBytes);
  const int64_t gathers = blocks * (reshard ? 2 : 1);
  t->Add(Op::kAllGather, ranks, gathers, block_bytes);
  t->Add(Op::kAllGather, ranks, 1, root_bytes);
  if (reduce) {
    t->Add(Op::kReduceScatter, ranks, blocks, block_bytes);
    t->Add(Op::kReduceScatter, ranks, 1, root_bytes);
  }
  const double n = static_cast<double>(ranks);
  const double rows = static_cast<double>(tokens) * n;  // every rank's
  const double hidden = rows * static_cast<double>(c * kFloatBytes);
  if (embeddings) {
    t->Add(Op::kAllGather, ranks, 1, rows * kIdBytes);  // token ids
    t->Add(Op::kReduceScatter, ranks, 1, hidden);       // the lookups
    t->Add(Op::kAllGather, ranks, 1, hidden);           // their gradient
  }
  if (head) {
    t->Add(Op::kAllGather, ranks, 1, hidden);           // hidden states
    t->Add(Op::kAllGather, ranks, 1, rows * kIdBytes);  // targets
    t->Add(Op::kAllGather, ranks, head_chunks,
           3.0 * rows * kFloatBytes / static_cast<double>(head_chunks));
    t->Add(Op::kReduceScatter, ranks, 1, hidden);  // their gradient
  }
}

}  // namespace

absl::Status HostRates::Check() const {
  auto missing = [&](const char* what) {
    return absl::FailedPreconditionError(
        absl::StrCat("host rates for ", device, " lack ", what,
                     "; measure them with `shardtrain-train --calibrate`"));
  };
  if (cores < 1) return missing("the core count");
  if (!(flops_per_thread > 0)) return missing("the compute rate");
  if (!(optimizer_seconds_per_parameter > 0)) return missing("AdamW's rate");
  if (!intra_node.known() || intra_node.latency_seconds < 0) {
    return missing("the collectives' latency and bandwidth");
  }
  return absl::OkStatus();
}

std::string HostRates::ToJson() const {
  nlohmann::json j = {
      {"device", device},
      {"cores", cores},
      {"flops_per_thread", flops_per_thread},
      {"compute_model", compute_model},
      {"gradient_seconds_per_parameter", gradient_seconds_per_parameter},
      {"optimizer_seconds_per_parameter", optimizer_seconds_per_parameter},
      {"intra_node",
       {{"latency_seconds", intra_node.latency_seconds},
        {"bytes_per_second", intra_node.bytes_per_second}}},
      {"measured_at", measured_at}};
  if (inter_node.known()) {
    j["inter_node"] = {{"latency_seconds", inter_node.latency_seconds},
                       {"bytes_per_second", inter_node.bytes_per_second}};
  }
  return j.dump();
}

absl::StatusOr<HostRates> HostRates::FromJson(const std::string& text) {
  nlohmann::json j =
      nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) {
    return absl::InvalidArgumentError("host rates: not a JSON object");
  }
  try {
    HostRates r;
    r.device = j.value("device", std::string("cpu"));
    r.cores = j.value("cores", int64_t{1});
    r.flops_per_thread = j.value("flops_per_thread", 0.0);
    r.compute_model = j.value("compute_model", std::string());
    r.gradient_seconds_per_parameter =
        j.value("gradient_seconds_per_parameter", 0.0);
    r.optimizer_seconds_per_parameter =
        j.value("optimizer_seconds_per_parameter", 0.0);
    r.measured_at = j.value("measured_at", std::string());
    for (auto [key, link] : {std::pair{"intra_node", &r.intra_node},
                             std::pair{"inter_node", &r.inter_node}}) {
      if (!j.contains(key)) continue;
      link->latency_seconds = j[key].value("latency_seconds", 0.0);
      link->bytes_per_second = j[key].value("bytes_per_second", 0.0);
    }
    return r;
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(
        "host rates: a field has the wrong type (", e.what(), ")"));
  }
}

std::string HostRatesCachePath() {
  const char* xdg = std::getenv("XDG_CACHE_HOME");
  const char* home = std::getenv("HOME");
  const std::filesystem::path dir =
      xdg != nullptr && *xdg != '\0'
          ? std::filesystem::path(xdg)
          : std::filesystem::path(home != nullptr ? home : "/tmp") / ".cache";
  return (dir / "shardtrain" / "host_rates.json").string();
}

namespace {

// The cache holds a few devices' rates: kilobytes, nested four deep.
constexpr int64_t kMaxCacheBytes = 1 << 20;
constexpr int kMaxCacheNesting = 8;

// The cache as an object; empty when there is none. One that cannot be read
// (a FIFO, a device, too large) or parsed (truncated, nested too deep) is
// ignored with a warning, so its rates are measured again and it is
// rewritten.
nlohmann::json ReadCache() {
  const std::string path = HostRatesCachePath();
  absl::StatusOr<std::string> text =
      ReadOwnFile(path, kMaxCacheBytes, "the calibration cache");
  if (absl::IsNotFound(text.status())) return nlohmann::json::object();
  absl::Status problem = text.status();
  if (problem.ok()) {
    problem = CheckJsonNesting(*text, kMaxCacheNesting, path);
  }
  nlohmann::json cache;
  if (problem.ok()) {
    cache = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
    if (!cache.is_object()) {
      problem = absl::InvalidArgumentError(
          absl::StrCat(path, " is not a JSON object"));
    }
  }
  if (!problem.ok()) {
    std::cerr << "shardtrain: warning: ignoring the calibration cache: "
              << problem.message() << "; its rates are measured again\n";
    return nlohmann::json::object();
  }
  return cache;
}

}  // namespace

absl::StatusOr<HostRates> LoadHostRates(const std::string& device,
                                        const std::string& model) {
  const nlohmann::json cache = ReadCache();
  if (!cache.contains(device) || !cache[device].is_object() ||
      cache[device].empty()) {
    return absl::NotFoundError(absl::StrCat(
        "no measured rates for ", device, " in ", HostRatesCachePath(),
        "; `shardtrain-train --calibrate` measures them"));
  }
  const nlohmann::json& models = cache[device];
  const nlohmann::json& entry =
      models.contains(model) ? models[model] : models.begin().value();
  absl::StatusOr<HostRates> rates = HostRates::FromJson(entry.dump());
  if (!rates.ok()) return rates.status();
  if (absl::Status s = rates->Check(); !s.ok()) return s;
  return rates;
}

absl::Status SaveHostRates(const HostRates& rates) {
  nlohmann::json cache = ReadCache();
  cache[rates.device][rates.compute_model] =
      nlohmann::json::parse(rates.ToJson());
  const std::filesystem::path path(HostRatesCachePath());
  std::error_code ec;
  std::filesystem::create_directories(path.parent_path(), ec);
  return WriteFileAtomically(path.string(), cache.dump(2) + "\n");
}

std::vector<std::string> CalibrationArguments(const TrainConfig& config) {
  const bool gpu = config.device.rfind("cuda", 0) == 0;
  const std::string largest = gpu ? "gpt2" : "gpt2-mini";
  absl::StatusOr<ModelConfig> model = ParseModelSpec(config.model);
  absl::StatusOr<ModelConfig> cap = ParseModelSpec(largest);
  const bool small =
      model.ok() && cap.ok() && model->NumParameters() <= cap->NumParameters();
  const int64_t seq =
      std::min<int64_t>(256, small ? std::min(config.seq_len, model->block_size)
                                   : config.seq_len);
  // The rendezvous waits while rank 0 measures compute.
  return {"--calibrate",
          "--model",
          small ? config.model : largest,
          "--seq-len",
          absl::StrCat(std::max<int64_t>(1, seq)),
          "--batch-size",
          gpu ? "8" : "4",
          "--device",
          config.device,
          "--comm-timeout",
          "1800"};
}

int64_t StepTimePlan::counted_bytes() const {
  int64_t total = 0;
  for (const MeshTraffic& t : traffic) total += t.counted_bytes;
  return total;
}

std::string StepTimePlan::Bottleneck() const {
  std::string name = "compute";
  double most = compute_seconds;
  if (optimizer_seconds > most) {
    most = optimizer_seconds;
    name = "AdamW and dense gradients";
  }
  if (bubble_seconds > most) {
    most = bubble_seconds;
    name = "the pipeline bubble";
  }
  for (const MeshTraffic& t : traffic) {
    if (t.seconds > most) {
      most = t.seconds;
      name = t.dimension + " traffic";
    }
  }
  return name;
}

absl::StatusOr<StepTimePlan> PlanStepTime(const TrainConfig& config,
                                          int64_t world_size,
                                          int64_t ranks_per_host,
                                          const HostRates& rates) {
  if (absl::Status s = rates.Check(); !s.ok()) return s;
  absl::StatusOr<ModelConfig> model = ParseModelSpec(config.model);
  if (!model.ok()) return model.status();
  const StrategyKind* kind = FindStrategyKind(config.strategy);
  if (kind == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("strategy: unknown '", config.strategy, "'"));
  }
  if (config.ModelParallelSize() > 1) {
    if (absl::Status s = config.CheckMeshWorld(world_size); !s.ok()) return s;
  } else if (!kind->distributed && world_size != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("world_size: ", config.strategy, " runs on one rank, not ",
                     world_size));
  }
  const int64_t stages = std::max<int64_t>(1, config.pipeline_stages);
  const int64_t tp = std::max<int64_t>(1, config.tensor_parallel);
  const int64_t data = config.DataParallelSize(world_size);
  const int64_t micro =
      stages > 1 ? std::max<int64_t>(1, config.micro_batches) : 1;
  const int64_t c = model->n_embd;
  const int64_t accum = std::max<int64_t>(1, config.grad_accum);
  // Tokens a rank (a replica's ranks, together) computes per micro-step.
  const int64_t tokens = config.batch_size * config.seq_len;
  absl::StatusOr<int64_t> every =
      ActivationCheckpointEvery(config.activation_checkpointing);
  if (!every.ok()) return every.status();

  StepTimePlan plan;
  plan.mesh = MeshName(config, world_size);
  plan.world_size = world_size;
  plan.data_parallel = data;
  plan.tensor_parallel = tp;
  plan.pipeline_stages = stages;
  plan.micro_batches = micro;
  plan.tokens_per_step = tokens * accum * data;

  // Compute: the slowest stage's forward (3x with the backward, once more
  // for recomputed blocks), 1/T of it under tensor parallelism.
  std::vector<int64_t> split;
  if (stages > 1 && !config.pipeline_split.empty()) {
    absl::StatusOr<std::vector<int64_t>> parsed =
        ParsePipelineSplit(config.pipeline_split);
    if (!parsed.ok()) return parsed.status();
    split = *std::move(parsed);
  }
  // Interleaved, a rank runs V chunks (model stages r, r + S, ...): what it
  // holds and computes is theirs together.
  const int64_t chunks =
      stages > 1 ? std::max<int64_t>(1, config.virtual_stages) : 1;
  absl::StatusOr<std::vector<PipelineStage>> cut =
      PartitionPipeline(*model, config.seq_len, stages, split, chunks);
  if (!cut.ok()) return cut.status();
  const double block_flops = BlockForwardFlopsPerToken(*model, config.seq_len);
  // Per rank: its blocks (as one run), its ends, its compute per token
  // (3x the forward, once more for recomputed blocks) and the directions
  // its activations cross to other ranks, per micro-batch.
  std::vector<PipelineStage> held(stages);
  std::vector<double> rank_flops(stages, 0);
  std::vector<int64_t> rank_directions(stages, 0);
  for (size_t k = 0; k < cut->size(); ++k) {
    const PipelineStage& stage = (*cut)[k];
    const int64_t r = static_cast<int64_t>(k) % stages;
    int64_t recomputed = 0;
    for (int64_t b = stage.first_block; b < stage.end_block; ++b) {
      if (*every > 0 && (b + 1) % *every == 0) ++recomputed;
    }
    rank_flops[r] += 3 * stage.flops_per_token +
                     static_cast<double>(recomputed) * block_flops;
    held[r].end_block += stage.end_block - stage.first_block;
    held[r].embeddings = held[r].embeddings || stage.embeddings;
    held[r].head = held[r].head || stage.head;
    held[r].flops_per_token += stage.flops_per_token;
    rank_directions[r] += (k > 0 ? 1 : 0) + (k + 1 < cut->size() ? 1 : 0);
  }
  double stage_flops = 0;  // per token, the slowest rank
  double all_stage_flops = 0;
  int64_t slowest_rank = 0;
  for (int64_t r = 0; r < stages; ++r) {
    all_stage_flops += rank_flops[r];
    if (rank_flops[r] > stage_flops) {
      stage_flops = rank_flops[r];
      slowest_rank = r;
    }
  }
  const PipelineStage* slowest = &held[slowest_rank];

  // The rank's rate: its threads, or its share of the host's cores. A
  // stage faster than the slowest waits (blocked, off the cores) for the
  // rest of the step: the cores are shared by the ranks' busy time, the
  // stages' work over the slowest's.
  const bool gpu = config.device.rfind("cuda", 0) == 0;
  const int64_t host_ranks =
      std::max<int64_t>(1, std::min(ranks_per_host, world_size));
  plan.threads_per_rank = gpu ? 1 : config.ThreadsPerRank(host_ranks);
  double share = 1.0;
  if (!gpu) {
    const double busy = static_cast<double>(host_ranks) * all_stage_flops /
                        (static_cast<double>(stages) * stage_flops);
    share =
        std::min(1.0, static_cast<double>(rates.cores) /
                          (busy * static_cast<double>(plan.threads_per_rank)));
  }
  const double rate = rates.flops_per_thread *
                      static_cast<double>(plan.threads_per_rank) * share;
  // Contention slows what runs on the cores: collectives on CPU too.
  const double slowdown = gpu ? 1.0 : 1.0 / share;

  const double step_flops = stage_flops * static_cast<double>(tokens * accum) /
                            static_cast<double>(tp);
  plan.compute_seconds = step_flops / rate;
  if (stages > 1) {
    // A step's M x accum micro-batches flow through the stages once: the
    // slowest stage sets the pace, and the others' time on one micro-batch
    // fills and drains the pipe (t = (M - 1) t_max + sum of t_s); in
    // chunks of 1/V of it when interleaved ((S-1)/(V·M+S-1) of the step
    // with uniform stages, SimulatePipeline).
    plan.bubble_seconds = (all_stage_flops - stage_flops) *
                          static_cast<double>(tokens) /
                          static_cast<double>(micro * tp * chunks) / rate;
  }

  // Parameters the rank keeps and updates (the slowest stage's).
  const int64_t blocks = slowest->end_block - slowest->first_block;
  const int64_t block_params = BlockParameters(*model);
  const int64_t wte = model->padded_vocab_size * c;
  const int64_t root =
      (stages == 1 || slowest->embeddings ? model->InputParameters() : 0) +
      (slowest->head ? model->OutputParameters() : 0);
  const bool has_wte =
      slowest->embeddings || (slowest->head && model->tied_head());
  int64_t kept = blocks * block_params + root + (has_wte ? wte : 0);
  if (tp > 1) {
    const int64_t replicated = TensorParallelReplicated(*model);
    kept = (kept - replicated) / tp + replicated;
  }
  const std::string& dp = config.strategy;
  const bool fsdp = dp == "fsdp" || dp == "hsdp";
  int64_t shard_ranks = 1;
  if (fsdp && data > 1) {
    // HSDP's groups as the engine forms them (the default: two replicas on
    // one host).
    shard_ranks = dp == "hsdp" ? ResolveShardGroupSize(config.shard_group_size,
                                                       data, host_ranks)
                               : data;
  }
  // AdamW updates the rank's shard; the gradients are made whole for the
  // gathered units (all but FSDP's vocabulary-parallel wte, which has only
  // its rows').
  const int64_t sharded_wte =
      fsdp && stages == 1 && tp == 1 && shard_ranks > 1 ? wte : 0;
  const int64_t gradient_params =
      kept - sharded_wte + sharded_wte / shard_ranks;
  plan.optimizer_seconds = (static_cast<double>(kept / shard_ranks) *
                                rates.optimizer_seconds_per_parameter +
                            static_cast<double>(gradient_params) *
                                rates.gradient_seconds_per_parameter) /
                           (static_cast<double>(plan.threads_per_rank) * share);

  // Traffic, per dimension.
  const LinkRates& intra = rates.intra_node;
  const LinkRates& inter =
      rates.inter_node.known() ? rates.inter_node : rates.intra_node;
  // A group whose ranks span hosts runs at the slower link.
  auto link_for = [&](int64_t stride, int64_t ranks) -> const LinkRates& {
    return stride * ranks > ranks_per_host ? inter : intra;
  };
  const int64_t act_bytes =
      tokens * c * (config.precision == "bf16" && gpu ? 2 : kFloatBytes);
  const int64_t head_chunks = 1;

  if (data > 1) {
    Traffic t;
    const int64_t dp_stride = tp;  // data ranks lie outside the tensor ones
    if (dp == "ddp") {
      const double bytes = static_cast<double>(kept * kFloatBytes);
      const double bucket = std::max(1.0, config.bucket_mb * 1024 * 1024);
      const int64_t buckets =
          std::max<int64_t>(1, static_cast<int64_t>(std::ceil(bytes / bucket)));
      t.Add(Op::kAllReduce, data, buckets, bytes / buckets);
      plan.traffic.push_back(Finish("data-parallel", data, t,
                                    link_for(dp_stride, data), slowdown));
    } else if (fsdp) {
      if (stages > 1 || tp > 1) {
        // Within a stage (or of a tensor-parallel rank's slices) every
        // unit, wte too, is gathered once per step and its gradient
        // reduce-scattered once.
        const double stage_bytes = static_cast<double>(kept * kFloatBytes);
        const int64_t units = blocks + 1 + (has_wte ? 1 : 0);
        t.Add(Op::kAllGather, shard_ranks, units, stage_bytes / units);
        t.Add(Op::kReduceScatter, shard_ranks, units, stage_bytes / units);
      } else {
        for (int64_t a = 0; a < accum; ++a) {
          const bool reduce = !config.fsdp_no_sync || a + 1 == accum;
          AddFsdp(&t, shard_ranks, blocks, block_params, root,
                  config.reshard_after_forward, reduce, tokens, c, head_chunks,
                  /*embeddings=*/true, /*head=*/true);
        }
      }
      t.Add(Op::kAllReduce, shard_ranks, 1, kFloatBytes);  // grad norm
      plan.traffic.push_back(
          Finish(shard_ranks == data ? "data-parallel" : "shard-group",
                 shard_ranks, t, link_for(dp_stride, shard_ranks), slowdown));
      if (shard_ranks < data) {
        Traffic across;
        const int64_t replicas = data / shard_ranks;
        across.Add(Op::kAllReduce, replicas, blocks + 2,
                   static_cast<double>(kept * kFloatBytes) /
                       static_cast<double>(shard_ranks * (blocks + 2)));
        plan.traffic.push_back(
            Finish("replica", replicas, across,
                   link_for(dp_stride * shard_ranks, replicas), slowdown));
      }
    }
  }
  double tensor_f_seconds = 0;
  double column_weight_gradient_seconds = 0;
  if (tp > 1) {
    Traffic t;
    const int64_t recomputed =
        *every > 0 ? (slowest->end_block - slowest->first_block) / *every : 0;
    const double act = static_cast<double>(act_bytes);
    for (int64_t a = 0; a < accum; ++a) {
      // Megatron's g forward and f backward, per attention and MLP.
      t.Add(Op::kAllReduce, tp, 4 * blocks + 2 * recomputed, act);
      if (slowest->embeddings || stages == 1) {
        t.Add(Op::kAllReduce, tp, 1, act);  // the embeddings' lookups
      }
      if (slowest->head || stages == 1) {
        t.Add(Op::kAllGather, tp, head_chunks,
              3.0 * static_cast<double>(tp * tokens * kFloatBytes) /
                  static_cast<double>(head_chunks));
        t.Add(Op::kAllReduce, tp, 1,
              static_cast<double>(tokens * c * kFloatBytes));  // head's dx
      }
    }
    t.Add(Op::kAllReduce, tp, 1,
          static_cast<double>(TensorParallelReplicated(*model) * kFloatBytes));
    plan.traffic.push_back(
        Finish("tensor-parallel", tp, t, link_for(1, tp), slowdown));
    // f's sums of the input gradient (two per block) go while the
    // column-parallel weights' gradients are computed (EnterLinear): the
    // time they can hide behind is those products', a forward's worth of
    // the column-parallel matrices per token.
    Traffic f;
    f.Add(Op::kAllReduce, tp, 2 * blocks * accum, act);
    tensor_f_seconds = Finish("f", tp, f, link_for(1, tp), slowdown).seconds;
    const double column_flops =
        model->is_llama()
            ? 2.0 * static_cast<double>(c) *
                  static_cast<double>(c +
                                      2 * model->n_kv_head * c / model->n_head +
                                      2 * model->intermediate_size)
            : 14.0 * static_cast<double>(c) * static_cast<double>(c);
    column_weight_gradient_seconds =
        column_flops * static_cast<double>(blocks * tokens * accum) /
        static_cast<double>(tp) / rate;
  }
  if (stages > 1) {
    Traffic t;
    const int64_t stride = tp * data;
    // Activations forward and their gradients backward, per micro-batch,
    // for a middle stage both ways (each chunk's, interleaved); the tied
    // wte between the end stages.
    const int64_t directions = rank_directions[slowest_rank];
    t.Add(Op::kSend, 2, micro * accum * directions,
          static_cast<double>(act_bytes) / static_cast<double>(micro));
    if (has_wte) {
      t.Add(Op::kAllReduce, 2, 1,
            static_cast<double>(wte / tp * kFloatBytes /
                                (fsdp ? shard_ranks : 1)));
    }
    plan.traffic.push_back(
        Finish("pipeline", stages, t, link_for(stride, stages), slowdown));
  }

  // The backward time the data-parallel reduction can hide behind, where
  // the engine overlaps it: DDP, FSDP and HSDP alone reduce as the whole
  // backward runs (buckets, per-unit reduce-scatters); pipeline stages
  // during the step's last micro-batch's backward only: replicated stages
  // their buckets, sharded stages each unit's reduce-scatter (their
  // all-gathers before the first micro-batch, and HSDP's average across
  // groups after the schedule, stay exposed); tensor-parallel meshes after
  // the schedule (nothing of the data-parallel reduction hidden; of the
  // tensor group's own traffic, f's backward sums behind the column-parallel
  // weight gradients).
  double hidden_behind = 0;
  bool sharded_stages = false;
  if (gpu && tp == 1) {
    const double backward = plan.compute_seconds * 2 / 3;
    if (stages == 1) {
      hidden_behind = backward;
    } else {
      hidden_behind = backward / static_cast<double>(micro * accum);
      sharded_stages = fsdp;
    }
  }
  double comm = 0;
  for (const MeshTraffic& t : plan.traffic) {
    const bool reduction = t.dimension == "data-parallel" ||
                           t.dimension == "replica" ||
                           t.dimension == "shard-group";
    if (hidden_behind > 0 && reduction &&
        !(sharded_stages && t.dimension == "replica")) {
      // NCCL overlaps it with that backward but for its last part; of a
      // sharded stage's traffic, the reduce-scatter half.
      const double hideable = sharded_stages ? t.seconds / 2 : t.seconds;
      const int64_t calls =
          std::max<int64_t>(1, sharded_stages ? t.calls / 2 : t.calls);
      comm += t.seconds - hideable +
              std::max(hideable - hidden_behind, hideable / calls);
    } else if (gpu && t.dimension == "tensor-parallel") {
      comm += t.seconds -
              std::min(tensor_f_seconds, column_weight_gradient_seconds);
    } else {
      comm += t.seconds;
    }
  }
  plan.exposed_comm_seconds = comm;
  plan.step_seconds = plan.compute_seconds + plan.bubble_seconds +
                      plan.optimizer_seconds + plan.exposed_comm_seconds;
  plan.tokens_per_second =
      static_cast<double>(plan.tokens_per_step) / plan.step_seconds;
  return plan;
}

std::string MeasuredAgainstPrediction(double predicted, double measured) {
  if (predicted <= 0) return "no prediction";
  const double off = measured / predicted - 1;
  if (std::abs(off) < 0.01) return "within 1% of the prediction";
  return absl::StrFormat("%.0f%% %s the prediction", 100 * std::abs(off),
                         off < 0 ? "below" : "above");
}

}  // namespace shardtrain
