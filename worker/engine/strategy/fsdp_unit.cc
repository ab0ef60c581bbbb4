#include "worker/engine/strategy/fsdp_unit.h"

#include <c10/core/StorageImpl.h>
#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "worker/engine/strategy/distributed_helpers.h"

namespace shardtrain {
namespace {

// Releases the memory of `t` while the tensor, every view of it and every
// autograd graph holding those views stay valid (their data must not be read
// until AllocateStorage). The same StorageImpl calls exist in LibTorch 1.13
// and 2.x.
void FreeStorage(const torch::Tensor& t) {
  c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  impl->set_data_ptr_noswap(c10::DataPtr(nullptr, impl->device()));
  impl->set_nbytes(0);
}

// Gives `t` (whose storage was freed) memory for all its elements again. The
// memory comes from an ordinary tensor allocation, so it goes through the
// device's current allocator (the tracking allocator on CPU, the caching
// allocator on CUDA) and is counted like any other tensor.
void AllocateStorage(const torch::Tensor& t) {
  torch::Tensor fresh =
      torch::empty({t.numel()}, t.options().requires_grad(false));
  c10::StorageImpl* source = fresh.storage().unsafeGetStorageImpl();
  c10::StorageImpl* target = t.storage().unsafeGetStorageImpl();
  const size_t nbytes = source->nbytes();
  target->set_data_ptr_noswap(
      source->set_data_ptr(c10::DataPtr(nullptr, source->device())));
  target->set_nbytes(nbytes);
}

absl::Status Annotate(const absl::Status& status, const std::string& unit,
                      const char* what) {
  return absl::Status(
      status.code(),
      absl::StrCat("FSDP unit ", unit, ": ", what, ": ", status.message()));
}

}  // namespace

absl::StatusOr<std::unique_ptr<FsdpUnit>> FsdpUnit::Create(
    std::string name, std::vector<Source> sources, Communicator* comm,
    const torch::Device& device, torch::ScalarType compute_dtype,
    int64_t align) {
  std::unique_ptr<FsdpUnit> unit(new FsdpUnit());
  FsdpUnit& u = *unit;
  u.name_ = std::move(name);
  u.comm_ = comm;
  u.rank_ = comm->rank();
  u.world_size_ = comm->world_size();
  for (const Source& source : sources) {
    if (source.member == nullptr || !source.value.defined()) {
      return absl::InternalError(absl::StrCat("FSDP unit ", u.name_,
                                              ": parameter '", source.name,
                                              "' has no module member"));
    }
    Param param;
    param.name = source.name;
    param.shape = source.value.sizes().vec();
    param.offset = u.numel_;
    param.numel = source.value.numel();
    param.member = source.member;
    u.numel_ += param.numel;
    u.params_.push_back(std::move(param));
  }
  const int64_t multiple = u.world_size_ * std::max<int64_t>(align, 1);
  u.padded_numel_ = (u.numel_ + multiple - 1) / multiple * multiple;
  const int64_t shard_numel = u.shard_numel();
  try {
    torch::NoGradGuard no_grad;
    torch::Tensor flat = torch::zeros(
        {u.padded_numel_},
        torch::TensorOptions().dtype(torch::kFloat).device(device));
    for (size_t i = 0; i < sources.size(); ++i) {
      flat.narrow(0, u.params_[i].offset, u.params_[i].numel)
          .copy_(sources[i].value.reshape({-1}));
    }
    // Every rank starts from rank 0's values: ranks that built their models
    // differently cannot silently train different replicas of the shards.
    if (u.world_size_ > 1) {
      if (absl::Status s = comm->Broadcast(flat, 0)->Wait(); !s.ok()) {
        return Annotate(s, u.name_, "broadcast of the initial parameters");
      }
    }
    u.shard_ = flat.narrow(0, u.rank_ * shard_numel, shard_numel).clone();
    u.shard_grad_ = torch::zeros_like(u.shard_);
    flat = torch::Tensor();

    // The full parameters are not kept: the model's own tensors become empty
    // (an accidental use is a shape error, not a read of freed memory) and the
    // members stay undefined until the unit is gathered.
    for (Source& source : sources) {
      source.value.set_data(torch::empty({0}, source.value.options()));
      *source.member = torch::Tensor();
    }

    u.full_ =
        torch::empty({u.padded_numel_},
                     torch::TensorOptions().dtype(compute_dtype).device(device))
            .requires_grad_(true);
    FreeStorage(u.full_);

    const int64_t begin = u.rank_ * shard_numel;
    const int64_t end = begin + shard_numel;
    for (const Param& param : u.params_) {
      const int64_t lo = std::max(param.offset, begin);
      const int64_t hi = std::min(param.offset + param.numel, end);
      if (lo >= hi) continue;
      torch::Tensor piece = u.shard_.narrow(0, lo - begin, hi - lo);
      piece.mutable_grad() = u.shard_grad_.narrow(0, lo - begin, hi - lo);
      (param.shape.size() >= 2 ? u.decay_pieces_ : u.no_decay_pieces_)
          .push_back(piece);
    }
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat("FSDP unit ", u.name_, ": ", e.what_without_backtrace()));
  }
  return unit;
}

int64_t FsdpUnit::FullBytes() const {
  return padded_numel_ *
         static_cast<int64_t>(c10::elementSize(full_.scalar_type()));
}

int64_t FsdpUnit::ShardBytes() const {
  return static_cast<int64_t>(shard_.nbytes() + shard_grad_.nbytes());
}

absl::Status FsdpUnit::LaunchGather() {
  if (state_ != State::kFreed) return absl::OkStatus();
  AllocateStorage(full_);
  torch::NoGradGuard no_grad;
  gather_input_ = shard_.scalar_type() == full_.scalar_type()
                      ? shard_
                      : shard_.to(full_.scalar_type());
  // Written through an alias with its own version counter: autograd saved
  // views of full_ in forward, and refilling their storage before backward
  // must not look like an in-place modification to it.
  gather_output_ = full_.variable_data();
  gather_work_ = comm_->AllGather(gather_output_, gather_input_);
  state_ = State::kGathering;
  return absl::OkStatus();
}

absl::Status FsdpUnit::WaitGather() {
  if (state_ == State::kFreed) {
    if (absl::Status s = LaunchGather(); !s.ok()) return s;
  }
  if (state_ != State::kGathering) return absl::OkStatus();
  const absl::Status s = gather_work_->Wait();
  gather_work_.reset();
  gather_input_ = torch::Tensor();
  gather_output_ = torch::Tensor();
  state_ = State::kGathered;
  if (!s.ok()) {
    Reshard();
    return Annotate(s, name_, "all-gather");
  }
  return absl::OkStatus();
}

void FsdpUnit::UseFullParams() {
  TORCH_INTERNAL_ASSERT(state_ == State::kGathered, "FSDP unit ", name_,
                        " used before it was gathered");
  PointMembersAt(full_);
}

void FsdpUnit::PointMembersAt(const torch::Tensor& flat) {
  std::vector<int64_t> sizes;
  for (const Param& param : params_) sizes.push_back(param.numel);
  if (padded_numel_ > numel_) sizes.push_back(padded_numel_ - numel_);
  const std::vector<torch::Tensor> pieces = flat.split_with_sizes(sizes);
  for (size_t i = 0; i < params_.size(); ++i) {
    *params_[i].member = pieces[i].view(params_[i].shape);
  }
}

void FsdpUnit::Reshard() {
  TORCH_INTERNAL_ASSERT(state_ != State::kGathering, "FSDP unit ", name_,
                        " resharded with its all-gather in flight");
  for (const Param& param : params_) *param.member = torch::Tensor();
  if (state_ == State::kGathered) FreeStorage(full_);
  state_ = State::kFreed;
}

void FsdpUnit::HoldUnshardedGradient() {
  torch::Tensor grad = full_.grad();
  if (!grad.defined()) return;
  full_.mutable_grad() = torch::Tensor();
  torch::NoGradGuard no_grad;
  if (held_grad_.defined()) {
    held_grad_.add_(grad);
  } else {
    held_grad_ = grad.to(torch::kFloat).contiguous();
  }
}

void FsdpUnit::SetParameterGradient(const torch::Tensor& grad) {
  const Param& p = params_.front();
  torch::Tensor flat = grad.reshape({-1});
  if (p.numel != padded_numel_) {
    flat = torch::zeros({padded_numel_}, grad.options());
    flat.narrow(0, p.offset, p.numel).copy_(grad.reshape({-1}));
  }
  full_.mutable_grad() = flat;
}

absl::Status FsdpUnit::LaunchReduceScatter() {
  if (absl::Status s = WaitReduceScatter(); !s.ok()) return s;
  torch::Tensor grad = full_.grad();
  if (!grad.defined() && !held_grad_.defined()) return absl::OkStatus();
  full_.mutable_grad() = torch::Tensor();
  torch::NoGradGuard no_grad;
  // Reduced in fp32 even when computing in bf16: the sum over ranks is where
  // bf16's 8-bit mantissa would lose most.
  if (held_grad_.defined()) {
    if (grad.defined()) held_grad_.add_(grad);
    grad = std::move(held_grad_);
    held_grad_ = torch::Tensor();
  }
  rs_input_ = grad.to(torch::kFloat).contiguous();
  rs_output_ = torch::empty_like(shard_);
  rs_work_ = comm_->ReduceScatter(rs_output_, rs_input_);
  return absl::OkStatus();
}

absl::Status FsdpUnit::WaitReduceScatter() {
  if (rs_work_ == nullptr) return absl::OkStatus();
  const absl::Status s = rs_work_->Wait();
  rs_work_.reset();
  rs_input_ = torch::Tensor();
  if (s.ok()) {
    torch::NoGradGuard no_grad;
    shard_grad_.add_(rs_output_, 1.0 / static_cast<double>(world_size_));
  }
  rs_output_ = torch::Tensor();
  return s.ok() ? s : Annotate(s, name_, "reduce-scatter");
}

absl::StatusOr<torch::Tensor> FsdpUnit::GatherMaster() {
  torch::Tensor flat;
  try {
    flat = torch::empty({padded_numel_}, shard_.options());
    if (absl::Status s = comm_->AllGather(flat, shard_)->Wait(); !s.ok()) {
      return Annotate(s, name_, "all-gather of the master parameters");
    }
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat("FSDP unit ", name_, ": ", e.what_without_backtrace()));
  }
  return flat;
}

std::vector<AdamW::Group> ShardWeightDecayGroups(
    const std::vector<std::unique_ptr<FsdpUnit>>& units, double weight_decay) {
  AdamW::Group decay{{}, weight_decay};
  AdamW::Group no_decay{{}, 0.0};
  for (const auto& unit : units) {
    for (const torch::Tensor& p : unit->decay_pieces()) {
      decay.params.push_back(p);
    }
    for (const torch::Tensor& p : unit->no_decay_pieces()) {
      no_decay.params.push_back(p);
    }
  }
  return {decay, no_decay};
}

std::string ModulePath(const std::string& name) {
  const size_t dot = name.rfind('.');
  return dot == std::string::npos ? name : name.substr(0, dot);
}

absl::StatusOr<std::vector<UnitSources>> GroupIntoUnits(
    const CausalLmImpl& model,
    const std::vector<std::pair<std::string, torch::Tensor>>& parameters,
    const std::map<std::string, torch::Tensor*>& members,
    const std::string& who) {
  std::vector<UnitSources> units;
  for (const auto& [name, value] : parameters) {
    const ParamPlace place = model.PlaceOf(name);
    // The token embedding and an untied head alone: the vocabulary-
    // parallel paths read their rows.
    const bool alone = place.role == ParamRole::kTokenEmbedding ||
                       (!model.tied_head() && name == model.head_weight_name());
    const std::string unit = alone ? ModulePath(name)
                             : place.role == ParamRole::kBlock
                                 ? model.BlockName(place.block)
                                 : "root";
    const auto member = members.find(name);
    if (member == members.end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, ": parameter '", name,
          "' is not the weight or bias of a Linear, LayerNorm or Embedding"));
    }
    auto it =
        std::find_if(units.begin(), units.end(),
                     [&](const UnitSources& u) { return u.name == unit; });
    if (it == units.end()) it = units.insert(units.end(), {unit, {}});
    it->sources.push_back({name, value, member->second});
  }
  return units;
}

void ForEachShardPiece(
    FsdpUnit& unit,
    const std::function<void(const FsdpUnit::Param& param, int64_t offset,
                             const torch::Tensor& piece,
                             const torch::Tensor& grad)>& visit) {
  const int64_t shard_begin = unit.shard_offset();
  const int64_t shard_end = shard_begin + unit.shard_numel();
  for (const FsdpUnit::Param& p : unit.params()) {
    const int64_t begin = std::max(p.offset, shard_begin);
    const int64_t end = std::min(p.offset + p.numel, shard_end);
    if (begin >= end) continue;  // none of p is in this shard
    visit(p, begin - p.offset,
          unit.shard().narrow(0, begin - shard_begin, end - begin),
          unit.shard_grad().narrow(0, begin - shard_begin, end - begin));
  }
}

GroupAverage::GroupAverage(Communicator* across, size_t units,
                           std::string strategy)
    : across_(across != nullptr && across->world_size() > 1 ? across : nullptr),
      strategy_(std::move(strategy)),
      launched_(units, false) {}

void GroupAverage::Launch(FsdpUnit& unit, size_t u) {
  if (across_ == nullptr || launched_[u]) return;
  launched_[u] = true;
  works_.emplace_back(&unit, across_->AllReduce(unit.shard_grad()));
}

void GroupAverage::Finish() {
  if (across_ == nullptr) return;
  const double groups = static_cast<double>(across_->world_size());
  auto works = std::move(works_);
  works_.clear();
  launched_.assign(launched_.size(), false);
  torch::NoGradGuard no_grad;
  for (auto& [unit, work] : works) {
    ThrowIfFailed(
        work->Wait(), strategy_,
        "the all-reduce of unit " + unit->name() + " across the shard groups");
    unit->shard_grad().div_(groups);
  }
}

void GroupAverage::Drop() {
  for (auto& [unit, work] : works_) (void)work->Wait();
  works_.clear();
  launched_.assign(launched_.size(), false);
}

}  // namespace shardtrain
