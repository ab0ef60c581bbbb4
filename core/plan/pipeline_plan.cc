#include "core/plan/pipeline_plan.h"

#include <algorithm>
#include <deque>
#include <functional>
#include <limits>
#include <map>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "core/model/family_shapes.h"

namespace shardtrain {

// --- Stages ---

double BlockForwardFlopsPerToken(const ModelConfig& config, int64_t seq_len) {
  // Two FLOPs per weight of the block's matrices (GPT-2: qkv 6C², attention
  // output 2C², MLP 16C²; Llama: q and o 4C², k and v 4C·kv, MLP 6C·I), and
  // QKᵀ and AV 2·T·C each.
  const double c = static_cast<double>(config.n_embd);
  const double matrices = static_cast<double>(
      config.BlockParameters() - ShapesOf(config).block_vector_params);
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
    const ModelConfig& config, int64_t seq_len, int64_t ranks,
    const std::vector<int64_t>& split, int64_t virtual_stages) {
  const int64_t blocks = config.n_layer;
  if (ranks < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--pipeline-stages: got ", ranks, "; must be >= 1"));
  }
  if (virtual_stages < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--virtual-stages: got ", virtual_stages, "; must be >= 1"));
  }
  const int64_t stages = ranks * virtual_stages;
  // "--pipeline-stages 2" or "--pipeline-stages 2 x --virtual-stages 2 = 4".
  const std::string flags =
      virtual_stages == 1
          ? absl::StrCat("--pipeline-stages ", ranks)
          : absl::StrCat("--pipeline-stages ", ranks, " x --virtual-stages ",
                         virtual_stages, " = ", stages, " model stages");
  if (stages > blocks) {
    return absl::InvalidArgumentError(
        absl::StrCat(flags, ": more stages than the model's ", blocks,
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
        split.size() + 1, " stages; ",
        virtual_stages == 1 ? absl::StrCat("--pipeline-stages is ", ranks)
                            : flags));
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
  if (name == "zb-h1") return PipelineSchedule::kZeroBubble;
  return absl::InvalidArgumentError(
      absl::StrCat("--pipeline-schedule: '", std::string(name),
                   "' is not one of gpipe, 1f1b, zb-h1"));
}

const char* PipelineScheduleName(PipelineSchedule schedule) {
  switch (schedule) {
    case PipelineSchedule::kGpipe:
      return "gpipe";
    case PipelineSchedule::kOneFOneB:
      return "1f1b";
    case PipelineSchedule::kZeroBubble:
      return "zb-h1";
  }
  return "?";
}

absl::Status CheckVirtualStages(PipelineSchedule schedule, int64_t stages,
                                int64_t micro_batches, int64_t virtual_stages) {
  if (virtual_stages < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--virtual-stages: got ", virtual_stages, "; must be >= 1"));
  }
  if (virtual_stages == 1) return absl::OkStatus();
  if (schedule == PipelineSchedule::kZeroBubble) {
    return absl::InvalidArgumentError(
        absl::StrCat("--virtual-stages ", virtual_stages,
                     ": zb-h1 does not interleave; use --virtual-stages 1 or "
                     "--pipeline-schedule 1f1b"));
  }
  if (stages < 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--virtual-stages ", virtual_stages,
        " interleaves pipeline stages: it needs --pipeline-stages of 2 or "
        "more, got ",
        stages));
  }
  if (schedule == PipelineSchedule::kOneFOneB && micro_batches % stages != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--virtual-stages ", virtual_stages,
        " under 1f1b runs micro-batches in groups of --pipeline-stages ",
        stages, ": --micro-batches must be a multiple of ", stages, ", got ",
        micro_batches));
  }
  return absl::OkStatus();
}

namespace {

// zb-h1's orders of every stage, by list scheduling on paper at equal F, B
// and W times (pipeline_plan.h).
std::vector<std::vector<PipelineAction>> ZeroBubbleOrders(
    int64_t stages, int64_t micro_batches) {
  using Kind = PipelineAction::Kind;
  const int64_t m_count = micro_batches;
  constexpr int64_t kUnknown = -1;
  // Ends of each stage's F and B of each micro-batch, in time units.
  std::vector<std::vector<int64_t>> f_end(
      stages, std::vector<int64_t>(m_count, kUnknown));
  std::vector<std::vector<int64_t>> b_end = f_end;
  std::vector<int64_t> forwarded(stages, 0), backwarded(stages, 0),
      weighted(stages, 0), free_at(stages, 0);
  std::vector<std::vector<PipelineAction>> orders(stages);
  const auto done_by = [](int64_t end, int64_t t) {
    return end != kUnknown && end <= t;
  };
  // Every action is one unit; the orders end within 3M + 2S units (checked
  // against a bug that would stall them).
  for (int64_t t = 0; t <= 4 * (m_count + stages); ++t) {
    bool all_done = true;
    for (int64_t s = 0; s < stages; ++s) {
      if (weighted[s] < m_count) all_done = false;
      if (free_at[s] > t) continue;
      const int64_t b = backwarded[s], f = forwarded[s];
      const bool b_ready = b < f && done_by(f_end[s][b], t) &&
                           (s + 1 == stages || done_by(b_end[s + 1][b], t));
      const bool f_ready = f < m_count && f - b < stages - s &&
                           f - weighted[s] < stages &&
                           (s == 0 || done_by(f_end[s - 1][f], t));
      if (b_ready) {
        orders[s].push_back({Kind::kBackward, b, 0});
        b_end[s][b] = t + 1;
        ++backwarded[s];
      } else if (f_ready) {
        orders[s].push_back({Kind::kForward, f, 0});
        f_end[s][f] = t + 1;
        ++forwarded[s];
      } else if (weighted[s] < b) {
        orders[s].push_back({Kind::kWeight, weighted[s], 0});
        ++weighted[s];
      } else {
        continue;
      }
      free_at[s] = t + 1;
    }
    if (all_done) return orders;
  }
  // Not reached: every order completes within the bound. Should a change
  // break that, 1F1B's order with each W right after its B is as safe.
  std::vector<std::vector<PipelineAction>> fallback(stages);
  for (int64_t s = 0; s < stages; ++s) {
    for (const PipelineAction& a :
         StageActions(PipelineSchedule::kOneFOneB, stages, s, micro_batches)) {
      fallback[s].push_back(a);
      if (a.kind == Kind::kBackward) {
        fallback[s].push_back({Kind::kWeight, a.micro_batch, 0});
      }
    }
  }
  return fallback;
}

}  // namespace

std::vector<PipelineAction> StageActions(PipelineSchedule schedule,
                                         int64_t stages, int64_t stage,
                                         int64_t micro_batches,
                                         int64_t virtual_stages) {
  using Kind = PipelineAction::Kind;
  if (schedule == PipelineSchedule::kZeroBubble) {
    return std::move(ZeroBubbleOrders(stages, micro_batches)[stage]);
  }
  std::vector<PipelineAction> actions;
  const int64_t v_count = std::max<int64_t>(1, virtual_stages);
  if (schedule == PipelineSchedule::kGpipe) {
    for (int64_t v = 0; v < v_count; ++v) {
      for (int64_t m = 0; m < micro_batches; ++m) {
        actions.push_back({Kind::kForward, m, v});
      }
    }
    for (int64_t v = v_count - 1; v >= 0; --v) {
      for (int64_t m = 0; m < micro_batches; ++m) {
        actions.push_back({Kind::kBackward, m, v});
      }
    }
    return actions;
  }
  // The k-th forward (and backward) of the rank: micro-batches in groups of
  // S through each chunk in turn (backwards from the last chunk). Without
  // interleaving, the micro-batches in order.
  const int64_t group = v_count == 1 ? micro_batches : stages;
  const int64_t round = group * v_count;
  const auto nth = [&](Kind kind, int64_t k) {
    const int64_t in_round = k % round;
    const int64_t chunk = in_round / group;
    return PipelineAction{kind, (k / round) * group + in_round % group,
                          kind == Kind::kForward ? chunk : v_count - 1 - chunk};
  };
  const int64_t total = micro_batches * v_count;
  const int64_t warmup =
      v_count == 1
          ? std::min(stages - stage - 1, micro_batches)
          : std::min(total, 2 * (stages - stage - 1) + (v_count - 1) * stages);
  int64_t forwarded = 0;
  int64_t backwarded = 0;
  for (; forwarded < warmup; ++forwarded) {
    actions.push_back(nth(Kind::kForward, forwarded));
  }
  while (forwarded < total) {  // steady state: one forward, one back
    actions.push_back(nth(Kind::kForward, forwarded++));
    actions.push_back(nth(Kind::kBackward, backwarded++));
  }
  while (backwarded < total) {  // cool-down
    actions.push_back(nth(Kind::kBackward, backwarded++));
  }
  return actions;
}

namespace {

// A schedule run on paper: every rank's actions in its order, each waiting
// for what it needs from another model stage.
struct Paper {
  int64_t stages = 0;                                // ranks S
  int64_t virtual_stages = 1;                        // chunks V per rank
  std::vector<std::vector<PipelineAction>> actions;  // per rank
  // end[kind][model stage][micro-batch] (unknown: -1).
  std::vector<std::vector<std::vector<double>>> end;
  std::vector<double> free_at;          // per rank: its last action's end
  std::vector<int64_t> peak_in_flight;  // per rank, in chunks
  int64_t stuck = -1;                   // a rank that cannot go on, or -1
};

Paper RunOnPaper(PipelineSchedule schedule, int64_t stages,
                 int64_t micro_batches, int64_t virtual_stages, double forward,
                 double backward) {
  using Kind = PipelineAction::Kind;
  Paper paper;
  paper.stages = stages;
  paper.virtual_stages = virtual_stages;
  const int64_t model_stages = stages * virtual_stages;
  const double unknown = -1;
  paper.end.assign(
      2, std::vector<std::vector<double>>(
             model_stages, std::vector<double>(micro_batches, unknown)));
  for (int64_t s = 0; s < stages; ++s) {
    paper.actions.push_back(
        StageActions(schedule, stages, s, micro_batches, virtual_stages));
  }
  const double f = forward / static_cast<double>(virtual_stages);
  const bool split = schedule == PipelineSchedule::kZeroBubble;
  // zb-h1's B and W: the input's and the weights' gradients, half each.
  const double b =
      backward / static_cast<double>(virtual_stages) / (split ? 2.0 : 1.0);
  const double w = split ? b : 0.0;
  std::vector<size_t> next(stages, 0);
  paper.free_at.assign(stages, 0);
  paper.peak_in_flight.assign(stages, 0);
  std::vector<int64_t> in_flight(stages, 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int64_t s = 0; s < stages; ++s) {
      while (next[s] < paper.actions[s].size()) {
        const PipelineAction& a = paper.actions[s][next[s]];
        const bool fwd = a.kind == Kind::kForward;
        const bool weight = a.kind == Kind::kWeight;
        const int64_t k = ModelStageOf(stages, s, a.chunk);
        // What this action waits for, on another stage (or its own forward,
        // or a W its own B).
        double ready = 0;
        if (weight) {
          ready = paper.end[1][k][a.micro_batch];
        } else if (fwd && k > 0) {
          ready = paper.end[0][k - 1][a.micro_batch];
        } else if (!fwd) {
          ready = k + 1 < model_stages ? paper.end[1][k + 1][a.micro_batch]
                                       : paper.end[0][k][a.micro_batch];
        }
        if (ready == unknown) break;
        const double start = std::max(paper.free_at[s], ready);
        paper.free_at[s] = start + (fwd ? f : (weight ? w : b));
        if (!weight)
          paper.end[fwd ? 0 : 1][k][a.micro_batch] = paper.free_at[s];
        // A micro-batch is held until its last action: its W when split.
        if (fwd) {
          ++in_flight[s];
        } else if (weight == split) {
          --in_flight[s];
        }
        paper.peak_in_flight[s] =
            std::max(paper.peak_in_flight[s], in_flight[s]);
        ++next[s];
        progress = true;
      }
    }
  }
  for (int64_t s = 0; s < stages; ++s) {
    if (next[s] < paper.actions[s].size()) {
      paper.stuck = s;
      break;
    }
  }
  return paper;
}

std::string ScheduleText(PipelineSchedule schedule, int64_t stages,
                         int64_t micro_batches, int64_t virtual_stages) {
  return absl::StrCat(
      PipelineScheduleName(schedule), " with ", stages, " stages",
      virtual_stages > 1 ? absl::StrCat(" of ", virtual_stages, " chunks") : "",
      " and ", micro_batches, " micro-batches");
}

}  // namespace

absl::StatusOr<PipelineTimeline> SimulatePipeline(
    PipelineSchedule schedule, int64_t stages, int64_t micro_batches,
    double forward, double backward, int64_t virtual_stages) {
  if (absl::Status s =
          CheckVirtualStages(schedule, stages, micro_batches, virtual_stages);
      !s.ok()) {
    return s;
  }
  // The transfers the engine posts for this schedule must complete under
  // NCCL's rule before any timing means anything.
  absl::StatusOr<std::vector<std::vector<PipelineOp>>> lowered =
      LowerAllStages(schedule, stages, micro_batches, virtual_stages);
  if (!lowered.ok()) return lowered.status();
  if (absl::Status s = CheckPointToPointOrder(*lowered); !s.ok()) {
    return absl::InternalError(absl::StrCat(
        ScheduleText(schedule, stages, micro_batches, virtual_stages),
        ": an unsafe transfer order: ", s.message()));
  }
  const Paper paper = RunOnPaper(schedule, stages, micro_batches,
                                 virtual_stages, forward, backward);
  if (paper.stuck >= 0) {
    return absl::InternalError(absl::StrCat(
        ScheduleText(schedule, stages, micro_batches, virtual_stages),
        " deadlocks at stage ", paper.stuck));
  }
  PipelineTimeline timeline;
  timeline.peak_in_flight = paper.peak_in_flight;
  for (double end : paper.free_at) {
    timeline.makespan = std::max(timeline.makespan, end);
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

PipelineOp Compute(OpKind kind, int64_t micro_batch, int64_t chunk) {
  PipelineOp op;
  op.kind = kind;
  op.micro_batch = micro_batch;
  op.chunk = chunk;
  return op;
}

OpKind ComputeKind(PipelineAction::Kind kind) {
  switch (kind) {
    case PipelineAction::Kind::kForward:
      return OpKind::kForward;
    case PipelineAction::Kind::kBackward:
      return OpKind::kBackward;
    case PipelineAction::Kind::kWeight:
      return OpKind::kWeight;
  }
  return OpKind::kForward;
}

PipelineOp Transfer(OpKind kind, Payload payload, int64_t micro_batch,
                    int64_t chunk, int64_t peer) {
  PipelineOp op = Compute(kind, micro_batch, chunk);
  op.payload = payload;
  op.peer = peer;
  return op;
}

const char* PayloadLetter(Payload payload) {
  return payload == Payload::kActivation ? "a" : "g";
}

// The model-stage boundary a transfer crosses (boundary b: between model
// stages b and b + 1), from the end that posts it: rank `stage` of
// `stages`.
int64_t BoundaryOf(const PipelineOp& op, int64_t stages, int64_t stage) {
  const int64_t k = ModelStageOf(stages, stage, op.chunk);
  const bool sends = op.kind == OpKind::kPostSend;
  if (op.payload == Payload::kActivation) return sends ? k : k - 1;
  return sends ? k - 1 : k;
}

// What an action receives before it runs, or sends after it: the peer rank
// and the chunk there (peer -1: nothing).
struct Neighbour {
  int64_t peer = -1;
  int64_t chunk = 0;
};
Neighbour Across(int64_t stages, int64_t virtual_stages, int64_t stage,
                 const PipelineAction& a, bool incoming) {
  if (a.kind == PipelineAction::Kind::kWeight) return {};  // no transfer
  const int64_t k = ModelStageOf(stages, stage, a.chunk);
  const bool forward = a.kind == PipelineAction::Kind::kForward;
  // A forward receives from k - 1 and sends to k + 1; a backward the other
  // way round.
  const int64_t other = forward == incoming ? k - 1 : k + 1;
  if (other < 0 || other >= stages * virtual_stages) return {};
  return {other % stages, other / stages};
}

// One transfer of a step: made by `from` (its chunk `from_chunk`) at
// `made`, received by `to` into `to_chunk`.
struct PlannedTransfer {
  Payload payload = Payload::kActivation;
  int64_t micro_batch = 0;
  int64_t from = 0, from_chunk = 0, from_index = 0;  // index: in from's actions
  int64_t to = 0, to_chunk = 0;
  double made = 0;
};

}  // namespace

absl::StatusOr<std::vector<std::vector<PipelineOp>>> LowerAllStages(
    PipelineSchedule schedule, int64_t stages, int64_t micro_batches,
    int64_t virtual_stages) {
  using Kind = PipelineAction::Kind;
  if (absl::Status s =
          CheckVirtualStages(schedule, stages, micro_batches, virtual_stages);
      !s.ok()) {
    return s;
  }
  // Any durations give an order that both ends of every pair share; a
  // backward twice a forward is what a step looks like.
  const Paper paper = RunOnPaper(schedule, stages, micro_batches,
                                 virtual_stages, /*forward=*/1.0,
                                 /*backward=*/2.0);
  const std::string what =
      ScheduleText(schedule, stages, micro_batches, virtual_stages);
  if (paper.stuck >= 0) {
    return absl::InternalError(
        absl::StrCat(what, " deadlocks at stage ", paper.stuck));
  }
  // Every pair's transfers, in the order they are made.
  std::map<std::pair<int64_t, int64_t>, std::vector<PlannedTransfer>> pairs;
  for (int64_t s = 0; s < stages; ++s) {
    for (size_t i = 0; i < paper.actions[s].size(); ++i) {
      const PipelineAction& a = paper.actions[s][i];
      const Neighbour to = Across(stages, virtual_stages, s, a, false);
      if (to.peer < 0) continue;
      const bool forward = a.kind == Kind::kForward;
      PlannedTransfer t;
      t.payload = forward ? Payload::kActivation : Payload::kGradient;
      t.micro_batch = a.micro_batch;
      t.from = s;
      t.from_chunk = a.chunk;
      t.from_index = static_cast<int64_t>(i);
      t.to = to.peer;
      t.to_chunk = to.chunk;
      t.made = paper.end[forward ? 0 : 1][ModelStageOf(stages, s, a.chunk)]
                        [a.micro_batch];
      pairs[{std::min(s, to.peer), std::max(s, to.peer)}].push_back(t);
    }
  }
  for (auto& [pair, transfers] : pairs) {
    std::sort(transfers.begin(), transfers.end(),
              [](const PlannedTransfer& a, const PlannedTransfer& b) {
                if (a.made != b.made) return a.made < b.made;
                if (a.from != b.from) return a.from < b.from;
                return a.from_index < b.from_index;
              });
  }
  std::vector<std::vector<PipelineOp>> lowered(stages);
  for (int64_t s = 0; s < stages; ++s) {
    std::vector<PipelineOp>& ops = lowered[s];
    std::map<int64_t, size_t> next;  // per peer: its pair's next transfer
    // Posts this end of the pair with `peer` up to and including the
    // transfer that `is_target` picks: receives early, a send only when it
    // is the target (its compute has just made it).
    const auto post_through =
        [&](int64_t peer,
            const std::function<bool(const PlannedTransfer&)>& is_target)
        -> absl::Status {
      const std::vector<PlannedTransfer>& order =
          pairs[{std::min(s, peer), std::max(s, peer)}];
      size_t& i = next[peer];
      for (; i < order.size(); ++i) {
        const PlannedTransfer& t = order[i];
        const bool target = is_target(t);
        if (t.to == s) {
          ops.push_back(Transfer(OpKind::kPostRecv, t.payload, t.micro_batch,
                                 t.to_chunk, peer));
        } else if (target) {
          ops.push_back(Transfer(OpKind::kPostSend, t.payload, t.micro_batch,
                                 t.from_chunk, peer));
        } else {
          return absl::InternalError(
              absl::StrCat(what, ": stage ", s, " would have to send ",
                           PayloadLetter(t.payload), t.micro_batch,
                           " to stage ", peer, " before it has computed it"));
        }
        if (target) {
          ++i;
          return absl::OkStatus();
        }
      }
      return absl::InternalError(absl::StrCat(
          what, ": stage ", peer, " never sends what stage ", s, " needs"));
    };
    for (const PipelineAction& a : paper.actions[s]) {
      const bool forward = a.kind == Kind::kForward;
      const Payload in = forward ? Payload::kActivation : Payload::kGradient;
      const Neighbour from = Across(stages, virtual_stages, s, a, true);
      if (from.peer >= 0) {
        const PipelineOp wait =
            Transfer(OpKind::kWaitRecv, in, a.micro_batch, a.chunk, from.peer);
        const bool posted =
            std::any_of(ops.begin(), ops.end(), [&](const PipelineOp& op) {
              return op.kind == OpKind::kPostRecv &&
                     op.payload == wait.payload &&
                     op.micro_batch == wait.micro_batch &&
                     op.chunk == wait.chunk && op.peer == wait.peer;
            });
        if (!posted) {
          absl::Status status =
              post_through(from.peer, [&](const PlannedTransfer& t) {
                return t.to == s && t.payload == in &&
                       t.micro_batch == a.micro_batch && t.to_chunk == a.chunk;
              });
          if (!status.ok()) return status;
        }
        ops.push_back(wait);
      }
      ops.push_back(Compute(ComputeKind(a.kind), a.micro_batch, a.chunk));
      const Neighbour to = Across(stages, virtual_stages, s, a, false);
      if (to.peer >= 0) {
        absl::Status status =
            post_through(to.peer, [&](const PlannedTransfer& t) {
              return t.from == s && t.payload == in &&
                     t.micro_batch == a.micro_batch && t.from_chunk == a.chunk;
            });
        if (!status.ok()) return status;
      }
    }
  }
  return lowered;
}

std::string DescribeOp(const PipelineOp& op) {
  const std::string chunk =
      op.chunk > 0 ? absl::StrCat(" (chunk ", op.chunk, ")") : "";
  switch (op.kind) {
    case OpKind::kForward:
      return absl::StrCat("F", op.micro_batch, chunk);
    case OpKind::kBackward:
      return absl::StrCat("B", op.micro_batch, chunk);
    case OpKind::kWeight:
      return absl::StrCat("W", op.micro_batch, chunk);
    case OpKind::kPostRecv:
      return absl::StrCat("recv ", PayloadLetter(op.payload), op.micro_batch,
                          chunk, " from ", op.peer);
    case OpKind::kWaitRecv:
      return absl::StrCat("wait ", PayloadLetter(op.payload), op.micro_batch,
                          chunk);
    case OpKind::kPostSend:
      return absl::StrCat("send ", PayloadLetter(op.payload), op.micro_batch,
                          chunk, " to ", op.peer);
  }
  return "?";
}

absl::StatusOr<std::vector<PipelineOp>> LowerStageActions(
    PipelineSchedule schedule, int64_t stages, int64_t stage,
    int64_t micro_batches, int64_t virtual_stages) {
  absl::StatusOr<std::vector<std::vector<PipelineOp>>> all =
      LowerAllStages(schedule, stages, micro_batches, virtual_stages);
  if (!all.ok()) return all.status();
  return std::move((*all)[stage]);
}

std::vector<PipelineOp> NaiveStageOps(PipelineSchedule schedule, int64_t stages,
                                      int64_t stage, int64_t micro_batches,
                                      int64_t virtual_stages) {
  using Kind = PipelineAction::Kind;
  std::vector<PipelineOp> ops;
  for (const PipelineAction& a :
       StageActions(schedule, stages, stage, micro_batches, virtual_stages)) {
    const bool forward = a.kind == Kind::kForward;
    const Payload in = forward ? Payload::kActivation : Payload::kGradient;
    const Neighbour from = Across(stages, virtual_stages, stage, a, true);
    const Neighbour to = Across(stages, virtual_stages, stage, a, false);
    if (from.peer >= 0) {
      ops.push_back(
          Transfer(OpKind::kPostRecv, in, a.micro_batch, a.chunk, from.peer));
      ops.push_back(
          Transfer(OpKind::kWaitRecv, in, a.micro_batch, a.chunk, from.peer));
    }
    ops.push_back(Compute(ComputeKind(a.kind), a.micro_batch, a.chunk));
    if (to.peer >= 0) {
      ops.push_back(
          Transfer(OpKind::kPostSend, in, a.micro_batch, a.chunk, to.peer));
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
                posted.chunk == op.chunk && posted.peer == op.peer) {
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
        if (a.payload != b.payload || a.micro_batch != b.micro_batch ||
            BoundaryOf(a, stages, pair.first) !=
                BoundaryOf(b, stages, pair.second)) {
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
