#include "core/run/device_mesh.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/run/strategy_kinds.h"

namespace shardtrain {

const char* MeshDimName(MeshDim dim) {
  switch (dim) {
    case MeshDim::kPipeline:
      return "pipeline";
    case MeshDim::kReplicate:
      return "replicate";
    case MeshDim::kShard:
      return "shard";
    case MeshDim::kTensor:
      return "tensor";
  }
  return "?";
}

absl::StatusOr<DeviceMesh> DeviceMesh::Create(
    std::vector<Dimension> dimensions) {
  int64_t size = 1;
  for (size_t i = 0; i < dimensions.size(); ++i) {
    const Dimension& d = dimensions[i];
    if (d.size < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("mesh: the ", MeshDimName(d.dim), " dimension has size ",
                       d.size, "; it must be >= 1"));
    }
    if (i > 0 &&
        static_cast<int>(dimensions[i - 1].dim) >= static_cast<int>(d.dim)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "mesh: the ", MeshDimName(d.dim), " dimension comes after ",
          MeshDimName(dimensions[i - 1].dim),
          "; dimensions go pipeline, replicate, shard, tensor, each once"));
    }
    if (size > (int64_t{1} << 40) / d.size) {
      return absl::InvalidArgumentError("mesh: too many ranks");
    }
    size *= d.size;
  }
  return DeviceMesh(std::move(dimensions), size);
}

DeviceMesh::DeviceMesh(std::vector<Dimension> dimensions, int64_t size)
    : dimensions_(std::move(dimensions)), size_(size) {}

int64_t DeviceMesh::SizeOf(MeshDim dim) const {
  for (const Dimension& d : dimensions_) {
    if (d.dim == dim) return d.size;
  }
  return 1;
}

int64_t DeviceMesh::Stride(MeshDim dim) const {
  int64_t stride = 1;
  for (auto it = dimensions_.rbegin(); it != dimensions_.rend(); ++it) {
    if (it->dim == dim) return stride;
    stride *= it->size;
  }
  return 0;
}

int64_t DeviceMesh::Coordinate(int64_t rank, MeshDim dim) const {
  const int64_t stride = Stride(dim);
  if (stride == 0) return 0;
  return (rank / stride) % SizeOf(dim);
}

int64_t DeviceMesh::WithCoordinate(int64_t rank, MeshDim dim,
                                   int64_t value) const {
  const int64_t stride = Stride(dim);
  if (stride == 0) return rank;
  return rank + (value - Coordinate(rank, dim)) * stride;
}

std::vector<int64_t> DeviceMesh::GroupOf(int64_t rank, MeshDim dim) const {
  std::vector<int64_t> group;
  for (int64_t i = 0; i < SizeOf(dim); ++i) {
    group.push_back(WithCoordinate(rank, dim, i));
  }
  return group;
}

std::vector<std::vector<int64_t>> DeviceMesh::Groups(MeshDim dim) const {
  std::vector<std::vector<int64_t>> groups;
  for (int64_t rank = 0; rank < size_; ++rank) {
    if (Coordinate(rank, dim) == 0) groups.push_back(GroupOf(rank, dim));
  }
  return groups;  // by rank, so by smallest member
}

std::vector<int64_t> DeviceMesh::RanksWithSameCoordinate(int64_t rank,
                                                         MeshDim dim) const {
  std::vector<int64_t> ranks;
  const int64_t mine = Coordinate(rank, dim);
  for (int64_t r = 0; r < size_; ++r) {
    if (Coordinate(r, dim) == mine) ranks.push_back(r);
  }
  return ranks;
}

std::string FormatRanks(const std::vector<int64_t>& ranks) {
  const bool contiguous =
      ranks.size() > 2 &&
      std::adjacent_find(ranks.begin(), ranks.end(), [](int64_t a, int64_t b) {
        return b != a + 1;
      }) == ranks.end();
  if (contiguous) return absl::StrCat(ranks.front(), "-", ranks.back());
  return absl::StrJoin(ranks, ",");
}

absl::StatusOr<DeviceMesh> BuildRunMesh(const RunMeshShape& shape,
                                        int64_t world_size,
                                        int64_t ranks_per_node) {
  const StrategyKind* kind = FindStrategyKind(shape.data_parallel);
  if (kind == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("mesh: unknown data-parallel strategy '",
                     shape.data_parallel, "'; allowed: ", StrategyNameList()));
  }
  const int64_t stages = std::max<int64_t>(1, shape.pipeline_stages);
  const int64_t tensor = std::max<int64_t>(1, shape.tensor_parallel);
  if (world_size < 1 || world_size % (stages * tensor) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "mesh: ", world_size, " ranks are not a multiple of ", stages,
        " pipeline stage(s) x ", tensor, " tensor-parallel rank(s)"));
  }
  const int64_t data = world_size / (stages * tensor);
  std::vector<DeviceMesh::Dimension> dims = {{MeshDim::kPipeline, stages}};
  if (!kind->distributed) {
    if (data != 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "mesh: ", shape.data_parallel, " holds one replica, but ", world_size,
          " ranks make ", data, " of ", stages * tensor));
    }
    dims.push_back({MeshDim::kReplicate, 1});
  } else if (kind->layout == StateLayout::kReplicated) {
    dims.push_back({MeshDim::kReplicate, data});
  } else if (kind->layout == StateLayout::kSharded) {
    dims.push_back({MeshDim::kShard, data});
  } else {
    const int64_t group =
        ResolveShardGroupSize(shape.shard_group_size, data, ranks_per_node);
    if (group < 1 || data % group != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("hsdp: the shard group size ", group,
                       " must divide the ", data, " data-parallel ranks"));
    }
    dims.push_back({MeshDim::kReplicate, data / group});
    dims.push_back({MeshDim::kShard, group});
  }
  dims.push_back({MeshDim::kTensor, tensor});
  return DeviceMesh::Create(std::move(dims));
}

}  // namespace shardtrain
