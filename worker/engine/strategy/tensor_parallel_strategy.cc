#include "worker/engine/strategy/tensor_parallel_strategy.h"

#include <torch/csrc/autograd/custom_function.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/train/device_mesh.h"
#include "worker/engine/model/llmc_checkpoint.h"
#include "worker/engine/strategy/autocast.h"
#include "worker/engine/strategy/distributed_helpers.h"
#include "worker/engine/strategy/vocab_parallel.h"

namespace shardtrain {
namespace {

using torch::autograd::AutogradContext;
using tensor_list = torch::autograd::variable_list;

Communicator& CommOf(AutogradContext* ctx) {
  return *reinterpret_cast<Communicator*>(ctx->saved_data.at("comm").toInt());
}

// In place: `tensor` summed over `comm`.
void SumOver(Communicator& comm, torch::Tensor& tensor, const char* what) {
  ThrowIfFailed(comm.AllReduce(tensor)->Wait(), "tensor parallel", what);
}

// f: identity forward, the gradient summed over the group backward.
class EnterFunction : public torch::autograd::Function<EnterFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               Communicator* comm) {
    ctx->saved_data["comm"] = reinterpret_cast<int64_t>(comm);
    return x;
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grad_outputs) {
    // A copy: autograd may hand the same gradient to another branch.
    torch::Tensor grad = grad_outputs[0].clone(at::MemoryFormat::Contiguous);
    SumOver(CommOf(ctx), grad, "all_reduce (f: input gradient)");
    return {grad, torch::Tensor()};
  }
};

// g: the partial products summed over the group forward, identity backward.
class LeaveFunction : public torch::autograd::Function<LeaveFunction> {
 public:
  static torch::Tensor forward(AutogradContext* /*ctx*/,
                               const torch::Tensor& partial,
                               Communicator* comm) {
    torch::Tensor sum = partial.contiguous();
    if (sum.data_ptr() == partial.data_ptr()) sum = partial.clone();
    SumOver(*comm, sum, "all_reduce (g: output)");
    return sum;
  }
  static tensor_list backward(AutogradContext* /*ctx*/,
                              tensor_list grad_outputs) {
    return {grad_outputs[0], torch::Tensor()};
  }
};

}  // namespace

class TensorParallelStrategy::Ops final : public TensorParallelOps {
 public:
  explicit Ops(Communicator* comm) : comm_(comm) {}
  int64_t rank() const override { return comm_->rank(); }
  int64_t size() const override { return comm_->world_size(); }
  torch::Tensor Enter(const torch::Tensor& x) override {
    return EnterFunction::apply(x, comm_);
  }
  torch::Tensor Leave(const torch::Tensor& x) override {
    return LeaveFunction::apply(x, comm_);
  }

 private:
  Communicator* const comm_;
};

TensorParallelStrategy::TensorParallelStrategy(const StrategyOptions& options,
                                               Communicator* world,
                                               int64_t tensor_parallel)
    : options_(options),
      world_(world),
      tensor_parallel_(std::max<int64_t>(1, tensor_parallel)) {}

TensorParallelStrategy::~TensorParallelStrategy() = default;

// The mesh is replicas x tensor ranks, the tensor ranks innermost.
int64_t TensorParallelStrategy::data_parallel_rank() const {
  return options_.rank / tensor_parallel_;
}

int64_t TensorParallelStrategy::data_parallel_size() const {
  return options_.world_size / tensor_parallel_;
}

std::string TensorParallelStrategy::name() const {
  return data_parallel_size() > 1 ? "ddp" : "single";
}

std::string TensorParallelStrategy::layout() const {
  if (model_.is_empty()) return "";
  const Gpt2Config& config = model_->config();
  const int64_t t = tensor_parallel_;
  std::vector<std::string> groups;
  for (int64_t d = 0; d < data_parallel_size(); ++d) {
    std::vector<int64_t> ranks;
    for (int64_t r = 0; r < t; ++r) ranks.push_back(d * t + r);
    groups.push_back(FormatRanks(ranks));
  }
  const std::string replicas =
      data_parallel_size() > 1
          ? absl::StrCat("ddp ", data_parallel_size(), " x ")
          : "";
  return absl::StrCat("mesh: ", replicas, "tensor parallel ", t, ": ranks ",
                      absl::StrJoin(groups, " | "), " each run ",
                      config.n_head / t, " of ", config.n_head, " heads and ",
                      4 * config.n_embd / t, " of ", 4 * config.n_embd,
                      " MLP units of every block and ",
                      config.padded_vocab_size / t, " of ",
                      config.padded_vocab_size, " vocabulary rows");
}

absl::Status TensorParallelStrategy::Setup(Gpt2 model) {
  if (world_ == nullptr || world_->rank() != options_.rank ||
      world_->world_size() != options_.world_size) {
    return absl::InvalidArgumentError(
        "tensor parallel: needs a communicator over the options' ranks");
  }
  if (options_.world_size % tensor_parallel_ != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor_parallel: ", tensor_parallel_, " does not divide the world of ",
        options_.world_size, " ranks"));
  }
  // Groups: the replica's tensor ranks, then the same slice's replicas.
  const DeviceMesh mesh =
      *DeviceMesh::Create({{MeshDim::kReplicate, data_parallel_size()},
                           {MeshDim::kTensor, tensor_parallel_}});
  // The tensor group is its own even when it is the world, so that its
  // traffic is counted apart.
  const std::vector<int64_t> tensor =
      mesh.GroupOf(options_.rank, MeshDim::kTensor);
  absl::StatusOr<std::unique_ptr<Communicator>> group =
      world_->NewGroup(absl::StrCat("tensor-", FormatRanks(tensor)), tensor);
  if (!group.ok()) return group.status();
  own_tensor_ = std::move(*group);
  tensor_ = own_tensor_.get();
  if (data_parallel_size() > 1) {
    const std::vector<int64_t> replicas =
        mesh.GroupOf(options_.rank, MeshDim::kReplicate);
    group = world_->NewGroup(absl::StrCat("replicas-", FormatRanks(replicas)),
                             replicas);
    if (!group.ok()) return group.status();
    replicas_ = std::move(*group);
  }
  model_ = std::move(model);
  try {
    model_->to(options_.device);
    torch::NoGradGuard no_grad;
    // Every rank starts from rank 0's values.
    for (auto& item : model_->named_parameters()) {
      shapes_[item.key()] = item.value().sizes().vec();
      torch::Tensor& p = item.value();
      ThrowIfFailed(world_->Broadcast(p, 0)->Wait(), "tensor parallel",
                    "broadcast of the parameters");
    }
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat("tensor parallel: setup: ", e.what_without_backtrace()));
  }
  ops_ = std::make_unique<Ops>(tensor_);
  if (absl::Status s = model_->ShardForTensorParallel(ops_.get()); !s.ok()) {
    return s;
  }
  try {
    // The vocabulary-parallel embedding and head add wte's gradient into
    // its .grad() themselves: it must exist before the first step.
    torch::Tensor& wte = model_->wte()->weight;
    wte.mutable_grad() = torch::zeros_like(wte);
    vocab_.comm = tensor_;
    vocab_.weight = wte.detach();
    vocab_.grad = wte.grad();
    vocab_.row_begin = tensor_->rank() * wte.size(0);
    vocab_.vocab_size = model_->config().vocab_size;
    vocab_.compute_dtype =
        options_.device.is_cuda() && options_.precision == "bf16"
            ? torch::kBFloat16
            : torch::kFloat;
    vocab_.shared_batch = true;
    vocab_.anchor = torch::zeros(
        {}, torch::TensorOptions().device(options_.device).requires_grad(true));
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat("tensor parallel: setup: ", e.what_without_backtrace()));
  }
  optimizer_ = std::make_unique<AdamW>(
      WeightDecayGroups(model_->parameters(), options_.weight_decay),
      options_.adamw);
  return absl::OkStatus();
}

torch::Tensor TensorParallelStrategy::ForwardBackward(
    const torch::Tensor& inputs, const torch::Tensor& targets,
    double loss_scale, bool sync) {
  const torch::Tensor loss = Forward(inputs, targets, loss_scale);
  (loss * loss_scale).backward();
  if (sync) AverageOverReplicas();
  return loss.detach();
}

torch::Tensor TensorParallelStrategy::Forward(const torch::Tensor& inputs,
                                              const torch::Tensor& targets,
                                              double grad_scale) {
  TORCH_CHECK(optimizer_ != nullptr,
              "tensor parallel: Setup() must come first");
  TORCH_CHECK(inputs.dim() == 2 && inputs.size(1) >= 1 &&
                  inputs.size(1) <= model_->config().block_size,
              "tensor parallel: inputs must be [B,T] with 1 <= T <= "
              "block_size = ",
              model_->config().block_size, ", got ", inputs.sizes());
  ScopedAutocast autocast(options_.device, options_.precision);
  torch::Tensor x = VocabParallelEmbedding(inputs, vocab_) +
                    model_->wpe()->weight.narrow(0, 0, inputs.size(1));
  for (int64_t i = 0; i < model_->num_blocks(); ++i) x = model_->RunBlock(i, x);
  return VocabParallelLoss(model_->ln_f()(x), targets, vocab_, grad_scale);
}

void TensorParallelStrategy::AverageOverReplicas() {
  if (replicas_ == nullptr) return;
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> params = model_->parameters();
  std::vector<torch::Tensor> grads;
  for (torch::Tensor& p : params) {
    if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
    grads.push_back(p.grad().view({-1}));
  }
  torch::Tensor flat = torch::cat(grads);
  SumOver(*replicas_, flat, "all_reduce (gradients over the replicas)");
  flat.div_(static_cast<double>(data_parallel_size()));
  int64_t offset = 0;
  for (torch::Tensor& p : params) {
    const int64_t n = p.numel();
    p.grad().view({-1}).copy_(flat.narrow(0, offset, n));
    offset += n;
  }
}

double TensorParallelStrategy::ClipGradNorm(double max_norm) {
  torch::NoGradGuard no_grad;
  // Slices differ between a replica's ranks, whole tensors do not: those
  // are counted on its first rank only. Replicas hold the same gradients.
  std::vector<torch::Tensor> grads;
  for (const auto& item : model_->named_parameters()) {
    const bool whole = item.value().sizes().vec() == shapes_.at(item.key());
    if (whole && tensor_->rank() != 0) continue;
    grads.push_back(item.value().grad());
  }
  torch::Tensor sum =
      SumOfSquares(grads, options_.device).to(torch::kFloat).reshape({1});
  SumOver(*tensor_, sum, "all_reduce (gradient norm)");
  const double norm = std::sqrt(sum.item<double>());
  if (max_norm > 0) {
    const double coef = max_norm / (norm + 1e-6);
    if (coef < 1) {
      for (const torch::Tensor& p : model_->parameters()) {
        if (p.grad().defined()) p.grad().mul_(coef);
      }
    }
  }
  return norm;
}

void TensorParallelStrategy::OptimizerStep(double lr) {
  optimizer_->Step(lr);
  optimizer_->ZeroGrad();
}

torch::Tensor TensorParallelStrategy::ForwardLoss(
    const torch::Tensor& inputs, const torch::Tensor& targets) {
  torch::NoGradGuard no_grad;
  return Forward(inputs, targets, /*grad_scale=*/0.0);
}

double TensorParallelStrategy::AllReduceMean(double value) {
  return shardtrain::AllReduceMean(*world_, value, options_.device,
                                   "tensor parallel");
}

void TensorParallelStrategy::Barrier() {
  ThrowIfFailed(world_->Barrier(), "tensor parallel", "barrier");
}

std::vector<StateSlice> TensorParallelStrategy::StateSlices(bool to_save) {
  std::vector<StateSlice> slices;
  const int64_t t = tensor_parallel_;
  // Replicas hold the same state: the first one writes it.
  if (to_save && data_parallel_rank() != 0) return slices;
  for (const auto& item : model_->named_parameters()) {
    const std::string& name = item.key();
    const std::vector<int64_t>& global = shapes_.at(name);
    const torch::Tensor& p = item.value();
    const std::vector<FlatRun> runs =
        TensorParallelRuns(name, global, tensor_->rank(), t);
    const bool whole = p.sizes().vec() == global;
    // Whole tensors are the same on every rank: the first writes them.
    if (whole && to_save && tensor_->rank() != 0) continue;
    const auto [exp_avg, exp_avg_sq] = optimizer_->StateOf(p);
    const std::pair<const char*, torch::Tensor> parts[] = {
        {"model.", p.detach().view(-1)},
        {"optim.exp_avg.", exp_avg.view(-1)},
        {"optim.exp_avg_sq.", exp_avg_sq.view(-1)}};
    for (const auto& [prefix, data] : parts) {
      int64_t at = 0;
      for (const FlatRun& run : runs) {
        slices.push_back({prefix + name, global, run.offset,
                          data.narrow(0, at, run.length)});
        at += run.length;
      }
    }
  }
  return slices;
}

int64_t TensorParallelStrategy::optimizer_steps() const {
  return optimizer_->step_count();
}

void TensorParallelStrategy::set_optimizer_steps(int64_t steps) {
  optimizer_->set_step_count(steps);
}

absl::Status TensorParallelStrategy::ExportModel(const std::string& path) {
  // Each sliced tensor's slices gathered on every rank of a replica (all the
  // same size), put back in place on rank 0, which writes the whole model.
  const int64_t t = tensor_parallel_;
  const std::map<std::string, torch::Tensor*> members = model_->MemberTensors();
  std::vector<std::pair<torch::Tensor*, torch::Tensor>> restore;
  absl::Status status = absl::OkStatus();
  try {
    torch::NoGradGuard no_grad;
    for (const auto& [name, global] : shapes_) {
      torch::Tensor* member = members.at(name);
      if (member->sizes().vec() == global) continue;
      const torch::Tensor local =
          member->detach().to(torch::kFloat).reshape({-1});
      torch::Tensor gathered =
          torch::empty({t * local.numel()}, local.options());
      ThrowIfFailed(tensor_->AllGather(gathered, local)->Wait(),
                    "tensor parallel", "all_gather (export)");
      if (options_.rank != 0) continue;
      torch::Tensor full = torch::empty(global, local.options());
      torch::Tensor flat = full.view({-1});
      for (int64_t r = 0; r < t; ++r) {
        int64_t at = r * local.numel();
        for (const FlatRun& run : TensorParallelRuns(name, global, r, t)) {
          flat.narrow(0, run.offset, run.length)
              .copy_(gathered.narrow(0, at, run.length));
          at += run.length;
        }
      }
      restore.emplace_back(member, *member);
      *member = full;
    }
    if (options_.rank == 0) status = SaveLlmcCheckpoint(model_, path);
  } catch (const c10::Error& e) {
    status = absl::InternalError(
        absl::StrCat("export: ", e.what_without_backtrace()));
  }
  for (auto& [member, value] : restore) *member = value;
  return status;
}

int64_t TensorParallelStrategy::ModelStateBytes() const {
  int64_t bytes = optimizer_->StateBytes();
  for (const torch::Tensor& p : model_->parameters()) {
    bytes += p.nbytes();
    if (p.grad().defined()) bytes += p.grad().nbytes();
  }
  return bytes;
}

CommStats TensorParallelStrategy::TakeCommStats() {
  CommStats total = world_->TakeStats();
  for (Communicator* c : {own_tensor_.get(), replicas_.get()}) {
    if (c == nullptr) continue;
    const CommStats part = c->TakeStats();
    total.seconds += part.seconds;
    total.bytes += part.bytes;
    if (c == own_tensor_.get()) total.tensor_parallel_bytes += part.bytes;
  }
  return total;
}

}  // namespace shardtrain
