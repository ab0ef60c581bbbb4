// The strategies, in one table: their names (flags, JobSpec, metrics), how
// reports name them, whether they run over several ranks, how a rank holds
// the model's state (what the memory plan computes), the smallest world at
// which a study includes them, and their flag help. Validation, `shardtrain
// compare`, `shardtrain plan`, the flags and the report read it; the factory
// (strategy/strategy_factory.cc) builds each one by this name, and a test
// checks the two agree. Torch-free. A new strategy is one file pair in
// strategy/, one row here and one in the factory.
#ifndef SHARDTRAIN_CORE_RUN_STRATEGY_KINDS_H_
#define SHARDTRAIN_CORE_RUN_STRATEGY_KINDS_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace shardtrain {

// The strategy name that asks for the mesh predicted fastest
// (core/plan/auto_mesh.h): resolved before any rank trains.
inline constexpr char kAutoStrategy[] = "auto";

// How a rank holds parameters, gradients and optimizer state.
enum class StateLayout {
  kReplicated,       // all of it, on every rank (single, DDP)
  kSharded,          // 1/N of it over the whole world (FSDP)
  kShardedInGroups,  // 1/G of it within a shard group of G ranks (HSDP)
};

struct StrategyKind {
  const char* name;          // "fsdp"
  const char* display_name;  // "FSDP"
  // Runs over a communicator, one rank per device; otherwise one process on
  // one device (world size 1).
  bool distributed;
  StateLayout layout;
  // The smallest world at which a study (compare's default, plan without
  // --strategy) includes it: below it the strategy is another row's (HSDP
  // under 4 ranks has no two groups of two).
  int64_t min_study_world;
  const char* help;  // a few words for --strategy's help
};

// Every strategy, in the order studies and reports list them.
const std::vector<StrategyKind>& StrategyKinds();
// The row named `name`, or nullptr.
const StrategyKind* FindStrategyKind(std::string_view name);
// "single, ddp, fsdp", for messages.
std::string StrategyNameList();
// Every name, for flag checks.
std::vector<std::string> StrategyNames();
// The names a study at `world` ranks includes (min_study_world).
std::vector<std::string> StudyStrategyNames(int64_t world);
// "single (one device) | ddp (...) | ...", for --strategy's help; with
// `with_auto`, auto's row last (where a job or run takes it: submit,
// shardtrain-train).
std::string StrategyFlagHelp(bool with_auto = false);
// "single, DDP, FSDP and HSDP": the display names, for help texts.
std::string StrategyDisplayNames();

// One entry of a study (`shardtrain compare --strategies`): a strategy row
// ("ddp"), or a mesh in the notation plan --fit prints: [ppS x]
// [<strategy>[D]] [x tpT], the pipeline stages first, the tensor-parallel
// ranks last, the data-parallel strategy over D replicas of the S x T ranks
// between (single when omitted): pp2, pp2xddp2, pp2xhsdp4, tp2, ddp2xtp2,
// fsdp2xtp2, pp2xtp2, pp2xfsdp2xtp2. D omitted: --world-size / (S x T).
struct StudyEntry {
  std::string name;             // as written: the run's label, CSV and legend
  std::string strategy;         // the data-parallel part, a StrategyKinds() row
  int64_t pipeline_stages = 1;  // 1: none (the study's --pp, if any)
  int64_t replicas = 0;         // <strategy>D's D; 0: from the world
  int64_t tensor_parallel = 1;  // 1: none (the study's --tp, if any)
};
// InvalidArgument naming --strategies, the entry and the notation.
absl::StatusOr<StudyEntry> ParseStudyEntry(std::string_view entry);

// HSDP's ranks per shard group when --shard-group-size is 0: the ranks per
// node, so the all-gathers and reduce-scatters stay inside a node and only
// the replicas' all-reduce crosses nodes. When every rank is on one node
// (ranks_per_node >= world_size, or unknown: 0) that would be plain FSDP;
// there the default is the largest divisor of the world size below it
// (half of an even world: two replicas), and 1 for one rank.
int64_t DefaultShardGroupSize(int64_t world_size, int64_t ranks_per_node);
// The shard group size a run uses: `requested` when > 0, else the default.
int64_t ResolveShardGroupSize(int64_t requested, int64_t world_size,
                              int64_t ranks_per_node);

}  // namespace shardtrain

#endif  // SHARDTRAIN_CORE_RUN_STRATEGY_KINDS_H_
