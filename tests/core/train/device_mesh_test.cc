#include "core/train/device_mesh.h"

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

}  // namespace
}  // namespace shardtrain
