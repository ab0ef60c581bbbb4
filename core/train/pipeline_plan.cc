#include "core/train/pipeline_plan.h"

#include <algorithm>
#include <deque>
#include <limits>
#include <map>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace shardtrain {

// --- Stages ---

double BlockForwardFlopsPerToken(const ModelConfig& config, int64_t seq_len) {
  // Two FLOPs per weight of the block's matrices (GPT-2: qkv 6C², attention
  // output 2C², MLP 16C²; Llama: q and o 4C², k and v 4C·kv, MLP 6C·I), and
  // QKᵀ and AV 2·T·C each.
  const double c = static_cast<double>(config.n_embd);
  const double matrices = static_cast<double>(
      config.BlockParameters() - (config.is_llama() ? 2 : 13) * config.n_embd);
  return 2.0 * matrices + 4.0 * static_cast<double>(seq_len) * c;
}

double HeadForwardFlopsPerToken(const ModelConfig& config) {
  return 2.0 * static_cast<double>(config.padded_vocab_size) *
         static_cast<double>(config.n_embd);
}

absl::StatusOr<std::vector<int64_t>> ParsePipelineSplit(std::string_view text) {
  std::vector<int64_t> split;
  for (absl::string_view part :
       absl::StrSplit(absl::string_view(text.data(), text.size()), ',')) {
    int64_t block = 0;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(part), &block)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--pipeline-split: '", std::string(text),
          "' is not a list of block indices (e.g. 4,8: stage 1 starts at "
          "block 4, stage 2 at block 8)"));
    }
    split.push_back(block);
  }
  return split;
}

namespace {

// The cut (stage start blocks, after 0) that makes the costliest stage the
// cheapest: dp over (stages so far, blocks so far).
std::vector<int64_t> BalancedSplit(int64_t blocks, int64_t stages,
                                   double block_cost, double head_cost) {
  const double inf = std::numeric_limits<double>::infinity();
  // best[s][i]: the cheapest costliest stage for blocks [0, i) in s stages;
  // cut[s][i]: where the last of those stages starts.
  std::vector<std::vector<double>> best(stages + 1,
                                        std::vector<double>(blocks + 1, inf));
  std::vector<std::vector<int64_t>> cut(stages + 1,
                                        std::vector<int64_t>(blocks + 1, 0));
  best[0][0] = 0;
  for (int64_t s = 1; s <= stages; ++s) {
    const bool last = s == stages;
    for (int64_t i = s; i <= blocks; ++i) {
      // Latest start first: among equal cuts, earlier stages get more.
      for (int64_t j = i - 1; j >= s - 1; --j) {
        if (best[s - 1][j] == inf) continue;
        const double stage =
            static_cast<double>(i - j) * block_cost + (last ? head_cost : 0.0);
        const double worst = std::max(best[s - 1][j], stage);
        if (worst < best[s][i] * (1 - 1e-12)) {
          best[s][i] = worst;
          cut[s][i] = j;
        }
      }
    }
  }
  std::vector<int64_t> split(stages - 1);
  int64_t end = blocks;
  for (int64_t s = stages; s > 1; --s) {
    end = cut[s][end];
    split[s - 2] = end;
  }
  return split;
}

}  // namespace

absl::StatusOr<std::vector<PipelineStage>> PartitionPipeline(
    const ModelConfig& config, int64_t seq_len, int64_t stages,
    const std::vector<int64_t>& split) {
  const int64_t blocks = config.n_layer;
  if (stages < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--pipeline-stages: got ", stages, "; must be >= 1"));
  }
  if (stages > blocks) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--pipeline-stages ", stages, ": more stages than the model's ", blocks,
        " blocks (every stage needs at least one)"));
  }
  const double block_cost = BlockForwardFlopsPerToken(config, seq_len);
  const double head_cost = HeadForwardFlopsPerToken(config);
  std::vector<int64_t> starts = split;
  if (starts.empty()) {
    starts = BalancedSplit(blocks, stages, block_cost, head_cost);
  } else if (static_cast<int64_t>(starts.size()) != stages - 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--pipeline-split ", absl::StrJoin(split, ","), " cuts the model into ",
        split.size() + 1, " stages; --pipeline-stages is ", stages));
  }
  starts.insert(starts.begin(), 0);
  starts.push_back(blocks);
  std::vector<PipelineStage> out;
  for (int64_t s = 0; s < stages; ++s) {
    PipelineStage stage;
    stage.first_block = starts[s];
    stage.end_block = starts[s + 1];
    if (stage.end_block <= stage.first_block || stage.first_block < 0 ||
        stage.end_block > blocks) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--pipeline-split ", absl::StrJoin(split, ","), ": stage ", s,
          " would hold blocks [", stage.first_block, ", ", stage.end_block,
          ") of the model's ", blocks,
          "; each stage needs at least one block, in increasing order"));
    }
    stage.embeddings = s == 0;
    stage.head = s == stages - 1;
    stage.flops_per_token =
        static_cast<double>(stage.end_block - stage.first_block) * block_cost +
        (stage.head ? head_cost : 0.0);
    out.push_back(stage);
  }
  return out;
}

std::string DescribeStage(const PipelineStage& stage) {
  std::string text = stage.end_block - stage.first_block == 1
                         ? absl::StrCat("block ", stage.first_block)
                         : absl::StrCat("blocks ", stage.first_block, "-",
                                        stage.end_block - 1);
  if (stage.embeddings) absl::StrAppend(&text, ", embeddings");
  if (stage.head) absl::StrAppend(&text, ", head");
  return text;
}

// --- Schedules ---

absl::StatusOr<PipelineSchedule> ParsePipelineSchedule(std::string_view name) {
  if (name == "gpipe") return PipelineSchedule::kGpipe;
  if (name == "1f1b") return PipelineSchedule::kOneFOneB;
  return absl::InvalidArgumentError(
      absl::StrCat("--pipeline-schedule: '", std::string(name),
                   "' is not one of gpipe, 1f1b"));
}

const char* PipelineScheduleName(PipelineSchedule schedule) {
  return schedule == PipelineSchedule::kGpipe ? "gpipe" : "1f1b";
}

std::vector<PipelineAction> StageActions(PipelineSchedule schedule,
                                         int64_t stages, int64_t stage,
                                         int64_t micro_batches) {
  using Kind = PipelineAction::Kind;
  std::vector<PipelineAction> actions;
  if (schedule == PipelineSchedule::kGpipe) {
    for (int64_t m = 0; m < micro_batches; ++m) {
      actions.push_back({Kind::kForward, m});
    }
    for (int64_t m = 0; m < micro_batches; ++m) {
      actions.push_back({Kind::kBackward, m});
    }
    return actions;
  }
  const int64_t warmup = std::min(stages - stage - 1, micro_batches);
  int64_t forwarded = 0;
  int64_t backwarded = 0;
  for (; forwarded < warmup; ++forwarded) {
    actions.push_back({Kind::kForward, forwarded});
  }
  while (forwarded < micro_batches) {  // steady state: one forward, one back
    actions.push_back({Kind::kForward, forwarded++});
    actions.push_back({Kind::kBackward, backwarded++});
  }
  while (backwarded < micro_batches) {  // cool-down
    actions.push_back({Kind::kBackward, backwarded++});
  }
  return actions;
}

absl::StatusOr<PipelineTimeline> SimulatePipeline(PipelineSchedule schedule,
                                                  int64_t stages,
                                                  int64_t micro_batches,
                                                  double forward,
                                                  double backward) {
  using Kind = PipelineAction::Kind;
  // The transfers the engine posts for this schedule must complete under
  // NCCL's rule before any timing means anything.
  std::vector<std::vector<PipelineOp>> lowered;
  for (int64_t s = 0; s < stages; ++s) {
    absl::StatusOr<std::vector<PipelineOp>> ops =
        LowerStageActions(schedule, stages, s, micro_batches);
    if (!ops.ok()) return ops.status();
    lowered.push_back(*std::move(ops));
  }
  if (absl::Status s = CheckPointToPointOrder(lowered); !s.ok()) {
    return absl::InternalError(absl::StrCat(
        PipelineScheduleName(schedule), " with ", stages, " stages and ",
        micro_batches,
        " micro-batches: an unsafe transfer order: ", s.message()));
  }
  const double unknown = -1;
  // end[kind][stage][micro-batch]: when that action ended (unknown: not yet).
  std::vector<std::vector<std::vector<double>>> end(
      2, std::vector<std::vector<double>>(
             stages, std::vector<double>(micro_batches, unknown)));
  std::vector<std::vector<PipelineAction>> actions;
  for (int64_t s = 0; s < stages; ++s) {
    actions.push_back(StageActions(schedule, stages, s, micro_batches));
  }
  std::vector<size_t> next(stages, 0);
  std::vector<double> free_at(stages, 0);
  std::vector<int64_t> in_flight(stages, 0);
  PipelineTimeline timeline;
  timeline.peak_in_flight.assign(stages, 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int64_t s = 0; s < stages; ++s) {
      while (next[s] < actions[s].size()) {
        const PipelineAction& a = actions[s][next[s]];
        const bool fwd = a.kind == Kind::kForward;
        // What this action waits for, on another stage (or its own forward).
        double ready = 0;
        if (fwd && s > 0) {
          ready = end[0][s - 1][a.micro_batch];
        } else if (!fwd) {
          ready = s + 1 < stages ? end[1][s + 1][a.micro_batch]
                                 : end[0][s][a.micro_batch];
        }
        if (ready == unknown) break;
        const double start = std::max(free_at[s], ready);
        free_at[s] = start + (fwd ? forward : backward);
        end[fwd ? 0 : 1][s][a.micro_batch] = free_at[s];
        in_flight[s] += fwd ? 1 : -1;
        timeline.peak_in_flight[s] =
            std::max(timeline.peak_in_flight[s], in_flight[s]);
        ++next[s];
        progress = true;
      }
    }
  }
  for (int64_t s = 0; s < stages; ++s) {
    if (next[s] < actions[s].size()) {
      return absl::InternalError(absl::StrCat(
          PipelineScheduleName(schedule), " with ", stages, " stages and ",
          micro_batches, " micro-batches deadlocks at stage ", s));
    }
    timeline.makespan = std::max(timeline.makespan, free_at[s]);
  }
  const double busy =
      static_cast<double>(stages * micro_batches) * (forward + backward);
  timeline.bubble_fraction =
      timeline.makespan > 0
          ? 1.0 - busy / (static_cast<double>(stages) * timeline.makespan)
          : 0.0;
  return timeline;
}

// --- Point-to-point order ---

namespace {

using OpKind = PipelineOp::Kind;
using Payload = PipelineOp::Payload;

PipelineOp Compute(OpKind kind, int64_t micro_batch) {
  PipelineOp op;
  op.kind = kind;
  op.micro_batch = micro_batch;
  return op;
}

PipelineOp Transfer(OpKind kind, Payload payload, int64_t micro_batch,
                    int64_t peer) {
  PipelineOp op;
  op.kind = kind;
  op.payload = payload;
  op.micro_batch = micro_batch;
  op.peer = peer;
  return op;
}

const char* PayloadLetter(Payload payload) {
  return payload == Payload::kActivation ? "a" : "g";
}

}  // namespace

std::string DescribeOp(const PipelineOp& op) {
  switch (op.kind) {
    case OpKind::kForward:
      return absl::StrCat("F", op.micro_batch);
    case OpKind::kBackward:
      return absl::StrCat("B", op.micro_batch);
    case OpKind::kPostRecv:
      return absl::StrCat("recv ", PayloadLetter(op.payload), op.micro_batch,
                          " from ", op.peer);
    case OpKind::kWaitRecv:
      return absl::StrCat("wait ", PayloadLetter(op.payload), op.micro_batch);
    case OpKind::kPostSend:
      return absl::StrCat("send ", PayloadLetter(op.payload), op.micro_batch,
                          " to ", op.peer);
  }
  return "?";
}

absl::StatusOr<std::vector<PipelineOp>> LowerStageActions(
    PipelineSchedule schedule, int64_t stages, int64_t stage,
    int64_t micro_batches) {
  using Kind = PipelineAction::Kind;
  std::vector<PipelineOp> ops;
  // The pair with the upstream stage follows the upstream's order: an
  // activation where it forwards, a gradient where it backwards.
  std::vector<PipelineAction> upstream;
  if (stage > 0) {
    upstream = StageActions(schedule, stages, stage - 1, micro_batches);
  }
  size_t next_up = 0;  // the upstream's first transfer not yet posted here
  std::vector<bool> activation_posted(micro_batches, false);
  // Posts this end of the upstream pair's transfers up to and including
  // `target` (a gradient: this stage's send of it).
  const auto post_through = [&](Kind target, int64_t micro) -> absl::Status {
    while (next_up < upstream.size()) {
      const PipelineAction& a = upstream[next_up++];
      if (a.kind == Kind::kForward) {
        if (!activation_posted[a.micro_batch]) {
          activation_posted[a.micro_batch] = true;
          ops.push_back(Transfer(OpKind::kPostRecv, Payload::kActivation,
                                 a.micro_batch, stage - 1));
        }
        if (target == Kind::kForward && a.micro_batch == micro) {
          return absl::OkStatus();
        }
      } else if (target == Kind::kBackward && a.micro_batch == micro) {
        ops.push_back(
            Transfer(OpKind::kPostSend, Payload::kGradient, micro, stage - 1));
        return absl::OkStatus();
      } else {
        return absl::InternalError(absl::StrCat(
            PipelineScheduleName(schedule), ": stage ", stage - 1,
            " waits for the gradient of micro-batch ", a.micro_batch,
            " before stage ", stage, " has computed it"));
      }
    }
    return absl::InternalError(absl::StrCat(
        PipelineScheduleName(schedule), ": stage ", stage - 1,
        " never posts what stage ", stage, " needs of micro-batch ", micro));
  };
  for (const PipelineAction& a :
       StageActions(schedule, stages, stage, micro_batches)) {
    const int64_t m = a.micro_batch;
    if (a.kind == Kind::kForward) {
      if (stage > 0) {
        if (!activation_posted[m]) {
          if (absl::Status s = post_through(Kind::kForward, m); !s.ok()) {
            return s;
          }
        }
        ops.push_back(
            Transfer(OpKind::kWaitRecv, Payload::kActivation, m, stage - 1));
      }
      ops.push_back(Compute(OpKind::kForward, m));
      if (stage + 1 < stages) {
        ops.push_back(
            Transfer(OpKind::kPostSend, Payload::kActivation, m, stage + 1));
      }
    } else {
      if (stage + 1 < stages) {
        ops.push_back(
            Transfer(OpKind::kPostRecv, Payload::kGradient, m, stage + 1));
        ops.push_back(
            Transfer(OpKind::kWaitRecv, Payload::kGradient, m, stage + 1));
      }
      ops.push_back(Compute(OpKind::kBackward, m));
      if (stage > 0) {
        if (absl::Status s = post_through(Kind::kBackward, m); !s.ok()) {
          return s;
        }
      }
    }
  }
  return ops;
}

std::vector<PipelineOp> NaiveStageOps(PipelineSchedule schedule, int64_t stages,
                                      int64_t stage, int64_t micro_batches) {
  using Kind = PipelineAction::Kind;
  std::vector<PipelineOp> ops;
  for (const PipelineAction& a :
       StageActions(schedule, stages, stage, micro_batches)) {
    const bool forward = a.kind == Kind::kForward;
    const Payload in = forward ? Payload::kActivation : Payload::kGradient;
    const int64_t from = forward ? stage - 1 : stage + 1;
    const int64_t to = forward ? stage + 1 : stage - 1;
    if (from >= 0 && from < stages) {
      ops.push_back(Transfer(OpKind::kPostRecv, in, a.micro_batch, from));
      ops.push_back(Transfer(OpKind::kWaitRecv, in, a.micro_batch, from));
    }
    ops.push_back(
        Compute(forward ? OpKind::kForward : OpKind::kBackward, a.micro_batch));
    if (to >= 0 && to < stages) {
      ops.push_back(Transfer(OpKind::kPostSend, in, a.micro_batch, to));
    }
  }
  return ops;
}

absl::Status CheckPointToPointOrder(
    const std::vector<std::vector<PipelineOp>>& stage_ops) {
  const int64_t stages = static_cast<int64_t>(stage_ops.size());
  struct Posted {
    int64_t stage;
    size_t index;  // into stage_ops[stage]
  };
  // queue[{a, b}]: what stage a posted toward b and is not yet complete, in
  // posting order.
  std::map<std::pair<int64_t, int64_t>, std::deque<Posted>> queue;
  std::vector<std::vector<bool>> done(stages);
  for (int64_t s = 0; s < stages; ++s)
    done[s].assign(stage_ops[s].size(), false);
  std::vector<size_t> pc(stages, 0);
  const auto op_at = [&](const Posted& p) -> const PipelineOp& {
    return stage_ops[p.stage][p.index];
  };
  for (bool progress = true; progress;) {
    progress = false;
    for (int64_t s = 0; s < stages; ++s) {
      while (pc[s] < stage_ops[s].size()) {
        const PipelineOp& op = stage_ops[s][pc[s]];
        if (op.kind == OpKind::kPostRecv || op.kind == OpKind::kPostSend) {
          queue[{s, op.peer}].push_back({s, pc[s]});
        } else if (op.kind == OpKind::kWaitRecv) {
          bool complete = false;
          for (size_t i = 0; i < pc[s]; ++i) {
            const PipelineOp& posted = stage_ops[s][i];
            if (posted.kind == OpKind::kPostRecv &&
                posted.payload == op.payload &&
                posted.micro_batch == op.micro_batch &&
                posted.peer == op.peer) {
              complete = done[s][i];
            }
          }
          if (!complete) break;
        }
        ++pc[s];
        progress = true;
      }
    }
    for (auto& [pair, mine] : queue) {
      if (pair.first > pair.second) continue;
      std::deque<Posted>& theirs = queue[{pair.second, pair.first}];
      while (!mine.empty() && !theirs.empty()) {
        const PipelineOp& a = op_at(mine.front());
        const PipelineOp& b = op_at(theirs.front());
        if (a.kind == b.kind) break;  // two sends, or two receives, facing
        if (a.payload != b.payload || a.micro_batch != b.micro_batch) {
          return absl::FailedPreconditionError(absl::StrCat(
              "stage ", pair.first, "'s ", DescribeOp(a),
              " would be matched "
              "with stage ",
              pair.second, "'s ", DescribeOp(b),
              " (NCCL pairs transfers by their order, not their tags)"));
        }
        done[mine.front().stage][mine.front().index] = true;
        done[theirs.front().stage][theirs.front().index] = true;
        mine.pop_front();
        theirs.pop_front();
        progress = true;
      }
    }
  }
  for (auto& [pair, mine] : queue) {
    if (pair.first > pair.second) continue;
    const std::deque<Posted>& theirs = queue[{pair.second, pair.first}];
    if (!mine.empty() && !theirs.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "stage ", pair.first, " and stage ", pair.second,
          " deadlock on NCCL: stage ", pair.first, "'s next transfer is ",
          DescribeOp(op_at(mine.front())), " while stage ", pair.second,
          "'s is ", DescribeOp(op_at(theirs.front())),
          " (neither completes before the other end posts its match)"));
    }
  }
  for (int64_t s = 0; s < stages; ++s) {
    if (pc[s] < stage_ops[s].size()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "stage ", s, " never gets past ", DescribeOp(stage_ops[s][pc[s]])));
    }
  }
  for (const auto& [pair, mine] : queue) {
    if (!mine.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "stage ", pair.first, "'s ", DescribeOp(op_at(mine.front())),
          " is never matched by stage ", pair.second));
    }
  }
  return absl::OkStatus();
}

}  // namespace shardtrain
