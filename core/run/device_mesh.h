// DeviceMesh: a run's ranks arranged as named dimensions, outermost first —
// pipeline stages × data-parallel replicas × data-parallel shards (× tensor
// parallel, innermost) — as torchtitan's ParallelDims and Megatron's
// parallel_state arrange them. Rank r's coordinate along each dimension is
// its row-major index, so the innermost dimensions hold neighbouring ranks
// (on one node, where the traffic is heaviest) and pipeline stages are the
// outermost blocks of ranks: with 2 stages × FSDP 2, stage 0 is ranks 0,1 and
// stage 1 ranks 2,3.
//
// Each dimension of size > 1 is one c10d sub-group per combination of the
// other coordinates (`Groups`); every rank must create every group, in the
// same order, even those it is not in (c10d's rule). Torch-free.
//
// A run's mesh is built in one place, BuildRunMesh, from the shape of its
// parallelism (RunMeshShape: the configuration's, or a strategy's options in
// tests); the engine's comm layer creates every group from it once
// (worker/engine/comm/mesh_groups.h) and the strategies ask that for theirs.
#ifndef SHARDTRAIN_CORE_RUN_DEVICE_MESH_H_
#define SHARDTRAIN_CORE_RUN_DEVICE_MESH_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace shardtrain {

// The dimensions, outermost first. A mesh holds each at most once.
enum class MeshDim { kPipeline, kReplicate, kShard, kTensor };

// "pipeline", "replicate", "shard", "tensor".
const char* MeshDimName(MeshDim dim);

class DeviceMesh {
 public:
  struct Dimension {
    MeshDim dim;
    int64_t size;
  };

  // A mesh of `dimensions` (outermost first; sizes >= 1; each dim once, in
  // MeshDim order). InvalidArgument names the dimension at fault.
  static absl::StatusOr<DeviceMesh> Create(std::vector<Dimension> dimensions);

  // The product of the sizes: the world size.
  int64_t size() const { return size_; }
  const std::vector<Dimension>& dimensions() const { return dimensions_; }
  // The size along `dim` (1 when the mesh does not have it).
  int64_t SizeOf(MeshDim dim) const;

  // Rank `rank`'s coordinate along `dim` (0 when the mesh does not have it).
  int64_t Coordinate(int64_t rank, MeshDim dim) const;
  // The rank whose coordinates are `rank`'s except `value` along `dim`.
  int64_t WithCoordinate(int64_t rank, MeshDim dim, int64_t value) const;

  // The ranks that differ from `rank` only along `dim`, by that coordinate:
  // `rank`'s group along `dim` (just `rank` when the size is 1).
  std::vector<int64_t> GroupOf(int64_t rank, MeshDim dim) const;
  // Every group along `dim`, ordered by their smallest rank: the sub-groups
  // to create, the same list on every rank.
  std::vector<std::vector<int64_t>> Groups(MeshDim dim) const;
  // The ranks that share `rank`'s coordinate along `dim`, ascending: with
  // dim kPipeline, the ranks of `rank`'s stage (its data-parallel world).
  std::vector<int64_t> RanksWithSameCoordinate(int64_t rank, MeshDim dim) const;

 private:
  DeviceMesh(std::vector<Dimension> dimensions, int64_t size);
  // Row-major stride of `dim`; 0 when absent.
  int64_t Stride(MeshDim dim) const;

  std::vector<Dimension> dimensions_;
  int64_t size_;
};

// "0,1" or "0-3" for a contiguous run, for layout lines.
std::string FormatRanks(const std::vector<int64_t>& ranks);

// The shape of a run's parallelism: pipeline stages, tensor-parallel ranks
// per replica, and the data-parallel strategy over the replicas (a
// StrategyKinds() row: single, ddp, fsdp, hsdp) with HSDP's shard group
// size (0: ResolveShardGroupSize's default).
struct RunMeshShape {
  int64_t pipeline_stages = 1;
  int64_t tensor_parallel = 1;
  std::string data_parallel = "single";
  int64_t shard_group_size = 0;
};

// The run's mesh of `world_size` ranks (`ranks_per_node` per node; 0:
// unknown): pipeline x replicate x shard x tensor. D = world / (S x T)
// data-parallel ranks are replicas under single and ddp, shards under
// fsdp, and D / G replicas of G-rank shard groups under hsdp. Refused,
// naming the numbers: a world that is not a multiple of S x T, single with
// more than one replica, a shard group that does not divide D, an unknown
// strategy.
absl::StatusOr<DeviceMesh> BuildRunMesh(const RunMeshShape& shape,
                                        int64_t world_size,
                                        int64_t ranks_per_node = 0);

}  // namespace shardtrain

#endif  // SHARDTRAIN_CORE_RUN_DEVICE_MESH_H_
