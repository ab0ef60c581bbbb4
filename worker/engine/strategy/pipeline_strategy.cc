#include "worker/engine/strategy/pipeline_strategy.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <set>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/run/strategy_kinds.h"
#include "worker/engine/strategy/autocast.h"
#include "worker/engine/strategy/distributed_helpers.h"
#include "worker/engine/strategy/tensor_parallel_layer.h"

namespace shardtrain {
namespace {

// `pipeline` with an hsdp shard group size resolved over the stage's ranks
// (0 for the other strategies).
PipelineOptions Resolved(PipelineOptions pipeline,
                         const StrategyOptions& options) {
  const StrategyKind* kind = FindStrategyKind(pipeline.data_parallel);
  if (kind == nullptr || kind->layout != StateLayout::kShardedInGroups) {
    pipeline.shard_group_size = 0;
  } else {
    pipeline.shard_group_size = ResolveShardGroupSize(
        pipeline.shard_group_size,
        options.world_size / std::max<int64_t>(1, pipeline.stages),
        options.ranks_per_node);
  }
  if (pipeline.wire_dtype == torch::ScalarType::Undefined) {
    pipeline.wire_dtype = ComputeDtype(options);
  }
  return pipeline;
}

}  // namespace

// A micro-batch between its forward and its backward on this stage.
struct PipelineStrategy::InFlight {
  torch::Tensor input;        // received activation (requires grad); stage > 0
  torch::Tensor output;       // sent activation; not the last stage
  torch::Tensor loss;         // the last stage's (graph kept until backward)
  torch::Tensor output_grad;  // received gradient of `output`
  // Posted receives of `input` and `output_grad`, until waited for.
  std::unique_ptr<CommWork> input_recv;
  std::unique_ptr<CommWork> output_grad_recv;
  // zb-h1: the weight gradients its B left for its W.
  WeightGradients deferred;
  int64_t rows = 0;
  int64_t seq = 0;
};

PipelineStrategy::PipelineStrategy(const StrategyOptions& options,
                                   Communicator* world,
                                   PipelineOptions pipeline)
    : options_(options),
      world_(world),
      pipeline_(Resolved(std::move(pipeline), options)) {
  // The mesh, built where every run's is (BuildRunMesh); a shape it refuses
  // is Setup's error.
  RunMeshShape shape;
  shape.pipeline_stages = pipeline_.stages;
  shape.tensor_parallel = tensor_parallel();
  shape.data_parallel = pipeline_.data_parallel;
  shape.shard_group_size = pipeline_.shard_group_size;
  absl::StatusOr<DeviceMesh> mesh =
      BuildRunMesh(shape, options_.world_size, options_.ranks_per_node);
  if (mesh.ok()) {
    mesh_ = *std::move(mesh);
    stage_ = mesh_->Coordinate(options_.rank, MeshDim::kPipeline);
  } else {
    mesh_error_ = mesh.status();
  }
}

PipelineStrategy::~PipelineStrategy() = default;

// Stages are the mesh's outermost blocks of ranks.
int64_t PipelineStrategy::data_parallel_rank() const {
  return options_.rank / tensor_parallel() % data_parallel_size();
}

int64_t PipelineStrategy::data_parallel_size() const {
  return options_.world_size / (pipeline_.stages * tensor_parallel());
}

void PipelineStrategy::Check(std::unique_ptr<CommWork> work, const char* what) {
  ThrowIfFailed(work->Wait(), "pipeline", what);
}

bool PipelineStrategy::Holds(int64_t stage, const std::string& name) const {
  const ParamPlace place = model_->PlaceOf(name);
  for (int64_t chunk = 0; chunk < chunks(); ++chunk) {
    const PipelineStage& held =
        partition_[ModelStageOf(pipeline_.stages, stage, chunk)];
    switch (place.role) {
      case ParamRole::kBlock:
        if (place.block >= held.first_block && place.block < held.end_block) {
          return true;
        }
        break;
      case ParamRole::kTokenEmbedding:
        // A tied head reads it on the last stage too.
        if (held.embeddings || (held.head && model_->tied_head())) return true;
        break;
      case ParamRole::kInput:
        if (held.embeddings) return true;
        break;
      case ParamRole::kOutput:
        if (held.head) return true;
        break;
    }
  }
  return false;
}

int64_t PipelineStrategy::ChunkHolding(const ParamPlace& place) const {
  if (place.role == ParamRole::kBlock) {
    for (int64_t chunk = 0; chunk < chunks(); ++chunk) {
      if (place.block >= Chunk(chunk).first_block &&
          place.block < Chunk(chunk).end_block) {
        return chunk;
      }
    }
  }
  // Outside the blocks: the embeddings' chunk (first stage) or the head's.
  return first() ? 0 : chunks() - 1;
}

bool PipelineStrategy::IsTokenEmbedding(const std::string& name) const {
  return model_->PlaceOf(name).role == ParamRole::kTokenEmbedding;
}

absl::Status PipelineStrategy::Setup(CausalLm model) {
  model_ = std::move(model);
  if (absl::Status s =
          CheckVirtualStages(pipeline_.schedule, pipeline_.stages,
                             pipeline_.micro_batches, pipeline_.virtual_stages);
      !s.ok()) {
    return s;
  }
  absl::StatusOr<std::vector<PipelineStage>> partition =
      model_->PipelineCuts(pipeline_.seq_len, pipeline_.stages, pipeline_.split,
                           pipeline_.virtual_stages);
  if (!partition.ok()) return partition.status();
  partition_ = std::move(*partition);

  const StrategyKind* kind = FindStrategyKind(pipeline_.data_parallel);
  const int64_t g = pipeline_.shard_group_size;
  const int64_t t = tensor_parallel();
  if (t > 1 && SplitsBackward()) {
    return absl::InvalidArgumentError(
        "pipeline x tensor parallel: zb-h1 splits the projections' backward, "
        "which tensor-parallel layers do not; use 1f1b");
  }
  if (t > 1 && options_.world_size % (pipeline_.stages * t) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("pipeline x tensor parallel: ", pipeline_.stages,
                     " stages x ", t, " tensor ranks with ",
                     pipeline_.data_parallel, " over ", options_.world_size,
                     " ranks: the world must be a multiple of stages x T"));
  }
  if (g > 0 && data_parallel_size() % g != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("hsdp: the shard group size ", g, " must divide the ",
                     data_parallel_size(), " ranks of each pipeline stage"));
  }
  if (!mesh_error_.ok()) return mesh_error_;

  if (pipeline_.stages < 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "pipeline: ", pipeline_.stages, " stage(s); a pipeline has 2 or more"));
  }
  // The order this run's transfers will be posted in, checked before any
  // collective: every rank reaches the same verdict and none is left
  // waiting.
  if (absl::StatusOr<const std::vector<PipelineOp>*> ops =
          StageOps(pipeline_.micro_batches);
      !ops.ok()) {
    return ops.status();
  }
  // The mesh's groups, made in one place (comm/mesh_groups.h): the
  // replica's stages, the ranks of its stage it replicates or shards with
  // (hsdp: its shard group, and the same shard's other groups), the tensor
  // ranks, and (first and last stage) the tied weight's pair.
  absl::StatusOr<std::unique_ptr<MeshGroups>> made =
      MeshGroups::Create(world_, *mesh_, model_->tied_head());
  if (!made.ok()) return made.status();
  groups_ = *std::move(made);
  pipe_ = groups_->Along(MeshDim::kPipeline);
  replicas_ = g > 1 ? groups_->Along(MeshDim::kShard) : groups_->DataParallel();
  across_groups_ = g > 1 ? groups_->Along(MeshDim::kReplicate) : nullptr;
  tensor_ = groups_->Along(MeshDim::kTensor);
  tied_ = model_->tied_head() ? groups_->TiedEnds() : nullptr;

  torch::NoGradGuard no_grad;
  RecordGlobalShapes(*model_);
  if (t > 1) {
    // Every stage's blocks split over the stage's tensor ranks (the whole
    // model, then the others' stages freed below).
    tensor_ops_ = MakeTensorParallelOps(tensor_);
    if (absl::Status s = model_->ShardForTensorParallel(tensor_ops_.get());
        !s.ok()) {
      return s;
    }
  }
  // Keep this stage's parameters on the device; free the others' storage.
  for (auto& item : model_->named_parameters()) {
    torch::Tensor& p = item.value();
    if (Owns(item.key())) {
      p.set_data(p.data().to(options_.device));
      owned_names_.push_back(item.key());
      owned_.push_back(p);
    } else {
      p.set_data(torch::empty({0}, p.options().device(options_.device)));
      p.set_requires_grad(false);
    }
  }
  // Sharded over the stage's ranks (fsdp) or a shard group of 2 or more
  // (hsdp); otherwise replicated.
  const bool shard_stage = replicas_ != nullptr && kind != nullptr &&
                           (kind->layout == StateLayout::kSharded || g > 1);
  if (t > 1 && (first() || last())) {
    // The vocabulary-parallel ends this stage runs: the embedding (first),
    // the head (last; the embedding's rows again when tied).
    try {
      ends_ = VocabParallelEnds(*model_, tensor_, options_,
                                /*rows_held=*/!shard_stage, first(), last());
    } catch (const c10::Error& e) {
      return absl::InternalError(absl::StrCat(
          "pipeline x tensor parallel: setup: ", e.what_without_backtrace()));
    }
  }
  if (shard_stage) {
    if (absl::Status s = ShardStage(); !s.ok()) return s;
  } else {
    optimizer_ = std::make_unique<AdamW>(
        WeightDecayGroups(owned_, options_.weight_decay), options_.adamw);
  }

  // Replicated stages reduce over their replicas as the step's last
  // backward runs (as DDP does). With tensor ranks (the vocabulary-parallel
  // head writes the embedding's gradient itself) the stage reduces after the
  // schedule, through one flat copy.
  if (replicas_ != nullptr && !sharded() && tensor_ == nullptr) {
    replica_buckets_ = std::make_unique<GradientBuckets>(
        owned_, replicas_,
        std::max<int64_t>(1, static_cast<int64_t>(std::llround(
                                 pipeline_.bucket_mb * 1024 * 1024))),
        "pipeline x ddp");
    // Each parameter's chunk, whose last backward of a step completes it.
    chunk_params_.assign(chunks(), {});
    for (size_t i = 0; i < owned_names_.size(); ++i) {
      chunk_params_[ChunkHolding(model_->PlaceOf(owned_names_[i]))].push_back(
          static_cast<int64_t>(i));
    }
  }

  std::vector<std::string> stages;
  for (int64_t s = 0; s < pipeline_.stages; ++s) {
    const std::vector<int64_t> ranks = mesh_->RanksWithSameCoordinate(
        mesh_->WithCoordinate(0, MeshDim::kPipeline, s), MeshDim::kPipeline);
    std::vector<std::string> held;  // its chunks' model stages
    for (int64_t chunk = 0; chunk < chunks(); ++chunk) {
      held.push_back(
          DescribeStage(partition_[ModelStageOf(pipeline_.stages, s, chunk)]));
    }
    stages.push_back(
        absl::StrCat("stage ", s, " = rank", ranks.size() > 1 ? "s " : " ",
                     FormatRanks(ranks), " (", absl::StrJoin(held, "; "), ")"));
  }
  const std::string groups = g > 0 && data_parallel_size() > 1
                                 ? absl::StrCat(" (", data_parallel_size() / g,
                                                " shard groups of ", g, ")")
                                 : "";
  const std::string tensor_ranks =
      t > 1 ? absl::StrCat(" x tensor parallel ", t) : "";
  layout_ = absl::StrCat("mesh: ", pipeline_.stages, " pipeline stages x ",
                         pipeline_.data_parallel, " ", data_parallel_size(),
                         groups, tensor_ranks, ", ",
                         chunks() > 1 ? absl::StrCat("interleaved (", chunks(),
                                                     " chunks per stage) ")
                                      : "",
                         PipelineScheduleName(pipeline_.schedule), " with ",
                         pipeline_.micro_batches,
                         " micro-batch(es): ", absl::StrJoin(stages, ", "));
  return absl::OkStatus();
}

absl::Status PipelineStrategy::ShardStage() {
  std::vector<std::pair<std::string, torch::Tensor>> parameters;
  for (size_t i = 0; i < owned_.size(); ++i) {
    parameters.emplace_back(owned_names_[i], owned_[i]);
  }
  const std::string embedding = ModulePath(model_->token_embedding_name());
  const std::string head = ModulePath(model_->head_weight_name());
  auto is_end = [&](const std::string& unit) {
    return unit == embedding || (!model_->tied_head() && unit == head);
  };
  // The vocabulary-parallel paths read the ends in fp32.
  absl::StatusOr<std::vector<std::unique_ptr<FsdpUnit>>> units = ShardIntoUnits(
      *model_, parameters, replicas_, across_groups_, options_.device,
      ComputeDtype(options_),
      [&](const std::string& unit) {
        return tensor_parallel() > 1 && is_end(unit);
      },
      across_groups_ != nullptr ? "pipeline x hsdp" : "pipeline x fsdp");
  if (!units.ok()) return units.status();
  units_ = *std::move(units);
  for (const auto& unit : units_) {
    if (unit->name() == embedding) embedding_unit_ = unit.get();
    // Without tensor ranks, the lookup and the chunked head read a leaf
    // over the gathered rows (GatherUnits).
    if (is_end(unit->name()) && tensor_parallel() == 1) {
      leaves_.push_back({unit.get(), torch::Tensor()});
    }
  }
  try {
    ends_.FindUnits(units_);
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat("pipeline x fsdp: setup: ", e.what_without_backtrace()));
  }
  // Each block's unit, for gathering as the forward reaches it, and each
  // unit's chunk: its reduce-scatter goes as soon as that chunk's last
  // backward of the step has completed its gradient (armed then),
  // overlapping the rest of it; HSDP's groups average each unit as its
  // reduce-scatter lands.
  std::vector<int64_t> unit_chunk;
  for (const auto& unit : units_) {
    unit_chunk.push_back(
        ChunkHolding(model_->PlaceOf(unit->params().front().name)));
  }
  unit_schedule_ = std::make_unique<UnitSchedule>(
      &units_, std::move(unit_chunk), BlockUnits(*model_, units_), chunks(),
      "pipeline x fsdp", across_groups_);
  // The units hold the values now; the parameters' storage is freed.
  owned_.clear();
  owned_names_.clear();
  optimizer_ = std::make_unique<AdamW>(
      ShardWeightDecayGroups(units_, options_.weight_decay), options_.adamw);
  return absl::OkStatus();
}

void PipelineStrategy::NeedUnits(size_t end) {
  if (unit_schedule_ == nullptr) return;
  unit_schedule_->Need(end, [this](FsdpUnit* unit) { UseGatheredUnit(unit); });
}

void PipelineStrategy::UseGatheredUnit(FsdpUnit* unit) {
  // The vocabulary-parallel paths (tensor ranks) read the gathered rows
  // and add their gradients into buffers of their own, handed to the
  // units before the reduce-scatter.
  if (tensor_ != nullptr) ends_.UseGatheredUnit(unit);
  if (!torch::GradMode::is_enabled()) return;  // evaluation
  // The LM head adds the head weight's gradient into its .grad() itself,
  // which a view of the unit's buffer cannot take: a leaf over the same
  // memory, its gradient handed to the unit before the reduce-scatter.
  for (auto& [held, leaf] : leaves_) {
    if (held != unit) continue;
    const FsdpUnit::Param& p = unit->params().front();
    if (!leaf.defined()) {
      leaf = unit->full()
                 .detach()
                 .narrow(0, p.offset, p.numel)
                 .view(p.shape)
                 .requires_grad_(true);
      // The head adds each micro-batch's gradient into it: in fp32, as the
      // units' own gradients accumulate (UnitSchedule), when it computes in
      // another dtype (in fp32 the head's first gradient becomes it).
      if (leaf.scalar_type() != torch::kFloat) {
        leaf.mutable_grad() =
            torch::zeros(p.shape, leaf.options().dtype(torch::kFloat));
      }
    }
    *p.member = leaf;
  }
}

void PipelineStrategy::GatherUnits() {
  unit_schedule_->LaunchGathers();
  NeedUnits(units_.size());
}

size_t PipelineStrategy::UnitsForBlock(int64_t i, bool through) const {
  return unit_schedule_ != nullptr ? unit_schedule_->ForBlock(i, through) : 0;
}

void PipelineStrategy::ReduceScatterAndFreeUnits() {
  if (tensor_ != nullptr) ends_.HandGradientsToUnits();
  for (auto& [unit, leaf] : leaves_) {
    if (!leaf.defined()) continue;
    torch::Tensor grad = leaf.grad();
    if (grad.defined()) unit->SetParameterGradient(grad);
    leaf = torch::Tensor();
  }
  // Then the units whose hook did not launch them (the embedding's gradient
  // is handed over above), in unit order.
  unit_schedule_->FinishReduceScatters();
  FreeUnits();
}

void PipelineStrategy::FreeUnits() {
  if (unit_schedule_ != nullptr) unit_schedule_->Reshard();
  if (tensor_ != nullptr) ends_.ReleaseUnits();
}

torch::Tensor PipelineStrategy::Activation(int64_t rows, int64_t seq) const {
  return torch::empty(
      {rows, seq, model_->dims().hidden_size},
      torch::TensorOptions(options_.device).dtype(pipeline_.wire_dtype));
}

void PipelineStrategy::PostSend(torch::Tensor tensor, int64_t stage,
                                int64_t tag) {
  p2p_bytes_ += static_cast<int64_t>(tensor.nbytes());
  sends_.emplace_back(pipe_->Send(tensor, stage, tag), tensor);
}

void PipelineStrategy::ReleaseCompletedSends() {
  // In posting order: a pair's sends complete in that order.
  while (!sends_.empty() && sends_.front().first->IsCompleted()) {
    Check(std::move(sends_.front().first), "send");
    sends_.pop_front();
  }
}

void PipelineStrategy::WaitReceive(std::unique_ptr<CommWork>& work) {
  const auto start = std::chrono::steady_clock::now();
  Check(std::move(work), "recv");
  bubble_seconds_ +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
}

torch::Tensor PipelineStrategy::Embed(const torch::Tensor& inputs) {
  if (tensor_ops_ == nullptr) return model_->Embed(inputs);
  return model_->FinishEmbedding(
      VocabParallelEmbedding(inputs, ends_.embedding()));
}

torch::Tensor PipelineStrategy::HeadLoss(const torch::Tensor& x,
                                         const torch::Tensor& targets,
                                         double scale) {
  if (tensor_ops_ == nullptr) return model_->HeadLoss(x, targets);
  return VocabParallelLoss(model_->FinalNorm(x), targets, ends_.head(), scale);
}

void PipelineStrategy::Forward(InFlight& m, const Batch& batch, double scale,
                               int64_t chunk) {
  const PipelineStage& mine = Chunk(chunk);
  torch::Tensor x;
  {
    ScopedAutocast autocast(options_.device, options_.precision);
    DeferWeightGradients defer(SplitsBackward() ? &m.deferred : nullptr);
    NeedUnits(UnitsForBlock(mine.first_block, /*through=*/false));
    if (EmbedsIn(chunk)) {
      x = Embed(batch.inputs);
    } else {
      // The residual stream is fp32 whatever crossed (under autocast, as
      // on one device); the fp32 copy is the leaf whose gradient goes back
      // (the wire's buffer is freed here). Without autocast (a compute
      // dtype forced on CPU) it is the dtype the blocks' weights have.
      const torch::ScalarType stream =
          autocast.active() ? torch::kFloat : ComputeDtype(options_);
      if (m.input.scalar_type() != stream) m.input = m.input.to(stream);
      m.input.requires_grad_(true);
      x = m.input;
    }
    for (int64_t i = mine.first_block; i < mine.end_block; ++i) {
      if (unit_schedule_ != nullptr) unit_schedule_->NoteBlock(i);
      NeedUnits(UnitsForBlock(i, /*through=*/true));
      x = model_->RunBlock(i, x);
    }
    // The stage's other units (the final norm, the head) by the end of its
    // last chunk's forward.
    if (chunk + 1 == chunks()) NeedUnits(units_.size());
    if (HeadIn(chunk)) m.loss = HeadLoss(x, batch.targets, scale);
  }
  if (!HeadIn(chunk)) m.output = x;
}

void PipelineStrategy::Backward(InFlight& m, double scale, int64_t chunk) {
  // zb-h1's B: recomputed blocks defer their weight gradients too.
  DeferWeightGradients defer(SplitsBackward() ? &m.deferred : nullptr);
  if (HeadIn(chunk)) {
    (m.loss * scale).backward();
  } else {
    m.output.backward(m.output_grad.to(m.output.scalar_type()));
  }
  m.output = torch::Tensor();
  m.output_grad = torch::Tensor();
}

int64_t PipelineStrategy::TransferTag(TagKind kind, int64_t boundary) {
  // Above the export's tag; one of each kind per boundary.
  return 8 * (boundary + 1) + static_cast<int64_t>(kind);
}

absl::StatusOr<const std::vector<PipelineOp>*> PipelineStrategy::StageOps(
    int64_t count) {
  if (auto it = lowered_.find(count); it != lowered_.end()) return &it->second;
  absl::StatusOr<std::vector<std::vector<PipelineOp>>> all =
      pipeline_.lower ? pipeline_.lower(pipeline_.schedule, pipeline_.stages,
                                        count, chunks())
                      : LowerAllStages(pipeline_.schedule, pipeline_.stages,
                                       count, chunks());
  const std::string what = absl::StrCat(
      "pipeline: ", PipelineScheduleName(pipeline_.schedule), " with ",
      pipeline_.stages, " stages",
      chunks() > 1 ? absl::StrCat(" of ", chunks(), " chunks") : "", " and ",
      count, " micro-batches");
  if (!all.ok()) {
    return absl::Status(all.status().code(),
                        absl::StrCat(what, ": ", all.status().message()));
  }
  if (static_cast<int64_t>(all->size()) != pipeline_.stages) {
    return absl::InternalError(
        absl::StrCat(what, ": lowered ", all->size(), " stages' ops"));
  }
  // NCCL pairs the transfers between two ranks by the order both post them
  // and a send waits for its receive: an order that is not safe under that
  // rule hangs the job at its first step, so it never starts.
  if (absl::Status s = CheckPointToPointOrder(*all); !s.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        what, ": its transfers would never complete on NCCL: ", s.message()));
  }
  return &lowered_.emplace(count, std::move((*all)[stage_])).first->second;
}

torch::Tensor PipelineStrategy::RunSchedule(const std::vector<Batch>& micro,
                                            double scale, bool reduce) {
  using Kind = PipelineOp::Kind;
  using Payload = PipelineOp::Payload;
  const int64_t count = static_cast<int64_t>(micro.size());
  // Per chunk and micro-batch: in_flight[chunk * count + micro_batch].
  std::vector<InFlight> in_flight(micro.size() * chunks());
  if (sharded()) {
    unit_schedule_->LaunchGathers();  // disarmed until a chunk's last backward
  }
  torch::Tensor loss_sum = torch::zeros(
      {}, torch::TensorOptions(options_.device).dtype(torch::kDouble));
  // The compute order with every transfer placed so that each pair's two
  // ends post them in the same order (core/plan/pipeline_plan.h): safe
  // where a send waits for its receive (NCCL).
  // Lowered once per micro-batch count (the whole schedule is run on paper).
  absl::StatusOr<const std::vector<PipelineOp>*> lowered = StageOps(count);
  TORCH_CHECK(lowered.ok(), std::string(lowered.status().message()));
  const std::vector<PipelineOp>& ops = **lowered;
  // A replicated stage's buckets and a sharded stage's units reduce as
  // each chunk's last backward of the step completes their parameters
  // (under zb-h1 its last W: the weights' gradients come last).
  const Kind completes = SplitsBackward() ? Kind::kWeight : Kind::kBackward;
  std::vector<size_t> chunk_last_backward(chunks(), ops.size());
  for (size_t i = 0; i < ops.size(); ++i) {
    if (ops[i].kind == completes) chunk_last_backward[ops[i].chunk] = i;
  }
  deferred_weight_gradients_ = 0;
  if (replica_buckets_ != nullptr) {
    replica_buckets_->AttachGradViews();
    // The vocabulary-parallel embedding and head (tensor ranks) add into
    // the token embedding's gradient themselves: into its bucket's view.
    ends_.UseGradientViews(*model_);
    replica_buckets_->Arm(false);
  }
  for (size_t i = 0; i < ops.size(); ++i) {
    const PipelineOp& op = ops[i];
    if (reduce && replica_buckets_ != nullptr &&
        i == chunk_last_backward[op.chunk]) {
      replica_buckets_->ArmParameters(chunk_params_[op.chunk]);
    }
    if (reduce && sharded() && i == chunk_last_backward[op.chunk]) {
      unit_schedule_->Arm(op.chunk);
    }
    InFlight& m = in_flight[op.chunk * count + op.micro_batch];
    const Batch& batch = micro[op.micro_batch];
    const bool activation = op.payload == Payload::kActivation;
    // A received activation enters this chunk's model stage from the one
    // before; a received gradient comes from the one after; sends the other
    // way round.
    const int64_t k = ModelStage(op.chunk);
    const bool crosses_below = (op.kind == Kind::kPostSend) != activation;
    const int64_t tag =
        TransferTag(activation ? TagKind::kActivation : TagKind::kGradient,
                    crosses_below ? k - 1 : k);
    switch (op.kind) {
      case Kind::kPostRecv: {
        torch::Tensor& buffer = activation ? m.input : m.output_grad;
        buffer = Activation(batch.inputs.size(0), batch.inputs.size(1));
        (activation ? m.input_recv : m.output_grad_recv) =
            pipe_->Recv(buffer, op.peer, tag);
        break;
      }
      case Kind::kWaitRecv:
        WaitReceive(activation ? m.input_recv : m.output_grad_recv);
        break;
      case Kind::kForward:
        Forward(m, batch, scale, op.chunk);
        break;
      case Kind::kBackward:
        if (HeadIn(op.chunk)) loss_sum += m.loss.detach().to(torch::kDouble);
        Backward(m, scale, op.chunk);
        m.loss = torch::Tensor();
        break;
      case Kind::kWeight:
        if (reduce && replica_buckets_ != nullptr &&
            i == chunk_last_backward[op.chunk]) {
          // Armed now: the chunk's parameters no W touches got their last
          // gradient with the last B, before they were armed.
          std::set<const void*> deferred;
          for (const torch::Tensor& t : m.deferred.Tensors()) {
            deferred.insert(t.unsafeGetTensorImpl());
          }
          std::vector<int64_t> complete;
          for (int64_t p : chunk_params_[op.chunk]) {
            if (deferred.count(owned_[p].unsafeGetTensorImpl()) == 0) {
              complete.push_back(p);
            }
          }
          replica_buckets_->MarkReady(complete);
        }
        deferred_weight_gradients_ += m.deferred.size();
        m.deferred.Run();
        break;
      case Kind::kPostSend:
        if (activation) {
          PostSend(m.output.detach().to(pipeline_.wire_dtype).contiguous(),
                   op.peer, tag);
        } else {
          PostSend(m.input.grad().to(pipeline_.wire_dtype).contiguous(),
                   op.peer, tag);
          m.input = torch::Tensor();
        }
        break;
    }
    // A send's buffer goes once its receive has taken it, not at the end.
    ReleaseCompletedSends();
  }
  const auto drained = std::chrono::steady_clock::now();
  for (auto& [work, tensor] : sends_) Check(std::move(work), "send");
  sends_.clear();
  bubble_seconds_ +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - drained)
          .count();
  // Every stage reports its replica's mean loss: the last stage's.
  torch::Tensor loss =
      (loss_sum / static_cast<double>(count)).to(torch::kFloat).reshape({1});
  Check(pipe_->AllReduce(loss), "all_reduce (loss)");
  return loss.reshape({});
}

void PipelineStrategy::SynchronizeGradients() {
  torch::NoGradGuard no_grad;
  if (sharded()) {
    // The mean over the stage's replicas lands in each rank's shard; the
    // tied embedding's two copies are sharded alike, so their shards sum
    // pairwise.
    ReduceScatterAndFreeUnits();
    if (tied_ != nullptr) {
      Check(tied_->AllReduce(embedding_unit_->shard_grad()),
            "all_reduce (tied embedding)");
    }
    return;
  }
  // The buckets' all-reduces (launched during the last backward) end
  // before the embedding's gradient is summed with its tied copy.
  if (replica_buckets_ != nullptr) replica_buckets_->Finish();
  if (tied_ != nullptr) {
    torch::Tensor& embedding = model_->token_embedding();
    if (!embedding.grad().defined()) {
      embedding.mutable_grad() = torch::zeros_like(embedding);
    }
    torch::Tensor grad = embedding.grad();
    Check(tied_->AllReduce(grad), "all_reduce (tied embedding)");
  }
  if (replicas_ == nullptr || replica_buckets_ != nullptr) return;
  std::vector<torch::Tensor> grads;
  for (torch::Tensor& p : owned_) {
    if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
    grads.push_back(p.grad().view({-1}));
  }
  torch::Tensor flat = torch::cat(grads);
  Check(replicas_->AllReduce(flat), "all_reduce (gradients)");
  flat.div_(static_cast<double>(data_parallel_size()));
  int64_t offset = 0;
  for (torch::Tensor& p : owned_) {
    const int64_t n = p.numel();
    p.grad().view({-1}).copy_(flat.narrow(0, offset, n));
    offset += n;
  }
}

std::vector<Batch> PipelineStrategy::Split(const Batch& batch) const {
  const int64_t rows = batch.inputs.size(0);
  const int64_t m = pipeline_.micro_batches;
  TORCH_CHECK(rows % m == 0, "pipeline: ", m,
              " micro-batches do not divide a batch of ", rows, " rows");
  std::vector<Batch> micro;
  for (int64_t i = 0; i < m; ++i) {
    micro.push_back({batch.inputs.narrow(0, i * rows / m, rows / m),
                     batch.targets.narrow(0, i * rows / m, rows / m)});
  }
  return micro;
}

torch::Tensor PipelineStrategy::ForwardBackwardStep(
    const std::vector<Batch>& batches) {
  std::vector<Batch> micro;
  for (const Batch& batch : batches) {
    std::vector<Batch> pieces = Split(batch);
    micro.insert(micro.end(), pieces.begin(), pieces.end());
  }
  // All of the step's micro-batches in one schedule: one fill and one drain.
  torch::Tensor loss = RunSchedule(
      micro, 1.0 / static_cast<double>(micro.size()), /*reduce=*/true);
  SynchronizeGradients();
  return loss;
}

torch::Tensor PipelineStrategy::ForwardBackward(const torch::Tensor& inputs,
                                                const torch::Tensor& targets,
                                                double loss_scale, bool sync) {
  const std::vector<Batch> micro = Split({inputs, targets});
  torch::Tensor loss = RunSchedule(
      micro, loss_scale / static_cast<double>(pipeline_.micro_batches), sync);
  if (sync) SynchronizeGradients();
  return loss;
}

void PipelineStrategy::OptimizerStep(double lr) {
  optimizer_->Step(lr);
  optimizer_->ZeroGrad();
  torch::NoGradGuard no_grad;
  for (auto& unit : units_) unit->shard_grad().zero_();
}

torch::Tensor PipelineStrategy::ForwardLoss(const torch::Tensor& inputs,
                                            const torch::Tensor& targets) {
  torch::NoGradGuard no_grad;
  if (sharded()) GatherUnits();
  torch::Tensor loss = torch::zeros(
      {1}, torch::TensorOptions(options_.device).dtype(torch::kFloat));
  // Through the model stages in order: each chunk takes the previous model
  // stage's output (from the rank before, the last rank's wrapping to rank
  // 0's next chunk) and hands its own on.
  const int64_t previous = (stage_ + pipeline_.stages - 1) % pipeline_.stages;
  const int64_t next = (stage_ + 1) % pipeline_.stages;
  for (int64_t chunk = 0; chunk < chunks(); ++chunk) {
    const PipelineStage& mine = Chunk(chunk);
    const int64_t k = ModelStage(chunk);
    torch::Tensor x;
    {
      ScopedAutocast autocast(options_.device, options_.precision);
      if (EmbedsIn(chunk)) {
        x = Embed(inputs);
      } else {
        x = Activation(inputs.size(0), inputs.size(1));
        Check(
            pipe_->Recv(x, previous, TransferTag(TagKind::kEvaluation, k - 1)),
            "recv");
        // As in training (Forward).
        x = x.to(autocast.active() ? torch::kFloat : ComputeDtype(options_));
      }
      for (int64_t i = mine.first_block; i < mine.end_block; ++i) {
        x = model_->RunBlock(i, x);
      }
    }
    if (HeadIn(chunk)) {
      ScopedAutocast autocast(options_.device, options_.precision);
      loss += HeadLoss(x, targets, /*scale=*/0.0).to(torch::kFloat);
    } else {
      torch::Tensor sent = x.to(pipeline_.wire_dtype).contiguous();
      Check(pipe_->Send(sent, next, TransferTag(TagKind::kEvaluation, k)),
            "send");
    }
  }
  FreeUnits();
  Check(pipe_->AllReduce(loss), "all_reduce (eval loss)");
  return loss.reshape({});
}

double PipelineStrategy::AllReduceMean(double value) {
  return shardtrain::AllReduceMean(*world_, value, options_.device, "pipeline");
}

void PipelineStrategy::Barrier() {
  ThrowIfFailed(world_->Barrier(), "pipeline", "barrier");
}

std::vector<HeldPiece> PipelineStrategy::HeldPieces() {
  // A stage's ranks hold its parameters: with tensor ranks each its slice
  // (whole tensors alike on all), and either the same as the stage's other
  // replicas or, sharded, each its part of every unit (HSDP's groups the
  // same parts). A tied embedding is held by the first and the last stage.
  auto place = [&](const std::string& name, const std::vector<int64_t>& local) {
    Placement p =
        tensor_ == nullptr
            ? Placement::Whole(name, local)
            : Placement::TensorParallel(*model_, name, global_shapes().at(name),
                                        tensor_->rank(), tensor_parallel());
    if (tied_ != nullptr && IsTokenEmbedding(name)) {
      p = p.ReplicatedAlong(MeshDim::kPipeline, first() ? 0 : 1, 2);
    }
    return p;
  };
  std::vector<HeldPiece> pieces;
  for (size_t i = 0; i < owned_.size(); ++i) {
    pieces.push_back(
        {place(owned_names_[i], owned_[i].sizes().vec())
             .ReplicatedAlong(MeshDim::kReplicate, data_parallel_rank(),
                              data_parallel_size()),
         owned_[i],
         {}});
  }
  const int64_t group = across_groups_ == nullptr ? 0 : across_groups_->rank();
  const int64_t groups =
      across_groups_ == nullptr ? 1 : across_groups_->world_size();
  for (auto& unit : units_) {
    ForEachShardPiece(
        *unit, [&](const FsdpUnit::Param& p, int64_t offset,
                   const torch::Tensor& piece, const torch::Tensor& grad) {
          pieces.push_back(
              {place(p.name, p.shape)
                   .Narrow(offset, piece.numel())
                   .ReplicatedAlong(MeshDim::kReplicate, group, groups),
               piece, grad});
        });
  }
  return pieces;
}

int64_t PipelineStrategy::optimizer_steps() const {
  return optimizer_->step_count();
}

void PipelineStrategy::set_optimizer_steps(int64_t steps) {
  optimizer_->set_step_count(steps);
}

int64_t PipelineStrategy::ModelStateBytes() const {
  int64_t bytes = optimizer_->StateBytes();
  for (const auto& unit : units_) bytes += unit->ShardBytes();
  for (const torch::Tensor& p : owned_) {
    bytes += p.nbytes();
    if (p.grad().defined()) bytes += p.grad().nbytes();
  }
  return bytes;
}

CommStats PipelineStrategy::TakeCommStats() {
  CommStats total =
      groups_ != nullptr ? groups_->TakeStats() : world_->TakeStats();
  total.p2p_bytes = std::exchange(p2p_bytes_, 0);
  total.pipeline_bubble_seconds = std::exchange(bubble_seconds_, 0.0);
  return total;
}

}  // namespace shardtrain
