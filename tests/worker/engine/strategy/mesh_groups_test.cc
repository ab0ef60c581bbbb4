// MeshGroups: every group of a rank in a run's mesh, made once, in one
// order on every rank, each holding exactly the ranks the mesh puts there.
#include "worker/engine/comm/mesh_groups.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>
#include <mutex>
#include <vector>

#include "core/run/device_mesh.h"
#include "tests/fakes/in_process_communicator.h"

namespace shardtrain {
namespace mesh_groups_test {

// The world ranks in `group`, found by summing one-hot vectors over it.
std::vector<int64_t> Members(Communicator* group, int64_t rank, int64_t world) {
  if (group == nullptr) return {rank};
  torch::Tensor mark = torch::zeros({world});
  mark[rank] = 1;
  EXPECT_TRUE(group->AllReduce(mark)->Wait().ok());
  std::vector<int64_t> members;
  for (int64_t r = 0; r < world; ++r) {
    if (mark[r].item<float>() > 0) members.push_back(r);
  }
  return members;
}

// pp2 x hsdp (2 groups of 2) x tp2 over 16 ranks: every group is the mesh's,
// the tensor group its own, the data-parallel group replicate x shard, and
// only the end stages hold the tied pair.
TEST(MeshGroupsTest, EveryGroupHoldsTheRanksTheMeshPutsThere) {
  constexpr int64_t kWorld = 16;
  RunMeshShape shape;
  shape.pipeline_stages = 2;
  shape.tensor_parallel = 2;
  shape.data_parallel = "hsdp";
  shape.shard_group_size = 2;
  const absl::StatusOr<DeviceMesh> mesh = BuildRunMesh(shape, kWorld);
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  EXPECT_EQ(mesh->SizeOf(MeshDim::kReplicate), 2);
  EXPECT_EQ(mesh->SizeOf(MeshDim::kShard), 2);
  RunRanks(kWorld, [&](int64_t rank, Communicator& world) {
    absl::StatusOr<std::unique_ptr<MeshGroups>> groups =
        MeshGroups::Create(&world, *mesh);
    ASSERT_TRUE(groups.ok()) << groups.status();
    MeshGroups& g = **groups;
    for (MeshDim dim : {MeshDim::kPipeline, MeshDim::kReplicate,
                        MeshDim::kShard, MeshDim::kTensor}) {
      EXPECT_EQ(Members(g.Along(dim), rank, kWorld), mesh->GroupOf(rank, dim))
          << MeshDimName(dim) << " of rank " << rank;
    }
    std::vector<int64_t> data;  // the rank's stage and tensor slice
    for (int64_t r = 0; r < kWorld; ++r) {
      if (mesh->Coordinate(r, MeshDim::kPipeline) ==
              mesh->Coordinate(rank, MeshDim::kPipeline) &&
          mesh->Coordinate(r, MeshDim::kTensor) ==
              mesh->Coordinate(rank, MeshDim::kTensor)) {
        data.push_back(r);
      }
    }
    EXPECT_EQ(Members(g.DataParallel(), rank, kWorld), data);
    // Every rank is its pipeline's first or last stage with two stages.
    const std::vector<int64_t> pipe = mesh->GroupOf(rank, MeshDim::kPipeline);
    ASSERT_NE(g.TiedEnds(), nullptr);
    EXPECT_EQ(Members(g.TiedEnds(), rank, kWorld), pipe);
    // The tensor group's traffic is counted apart.
    g.TakeStats();
    torch::Tensor x = torch::ones({4});
    ASSERT_TRUE(g.Along(MeshDim::kTensor)->AllReduce(x)->Wait().ok());
    const CommStats stats = g.TakeStats();
    EXPECT_GT(stats.tensor_parallel_bytes, 0);
    EXPECT_EQ(stats.tensor_parallel_bytes, stats.bytes);
  });
}

// A group that spans the world is the world, but the tensor group; a
// dimension of one rank has none.
TEST(MeshGroupsTest, TheWorldIsReusedButForTheTensorGroup) {
  RunMeshShape fsdp;
  fsdp.data_parallel = "fsdp";
  const absl::StatusOr<DeviceMesh> sharded = BuildRunMesh(fsdp, 2);
  ASSERT_TRUE(sharded.ok());
  RunMeshShape tp;
  tp.tensor_parallel = 2;
  const absl::StatusOr<DeviceMesh> tensor = BuildRunMesh(tp, 2);
  ASSERT_TRUE(tensor.ok());
  RunRanks(2, [&](int64_t, Communicator& world) {
    absl::StatusOr<std::unique_ptr<MeshGroups>> a =
        MeshGroups::Create(&world, *sharded);
    ASSERT_TRUE(a.ok());
    EXPECT_EQ((*a)->Along(MeshDim::kShard), &world);
    EXPECT_EQ((*a)->DataParallel(), &world);
    EXPECT_EQ((*a)->Along(MeshDim::kPipeline), nullptr);
    EXPECT_EQ((*a)->Along(MeshDim::kTensor), nullptr);
    EXPECT_EQ((*a)->TiedEnds(), nullptr);
    absl::StatusOr<std::unique_ptr<MeshGroups>> b =
        MeshGroups::Create(&world, *tensor);
    ASSERT_TRUE(b.ok());
    ASSERT_NE((*b)->Along(MeshDim::kTensor), nullptr);
    EXPECT_NE((*b)->Along(MeshDim::kTensor), &world);
    EXPECT_EQ((*b)->DataParallel(), nullptr);
  });
}

// An untied head (Llama 3.1 8B's lm_head) leaves the pipeline's ends
// nothing to sum: no tied group is made for them.
TEST(MeshGroupsTest, AnUntiedHeadMakesNoTiedEndsGroup) {
  RunMeshShape pp;
  pp.pipeline_stages = 2;
  const absl::StatusOr<DeviceMesh> mesh = BuildRunMesh(pp, 2);
  ASSERT_TRUE(mesh.ok());
  RunRanks(2, [&](int64_t, Communicator& world) {
    absl::StatusOr<std::unique_ptr<MeshGroups>> tied =
        MeshGroups::Create(&world, *mesh);
    ASSERT_TRUE(tied.ok());
    EXPECT_NE((*tied)->TiedEnds(), nullptr);
    absl::StatusOr<std::unique_ptr<MeshGroups>> untied =
        MeshGroups::Create(&world, *mesh, /*tied_ends=*/false);
    ASSERT_TRUE(untied.ok());
    EXPECT_EQ((*untied)->TiedEnds(), nullptr);
    EXPECT_NE((*untied)->Along(MeshDim::kPipeline), nullptr);
  });
}

TEST(MeshGroupsTest, AMeshOfAnotherSizeIsRefused) {
  RunMeshShape ddp;
  ddp.data_parallel = "ddp";
  const absl::StatusOr<DeviceMesh> mesh = BuildRunMesh(ddp, 4);
  ASSERT_TRUE(mesh.ok());
  RunRanks(2, [&](int64_t, Communicator& world) {
    EXPECT_FALSE(MeshGroups::Create(&world, *mesh).ok());
  });
}

}  // namespace mesh_groups_test
}  // namespace shardtrain
