#include "worker/engine/strategy/unit_schedule.h"

#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace shardtrain {

std::string FsdpEvent::ToString() const {
  const char* names[] = {"gather_launch", "gather_done",    "compute_begin",
                         "compute_end",   "backward_begin", "grad_ready",
                         "reshard"};
  return absl::StrCat(names[static_cast<int>(kind)], " ", unit);
}

UnitSchedule::UnitSchedule(const std::vector<std::unique_ptr<FsdpUnit>>* units,
                           std::vector<int64_t> group_of,
                           std::map<int64_t, size_t> block_unit, int64_t groups,
                           std::string strategy, Communicator* across)
    : mode_(Mode::kWholeStep),
      units_(units),
      gathered_(units->size()),
      group_of_(std::move(group_of)),
      block_unit_(std::move(block_unit)),
      strategy_(std::move(strategy)),
      armed_(static_cast<size_t>(std::max<int64_t>(1, groups)), false),
      launched_(units->size(), false),
      average_(across, units->size(), strategy_) {
  AddHooks();
}

UnitSchedule::UnitSchedule(const std::vector<std::unique_ptr<FsdpUnit>>* units,
                           std::map<int64_t, size_t> block_unit,
                           PerBlock per_block, std::string strategy,
                           Communicator* across)
    : mode_(Mode::kPerBlock),
      per_block_(std::move(per_block)),
      units_(units),
      gathered_(std::min(per_block_.gathered, units->size())),
      group_of_(units->size(), 0),
      block_unit_(std::move(block_unit)),
      strategy_(std::move(strategy)),
      armed_(1, false),
      launched_(units->size(), false),
      average_(across, units->size(), strategy_) {
  std::vector<bool> of_block(units->size(), false);
  for (const auto& [block, u] : block_unit_) of_block[u] = true;
  for (size_t u = 0; u < gathered_; ++u) {
    if (!of_block[u]) root_.push_back(u);
  }
  AddHooks();
}

void UnitSchedule::AddHooks() {
  for (size_t u = 0; u < gathered_; ++u) {
    hooks_.Add((*units_)[u]->full(), [this, u] { OnGradReady(u); });
  }
}

void UnitSchedule::Emit(FsdpEvent::Kind kind, size_t u) {
  if (observer_) observer_(FsdpEvent{kind, static_cast<int64_t>(u)});
}

void UnitSchedule::LaunchGather(size_t u) {
  FsdpUnit& unit = *(*units_)[u];
  if (unit.gathered() || unit.gather_in_flight()) return;
  ThrowIfFailed(unit.LaunchGather(), strategy_, "all_gather");
  Emit(FsdpEvent::Kind::kGatherLaunch, u);
}

void UnitSchedule::WaitGather(size_t u) {
  FsdpUnit& unit = *(*units_)[u];
  if (unit.gathered()) return;
  LaunchGather(u);
  ThrowIfFailed(unit.WaitGather(), strategy_, "all_gather");
  Emit(FsdpEvent::Kind::kGatherDone, u);
}

void UnitSchedule::ReshardUnit(size_t u) {
  FsdpUnit& unit = *(*units_)[u];
  if (unit.gather_in_flight()) (void)unit.WaitGather();
  unit.Reshard();
  Emit(FsdpEvent::Kind::kReshard, u);
}

// --- kPerBlock ---

void UnitSchedule::BeginMicroStep(bool sync) {
  sync_ = sync;
  armed_[0] = sync || !per_block_.no_sync;
  launched_.assign(launched_.size(), false);
  last_launched_ = -1;
  if (armed_[0]) trace_ = {};
}

void UnitSchedule::BeginForward() {
  TORCH_CHECK(mode_ == Mode::kPerBlock, strategy_, ": not a per-block run");
  for (size_t u : root_) LaunchGather(u);
  if (per_block_.prefetch && !block_unit_.empty()) {
    LaunchGather(block_unit_.begin()->second);
  }
  for (size_t u : root_) {
    WaitGather(u);
    (*units_)[u]->UseFullParams();
  }
}

void UnitSchedule::BeforeBlock(int64_t i) {
  const size_t u = UnitOfBlock(i);
  WaitGather(u);
  (*units_)[u]->UseFullParams();
  if (per_block_.prefetch && block_unit_.count(i + 1) > 0) {
    LaunchGather(UnitOfBlock(i + 1));
  }
  Emit(FsdpEvent::Kind::kComputeBegin, u);
}

void UnitSchedule::AfterBlock(int64_t i, const torch::Tensor& output,
                              bool training) {
  const size_t u = UnitOfBlock(i);
  Emit(FsdpEvent::Kind::kComputeEnd, u);
  if (training) {
    // Fires when the gradient of the block's output is complete, i.e.
    // right before the block's own backward.
    output.register_hook([this, i](const torch::Tensor&) { PreBackward(i); });
  }
  // The last block stays gathered in training: its backward comes right
  // after the head's, so freeing it would only buy a second all-gather.
  const bool last = block_unit_.rbegin()->first == i;
  if (!training || (per_block_.reshard_after_forward && !last)) {
    ReshardUnit(u);
  }
}

void UnitSchedule::EndForward(bool training) {
  if (training) return;
  for (size_t u : root_) ReshardUnit(u);
}

void UnitSchedule::PreBackward(int64_t block) {
  const size_t u = UnitOfBlock(block);
  Emit(FsdpEvent::Kind::kBackwardBegin, u);
  // The graph holds views of the full buffer: refilling its storage is
  // enough, no new views are made.
  WaitGather(u);
  // A recomputed block runs its forward again inside its backward, reading
  // the members: point them at the gathered parameters (new views, whose
  // gradient reaches the same leaf). Backward runs hooks with grad mode
  // off; these views must record their base for the recomputation's
  // gradient to reach it.
  if (per_block_.recomputed && per_block_.recomputed(block)) {
    c10::AutoGradMode grad_mode(true);
    (*units_)[u]->UseFullParams();
  }
  if (per_block_.prefetch && block_unit_.count(block - 1) > 0) {
    LaunchGather(UnitOfBlock(block - 1));
  }
}

void UnitSchedule::FinishBackward() {
  if (last_launched_ >= 0) {
    ThrowIfFailed((*units_)[last_launched_]->WaitReduceScatter(), strategy_,
                  "reduce_scatter");
  }
  for (size_t u = 0; u < gathered_; ++u) {
    FsdpUnit& unit = *(*units_)[u];
    if (!armed_[0]) {
      unit.HoldUnshardedGradient();  // one that missed its hook
    } else if (unit.full().grad().defined() ||
               unit.holds_unsharded_gradient()) {
      ThrowIfFailed(unit.LaunchReduceScatter(), strategy_, "reduce_scatter");
      ThrowIfFailed(unit.WaitReduceScatter(), strategy_, "reduce_scatter");
    }
    if (unit.gather_in_flight() || unit.gathered()) ReshardUnit(u);
  }
  trace_.backward_end = std::chrono::steady_clock::now();
  if (sync_) {
    for (size_t u = 0; u < units_->size(); ++u) {
      average_.Launch(*(*units_)[u], u);
    }
  }
  average_.Finish();
  launched_.assign(launched_.size(), false);
  last_launched_ = -1;
}

void UnitSchedule::Reset() {
  average_.Drop();
  for (const auto& unit : *units_) {
    if (unit->gather_in_flight()) (void)unit->WaitGather();
    (void)unit->WaitReduceScatter();
    unit->Reshard();
    unit->full().mutable_grad() = torch::Tensor();
    unit->DropUnshardedGradient();
  }
  launched_.assign(launched_.size(), false);
  last_launched_ = -1;
  ready_ = 0;
}

// --- kWholeStep ---

void UnitSchedule::LaunchGathers() {
  // A failed step may have left a group armed, gradients held, or
  // averages in flight.
  for (const auto& unit : *units_) unit->DropUnshardedGradient();
  average_.Drop();
  armed_.assign(armed_.size(), false);
  launched_.assign(launched_.size(), false);
  last_launched_ = -1;
  ready_ = 0;
  if (c10::GradMode::is_enabled()) gather_trace_.clear();  // not evaluation
  for (size_t u = 0; u < units_->size(); ++u) LaunchGather(u);
}

void UnitSchedule::Need(size_t end,
                        const std::function<void(FsdpUnit*)>& on_ready) {
  end = std::min(end, units_->size());
  for (; ready_ < end; ++ready_) {
    FsdpUnit* unit = (*units_)[ready_].get();
    WaitGather(ready_);
    unit->UseFullParams();
    if (c10::GradMode::is_enabled()) {
      gather_trace_.push_back(absl::StrCat("unit ", unit->name(), " ready"));
    }
    if (on_ready) on_ready(unit);
  }
}

void UnitSchedule::NoteBlock(int64_t i) {
  if (ready_ < units_->size() && c10::GradMode::is_enabled()) {
    gather_trace_.push_back(absl::StrCat("block ", i));
  }
}

size_t UnitSchedule::ForBlock(int64_t i, bool through) const {
  const auto it = block_unit_.find(i);
  if (it == block_unit_.end()) return units_->size();
  return it->second + (through ? 1 : 0);
}

void UnitSchedule::Arm(int64_t group) {
  if (std::none_of(armed_.begin(), armed_.end(),
                   [](bool armed) { return armed; })) {
    trace_ = {};
  }
  armed_[group] = true;
}

// --- both ---

void UnitSchedule::OnGradReady(size_t u) {
  Emit(FsdpEvent::Kind::kGradReady, u);
  FsdpUnit& unit = *(*units_)[u];
  if (!armed_[group_of_[u]]) {
    // A micro-batch that does not reduce: its gradient is added into an
    // fp32 buffer and the leaf's (the compute dtype's: bf16 under mixed
    // precision) is freed, so micro-batches accumulate in fp32 as they do
    // on one device; the reduce-scatter adds the last one's.
    unit.HoldUnshardedGradient();
    if (mode_ == Mode::kPerBlock) ReshardUnit(u);
    return;
  }
  if (launched_[u]) return;
  if (mode_ == Mode::kPerBlock) {
    // The unit's reduce-scatter launched, then the one before waited for
    // (at most two in flight: the full gradients of the units finished
    // earlier must not pile up while backward goes on) and, on a syncing
    // step, its average across HSDP's groups launched; the unit freed.
    ThrowIfFailed(unit.LaunchReduceScatter(), strategy_, "reduce_scatter");
    if (last_launched_ >= 0) {
      FsdpUnit& earlier = *(*units_)[last_launched_];
      ThrowIfFailed(earlier.WaitReduceScatter(), strategy_, "reduce_scatter");
      if (sync_) average_.Launch(earlier, static_cast<size_t>(last_launched_));
    }
    ReshardUnit(u);
  } else {
    // One reduce-scatter in flight: the one before has had this unit's
    // backward to finish, and its buffers go before this one's come.
    if (last_launched_ >= 0) {
      ThrowIfFailed((*units_)[last_launched_]->WaitReduceScatter(), strategy_,
                    "reduce_scatter");
    }
    ThrowIfFailed(unit.LaunchReduceScatter(), strategy_, "reduce_scatter");
  }
  last_launched_ = static_cast<int64_t>(u);
  launched_[u] = true;
  trace_.unit_launch.push_back(std::chrono::steady_clock::now());
}

void UnitSchedule::FinishReduceScatters() {
  armed_.assign(armed_.size(), false);
  trace_.backward_end = std::chrono::steady_clock::now();
  for (size_t u = 0; u < units_->size(); ++u) {
    if (launched_[u]) continue;
    ThrowIfFailed((*units_)[u]->LaunchReduceScatter(), strategy_,
                  "reduce_scatter");
  }
  for (size_t u = 0; u < units_->size(); ++u) {
    FsdpUnit& unit = *(*units_)[u];
    ThrowIfFailed(unit.WaitReduceScatter(), strategy_, "reduce_scatter");
    average_.Launch(unit, u);
  }
  average_.Finish();
  launched_.assign(units_->size(), false);
  last_launched_ = -1;
}

void UnitSchedule::Reshard() {
  for (size_t u = 0; u < units_->size(); ++u) {
    if ((*units_)[u]->gather_in_flight() || (*units_)[u]->gathered()) {
      ReshardUnit(u);
    }
  }
  ready_ = 0;
}

absl::StatusOr<std::vector<std::unique_ptr<FsdpUnit>>> ShardIntoUnits(
    CausalLmImpl& model,
    const std::vector<std::pair<std::string, torch::Tensor>>& parameters,
    Communicator* shard, Communicator* across, const torch::Device& device,
    torch::ScalarType compute_dtype,
    const std::function<bool(const std::string& unit)>& fp32,
    const std::string& strategy, int64_t row_width) {
  // Units in the order their first parameter comes: the token embedding
  // alone, the other tensors outside the blocks together, one per block.
  absl::StatusOr<std::vector<UnitSources>> grouped =
      GroupIntoUnits(model, parameters, model.MemberTensors(), strategy);
  if (!grouped.ok()) return grouped.status();
  const std::string embedding = ModulePath(model.token_embedding_name());
  const std::string head = ModulePath(model.head_weight_name());
  std::vector<std::unique_ptr<FsdpUnit>> units;
  try {
    for (UnitSources& u : *grouped) {
      const torch::ScalarType dtype =
          fp32 && fp32(u.name) ? torch::kFloat : compute_dtype;
      const bool rows =
          u.name == embedding || (!model.tied_head() && u.name == head);
      absl::StatusOr<std::unique_ptr<FsdpUnit>> unit =
          FsdpUnit::Create(u.name, std::move(u.sources), shard, device, dtype,
                           /*align=*/rows ? row_width : 1);
      if (!unit.ok()) return unit.status();
      units.push_back(*std::move(unit));
    }
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat(strategy, ": setup: ", e.what_without_backtrace()));
  }
  if (across != nullptr && across->world_size() > 1) {
    // Every shard group starts from the first group's shards.
    for (const auto& unit : units) {
      if (absl::Status s = across->Broadcast(unit->shard(), 0)->Wait();
          !s.ok()) {
        return absl::Status(s.code(),
                            absl::StrCat(strategy, ": broadcast of unit ",
                                         unit->name(), ": ", s.message()));
      }
    }
  }
  return units;
}

std::map<int64_t, size_t> BlockUnits(
    const CausalLmImpl& model,
    const std::vector<std::unique_ptr<FsdpUnit>>& units) {
  std::map<int64_t, size_t> block_unit;
  for (size_t u = 0; u < units.size(); ++u) {
    const ParamPlace place = model.PlaceOf(units[u]->params().front().name);
    if (place.role == ParamRole::kBlock) block_unit[place.block] = u;
  }
  return block_unit;
}

}  // namespace shardtrain
