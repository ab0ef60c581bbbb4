#include "worker/engine/strategy/vocab_parallel.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "worker/engine/model/causal_lm.h"

namespace shardtrain {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

void Check(const absl::Status& status, const char* what) {
  TORCH_CHECK(status.ok(), "vocab-parallel ", what, ": ", status.ToString());
}

// Every rank's `local` (same shape on all), concatenated in rank order.
torch::Tensor AllGather(Communicator& comm, const torch::Tensor& local,
                        const char* what) {
  const torch::Tensor input = local.contiguous();
  std::vector<int64_t> sizes = input.sizes().vec();
  sizes.insert(sizes.begin(), comm.world_size());
  torch::Tensor output = at::empty(sizes, input.options());
  Check(comm.AllGather(output, input)->Wait(), what);
  return output;
}

// In place: `tensor` summed over the ranks.
void AllReduce(Communicator& comm, torch::Tensor& tensor, const char* what) {
  Check(comm.AllReduce(tensor)->Wait(), what);
}

// Rank r receives the sum over ranks of rows [r*n, (r+1)*n) of `all`.
torch::Tensor ReduceScatter(Communicator& comm, const torch::Tensor& all,
                            const char* what) {
  const torch::Tensor input = all.contiguous();
  std::vector<int64_t> sizes = input.sizes().vec();
  sizes[0] /= comm.world_size();
  torch::Tensor output = at::empty(sizes, input.options());
  Check(comm.ReduceScatter(output, input)->Wait(), what);
  return output;
}

const VocabShard& ShardOf(AutogradContext* ctx) {
  return *reinterpret_cast<const VocabShard*>(
      ctx->saved_data.at("shard").toInt());
}

class EmbeddingFunction : public torch::autograd::Function<EmbeddingFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& ids,
                               const torch::Tensor& /*anchor*/,
                               const VocabShard* shard) {
    Communicator& comm = *shard->comm;
    const int64_t rows = shard->weight.size(0);
    const int64_t c = shard->weight.size(1);
    const torch::Tensor all_ids =
        shard->shared_batch
            ? ids.reshape({-1})
            : AllGather(comm, ids.reshape({-1}), "all-gather of the token ids")
                  .reshape({-1});
    const torch::Tensor local = all_ids - shard->row_begin;
    const torch::Tensor mine = local.ge(0).logical_and(local.lt(rows));
    // Every rank's tokens looked up in this rank's rows, zero where another
    // rank owns the row: the reduce-scatter's sum is then exact.
    torch::Tensor looked_up =
        at::embedding(shard->weight, local.clamp(0, rows - 1))
            .to(shard->compute_dtype);
    looked_up.mul_(mine.unsqueeze(1).to(looked_up.scalar_type()));
    torch::Tensor out;
    if (shard->shared_batch) {
      out = looked_up;
      AllReduce(comm, out, "all-reduce of the embeddings");
    } else {
      out = ReduceScatter(comm, looked_up, "reduce-scatter of the embeddings");
    }
    ctx->saved_data["shard"] = reinterpret_cast<int64_t>(shard);
    ctx->save_for_backward({local, mine});
    std::vector<int64_t> shape = ids.sizes().vec();
    shape.push_back(c);
    return out.view(shape);
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grad_outputs) {
    const VocabShard& shard = ShardOf(ctx);
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    const torch::Tensor& local = saved[0];
    const torch::Tensor& mine = saved[1];
    Communicator& comm = *shard.comm;
    const torch::Tensor grad =
        grad_outputs[0].reshape({-1, shard.weight.size(1)}).to(torch::kFloat);
    const torch::Tensor index = mine.nonzero().squeeze(1);
    torch::NoGradGuard no_grad;
    if (shard.shared_batch) {
      shard.grad.index_add_(0, local.index_select(0, index),
                            grad.index_select(0, index));
    } else {
      const torch::Tensor all_grads =
          AllGather(comm, grad, "all-gather of the embedding gradient")
              .reshape({-1, grad.size(1)});
      shard.grad.index_add_(0, local.index_select(0, index),
                            all_grads.index_select(0, index).mul_(
                                1.0 / static_cast<double>(comm.world_size())));
    }
    return {torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

class LossFunction : public torch::autograd::Function<LossFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx,
                               const torch::Tensor& hidden,
                               const torch::Tensor& targets,
                               const VocabShard* shard, double grad_scale) {
    Communicator& comm = *shard->comm;
    // The batches scored together: every rank's, or the one they share.
    const bool shared = shard->shared_batch;
    const int64_t world = shared ? 1 : comm.world_size();
    const int64_t c = hidden.size(-1);
    const int64_t n = targets.numel();
    const bool want_grad = hidden.requires_grad();
    const torch::Tensor x_all =
        shared ? hidden.reshape({-1, c}).to(torch::kFloat).contiguous()
               : AllGather(comm, hidden.reshape({-1, c}).to(torch::kFloat),
                           "all-gather of the hidden states")
                     .reshape({-1, c});
    const torch::Tensor t_all = shared ? targets.reshape({-1})
                                       : AllGather(comm, targets.reshape({-1}),
                                                   "all-gather of the targets")
                                             .reshape({-1});
    // This rank's scored rows: the embedding's padding rows never enter the
    // softmax (a rank could own padding only).
    const int64_t scored = std::clamp<int64_t>(
        shard->vocab_size - shard->row_begin, 0, shard->weight.size(0));
    const torch::Tensor w = shard->weight.narrow(0, 0, scored);
    const torch::Tensor w_compute = w.to(shard->compute_dtype);
    const torch::Tensor x_compute = x_all.to(shard->compute_dtype);
    const bool fp32 = shard->compute_dtype == torch::kFloat;
    const int64_t chunk_bytes = shard->chunk_bytes > 0
                                    ? shard->chunk_bytes
                                    : LmHeadChunkBytes(hidden.device());
    // From the shard's row count, the same on every rank (its scored rows
    // are not): all ranks must cut the same chunks for the collectives.
    const int64_t chunk_rows = std::max<int64_t>(
        1, chunk_bytes /
               (shard->weight.size(0) * static_cast<int64_t>(sizeof(float))));
    const auto fp32_options = x_all.options().dtype(torch::kFloat);
    torch::Tensor loss_all = at::empty({world * n}, fp32_options);
    torch::Tensor dx_all;
    if (want_grad) dx_all = at::empty({world * n, c}, fp32_options);
    // Without a backward (evaluation) the shard may have no gradient.
    torch::Tensor w_grad;
    if (want_grad) w_grad = shard->grad.narrow(0, 0, scored);
    // Each token's loss is its rank's mean over n tokens.
    const double row_scale = 1.0 / static_cast<double>(n);
    const double w_grad_scale = grad_scale / static_cast<double>(world);

    for (int64_t start = 0; start < world * n; start += chunk_rows) {
      const int64_t len = std::min(chunk_rows, world * n - start);
      const torch::Tensor x = x_compute.narrow(0, start, len);
      const torch::Tensor target = t_all.narrow(0, start, len);
      torch::Tensor logits = scored > 0
                                 ? at::mm(x, w_compute.t()).to(torch::kFloat)
                                 : at::empty({len, 0}, fp32_options);
      const torch::Tensor local = target - shard->row_begin;
      const torch::Tensor owned = local.ge(0).logical_and(local.lt(scored));
      const torch::Tensor column =
          local.clamp(0, std::max<int64_t>(scored - 1, 0)).unsqueeze(1);
      torch::Tensor target_logit = at::zeros({len}, fp32_options);
      torch::Tensor max = at::full(
          {len}, -std::numeric_limits<float>::infinity(), fp32_options);
      torch::Tensor sum = at::zeros({len}, fp32_options);
      if (scored > 0) {
        target_logit =
            at::where(owned, logits.gather(1, column).squeeze(1), target_logit);
        max = std::get<0>(logits.max(1));
        sum = logits.sub_(max.unsqueeze(1)).exp_().sum(1);
      }
      // Every rank's (max, sum of exp(logit - max), target logit) per row.
      const torch::Tensor stats =
          AllGather(comm, at::stack({max, sum, target_logit}),
                    "all-gather of the softmax statistics");  // [world, 3, len]
      const torch::Tensor global_max = std::get<0>(stats.select(1, 0).max(0));
      const torch::Tensor rescale =
          (stats.select(1, 0) - global_max.unsqueeze(0)).exp_();
      const torch::Tensor global_sum = (stats.select(1, 1) * rescale).sum(0);
      torch::Tensor loss = loss_all.narrow(0, start, len);
      at::sub_out(loss, global_sum.log() + global_max,
                  stats.select(1, 2).sum(0));
      if (!want_grad || scored == 0) {
        if (want_grad) dx_all.narrow(0, start, len).zero_();
        continue;
      }
      // Softmax over this rank's columns: exp(l - max) / (S exp(M - max)),
      // at world size 1 exactly what a softmax computes; minus the one-hot
      // target; over the token's rank's n tokens.
      torch::Tensor g =
          logits.div_((global_sum * (global_max - max).exp()).unsqueeze(1));
      g.scatter_add_(1, column, owned.to(torch::kFloat).neg().unsqueeze(1));
      g.mul_(row_scale);
      torch::Tensor dx = dx_all.narrow(0, start, len);
      const torch::Tensor x_fp32 = x_all.narrow(0, start, len);
      if (fp32) {
        at::mm_out(dx, g, w);
        w_grad.addmm_(g.t(), x_fp32, /*beta=*/1, /*alpha=*/w_grad_scale);
      } else {
        const torch::Tensor g_compute = g.to(shard->compute_dtype);
        dx.copy_(at::mm(g_compute, w_compute));
        w_grad.add_(at::mm(g_compute.t(), x).to(torch::kFloat), w_grad_scale);
      }
    }
    ctx->saved_data["shard"] = reinterpret_cast<int64_t>(shard);
    ctx->saved_data["grad_scale"] = grad_scale;
    if (want_grad) {
      torch::Tensor dx;
      if (shared) {
        dx = dx_all;
        AllReduce(comm, dx, "all-reduce of the hidden states' gradient");
      } else {
        dx = ReduceScatter(comm, dx_all,
                           "reduce-scatter of the hidden states' gradient");
      }
      ctx->save_for_backward({dx.view(hidden.sizes())});
    }
    return loss_all.narrow(0, shared ? 0 : comm.rank() * n, n).mean();
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grad_outputs) {
    const double expected = ctx->saved_data.at("grad_scale").toDouble();
    const double got = grad_outputs[0].item<double>();
    TORCH_CHECK(
        std::abs(got - expected) <= 1e-6 * std::abs(expected),
        "vocab-parallel loss: backpropagated with scale ", got,
        " but its embedding gradient was applied in forward with scale ",
        expected);
    TORCH_CHECK(!ctx->saved_data.count("done"),
                "vocab-parallel loss: backward through the same graph twice");
    ctx->saved_data["done"] = true;
    torch::Tensor dx = ctx->get_saved_variables()[0];
    return {dx.mul_(grad_outputs[0]), torch::Tensor(), torch::Tensor(),
            torch::Tensor()};
  }
};

}  // namespace

torch::Tensor VocabParallelEmbedding(const torch::Tensor& ids,
                                     const VocabShard& shard) {
  TORCH_CHECK(ids.dim() == 2 && ids.scalar_type() == torch::kLong,
              "vocab-parallel embedding: ids must be [B,T] int64, got ",
              ids.sizes(), " ", ids.scalar_type());
  TORCH_CHECK(shard.anchor.defined() && shard.anchor.requires_grad(),
              "vocab-parallel embedding: the shard needs an anchor leaf");
  TORCH_CHECK(
      ids.numel() == 0 || (ids.min().item<int64_t>() >= 0 &&
                           ids.max().item<int64_t>() < shard.vocab_size),
      "vocab-parallel embedding: token ids must be in [0, ", shard.vocab_size,
      ")");
  return EmbeddingFunction::apply(ids, shard.anchor, &shard);
}

torch::Tensor VocabParallelLoss(const torch::Tensor& hidden,
                                const torch::Tensor& targets,
                                const VocabShard& shard, double grad_scale) {
  TORCH_CHECK(hidden.dim() >= 2 && hidden.size(-1) == shard.weight.size(1),
              "vocab-parallel loss: hidden must be [..., C] with C = ",
              shard.weight.size(1), ", got ", hidden.sizes());
  TORCH_CHECK(targets.scalar_type() == torch::kLong &&
                  targets.numel() * hidden.size(-1) == hidden.numel(),
              "vocab-parallel loss: targets must be int64 with one entry per "
              "row of hidden, got ",
              targets.sizes(), " for hidden ", hidden.sizes());
  TORCH_CHECK(targets.numel() == 0 ||
                  (targets.min().item<int64_t>() >= 0 &&
                   targets.max().item<int64_t>() < shard.vocab_size),
              "vocab-parallel loss: targets must be in [0, ", shard.vocab_size,
              ")");
  return LossFunction::apply(hidden, targets, &shard, grad_scale);
}

}  // namespace shardtrain
