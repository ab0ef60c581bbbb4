#include "core/train/strategy_kinds.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace shardtrain {

const std::vector<StrategyKind>& StrategyKinds() {
  static const auto* const kKinds = new std::vector<StrategyKind>{
      {"single", "single-device", /*distributed=*/false,
       StateLayout::kReplicated, /*min_study_world=*/1, "one device"},
      {"ddp", "DDP", /*distributed=*/true, StateLayout::kReplicated,
       /*min_study_world=*/2, "replicas, gradients all-reduced"},
      {"fsdp", "FSDP", /*distributed=*/true, StateLayout::kSharded,
       /*min_study_world=*/2, "state sharded over every rank"},
      {"hsdp", "HSDP", /*distributed=*/true, StateLayout::kShardedInGroups,
       /*min_study_world=*/4, "sharded within groups, replicated across"},
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

std::vector<std::string> StudyStrategyNames(int64_t world) {
  std::vector<std::string> names;
  for (const StrategyKind& kind : StrategyKinds()) {
    if (world >= kind.min_study_world) names.push_back(kind.name);
  }
  return names;
}

std::string StrategyFlagHelp() {
  std::vector<std::string> rows;
  for (const StrategyKind& kind : StrategyKinds()) {
    rows.push_back(absl::StrCat(kind.name, " (", kind.help, ")"));
  }
  return absl::StrJoin(rows, " | ");
}

bool ComposesWithPipelineStages(const StrategyKind& kind) {
  return kind.layout == StateLayout::kReplicated;
}

namespace {

// "a", "a and b", "a, b and c".
std::string JoinAnd(const std::vector<std::string>& items) {
  if (items.size() <= 1) return absl::StrJoin(items, "");
  return absl::StrCat(absl::StrJoin(items.begin(), items.end() - 1, ", "),
                      " and ", items.back());
}

}  // namespace

std::string PipelineStrategyNameList() {
  std::vector<std::string> names;
  for (const StrategyKind& kind : StrategyKinds()) {
    if (ComposesWithPipelineStages(kind)) names.push_back(kind.name);
  }
  return JoinAnd(names);
}

std::string NonPipelineStrategyDisplayNames() {
  std::vector<std::string> names;
  for (const StrategyKind& kind : StrategyKinds()) {
    if (!ComposesWithPipelineStages(kind)) names.push_back(kind.display_name);
  }
  return JoinAnd(names);
}

int64_t DefaultShardGroupSize(int64_t world_size, int64_t ranks_per_node) {
  if (world_size <= 1) return 1;
  if (ranks_per_node > 0 && ranks_per_node < world_size &&
      world_size % ranks_per_node == 0) {
    return ranks_per_node;
  }
  for (int64_t g = world_size / 2; g > 1; --g) {
    if (world_size % g == 0) return g;
  }
  return 1;
}

int64_t ResolveShardGroupSize(int64_t requested, int64_t world_size,
                              int64_t ranks_per_node) {
  return requested > 0 ? requested
                       : DefaultShardGroupSize(world_size, ranks_per_node);
}

}  // namespace shardtrain
