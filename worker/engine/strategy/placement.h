// Placements: where each piece of the model's parameters that a rank holds
// lives on the run's mesh — the small part of PyTorch's DTensor this engine
// needs. A strategy says what its rank holds (Strategy::HeldPieces: a
// parameter whole, a tensor-parallel slice, an FSDP shard of either, one
// pipeline stage's, a tied embedding's copy) and, from placements alone, one
// function each does what used to be written once per strategy:
//   - the global gradient norm, every element counted once (replicas, whole
//     tensors on every tensor rank, the tied embedding's two stages);
//   - the checkpoint's state slices (what a rank loads, and the even share
//     of a replicated range it writes);
//   - the gradient slices the equivalence tests put together;
//   - the whole tensors an export writes.
#ifndef SHARDTRAIN_WORKER_ENGINE_STRATEGY_PLACEMENT_H_
#define SHARDTRAIN_WORKER_ENGINE_STRATEGY_PLACEMENT_H_

#include <torch/types.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/run/device_mesh.h"
#include "worker/engine/comm/communicator.h"
#include "worker/engine/model/causal_lm.h"
#include "worker/engine/support/adamw.h"

namespace shardtrain {

struct StateSlice;

// Which elements of global tensor `name` (of shape `global`) a piece holds,
// and who else holds the same ones.
struct Placement {
  // Along mesh dimension `dim`, `count` ranks hold these same elements and
  // this rank is the `index`-th of them: DDP's replicas and HSDP's groups
  // (kReplicate), the tensor ranks' copies of a tensor the plan keeps whole
  // (kTensor), the two stages holding a tied embedding (kPipeline). A
  // dimension that splits the tensor (FSDP's shards, tensor-parallel
  // slices, pipeline stages) is not listed: its ranks hold different
  // elements.
  struct Replica {
    MeshDim dim;
    int64_t index = 0;
    int64_t count = 1;
  };

  std::string name;
  std::vector<int64_t> global;
  // Runs of the global tensor flattened row-major that, concatenated, are
  // the piece's elements in the order it holds them.
  std::vector<FlatRun> runs;
  std::vector<Replica> replicas;

  // The whole tensor.
  static Placement Whole(std::string name, std::vector<int64_t> global);
  // Tensor-parallel rank `rank`'s (of `size`) slice of it under `model`'s
  // plan (TensorParallelRuns); a tensor the plan keeps whole is replicated
  // along kTensor.
  static Placement TensorParallel(const CausalLmImpl& model, std::string name,
                                  std::vector<int64_t> global, int64_t rank,
                                  int64_t size);

  // Elements the piece holds.
  int64_t numel() const;
  // Elements [offset, offset + n) of this piece, in its order: an FSDP
  // shard's part of the piece's flattening. Replicas are kept.
  Placement Narrow(int64_t offset, int64_t n) const;
  // Also held by `count` ranks along `dim`, this one the `index`-th;
  // nothing changes when `count` is 1.
  Placement ReplicatedAlong(MeshDim dim, int64_t index, int64_t count) const;

  // How many ranks hold these elements, and this rank's place among them
  // (row-major over `replicas`).
  int64_t holders() const;
  int64_t holder_index() const;
};

// A piece of one parameter that this rank holds: its placement, the memory
// the optimizer updates, and its gradient.
struct HeldPiece {
  Placement placement;
  // What the optimizer updates (a parameter, or a view of a unit's shard):
  // AdamW::StateOf(value) are its moments.
  torch::Tensor value;
  // The gradient: this view (of a unit's shard gradient) when defined,
  // otherwise value's own .grad().
  torch::Tensor grad_view;

  // The gradient, flattened; undefined when there is none, unless `make`:
  // then zeros are set as value's gradient first.
  torch::Tensor Gradient(bool make = false) const;
};

// The global L2 norm of the pieces' gradients over all ranks of `world`
// (nullptr or one rank: this rank's pieces are everything): each element
// counted once, by the first of the ranks holding it. With max_norm > 0
// every piece's gradient is scaled so that the norm is at most max_norm
// (as torch.nn.utils.clip_grad_norm_). Collective over `world`: every rank
// calls it. Throws c10::Error naming `who` when the reduction fails.
double ClipGradientNorm(const std::vector<HeldPiece>& pieces,
                        Communicator* world, const torch::Device& device,
                        double max_norm, std::string_view who);

// The pieces' values and AdamW moments ("model.", "optim.exp_avg.",
// "optim.exp_avg_sq." + name) as ranges of the global tensors. With
// `to_save`, a range held by several ranks is split into even shares, the
// k-th of its holders writing the k-th, so every byte is written once and
// all ranks write at once; otherwise everything held (what a load fills).
std::vector<StateSlice> PlacedStateSlices(const std::vector<HeldPiece>& pieces,
                                          const AdamW& optimizer, bool to_save);

// Every piece's gradient ("grad." + name) as ranges of the global tensors,
// zeros set where none was made; replicas give theirs too.
std::vector<StateSlice> PlacedGradientSlices(
    const std::vector<HeldPiece>& pieces);

// The whole fp32 tensor `name` of shape `global`, put together from the
// pieces every rank of `world` holds (each element from the first of its
// holders) and returned on every rank; its elements' count from this rank
// is added to `*contributed` (how an export checks that every element came
// from somewhere). Collective over `world` (nullptr: this rank alone):
// every rank calls it for the same tensors in the same order. Throws
// c10::Error naming `who` when the reduction fails.
torch::Tensor GatherWhole(const std::vector<HeldPiece>& pieces,
                          const std::string& name,
                          const std::vector<int64_t>& global,
                          Communicator* world, const torch::Device& device,
                          std::string_view who, int64_t* contributed);

}  // namespace shardtrain

#endif  // SHARDTRAIN_WORKER_ENGINE_STRATEGY_PLACEMENT_H_
