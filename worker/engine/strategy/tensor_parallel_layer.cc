#include "worker/engine/strategy/tensor_parallel_layer.h"

#include <torch/csrc/autograd/custom_function.h>
#include <torch/torch.h>

#include <algorithm>
#include <utility>

#include "worker/engine/strategy/distributed_helpers.h"
#include "worker/engine/strategy/fsdp_unit.h"

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

// f fused with up to three column-parallel projections of its output (see
// TensorParallelOps::EnterLinear). A custom function's inputs must be
// defined tensors on LibTorch 1.13: unused weight slots and absent biases
// are empty placeholders, and `weights` (how many) and `biases` (a bit per
// slot) say which are real.
class EnterLinearFunction
    : public torch::autograd::Function<EnterLinearFunction> {
 public:
  static tensor_list forward(AutogradContext* ctx, const torch::Tensor& x,
                             const torch::Tensor& w0, const torch::Tensor& b0,
                             const torch::Tensor& w1, const torch::Tensor& b1,
                             const torch::Tensor& w2, const torch::Tensor& b2,
                             int64_t weights, int64_t biases,
                             Communicator* comm, int64_t* overlapped) {
    ctx->saved_data["comm"] = reinterpret_cast<int64_t>(comm);
    ctx->saved_data["overlapped"] = reinterpret_cast<int64_t>(overlapped);
    ctx->saved_data["biases"] = biases;
    const torch::Tensor* w[] = {&w0, &w1, &w2};
    const torch::Tensor* b[] = {&b0, &b1, &b2};
    tensor_list out;
    for (int64_t i = 0; i < weights; ++i) {
      out.push_back(
          at::linear(x, *w[i], (biases >> i) & 1 ? *b[i] : torch::Tensor()));
    }
    // The rows as the products read them (bf16 under autocast, as linear
    // would keep them), and the input's own dtype for its gradient.
    ctx->saved_data["x_dtype"] = static_cast<int64_t>(x.scalar_type());
    ctx->save_for_backward({out.front().scalar_type() == x.scalar_type()
                                ? x
                                : x.to(out.front().scalar_type()),
                            w0, w1, w2});
    return out;
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grad_outputs) {
    const tensor_list saved = ctx->get_saved_variables();
    const torch::Tensor& rows = saved[0];
    const auto x_dtype =
        static_cast<c10::ScalarType>(ctx->saved_data["x_dtype"].toInt());
    const int64_t biases = ctx->saved_data["biases"].toInt();
    // The products run in the rows' dtype (the compute dtype); the input
    // gradient is summed over the projections and the ranks in the input's
    // own, as autograd would.
    const torch::ScalarType dtype = rows.scalar_type();
    std::vector<torch::Tensor> weights, grads;
    for (size_t i = 0; i < grad_outputs.size(); ++i) {
      const torch::Tensor& w = saved[1 + i];
      torch::Tensor dy = grad_outputs[i];
      dy = dy.defined()
               ? dy.reshape({-1, w.size(0)}).to(dtype)
               : torch::zeros({rows.size(0), w.size(0)}, rows.options());
      grads.push_back(dy);
      weights.push_back(w);
    }
    torch::Tensor dx;
    for (size_t i = 0; i < grads.size(); ++i) {
      torch::Tensor part = grads[i].mm(weights[i].to(dtype)).to(x_dtype);
      dx = dx.defined() ? dx.add_(part) : part;
    }
    dx = dx.contiguous();
    // The sum over the group goes now; the weight gradients do not need it.
    std::unique_ptr<CommWork> sum = CommOf(ctx).AllReduce(dx);
    tensor_list out = {torch::Tensor()};
    for (size_t i = 0; i < 3; ++i) {
      if (i >= grads.size()) {
        out.insert(out.end(), 2, torch::Tensor());
        continue;
      }
      const torch::ScalarType kept = weights[i].scalar_type();
      out.push_back(grads[i].t().mm(rows).to(kept));
      out.push_back((biases >> i) & 1 ? grads[i].sum(0).to(kept)
                                      : torch::Tensor());
    }
    ThrowIfFailed(sum->Wait(), "tensor parallel",
                  "all_reduce (f: input gradient)");
    out[0] = dx;
    ++*reinterpret_cast<int64_t*>(ctx->saved_data["overlapped"].toInt());
    // weights, biases, comm, overlapped
    out.insert(out.end(), 4, torch::Tensor());
    return out;
  }
};

class GroupOps final : public TensorParallelOps {
 public:
  explicit GroupOps(Communicator* comm) : comm_(comm) {}
  int64_t rank() const override { return comm_->rank(); }
  int64_t size() const override { return comm_->world_size(); }
  torch::Tensor Leave(const torch::Tensor& x) override {
    return LeaveFunction::apply(x, comm_);
  }
  std::vector<torch::Tensor> EnterLinear(
      const torch::Tensor& x, const std::vector<torch::Tensor>& weights,
      const std::vector<torch::Tensor>& biases) override {
    TORCH_CHECK(!weights.empty() && weights.size() <= 3,
                "tensor parallel: 1 to 3 column-parallel weights, got ",
                weights.size());
    const torch::Tensor none = torch::empty({0}, x.options());
    torch::Tensor w[3] = {none, none, none};
    torch::Tensor b[3] = {none, none, none};
    int64_t with_bias = 0;
    for (size_t i = 0; i < weights.size(); ++i) {
      w[i] = weights[i];
      if (i < biases.size() && biases[i].defined()) {
        b[i] = biases[i];
        with_bias |= int64_t{1} << i;
      }
    }
    return EnterLinearFunction::apply(x, w[0], b[0], w[1], b[1], w[2], b[2],
                                      static_cast<int64_t>(weights.size()),
                                      with_bias, comm_, &overlapped_);
  }
  int64_t overlapped_input_gradients() const override { return overlapped_; }

 private:
  Communicator* const comm_;
  int64_t overlapped_ = 0;
};

}  // namespace

std::unique_ptr<TensorParallelOps> MakeTensorParallelOps(Communicator* group) {
  return std::make_unique<GroupOps>(group);
}

VocabShard TensorParallelVocabShard(CausalLmImpl& model, Communicator* group,
                                    const StrategyOptions& options,
                                    bool rows_held, bool head) {
  VocabShard vocab;
  if (rows_held) {
    torch::Tensor& embedding =
        head ? model.head_weight() : model.token_embedding();
    embedding.mutable_grad() = torch::zeros_like(embedding);
    vocab.weight = embedding.detach();
    vocab.grad = embedding.grad();
  }
  vocab.comm = group;
  vocab.row_begin =
      group->rank() * (model.dims().padded_vocab_size / group->world_size());
  vocab.vocab_size = model.dims().vocab_size;
  vocab.compute_dtype = ComputeDtype(options);
  vocab.shared_batch = true;
  vocab.anchor = torch::zeros(
      {}, torch::TensorOptions().device(options.device).requires_grad(true));
  return vocab;
}

VocabParallelEnds::VocabParallelEnds(CausalLmImpl& model, Communicator* group,
                                     const StrategyOptions& options,
                                     bool rows_held, bool embedding, bool head)
    : tied_(model.tied_head()),
      embedding_unit_name_(ModulePath(model.token_embedding_name())),
      head_unit_name_(ModulePath(model.head_weight_name())) {
  if (embedding || (head && tied_)) {
    embedding_ = TensorParallelVocabShard(model, group, options, rows_held);
  }
  if (head && !tied_) {
    head_ = TensorParallelVocabShard(model, group, options, rows_held,
                                     /*head=*/true);
  }
}

bool VocabParallelEnds::IsEndUnit(const std::string& unit) const {
  return unit == embedding_unit_name_ || unit == head_unit_name_;
}

void VocabParallelEnds::FindUnits(
    const std::vector<std::unique_ptr<FsdpUnit>>& units) {
  for (const auto& unit : units) {
    if (unit->name() == embedding_unit_name_) embedding_unit_ = unit.get();
    if (unit->name() == head_unit_name_) head_unit_ = unit.get();
  }
  if (tied_) head_unit_ = nullptr;
}

namespace {

// `shard` pointed at the unit's gathered rows (the unit's one parameter),
// with a gradient of its own under grad mode: fp32 whatever the compute
// dtype, so that the step's micro-batches (and the head's chunks) add up in
// fp32.
void UseGathered(FsdpUnit* unit, VocabShard& shard) {
  if (unit == nullptr) return;
  const FsdpUnit::Param& p = unit->params().front();
  shard.weight =
      unit->full().detach().narrow(0, p.offset, p.numel).view(p.shape);
  if (torch::GradMode::is_enabled()) {
    shard.grad =
        torch::zeros(p.shape, shard.weight.options().dtype(torch::kFloat));
  }
}

}  // namespace

void VocabParallelEnds::UseGatheredUnits() {
  UseGathered(embedding_unit_, embedding_);
  UseGathered(head_unit_, head_);
}

void VocabParallelEnds::UseGatheredUnit(const FsdpUnit* unit) {
  if (unit == nullptr) return;
  if (unit == embedding_unit_) UseGathered(embedding_unit_, embedding_);
  if (unit == head_unit_) UseGathered(head_unit_, head_);
}

void VocabParallelEnds::HandGradientsToUnits() {
  if (embedding_unit_ != nullptr && embedding_.grad.defined()) {
    embedding_unit_->SetParameterGradient(embedding_.grad);
  }
  if (head_unit_ != nullptr && head_.grad.defined()) {
    head_unit_->SetParameterGradient(head_.grad);
  }
}

void VocabParallelEnds::ReleaseUnits() {
  for (auto [unit, shard] : {std::pair(embedding_unit_, &embedding_),
                             std::pair(head_unit_, &head_)}) {
    if (unit == nullptr) continue;
    shard->weight = torch::Tensor();
    shard->grad = torch::Tensor();
  }
}

void VocabParallelEnds::UseGradientViews(CausalLmImpl& model) {
  if (embedding_.grad.defined())
    embedding_.grad = model.token_embedding().grad();
  if (head_.grad.defined()) head_.grad = model.head_weight().grad();
}

}  // namespace shardtrain
