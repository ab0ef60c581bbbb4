#include "worker/engine/comm/mesh_groups.h"

#include <algorithm>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace shardtrain {
namespace {

// The ranks that differ from `rank` only along `dims`, ascending.
std::vector<int64_t> GroupOver(const DeviceMesh& mesh, int64_t rank,
                               const std::vector<MeshDim>& dims) {
  std::vector<int64_t> group = {rank};
  for (MeshDim dim : dims) {
    std::vector<int64_t> wider;
    for (int64_t member : group) {
      for (int64_t other : mesh.GroupOf(member, dim)) wider.push_back(other);
    }
    group = std::move(wider);
  }
  std::sort(group.begin(), group.end());
  group.erase(std::unique(group.begin(), group.end()), group.end());
  return group;
}

}  // namespace

absl::StatusOr<std::unique_ptr<MeshGroups>> MeshGroups::Create(
    Communicator* world, const DeviceMesh& mesh, bool tied_ends) {
  if (world == nullptr || world->world_size() != mesh.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("mesh of ", mesh.size(), " ranks over a communicator of ",
                     world == nullptr ? 0 : world->world_size()));
  }
  std::unique_ptr<MeshGroups> groups(new MeshGroups(world, mesh));
  const int64_t rank = world->rank();
  // One order on every rank: the dimensions outermost first, then the
  // data-parallel group, then the tied ends.
  auto make = [&](const std::string& name, const std::vector<int64_t>& ranks,
                  bool own) -> absl::StatusOr<Communicator*> {
    if (ranks.size() < 2) return nullptr;
    if (!own && static_cast<int64_t>(ranks.size()) == world->world_size()) {
      return world;
    }
    absl::StatusOr<std::unique_ptr<Communicator>> group =
        world->NewGroup(absl::StrCat(name, "-", FormatRanks(ranks)), ranks);
    if (!group.ok()) return group.status();
    groups->owned_.push_back(*std::move(group));
    return groups->owned_.back().get();
  };
  for (MeshDim dim : {MeshDim::kPipeline, MeshDim::kReplicate, MeshDim::kShard,
                      MeshDim::kTensor}) {
    absl::StatusOr<Communicator*> group =
        make(MeshDimName(dim), mesh.GroupOf(rank, dim),
             /*own=*/dim == MeshDim::kTensor);
    if (!group.ok()) return group.status();
    groups->along_[static_cast<int>(dim)] = *group;
  }
  const bool replicate = mesh.SizeOf(MeshDim::kReplicate) > 1;
  const bool shard = mesh.SizeOf(MeshDim::kShard) > 1;
  if (replicate && shard) {
    absl::StatusOr<Communicator*> group =
        make("data-parallel",
             GroupOver(mesh, rank, {MeshDim::kReplicate, MeshDim::kShard}),
             /*own=*/false);
    if (!group.ok()) return group.status();
    groups->data_parallel_ = *group;
  } else {
    groups->data_parallel_ =
        groups->Along(replicate ? MeshDim::kReplicate : MeshDim::kShard);
  }
  const std::vector<int64_t> pipe = mesh.GroupOf(rank, MeshDim::kPipeline);
  if (tied_ends && pipe.size() > 1 &&
      (rank == pipe.front() || rank == pipe.back())) {
    const std::vector<int64_t> ends = {pipe.front(), pipe.back()};
    absl::StatusOr<std::unique_ptr<Communicator>> tied =
        world->NewGroup(absl::StrCat("tied-", FormatRanks(ends)), ends);
    if (!tied.ok()) return tied.status();
    groups->tied_ends_ = *std::move(tied);
  }
  return groups;
}

absl::StatusOr<std::unique_ptr<MeshGroups>> MeshGroups::Create(
    Communicator* world, const RunMeshShape& shape, int64_t ranks_per_node) {
  if (world == nullptr) {
    return absl::InvalidArgumentError("mesh: needs a communicator");
  }
  absl::StatusOr<DeviceMesh> mesh =
      BuildRunMesh(shape, world->world_size(), ranks_per_node);
  if (!mesh.ok()) return mesh.status();
  return Create(world, *mesh);
}

Communicator* MeshGroups::Along(MeshDim dim) const {
  return along_[static_cast<int>(dim)];
}

CommStats MeshGroups::TakeStats() {
  CommStats total = world_->TakeStats();
  const bool hybrid = mesh_.SizeOf(MeshDim::kReplicate) > 1 &&
                      mesh_.SizeOf(MeshDim::kShard) > 1;
  auto add = [&](Communicator* c) {
    if (c == nullptr || c == world_) return;
    const CommStats part = c->TakeStats();
    total.seconds += part.seconds;
    total.bytes += part.bytes;
    if (c == Along(MeshDim::kTensor)) {
      total.tensor_parallel_bytes += part.bytes;
    }
    if (hybrid && c == Along(MeshDim::kReplicate)) {
      total.inter_group_bytes += part.bytes;
    }
  };
  for (const auto& group : owned_) add(group.get());
  add(tied_ends_.get());
  return total;
}

}  // namespace shardtrain
