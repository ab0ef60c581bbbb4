#include "worker/engine/strategy/placement.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "worker/engine/strategy/distributed_helpers.h"
#include "worker/engine/strategy/strategy.h"

namespace shardtrain {
namespace {

int64_t Product(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (const int64_t d : shape) n *= d;
  return n;
}

// Appends the elements [from, to) of a piece placed as `placement`, whose
// values in the piece's order are `data` (1-D), as slices of `key`.
void AppendRange(const std::string& key, const Placement& placement,
                 int64_t from, int64_t to, const torch::Tensor& data,
                 std::vector<StateSlice>* slices) {
  int64_t at = 0;  // where the run starts among the piece's elements
  for (const FlatRun& run : placement.runs) {
    const int64_t begin = std::max(from, at);
    const int64_t end = std::min(to, at + run.length);
    if (begin < end) {
      slices->push_back({key, placement.global, run.offset + (begin - at),
                         data.narrow(0, begin, end - begin)});
    }
    at += run.length;
  }
}

}  // namespace

Placement Placement::Whole(std::string name, std::vector<int64_t> global) {
  Placement p;
  p.runs = {FlatRun{0, Product(global)}};
  p.name = std::move(name);
  p.global = std::move(global);
  return p;
}

Placement Placement::TensorParallel(const CausalLmImpl& model, std::string name,
                                    std::vector<int64_t> global, int64_t rank,
                                    int64_t size) {
  Placement p;
  p.runs = model.TensorParallelRuns(name, global, rank, size);
  const bool whole = p.runs.size() == 1 && p.runs[0].offset == 0 &&
                     p.runs[0].length == Product(global);
  p.name = std::move(name);
  p.global = std::move(global);
  return whole ? p.ReplicatedAlong(MeshDim::kTensor, rank, size) : p;
}

int64_t Placement::numel() const {
  int64_t n = 0;
  for (const FlatRun& run : runs) n += run.length;
  return n;
}

Placement Placement::Narrow(int64_t offset, int64_t n) const {
  Placement p;
  p.name = name;
  p.global = global;
  p.replicas = replicas;
  int64_t at = 0;
  for (const FlatRun& run : runs) {
    const int64_t begin = std::max(offset, at);
    const int64_t end = std::min(offset + n, at + run.length);
    if (begin < end) p.runs.push_back({run.offset + (begin - at), end - begin});
    at += run.length;
  }
  return p;
}

Placement Placement::ReplicatedAlong(MeshDim dim, int64_t index,
                                     int64_t count) const {
  Placement p = *this;
  if (count > 1) p.replicas.push_back({dim, index, count});
  return p;
}

int64_t Placement::holders() const {
  int64_t n = 1;
  for (const Replica& r : replicas) n *= r.count;
  return n;
}

int64_t Placement::holder_index() const {
  int64_t index = 0;
  for (const Replica& r : replicas) index = index * r.count + r.index;
  return index;
}

torch::Tensor HeldPiece::Gradient(bool make) const {
  if (grad_view.defined()) return grad_view.view({-1});
  if (!value.grad().defined()) {
    if (!make) return torch::Tensor();
    torch::Tensor param = value;  // the same tensor: its gradient is set
    param.mutable_grad() = torch::zeros_like(value);
  }
  return value.grad().view({-1});
}

double ClipGradientNorm(const std::vector<HeldPiece>& pieces,
                        Communicator* world, const torch::Device& device,
                        double max_norm, std::string_view who) {
  torch::NoGradGuard no_grad;
  const bool alone = world == nullptr || world->world_size() == 1;
  std::vector<torch::Tensor> counted;
  for (const HeldPiece& piece : pieces) {
    // On one rank every copy is this rank's own: all count.
    if (!alone && piece.placement.holder_index() != 0) continue;
    counted.push_back(piece.Gradient());
  }
  torch::Tensor sum = SumOfSquares(counted, device).reshape({1});
  if (!alone) {
    ThrowIfFailed(world->AllReduce(sum)->Wait(), who,
                  "all_reduce (gradient norm)");
  }
  const double norm = std::sqrt(sum.item<double>());
  if (max_norm > 0) {
    const double coef = max_norm / (norm + 1e-6);
    if (coef < 1) {
      for (const HeldPiece& piece : pieces) {
        const torch::Tensor grad = piece.Gradient();
        if (grad.defined()) grad.mul_(coef);
      }
    }
  }
  return norm;
}

std::vector<StateSlice> PlacedStateSlices(const std::vector<HeldPiece>& pieces,
                                          const AdamW& optimizer,
                                          bool to_save) {
  std::vector<StateSlice> slices;
  for (const HeldPiece& piece : pieces) {
    const Placement& place = piece.placement;
    const int64_t n = place.numel();
    int64_t from = 0, to = n;
    if (to_save) {
      // The k-th of the range's holders writes the k-th even share.
      const int64_t holders = place.holders();
      const int64_t k = place.holder_index();
      from = n * k / holders;
      to = n * (k + 1) / holders;
      if (from == to) continue;
    }
    const auto [exp_avg, exp_avg_sq] = optimizer.StateOf(piece.value);
    AppendRange("model." + place.name, place, from, to,
                piece.value.detach().view({-1}), &slices);
    AppendRange("optim.exp_avg." + place.name, place, from, to,
                exp_avg.view({-1}), &slices);
    AppendRange("optim.exp_avg_sq." + place.name, place, from, to,
                exp_avg_sq.view({-1}), &slices);
  }
  return slices;
}

std::vector<StateSlice> PlacedGradientSlices(
    const std::vector<HeldPiece>& pieces) {
  std::vector<StateSlice> slices;
  for (const HeldPiece& piece : pieces) {
    AppendRange("grad." + piece.placement.name, piece.placement, 0,
                piece.placement.numel(), piece.Gradient(/*make=*/true),
                &slices);
  }
  return slices;
}

torch::Tensor GatherWhole(const std::vector<HeldPiece>& pieces,
                          const std::string& name,
                          const std::vector<int64_t>& global,
                          Communicator* world, const torch::Device& device,
                          std::string_view who, int64_t* contributed) {
  torch::NoGradGuard no_grad;
  const bool alone = world == nullptr || world->world_size() == 1;
  // Each element is written by exactly one rank, the first of its holders,
  // into zeros elsewhere: the sum over the ranks is the tensor.
  torch::Tensor whole =
      torch::zeros({Product(global)},
                   torch::TensorOptions().dtype(torch::kFloat).device(device));
  for (const HeldPiece& piece : pieces) {
    const Placement& place = piece.placement;
    if (place.name != name || (!alone && place.holder_index() != 0)) continue;
    const torch::Tensor values = piece.value.detach().reshape({-1});
    int64_t at = 0;
    for (const FlatRun& run : place.runs) {
      whole.narrow(0, run.offset, run.length)
          .copy_(values.narrow(0, at, run.length));
      at += run.length;
    }
    *contributed += at;
  }
  if (!alone) {
    ThrowIfFailed(world->AllReduce(whole)->Wait(), who,
                  "all_reduce (export of " + name + ")");
  }
  return whole.view(global);
}

}  // namespace shardtrain
