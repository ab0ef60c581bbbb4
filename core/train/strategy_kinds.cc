#include "core/train/strategy_kinds.h"

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
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

absl::StatusOr<StudyEntry> ParseStudyEntry(std::string_view entry) {
  StudyEntry out;
  out.name = std::string(entry);
  const auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--strategies: '", out.name, "' ", why, "; an entry is a strategy (",
        StrategyNameList(),
        ") or a pipeline mesh: ppS (S stages) or ppSx<strategy>[D] (S stages "
        "x D ranks per stage, e.g. pp2xddp2)"));
  };
  const auto number = [](const std::string& text, int64_t* value) {
    return !text.empty() && std::all_of(text.begin(), text.end(), [](char c) {
      return absl::ascii_isdigit(c);
    }) && absl::SimpleAtoi(text, value);
  };
  const std::string& name = out.name;
  if (name.rfind("pp", 0) != 0) {
    if (FindStrategyKind(name) == nullptr) return bad("is not one");
    out.strategy = name;
    return out;
  }
  const size_t x = name.find('x');
  if (!number(
          name.substr(2, x == std::string::npos ? std::string::npos : x - 2),
          &out.pipeline_stages) ||
      out.pipeline_stages < 2) {
    return bad("names no number of stages (2 or more) after pp");
  }
  if (x == std::string::npos) {
    out.strategy = "single";
    return out;
  }
  std::string rest = name.substr(x + 1);
  size_t name_end = rest.size();
  while (name_end > 0 && absl::ascii_isdigit(rest[name_end - 1])) --name_end;
  out.strategy = rest.substr(0, name_end);
  const StrategyKind* kind = FindStrategyKind(out.strategy);
  if (kind == nullptr) return bad("names no strategy after 'x'");
  if (name_end < rest.size() &&
      (!number(rest.substr(name_end), &out.replicas) || out.replicas < 1)) {
    return bad("names no valid replica count");
  }
  if (!kind->distributed && out.replicas > 1) {
    return bad("gives single more than one replica (use ddp)");
  }
  return out;
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
