// MeshGroups: every communicator a rank of a run's mesh
// (core/run/device_mesh.h, built once by BuildRunMesh) takes part in,
// created once, here, in one order on every rank: along each dimension of
// size > 1 (pipeline, replicate, shard, tensor), the data-parallel group
// (replicate x shard: the ranks that share a stage and a tensor slice), and
// the tied ends of the rank's pipeline (its first and last stage, which both
// hold the tied embedding). The strategies ask for theirs; none forms a group
// of its own.
//
// A group that spans the whole world is the world communicator itself, but
// the tensor-parallel group, always its own, so that its traffic is counted
// apart (CommStats::tensor_parallel_bytes).
#ifndef SHARDTRAIN_WORKER_ENGINE_COMM_MESH_GROUPS_H_
#define SHARDTRAIN_WORKER_ENGINE_COMM_MESH_GROUPS_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "core/run/device_mesh.h"
#include "worker/engine/comm/communicator.h"

namespace shardtrain {

class MeshGroups {
 public:
  // The groups of `world`'s rank in `mesh` (of world->world_size() ranks);
  // the tied ends' only with `tied_ends` (a model whose head is its
  // embedding). `world` must outlive the result. Collective over each
  // group's members.
  static absl::StatusOr<std::unique_ptr<MeshGroups>> Create(
      Communicator* world, const DeviceMesh& mesh, bool tied_ends = true);
  // The same for the mesh BuildRunMesh makes of `shape` over `world`'s
  // ranks (`ranks_per_node` per node); its refusal otherwise.
  static absl::StatusOr<std::unique_ptr<MeshGroups>> Create(
      Communicator* world, const RunMeshShape& shape, int64_t ranks_per_node);

  MeshGroups(const MeshGroups&) = delete;
  MeshGroups& operator=(const MeshGroups&) = delete;

  const DeviceMesh& mesh() const { return mesh_; }
  Communicator* world() const { return world_; }
  int64_t rank() const { return world_->rank(); }
  // This rank's coordinate along `dim`.
  int64_t Coordinate(MeshDim dim) const {
    return mesh_.Coordinate(rank(), dim);
  }

  // This rank's group along `dim`; nullptr when the dimension has one rank.
  Communicator* Along(MeshDim dim) const;
  // The ranks that share this rank's stage and tensor slice (replicate x
  // shard); nullptr when there is one.
  Communicator* DataParallel() const { return data_parallel_; }
  // The first and last stage of this rank's pipeline, on those two stages
  // of a pipeline of two or more with tied ends; nullptr elsewhere.
  Communicator* TiedEnds() const { return tied_ends_.get(); }

  // Every group's traffic since the last call (the world's included),
  // summed; the tensor group's also as tensor_parallel_bytes, and with both
  // replicate and shard dimensions (HSDP) the replicate group's as
  // inter_group_bytes.
  CommStats TakeStats();

 private:
  MeshGroups(Communicator* world, DeviceMesh mesh)
      : world_(world), mesh_(std::move(mesh)) {}

  Communicator* const world_;
  const DeviceMesh mesh_;
  std::vector<std::unique_ptr<Communicator>> owned_;
  Communicator* along_[4] = {nullptr, nullptr, nullptr, nullptr};
  Communicator* data_parallel_ = nullptr;
  std::unique_ptr<Communicator> tied_ends_;
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_WORKER_ENGINE_COMM_MESH_GROUPS_H_
