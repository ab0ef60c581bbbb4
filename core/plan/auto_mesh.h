// `--strategy auto` (shardtrain-train's launcher, and the coordinator when
// a job starts): every mesh of the ranks ranked by predicted step time
// (core/plan/mesh_search.h, this host's measured rates), the fastest that
// fits memory_cap trained, the choice logged with its predicted numbers,
// and after a shardtrain-train run set beside the measured ones (and in
// <out>/auto_mesh.json). Torch-free.
#ifndef SHARDTRAIN_CORE_PLAN_AUTO_MESH_H_
#define SHARDTRAIN_CORE_PLAN_AUTO_MESH_H_

#include <cstdint>
#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "core/plan/mesh_search.h"
#include "core/run/train_config.h"

namespace shardtrain {

// The environment variable through which the launcher hands its choice to
// its ranks (MeshFieldsYaml), so that every rank trains the same mesh.
inline constexpr char kAutoMeshVariable[] = "SHARDTRAIN_AUTO_MESH";

struct AutoChoice {
  std::vector<MeshCandidate> ranked;  // fastest first; [0] was chosen
  std::string why;
};

// This host's rates for `config`'s device and model from the cache; when
// it has none and `calibrator` names a shardtrain-train binary, measured
// first (`--calibrate`, a few seconds to a minute, said on `log`).
absl::StatusOr<HostRates> LoadOrMeasureHostRates(const TrainConfig& config,
                                                 const std::string& calibrator,
                                                 std::ostream& log);

// Replaces `config`'s strategy "auto" by the chosen mesh's fields, for a
// run of `world_size` ranks, `ranks_per_host` per host. The rates come from
// the cache; when it has none and `calibrator` names a shardtrain-train
// binary, it measures them first (`--calibrate`, a few seconds to a
// minute). Prints the choice and the runners-up to `log`. Errors: no rates,
// nothing fits (RankMeshesForAuto), a model that does not parse.
absl::Status ResolveAutoStrategy(TrainConfig* config, int64_t world_size,
                                 int64_t ranks_per_host,
                                 const std::string& calibrator,
                                 std::ostream& log, AutoChoice* choice);

// After the run: the median tokens/s of `config.out`/metrics.jsonl (steps
// after the first) beside the prediction, to `log` and to
// `config.out`/auto_mesh.json. Nothing without an out directory.
void ReportAutoOutcome(const AutoChoice& choice, const TrainConfig& config,
                       std::ostream& log);

}  // namespace shardtrain

#endif  // SHARDTRAIN_CORE_PLAN_AUTO_MESH_H_
