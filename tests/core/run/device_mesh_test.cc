#include "core/run/device_mesh.h"

#include <gtest/gtest.h>

#include <vector>

namespace shardtrain {
namespace {

using Groups = std::vector<std::vector<int64_t>>;

TEST(DeviceMeshTest, PipelineStagesAreTheOutermostBlocksOfRanks) {
  // 2 stages x HSDP (2 replicas x 2 shards): 8 ranks.
  absl::StatusOr<DeviceMesh> mesh =
      DeviceMesh::Create({{MeshDim::kPipeline, 2},
                          {MeshDim::kReplicate, 2},
                          {MeshDim::kShard, 2}});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  EXPECT_EQ(mesh->size(), 8);
  EXPECT_EQ(mesh->SizeOf(MeshDim::kTensor), 1);
  EXPECT_EQ(mesh->Coordinate(5, MeshDim::kPipeline), 1);
  EXPECT_EQ(mesh->Coordinate(5, MeshDim::kReplicate), 0);
  EXPECT_EQ(mesh->Coordinate(5, MeshDim::kShard), 1);
  EXPECT_EQ(mesh->Coordinate(5, MeshDim::kTensor), 0);
  EXPECT_EQ(mesh->RanksWithSameCoordinate(5, MeshDim::kPipeline),
            (std::vector<int64_t>{4, 5, 6, 7}));
  // Shard groups are neighbours; the pipeline peers are a stage apart.
  EXPECT_EQ(mesh->Groups(MeshDim::kShard),
            (Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
  EXPECT_EQ(mesh->Groups(MeshDim::kReplicate),
            (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));
  EXPECT_EQ(mesh->Groups(MeshDim::kPipeline),
            (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(mesh->GroupOf(6, MeshDim::kPipeline), (std::vector<int64_t>{2, 6}));
  EXPECT_EQ(mesh->WithCoordinate(6, MeshDim::kPipeline, 0), 2);
  EXPECT_EQ(mesh->Groups(MeshDim::kTensor),
            (Groups{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}));
}

TEST(DeviceMeshTest, EveryRankIsInExactlyOneGroupAlongEachDimension) {
  absl::StatusOr<DeviceMesh> mesh = DeviceMesh::Create(
      {{MeshDim::kPipeline, 3}, {MeshDim::kShard, 2}, {MeshDim::kTensor, 2}});
  ASSERT_TRUE(mesh.ok());
  for (MeshDim dim : {MeshDim::kPipeline, MeshDim::kReplicate, MeshDim::kShard,
                      MeshDim::kTensor}) {
    std::vector<int> seen(mesh->size(), 0);
    for (const std::vector<int64_t>& group : mesh->Groups(dim)) {
      EXPECT_EQ(static_cast<int64_t>(group.size()), mesh->SizeOf(dim));
      for (int64_t r : group) {
        ++seen[r];
        EXPECT_EQ(mesh->GroupOf(r, dim), group) << MeshDimName(dim);
      }
    }
    for (int count : seen) EXPECT_EQ(count, 1) << MeshDimName(dim);
  }
}

TEST(DeviceMeshTest, BadDimensionsAreRefusedByName) {
  absl::StatusOr<DeviceMesh> zero =
      DeviceMesh::Create({{MeshDim::kPipeline, 0}});
  EXPECT_EQ(zero.status().message(),
            "mesh: the pipeline dimension has size 0; it must be >= 1");
  absl::StatusOr<DeviceMesh> order =
      DeviceMesh::Create({{MeshDim::kShard, 2}, {MeshDim::kPipeline, 2}});
  EXPECT_FALSE(order.ok());
  EXPECT_NE(order.status().message().find("pipeline dimension comes after "
                                          "shard"),
            std::string::npos)
      << order.status();
  EXPECT_FALSE(
      DeviceMesh::Create({{MeshDim::kShard, 2}, {MeshDim::kShard, 2}}).ok());
}

TEST(DeviceMeshTest, RanksAreFormattedAsARunOrAList) {
  EXPECT_EQ(FormatRanks({0, 1}), "0,1");
  EXPECT_EQ(FormatRanks({4, 5, 6, 7}), "4-7");
  EXPECT_EQ(FormatRanks({1, 3, 5}), "1,3,5");
  EXPECT_EQ(FormatRanks({2}), "2");
}

// A run's mesh from the shape of its parallelism: the data-parallel ranks
// are replicas (single, ddp), shards (fsdp) or replicated shard groups
// (hsdp), between the pipeline stages and the tensor ranks.
TEST(BuildRunMeshTest, PlacesTheDataParallelRanksByTheirStrategy) {
  RunMeshShape shape;
  shape.pipeline_stages = 2;
  shape.tensor_parallel = 2;
  shape.data_parallel = "ddp";
  absl::StatusOr<DeviceMesh> mesh = BuildRunMesh(shape, 8);
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  EXPECT_EQ(mesh->SizeOf(MeshDim::kPipeline), 2);
  EXPECT_EQ(mesh->SizeOf(MeshDim::kReplicate), 2);
  EXPECT_EQ(mesh->SizeOf(MeshDim::kShard), 1);
  EXPECT_EQ(mesh->SizeOf(MeshDim::kTensor), 2);
  // Stage 0 is ranks 0-3; rank 5's tensor pair is 4,5; its replicas 5,7.
  EXPECT_EQ(mesh->GroupOf(5, MeshDim::kTensor), (std::vector<int64_t>{4, 5}));
  EXPECT_EQ(mesh->GroupOf(5, MeshDim::kReplicate),
            (std::vector<int64_t>{5, 7}));
  shape.data_parallel = "fsdp";
  mesh = BuildRunMesh(shape, 8);
  ASSERT_TRUE(mesh.ok());
  EXPECT_EQ(mesh->SizeOf(MeshDim::kShard), 2);
  EXPECT_EQ(mesh->SizeOf(MeshDim::kReplicate), 1);
  // HSDP: consecutive ranks share a shard group.
  RunMeshShape hsdp;
  hsdp.data_parallel = "hsdp";
  hsdp.shard_group_size = 2;
  mesh = BuildRunMesh(hsdp, 4);
  ASSERT_TRUE(mesh.ok());
  EXPECT_EQ(mesh->GroupOf(2, MeshDim::kShard), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(mesh->GroupOf(2, MeshDim::kReplicate),
            (std::vector<int64_t>{0, 2}));
  // The default shard group: the ranks of a node.
  hsdp.shard_group_size = 0;
  mesh = BuildRunMesh(hsdp, 8, /*ranks_per_node=*/4);
  ASSERT_TRUE(mesh.ok());
  EXPECT_EQ(mesh->SizeOf(MeshDim::kShard), 4);
}

TEST(BuildRunMeshTest, RefusesWhatTheWorldCannotHoldNamingTheNumbers) {
  RunMeshShape shape;
  shape.pipeline_stages = 3;
  shape.data_parallel = "ddp";
  absl::Status s = BuildRunMesh(shape, 4).status();
  EXPECT_NE(s.message().find("4 ranks are not a multiple of 3 pipeline"),
            std::string::npos)
      << s;
  shape.pipeline_stages = 2;
  shape.data_parallel = "single";
  s = BuildRunMesh(shape, 4).status();
  EXPECT_NE(s.message().find("single holds one replica"), std::string::npos)
      << s;
  shape.data_parallel = "hsdp";
  shape.shard_group_size = 3;
  s = BuildRunMesh(shape, 8).status();
  EXPECT_NE(s.message().find("shard group size 3 must divide the 4"),
            std::string::npos)
      << s;
  shape.data_parallel = "zero";
  EXPECT_FALSE(BuildRunMesh(shape, 8).ok());
}

}  // namespace
}  // namespace shardtrain
