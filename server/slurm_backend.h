// The Slurm backend (`--launcher slurm`): an attempt is one sbatch
// allocation (server/slurm_job_launcher.h) on the cluster SLURM_CONF points
// at. Its slots are the ranks the partition can place at once — a queue
// limit for shardtraind, not a placement: Slurm places the ranks. Its flags
// are --slurm-*; the cluster view shows Slurm's nodes and partitions, asked
// on each call. Ranks report to --worker-listen, which must be a TCP address
// of this host the nodes reach.
#ifndef SHARDTRAIN_SERVER_SLURM_BACKEND_H_
#define SHARDTRAIN_SERVER_SLURM_BACKEND_H_

#include <memory>
#include <string>

#include "server/backend.h"
#include "server/slurm.h"

namespace shardtrain {

class SlurmBackendKind : public BackendKind {
 public:
  std::string name() const override { return "slurm"; }
  std::string summary() const override {
    return "sbatch/srun on the Slurm cluster SLURM_CONF points at";
  }
  void AddFlags(CLI::App& app) override;
  absl::Status Validate(const BackendContext& context) const override;
  absl::StatusOr<std::unique_ptr<Backend>> Create(
      const BackendContext& context) override;

 private:
  SlurmOptions options_;
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_SERVER_SLURM_BACKEND_H_
