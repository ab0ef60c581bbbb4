// Placements (worker/engine/strategy/placement.h): a piece's runs of the
// global tensor, its holders, and the three functions computed from
// placements alone — the gradient norm counting each element once, the
// checkpoint's shares and the gradient slices — on in-process ranks.
#include "worker/engine/strategy/placement.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <map>
#include <mutex>
#include <vector>

#include "tests/fakes/in_process_communicator.h"
#include "worker/engine/strategy/strategy.h"

namespace shardtrain {
namespace placement_test {

std::vector<std::pair<int64_t, int64_t>> Runs(const Placement& p) {
  std::vector<std::pair<int64_t, int64_t>> runs;
  for (const FlatRun& run : p.runs) runs.emplace_back(run.offset, run.length);
  return runs;
}

// A column slice of a [2, 8] matrix (columns 2..5: runs 2+4 and 10+4),
// narrowed to an FSDP shard of its flattening: elements 3..6 of the slice
// are global 5, then 10..12.
TEST(PlacementTest, NarrowMapsAShardOfASliceOntoTheGlobalTensor) {
  Placement slice;
  slice.name = "w";
  slice.global = {2, 8};
  slice.runs = {{2, 4}, {10, 4}};
  EXPECT_EQ(slice.numel(), 8);
  const Placement shard = slice.Narrow(3, 4);
  EXPECT_EQ(Runs(shard),
            (std::vector<std::pair<int64_t, int64_t>>{{5, 1}, {10, 3}}));
  EXPECT_EQ(shard.numel(), 4);
  EXPECT_EQ(shard.global, slice.global);
  EXPECT_EQ(Runs(slice.Narrow(0, 8)), Runs(slice));
  EXPECT_TRUE(slice.Narrow(8, 0).runs.empty());
  EXPECT_EQ(Runs(Placement::Whole("b", {3, 5})),
            (std::vector<std::pair<int64_t, int64_t>>{{0, 15}}));
}

TEST(PlacementTest, HoldersCountEveryReplicatingDimension) {
  const Placement one = Placement::Whole("b", {4});
  EXPECT_EQ(one.holders(), 1);
  EXPECT_EQ(one.holder_index(), 0);
  // Size 1 adds nothing.
  EXPECT_TRUE(one.ReplicatedAlong(MeshDim::kReplicate, 0, 1).replicas.empty());
  // A tensor-whole gain on tensor rank 1 of 2, in replica 2 of 3.
  const Placement gain = one.ReplicatedAlong(MeshDim::kTensor, 1, 2)
                             .ReplicatedAlong(MeshDim::kReplicate, 2, 3);
  EXPECT_EQ(gain.holders(), 6);
  EXPECT_EQ(gain.holder_index(), 1 * 3 + 2);
  // Narrowing keeps who else holds the elements.
  EXPECT_EQ(gain.Narrow(1, 2).holders(), 6);
}

// Four ranks as TP 2 x DDP 2 (rank = replica * 2 + tensor rank) hold: a
// [2, 4] matrix split by rows (each tensor rank one row, both replicas the
// same), a 3-element gain whole on every rank, and a 4-element bias on
// tensor rank 0 only, sharded over the replicas (each holds a half). The
// norm over all ranks counts every element once, clipping scales every
// piece, the shares written cover every tensor exactly once, and the whole
// tensors are put back together from one rank each.
TEST(PlacementTest, TheNormCountsEachElementOnceAndTheSharesCoverEachOnce) {
  // The global tensors, with distinct values.
  const torch::Tensor matrix = torch::arange(1, 9, torch::kFloat).view({2, 4});
  const torch::Tensor gain = torch::tensor({0.5f, -2.f, 3.f});
  const torch::Tensor bias = torch::tensor({7.f, -1.f, 2.f, 4.f});
  const double expected = std::sqrt(matrix.pow(2).sum().item<double>() +
                                    gain.pow(2).sum().item<double>() +
                                    bias.pow(2).sum().item<double>());

  std::mutex mutex;
  std::vector<double> norms(4);
  std::map<std::string, std::vector<int>> written;  // element -> times
  written["model.m"].assign(8, 0);
  written["model.g"].assign(3, 0);
  written["model.b"].assign(4, 0);
  std::vector<std::vector<float>> clipped_gain(4);
  std::vector<int64_t> contributions(4);
  RunRanks(4, [&](int64_t rank, Communicator& world) {
    const int64_t tensor = rank % 2;
    const int64_t replica = rank / 2;
    std::vector<HeldPiece> pieces;
    auto hold = [&](Placement place, const torch::Tensor& values) {
      torch::Tensor value = values.clone().set_requires_grad(true);
      // The gradient equals the value: the norm is the values' norm.
      value.mutable_grad() = values.clone();
      pieces.push_back({std::move(place), value, {}});
    };
    Placement row;
    row.name = "m";
    row.global = {2, 4};
    row.runs = {{tensor * 4, 4}};
    hold(row.ReplicatedAlong(MeshDim::kReplicate, replica, 2),
         matrix[tensor].clone());
    hold(Placement::Whole("g", {3})
             .ReplicatedAlong(MeshDim::kTensor, tensor, 2)
             .ReplicatedAlong(MeshDim::kReplicate, replica, 2),
         gain);
    if (tensor == 0) {
      // Tensor rank 0 holds the bias, sharded over the replicas; tensor
      // rank 1 holds none of it.
      hold(Placement::Whole("b", {4}).Narrow(replica * 2, 2),
           bias.narrow(0, replica * 2, 2));
    }
    std::vector<torch::Tensor> values;
    for (const HeldPiece& piece : pieces) values.push_back(piece.value);
    const AdamW optimizer({{values, 0.0}}, AdamWOptions{});

    const double norm =
        ClipGradientNorm(pieces, &world, torch::kCPU, expected / 2, "test");
    const std::vector<StateSlice> saved =
        PlacedStateSlices(pieces, optimizer, /*to_save=*/true);
    const std::vector<StateSlice> loaded =
        PlacedStateSlices(pieces, optimizer, /*to_save=*/false);
    // Every rank gets each whole tensor back, each element from one rank.
    int64_t contributed = 0;
    const torch::Tensor whole_m = GatherWhole(
        pieces, "m", {2, 4}, &world, torch::kCPU, "test", &contributed);
    const torch::Tensor whole_g = GatherWhole(
        pieces, "g", {3}, &world, torch::kCPU, "test", &contributed);
    const torch::Tensor whole_b = GatherWhole(
        pieces, "b", {4}, &world, torch::kCPU, "test", &contributed);
    std::lock_guard<std::mutex> lock(mutex);
    EXPECT_TRUE(torch::equal(whole_m, matrix)) << "rank " << rank;
    EXPECT_TRUE(torch::equal(whole_g, gain)) << "rank " << rank;
    EXPECT_TRUE(torch::equal(whole_b, bias)) << "rank " << rank;
    contributions[rank] = contributed;
    norms[rank] = norm;
    for (const StateSlice& slice : saved) {
      if (slice.name.rfind("model.", 0) != 0) continue;
      for (int64_t i = 0; i < slice.data.numel(); ++i) {
        ++written[slice.name][slice.offset + i];
      }
    }
    // What a load fills: every element held, the moments beside the values.
    int64_t held = 0;
    for (const StateSlice& slice : loaded) {
      if (slice.name.rfind("model.", 0) == 0) held += slice.data.numel();
    }
    EXPECT_EQ(held, tensor == 0 ? 4 + 3 + 2 : 4 + 3) << "rank " << rank;
    EXPECT_EQ(loaded.size(), 3 * pieces.size());
    // Clipping to half the norm halves every piece's gradient.
    const torch::Tensor g = pieces[1].Gradient();
    clipped_gain[rank] = std::vector<float>(g.data_ptr<float>(),
                                            g.data_ptr<float>() + g.numel());
  });
  for (int64_t rank = 0; rank < 4; ++rank) {
    EXPECT_NEAR(norms[rank], expected, 1e-12 * expected) << "rank " << rank;
    for (size_t i = 0; i < 3; ++i) {
      EXPECT_NEAR(clipped_gain[rank][i], gain[i].item<float>() / 2, 1e-6);
    }
  }
  // Rank 0 (first of every replica) gives its row, the gain and half the
  // bias; rank 1 its row; rank 2 the other half of the bias; rank 3 none.
  EXPECT_EQ(contributions, (std::vector<int64_t>{4 + 3 + 2, 4, 2, 0}));
  for (const auto& [name, times] : written) {
    for (size_t i = 0; i < times.size(); ++i) {
      EXPECT_EQ(times[i], 1) << name << " element " << i;
    }
  }
}

// On one rank (no world) every piece counts, whatever its placement says
// of others; gradient slices set zeros where none was made.
TEST(PlacementTest, OneRankCountsEverythingAndGradientSlicesMakeZeros) {
  torch::Tensor a = torch::tensor({3.f, 4.f}).set_requires_grad(true);
  a.mutable_grad() = torch::tensor({3.f, 4.f});
  torch::Tensor b = torch::ones({2, 2}).set_requires_grad(true);
  std::vector<HeldPiece> pieces = {
      {Placement::Whole("a", {2}).ReplicatedAlong(MeshDim::kTensor, 1, 2),
       a,
       {}},
      {Placement::Whole("b", {2, 2}), b, {}}};
  EXPECT_DOUBLE_EQ(ClipGradientNorm(pieces, nullptr, torch::kCPU, 0, "test"),
                   5.0);
  const std::vector<StateSlice> grads = PlacedGradientSlices(pieces);
  ASSERT_EQ(grads.size(), 2u);
  EXPECT_EQ(grads[0].name, "grad.a");
  EXPECT_EQ(grads[1].name, "grad.b");
  EXPECT_EQ(grads[1].shape, (std::vector<int64_t>{2, 2}));
  ASSERT_TRUE(b.grad().defined());
  EXPECT_EQ(b.grad().abs().sum().item<float>(), 0.f);
  // A view of the memory the optimizer reads: writing it writes the grad.
  grads[1].data.fill_(2.f);
  EXPECT_EQ(b.grad().sum().item<float>(), 8.f);
}

}  // namespace placement_test
}  // namespace shardtrain
