#include "worker/engine/strategy/unit_schedule.h"

#include <c10/core/GradMode.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace shardtrain {

UnitSchedule::UnitSchedule(const std::vector<std::unique_ptr<FsdpUnit>>* units,
                           std::vector<int64_t> group_of,
                           std::map<int64_t, size_t> block_unit, int64_t groups,
                           std::string strategy)
    : units_(units),
      group_of_(std::move(group_of)),
      block_unit_(std::move(block_unit)),
      strategy_(std::move(strategy)),
      armed_(static_cast<size_t>(std::max<int64_t>(1, groups)), false),
      launched_(units->size(), false) {
  for (size_t u = 0; u < units_->size(); ++u) {
    hooks_.Add((*units_)[u]->full(), [this, u] { OnGradReady(u); });
  }
}

void UnitSchedule::LaunchGathers() {
  // A failed step may have left a group armed, or gradients held.
  for (const auto& unit : *units_) unit->DropUnshardedGradient();
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
  for (const auto& unit : *units_) {
    ThrowIfFailed(unit->WaitReduceScatter(), strategy_, "reduce_scatter");
  }
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

}  // namespace shardtrain
