#include "core/run/strategy_kinds.h"

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/nearest_name.h"

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

std::string StrategyFlagHelp(bool with_auto) {
  std::vector<std::string> rows;
  for (const StrategyKind& kind : StrategyKinds()) {
    rows.push_back(absl::StrCat(kind.name, " (", kind.help, ")"));
  }
  if (with_auto) {
    rows.push_back(absl::StrCat(
        kAutoStrategy,
        " (the mesh predicted fastest for the ranks, picked at the start)"));
  }
  return absl::StrJoin(rows, " | ");
}

std::string StrategyDisplayNames() {
  std::vector<std::string> names;
  for (const StrategyKind& kind : StrategyKinds()) {
    names.push_back(kind.display_name);
  }
  if (names.size() <= 1) return absl::StrJoin(names, "");
  return absl::StrCat(absl::StrJoin(names.begin(), names.end() - 1, ", "),
                      " and ", names.back());
}

namespace {

// "is not one", and the strategy or "auto" it is a typo of.
std::string NotOne(const std::string& name) {
  std::vector<std::string> known = StrategyNames();
  known.push_back(kAutoStrategy);
  const std::string near = NearestName(name, known);
  return absl::StrCat(
      "is not one",
      near.empty() ? "" : absl::StrCat(" (did you mean ", near, "?)"));
}

}  // namespace

absl::StatusOr<StudyEntry> ParseStudyEntry(std::string_view entry) {
  StudyEntry out;
  out.name = std::string(entry);
  const auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--strategies: '", out.name, "' ", why, "; an entry is a strategy (",
        StrategyNameList(),
        ") or a mesh: [ppS x] [<strategy>[D]] [x tpT] (S pipeline stages, D "
        "data-parallel replicas, T tensor-parallel ranks, e.g. pp2xddp2, "
        "ddp2xtp2, pp2xtp2)"));
  };
  const auto number = [](const std::string& text, int64_t* value) {
    return !text.empty() && std::all_of(text.begin(), text.end(), [](char c) {
      return absl::ascii_isdigit(c);
    }) && absl::SimpleAtoi(text, value);
  };
  const std::string& name = out.name;
  std::vector<std::string> parts = absl::StrSplit(name, 'x');
  const bool staged = absl::StartsWith(parts.front(), "pp");
  const bool tensor =
      parts.size() > (staged ? 1u : 0u) && absl::StartsWith(parts.back(), "tp");
  if (!staged && !tensor) {
    if (name == kAutoStrategy) {  // the mesh predicted fastest, chosen later
      out.strategy = name;
      return out;
    }
    if (FindStrategyKind(name) == nullptr) return bad(NotOne(name));
    out.strategy = name;
    return out;
  }
  if (staged) {
    if (!number(parts.front().substr(2), &out.pipeline_stages) ||
        out.pipeline_stages < 2) {
      return bad("names no number of stages (2 or more) after pp");
    }
    parts.erase(parts.begin());
  }
  if (tensor) {
    if (!number(parts.back().substr(2), &out.tensor_parallel) ||
        out.tensor_parallel < 2) {
      return bad(
          "names no number of tensor-parallel ranks (2 or more) after "
          "tp");
    }
    parts.pop_back();
  }
  if (parts.empty()) {
    out.strategy = "single";
    return out;
  }
  if (parts.size() > 1) return bad("names more than one strategy");
  const std::string& rest = parts.front();
  size_t name_end = rest.size();
  while (name_end > 0 && absl::ascii_isdigit(rest[name_end - 1])) --name_end;
  out.strategy = rest.substr(0, name_end);
  const StrategyKind* kind = FindStrategyKind(out.strategy);
  if (kind == nullptr) {
    const std::string near = NearestName(out.strategy, StrategyNames());
    return bad(absl::StrCat(
        staged ? "names no strategy after 'x'" : "names no strategy",
        near.empty() ? "" : absl::StrCat(" (did you mean ", near, "?)")));
  }
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
