// UnitSchedule: when the FSDP units of a composed mesh move within a step —
// a pipeline stage sharded over its replicas (PP x FSDP), or a
// tensor-parallel rank's slices sharded over the ranks holding the same
// slices (TP x FSDP). Both keep their units gathered for the whole step (no
// resharding between micro-batches, which would repeat every all-gather per
// micro-batch), and both:
//   - gather as the forward needs them: every unit's all-gather launched at
//     the step's start, in the order the forward uses the units, each waited
//     for just before the first computation that reads it, so the first
//     block computes while later units arrive;
//   - accumulate in fp32: a backward before the step's last (another
//     micro-batch's) adds each unit's gradient, as its hook sees it whole,
//     into an fp32 buffer of the unit's and frees the leaf's, whose dtype
//     is the compute dtype (bf16 under mixed precision);
//   - reduce-scatter as the backward completes them: during the step's last
//     backward (of a pipeline chunk: each chunk's own last backward), a
//     unit's reduce-scatter launches as soon as its gradient is whole, from
//     the gradient hook of its flat buffer, while the backward goes on
//     through earlier blocks; the units no hook launched (those whose
//     gradients the strategy hands over itself) go after the backward.
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

class UnitSchedule {
 public:
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
  UnitSchedule(const UnitSchedule&) = delete;
  UnitSchedule& operator=(const UnitSchedule&) = delete;

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
  void OnGradReady(size_t u);

  const std::vector<std::unique_ptr<FsdpUnit>>* const units_;
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
  GradReadyHooks hooks_;  // last: removed before the rest is destroyed
};

// The units of a composed mesh's sharded parameters (TP x FSDP/HSDP, a
// pipeline's sharded stages): `parameters` (name, value; members of
// `model`'s modules) grouped as GroupIntoUnits groups them, each sharded
// over `shard`, gathered in `compute_dtype` but for the units `fp32` names
// (those the vocabulary-parallel ends read in fp32). With `across` (HSDP),
// every replica group starts from the first group's shards. Collective
// over `shard` and `across`; `strategy` names errors.
absl::StatusOr<std::vector<std::unique_ptr<FsdpUnit>>> ShardIntoUnits(
    CausalLmImpl& model,
    const std::vector<std::pair<std::string, torch::Tensor>>& parameters,
    Communicator* shard, Communicator* across, const torch::Device& device,
    torch::ScalarType compute_dtype,
    const std::function<bool(const std::string& unit)>& fp32,
    const std::string& strategy);

// Each block's unit (by the place of its first parameter), for UnitSchedule.
std::map<int64_t, size_t> BlockUnits(
    const CausalLmImpl& model,
    const std::vector<std::unique_ptr<FsdpUnit>>& units);

}  // namespace shardtrain

#endif  // SHARDTRAIN_WORKER_ENGINE_STRATEGY_UNIT_SCHEDULE_H_
