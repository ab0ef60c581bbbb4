#include "worker/engine/strategy/unit_schedule.h"

#include <c10/core/GradMode.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace shardtrain {

UnitSchedule::UnitSchedule(const std::vector<std::unique_ptr<FsdpUnit>>* units,
                           std::vector<int64_t> group_of,
                           std::map<int64_t, size_t> block_unit, int64_t groups,
                           std::string strategy, Communicator* across)
    : units_(units),
      group_of_(std::move(group_of)),
      block_unit_(std::move(block_unit)),
      strategy_(std::move(strategy)),
      armed_(static_cast<size_t>(std::max<int64_t>(1, groups)), false),
      launched_(units->size(), false),
      average_(across, units->size(), strategy_) {
  for (size_t u = 0; u < units_->size(); ++u) {
    hooks_.Add((*units_)[u]->full(), [this, u] { OnGradReady(u); });
  }
}

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
  for (const auto& unit : *units_) {
    ThrowIfFailed(unit->LaunchGather(), strategy_, "all_gather");
  }
}

void UnitSchedule::Need(size_t end,
                        const std::function<void(FsdpUnit*)>& on_ready) {
  end = std::min(end, units_->size());
  for (; ready_ < end; ++ready_) {
    FsdpUnit* unit = (*units_)[ready_].get();
    ThrowIfFailed(unit->WaitGather(), strategy_, "all_gather");
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

void UnitSchedule::OnGradReady(size_t u) {
  if (!armed_[group_of_[u]]) {
    // A micro-batch before the step's last: its gradient is added into an
    // fp32 buffer and the leaf's (the compute dtype's: bf16 under mixed
    // precision) is freed, so micro-batches accumulate in fp32 as they do
    // on one device; the reduce-scatter adds the last one's.
    (*units_)[u]->HoldUnshardedGradient();
    return;
  }
  if (launched_[u]) return;
  // One reduce-scatter in flight: the one before has had this unit's
  // backward to finish, and its buffers go before this one's come.
  if (last_launched_ >= 0) {
    ThrowIfFailed((*units_)[last_launched_]->WaitReduceScatter(), strategy_,
                  "reduce_scatter");
  }
  last_launched_ = static_cast<int64_t>(u);
  ThrowIfFailed((*units_)[u]->LaunchReduceScatter(), strategy_,
                "reduce_scatter");
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
  for (const auto& unit : *units_) {
    if (unit->gather_in_flight()) (void)unit->WaitGather();
    unit->Reshard();
  }
  ready_ = 0;
}

absl::StatusOr<std::vector<std::unique_ptr<FsdpUnit>>> ShardIntoUnits(
    CausalLmImpl& model,
    const std::vector<std::pair<std::string, torch::Tensor>>& parameters,
    Communicator* shard, Communicator* across, const torch::Device& device,
    torch::ScalarType compute_dtype,
    const std::function<bool(const std::string& unit)>& fp32,
    const std::string& strategy) {
  // Units in the order their first parameter comes: the token embedding
  // alone, the other tensors outside the blocks together, one per block.
  absl::StatusOr<std::vector<UnitSources>> grouped =
      GroupIntoUnits(model, parameters, model.MemberTensors(), strategy);
  if (!grouped.ok()) return grouped.status();
  std::vector<std::unique_ptr<FsdpUnit>> units;
  try {
    for (UnitSources& u : *grouped) {
      const torch::ScalarType dtype =
          fp32(u.name) ? torch::kFloat : compute_dtype;
      absl::StatusOr<std::unique_ptr<FsdpUnit>> unit =
          FsdpUnit::Create(u.name, std::move(u.sources), shard, device, dtype);
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
