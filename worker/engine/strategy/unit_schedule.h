// UnitSchedule: the one FSDP runtime — when a rank's FSDP units (fsdp_unit.h)
// are gathered, freed and reduced within a step. Standalone FSDP/HSDP, a
// pipeline stage sharded over its replicas (PP x FSDP) and a tensor-parallel
// rank's slices sharded over the ranks holding the same slices (TP x FSDP)
// all run their units through it, in one of two modes:
//
// kWholeStep (the composed meshes): every unit's all-gather launched at the
// step's start, in the order the forward uses the units, each waited for
// just before the first computation that reads it, so the first block
// computes while later units arrive; the units stay gathered for the whole
// step (a pipeline's micro-batches interleave their forwards and
// backwards: freeing between them would repeat every all-gather per
// micro-batch).
//
// kPerBlock (standalone FSDP/HSDP, whose forward and backward run one
// micro-batch at a time): the units outside the blocks (the root: other
// inputs, the final norm) gathered at the forward's start and kept to the
// end of backward; each block's unit gathered as the forward reaches it
// (the next block's all-gather launched while it computes: prefetch), freed
// after its forward (reshard_after_forward; the last block kept, its
// backward comes first), gathered again by a hook on its output just before
// its backward, which launches the block before's all-gather; freed once
// its reduce-scatter launched.
//
// In both modes gradients:
//   - accumulate in fp32 when a micro-step does not reduce (a pipeline's
//     micro-batches before a chunk's last; FSDP's no_sync): each unit's
//     gradient, as its hook sees it whole, is added into an fp32 buffer of
//     the unit's and the leaf's (the compute dtype's: bf16 under mixed
//     precision) is freed;
//   - reduce-scatter as the backward completes them: a unit's
//     reduce-scatter launches from the gradient hook of its flat buffer
//     while the backward goes on through earlier blocks; the units no hook
//     launched go after the backward;
//   - with `across` (HSDP: the groups holding the same shards), each unit's
//     shard gradient is averaged over the groups once its reduce-scatter has
//     landed, on the step's syncing micro-step.
// Units past `gathered` (kPerBlock: the vocabulary-parallel token embedding
// and untied head, whose users write their shard gradients themselves) are
// never gathered, only averaged across HSDP's groups.
// Not thread-safe: one rank's thread drives it, its hooks run inside that
// thread's backward().
#ifndef SHARDTRAIN_WORKER_ENGINE_STRATEGY_UNIT_SCHEDULE_H_
#define SHARDTRAIN_WORKER_ENGINE_STRATEGY_UNIT_SCHEDULE_H_

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/engine/strategy/distributed_helpers.h"
#include "worker/engine/strategy/fsdp_unit.h"

namespace shardtrain {

// What the runtime did, in order, for tests and tracing; `unit` is the
// unit's index in the schedule (standalone FSDP: 0 = root, 1 + i = block i,
// num_blocks + 1 = the token embedding, which is never gathered).
struct FsdpEvent {
  enum class Kind {
    kGatherLaunch,   // all-gather launched (full buffer allocated)
    kGatherDone,     // waited for; the full parameters are in place
    kComputeBegin,   // a block's forward starts (kPerBlock)
    kComputeEnd,     // a block's forward has returned (kPerBlock)
    kBackwardBegin,  // the pre-backward hook of a block fired (kPerBlock)
    kGradReady,      // the unit's flat gradient is complete
    kReshard,        // the full buffer was freed
  };
  Kind kind;
  int64_t unit;

  std::string ToString() const;
};

class UnitSchedule {
 public:
  // kPerBlock's choices (FsdpOptions says what each buys).
  struct PerBlock {
    bool reshard_after_forward = true;
    bool prefetch = true;
    // Micro-steps that do not sync hold the units' full gradients in fp32
    // instead of reduce-scattering them.
    bool no_sync = false;
    // Whether block i recomputes its forward inside its backward
    // (activation checkpointing): its unit's views are made again then.
    std::function<bool(int64_t block)> recomputed;
    // Units [0, gathered) are gathered; the rest never are.
    size_t gathered = 0;
  };

  // A step's reduction: when each unit's reduce-scatter launched (in launch
  // order; those the backward completed first) against when the backward
  // ended.
  struct OverlapTrace {
    std::vector<std::chrono::steady_clock::time_point> unit_launch;
    std::chrono::steady_clock::time_point backward_end;
  };

  // `units` (in the order the forward uses them) must outlive the schedule;
  // `group_of[u]`: which group's last backward completes unit u (a pipeline
  // chunk; 0 when there is one group); `block_unit`: each block's unit
  // (BlockUnits). `across` (HSDP; nullptr: none): the replica groups
  // holding the same shards, over which each unit's shard gradient is
  // averaged once its reduce-scatter has landed. `strategy`: for errors
  // ("pipeline x fsdp").
  UnitSchedule(const std::vector<std::unique_ptr<FsdpUnit>>* units,
               std::vector<int64_t> group_of,
               std::map<int64_t, size_t> block_unit, int64_t groups,
               std::string strategy, Communicator* across = nullptr);
  // kPerBlock over one group: `block_unit` maps every block to its own
  // unit; the units of no block are the root's.
  UnitSchedule(const std::vector<std::unique_ptr<FsdpUnit>>* units,
               std::map<int64_t, size_t> block_unit, PerBlock per_block,
               std::string strategy, Communicator* across = nullptr);
  UnitSchedule(const UnitSchedule&) = delete;
  UnitSchedule& operator=(const UnitSchedule&) = delete;

  // kPerBlock, one micro-step: BeginMicroStep, then the forward
  // (BeginForward, Before/AfterBlock for each block, EndForward), the
  // backward, FinishBackward; after a failure, Reset. Evaluation runs the
  // forward alone, without grad mode.
  //
  // Whether this micro-step reduces (or, with no_sync and !sync, holds its
  // gradients); HSDP averages on the syncing one.
  void BeginMicroStep(bool sync);
  // The root's units gathered (the first block's all-gather launched
  // beside them).
  void BeginForward();
  // Block i's unit gathered and in use, the next block's launched.
  void BeforeBlock(int64_t i);
  // Block i's forward returned `output`: in training its pre-backward hook
  // goes on `output`; its unit freed (reshard_after_forward) unless it is
  // the last block and this is training.
  void AfterBlock(int64_t i, const torch::Tensor& output, bool training);
  // Evaluation: the root freed too.
  void EndForward(bool training);
  // After the backward: the units no hook handled reduced (or held), every
  // reduce-scatter waited for, HSDP's average done on a syncing step,
  // every unit freed.
  void FinishBackward();
  // After a failure: no unit gathered, no collective pending, no held or
  // leaf gradient left (results of failed collectives are dropped).
  void Reset();
  // Called synchronously at every event (on the rank's thread, also from
  // inside backward). Empty to stop.
  void set_observer(std::function<void(const FsdpEvent&)> observer) {
    observer_ = std::move(observer);
  }

  // kWholeStep, one step.
  //
  // At the step's start: every unit's all-gather launched, every group
  // disarmed and every held gradient dropped (a failed step may have left
  // them).
  void LaunchGathers();
  // Waits for the units before `end` (in unit order), points the model at
  // each and calls `on_ready` with it; nothing for those already ready.
  void Need(size_t end, const std::function<void(FsdpUnit*)>& on_ready);
  // How many units the forward needs before block `i` runs: those before
  // its unit, or with `through`, its unit too (every unit if it has none).
  size_t ForBlock(int64_t i, bool through) const;
  size_t ready() const { return ready_; }
  size_t size() const { return units_->size(); }
  // Block `i`'s forward starts: noted when gathers are still outstanding.
  void NoteBlock(int64_t i);
  // The last training step's gathers, in order: "unit NAME ready" as the
  // forward waited for each, "block I" as block I's forward started while
  // gathers were still outstanding.
  const std::vector<std::string>& gather_trace() const { return gather_trace_; }

  // The last backward of `group` in this step starts: its units'
  // reduce-scatters go from their hooks as their gradients complete.
  void Arm(int64_t group);
  // Not this micro-step (one before the step's last): nothing launches; the
  // units' gradients are held in fp32.
  void Disarm() { armed_.assign(armed_.size(), false); }
  bool armed(int64_t group) const { return armed_[group]; }
  // After the backward: the units no hook launched, in unit order, then
  // every reduce-scatter waited for (and, across HSDP's groups, each
  // unit's average launched as it lands, then waited for); disarms every
  // group. The caller hands over the gradients the hooks cannot see
  // before.
  void FinishReduceScatters();
  // The units freed; a gather still in flight (a step that failed before
  // its forward needed every unit) waited for first.
  void Reshard();

  const OverlapTrace& trace() const { return trace_; }

 private:
  enum class Mode { kWholeStep, kPerBlock };

  void AddHooks();
  void Emit(FsdpEvent::Kind kind, size_t u);
  void LaunchGather(size_t u);
  // Waits for (launching if need be) unit u's all-gather.
  void WaitGather(size_t u);
  void ReshardUnit(size_t u);
  void PreBackward(int64_t block);
  void OnGradReady(size_t u);
  size_t UnitOfBlock(int64_t i) const { return block_unit_.at(i); }

  const Mode mode_;
  const PerBlock per_block_;  // kPerBlock
  const std::vector<std::unique_ptr<FsdpUnit>>* const units_;
  const size_t gathered_;     // units [0, gathered_) are gathered
  std::vector<size_t> root_;  // kPerBlock: the units of no block
  bool sync_ = true;          // of the micro-step in progress (kPerBlock)
  const std::vector<int64_t> group_of_;
  const std::map<int64_t, size_t> block_unit_;
  const std::string strategy_;
  std::vector<bool> armed_;     // per group
  std::vector<bool> launched_;  // per unit, this step
  int64_t last_launched_ = -1;  // by a hook, this step
  size_t ready_ = 0;            // units [0, ready_) are gathered and in use
  OverlapTrace trace_;
  std::vector<std::string> gather_trace_;
  GroupAverage average_;
  std::function<void(const FsdpEvent&)> observer_;
  GradReadyHooks hooks_;  // last: removed before the rest is destroyed
};

// The units of a composed mesh's sharded parameters (TP x FSDP/HSDP, a
// pipeline's sharded stages): `parameters` (name, value; members of
// `model`'s modules) grouped as GroupIntoUnits groups them, each sharded
// over `shard`, gathered in `compute_dtype` but for the units `fp32` names
// (those the vocabulary-parallel ends read in fp32). With `row_width` > 1
// the token embedding's and an untied head's units are padded so that every
// shard is whole rows of that width (standalone FSDP's vocabulary-parallel
// ends read their rows in place). With `across` (HSDP), every replica group
// starts from the first group's shards. Collective over `shard` and
// `across`; `strategy` names errors.
absl::StatusOr<std::vector<std::unique_ptr<FsdpUnit>>> ShardIntoUnits(
    CausalLmImpl& model,
    const std::vector<std::pair<std::string, torch::Tensor>>& parameters,
    Communicator* shard, Communicator* across, const torch::Device& device,
    torch::ScalarType compute_dtype,
    const std::function<bool(const std::string& unit)>& fp32,
    const std::string& strategy, int64_t row_width = 1);

// Each block's unit (by the place of its first parameter), for UnitSchedule.
std::map<int64_t, size_t> BlockUnits(
    const CausalLmImpl& model,
    const std::vector<std::unique_ptr<FsdpUnit>>& units);

}  // namespace shardtrain

#endif  // SHARDTRAIN_WORKER_ENGINE_STRATEGY_UNIT_SCHEDULE_H_
