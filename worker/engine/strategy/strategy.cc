#include "worker/engine/strategy/strategy.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <map>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/checkpoint/checkpoint_format.h"
#include "worker/engine/strategy/distributed_helpers.h"

namespace shardtrain {

torch::Tensor SumOfSquares(const std::vector<torch::Tensor>& tensors,
                           const torch::Device& device) {
  torch::Tensor sum = torch::zeros(
      {}, torch::TensorOptions().dtype(torch::kDouble).device(device));
  // On a GPU one multi-tensor norm per device and dtype (its tree reductions
  // are accurate). On CPU ATen's float norm accumulates in float, off by
  // ~1e-4 relative over a 6M-element embedding, which would make the
  // sharded and unsharded norms disagree: pieces of 1 Mi elements are summed
  // in double instead (an 8 MiB temporary).
  constexpr int64_t kPiece = int64_t{1} << 20;
  std::map<std::pair<std::string, int>, std::vector<torch::Tensor>> groups;
  for (const torch::Tensor& t : tensors) {
    if (!t.defined() || t.numel() == 0) continue;
    if (t.is_cpu()) {
      const torch::Tensor flat = t.reshape({-1});
      for (int64_t start = 0; start < flat.numel(); start += kPiece) {
        const torch::Tensor piece =
            flat.narrow(0, start, std::min(kPiece, flat.numel() - start))
                .to(torch::kDouble);
        sum += at::dot(piece, piece).to(device);
      }
      continue;
    }
    groups[{t.device().str(), static_cast<int>(t.scalar_type())}].push_back(t);
  }
  for (const auto& [key, group] : groups) {
    const torch::Tensor norms = at::stack(at::_foreach_norm(group, 2));
    sum += norms.to(device, torch::kDouble).pow(2).sum();
  }
  return sum;
}

std::vector<AdamW::Group> WeightDecayGroups(
    const std::vector<torch::Tensor>& params, double weight_decay) {
  AdamW::Group decay{{}, weight_decay};
  AdamW::Group no_decay{{}, 0.0};
  for (const torch::Tensor& p : params) {
    (p.dim() >= 2 ? decay : no_decay).params.push_back(p);
  }
  return {decay, no_decay};
}

double Strategy::ClipGradNorm(double max_norm) {
  return ClipGradientNorm(HeldPieces(), placement_world(), device(), max_norm,
                          name());
}

std::vector<StateSlice> Strategy::StateSlices(bool to_save) {
  return PlacedStateSlices(HeldPieces(), optimizer(), to_save);
}

std::vector<StateSlice> Strategy::GradientSlices() {
  return PlacedGradientSlices(HeldPieces());
}

void Strategy::RecordGlobalShapes(CausalLmImpl& model) {
  global_shapes_.clear();
  for (const auto& item : model.named_parameters()) {
    global_shapes_[item.key()] = item.value().sizes().vec();
  }
}

absl::Status Strategy::ExportModel(const std::string& path) {
  absl::Status status = absl::OkStatus();
  std::vector<std::pair<torch::Tensor*, torch::Tensor>> restore;
  try {
    torch::NoGradGuard no_grad;
    const std::vector<HeldPiece> pieces = HeldPieces();
    const std::map<std::string, torch::Tensor*> members =
        model().MemberTensors();
    const bool writer = rank() == 0;
    int64_t contributed = 0;
    int64_t expected = 0;
    for (const auto& [name, global] : global_shapes_) {
      torch::Tensor whole = GatherWhole(pieces, name, global, placement_world(),
                                        device(), this->name(), &contributed);
      expected += whole.numel();
      if (!writer) continue;
      const auto member = members.find(name);
      if (member == members.end()) {
        status = absl::InternalError(
            absl::StrCat("export: the model has no member for ", name));
        continue;
      }
      restore.emplace_back(member->second, *member->second);
      *member->second = whole;
    }
    // Every element came from exactly one rank.
    torch::Tensor count = torch::tensor(
        {static_cast<double>(contributed)},
        torch::TensorOptions().dtype(torch::kDouble).device(device()));
    if (placement_world() != nullptr) {
      ThrowIfFailed(placement_world()->AllReduce(count)->Wait(), this->name(),
                    "all_reduce (export count)");
    }
    if (count.item<double>() != static_cast<double>(expected)) {
      status = absl::InternalError(
          absl::StrCat("export: the ranks hold ", count.item<double>(),
                       " of the model's ", expected, " elements"));
    } else if (writer && status.ok()) {
      status = model().ExportWeights(path);
    }
  } catch (const c10::Error& e) {
    status = absl::InternalError(
        absl::StrCat("export: ", e.what_without_backtrace()));
  }
  for (auto& [member, value] : restore) *member = value;
  return status;
}

torch::Tensor Strategy::ForwardBackwardStep(const std::vector<Batch>& batches) {
  const double scale = 1.0 / static_cast<double>(batches.size());
  torch::Tensor loss_sum;
  for (size_t i = 0; i < batches.size(); ++i) {
    torch::Tensor loss =
        ForwardBackward(batches[i].inputs, batches[i].targets, scale,
                        /*sync=*/i + 1 == batches.size());
    loss_sum = loss_sum.defined() ? loss_sum + loss : loss;
  }
  return loss_sum * scale;
}

absl::Status Strategy::SaveCheckpoint(const std::string& dir,
                                      const nlohmann::json& training) {
  absl::Status status = absl::OkStatus();
  try {
    // Host copies (fp32, contiguous) of the slices, alive until written.
    const std::vector<StateSlice> slices = StateSlices(/*to_save=*/true);
    std::vector<torch::Tensor> host;
    std::vector<ChunkToWrite> chunks;
    host.reserve(slices.size());
    for (const StateSlice& slice : slices) {
      host.push_back(
          slice.data.detach().to(torch::kCPU, torch::kFloat).contiguous());
      chunks.push_back({slice.name, slice.shape, slice.offset,
                        host.back().numel(), host.back().data_ptr<float>()});
    }
    status = WriteRankChunks(dir, rank(), chunks);
  } catch (const c10::Error& e) {
    status = absl::InternalError(
        absl::StrCat("checkpoint: ", e.what_without_backtrace()));
  }
  // Every rank must have written before rank 0 merges the indexes; one
  // rank's failure fails the checkpoint everywhere.
  const bool everywhere = AllReduceMean(status.ok() ? 1.0 : 0.0) == 1.0;
  if (!status.ok()) return status;
  if (!everywhere) {
    return absl::InternalError(
        absl::StrCat("checkpoint ", dir, ": another rank could not write"));
  }
  if (rank() != 0) return absl::OkStatus();
  nlohmann::json record = training.is_object() ? training : nlohmann::json{};
  record["optimizer_steps"] = optimizer_steps();
  return WriteCheckpointMetadata(dir, world_size(), record);
}

absl::Status Strategy::LoadCheckpoint(const std::string& dir) {
  absl::StatusOr<std::unique_ptr<CheckpointReader>> reader =
      CheckpointReader::Open(dir);
  if (!reader.ok()) return reader.status();
  return LoadCheckpoint(**reader);
}

absl::Status Strategy::LoadCheckpoint(CheckpointReader& reader) {
  const std::string& dir = reader.dir();
  const CheckpointMetadata& metadata = reader.metadata();
  const int64_t optimizer_steps =
      TrainingInt(metadata.training, "optimizer_steps");
  if (optimizer_steps < 0) {
    return absl::DataLossError(
        absl::StrCat("checkpoint ", dir, " records no optimizer step count"));
  }
  try {
    torch::NoGradGuard no_grad;
    for (const StateSlice& slice : StateSlices(/*to_save=*/false)) {
      const TensorEntry* saved = metadata.Find(slice.name);
      if (saved == nullptr || saved->shape != slice.shape) {
        return absl::FailedPreconditionError(absl::StrCat(
            "checkpoint ", dir, " ",
            saved == nullptr
                ? absl::StrCat("has no tensor ", slice.name)
                : absl::StrCat("holds ", slice.name, " as [",
                               absl::StrJoin(saved->shape, ", "), "], not [",
                               absl::StrJoin(slice.shape, ", "), "]"),
            ": it was written for another model (wrong --model?)"));
      }
      torch::Tensor buffer = torch::empty({slice.data.numel()}, torch::kFloat);
      if (absl::Status s = reader.Read(slice.name, slice.offset, buffer.numel(),
                                       buffer.data_ptr<float>());
          !s.ok()) {
        return s;
      }
      slice.data.copy_(buffer);
    }
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat("checkpoint ", dir, ": ", e.what_without_backtrace()));
  }
  set_optimizer_steps(optimizer_steps);
  return absl::OkStatus();
}

}  // namespace shardtrain
