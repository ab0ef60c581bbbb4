#include "worker/engine/train/strategy_kinds.h"

#include "absl/strings/str_join.h"

namespace shardtrain {

const std::vector<StrategyKind>& StrategyKinds() {
  static const auto* const kKinds = new std::vector<StrategyKind>{
      {"single", "single-device", /*distributed=*/false},
      {"ddp", "DDP", /*distributed=*/true},
      {"fsdp", "FSDP", /*distributed=*/true},
  };
  return *kKinds;
}

const StrategyKind* FindStrategyKind(std::string_view name) {
  for (const StrategyKind& kind : StrategyKinds()) {
    if (name == kind.name) return &kind;
  }
  return nullptr;
}

std::vector<std::string> StrategyNames() {
  std::vector<std::string> names;
  for (const StrategyKind& kind : StrategyKinds()) names.push_back(kind.name);
  return names;
}

std::string StrategyNameList() { return absl::StrJoin(StrategyNames(), ", "); }

}  // namespace shardtrain
