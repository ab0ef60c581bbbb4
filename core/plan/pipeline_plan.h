// Pipeline parallelism without LibTorch: how GPT-2's blocks are cut into
// stages, and in which order each stage runs a step's micro-batches.
//
// Stages. Stage 0 also holds the token and position embeddings, the last
// stage the final LayerNorm and the LM head. By default the cut balances
// the forward FLOPs per token of each stage (a block: its four projections
// and attention; the head: its vocabulary-wide product, several blocks'
// worth on GPT-2 small), so the slowest stage — which sets the pipeline's
// pace — is as fast as a contiguous cut allows; `--pipeline-split` gives the
// cut instead.
//
// Schedules (PipeDream-flush's names). GPipe: every micro-batch's forward,
// then every backward; a stage holds all M micro-batches' activations at
// once. 1F1B: stage s runs min(S-s-1, M) warm-up forwards, then alternates
// one forward and one backward, then drains the backwards; it holds at most
// min(S-s, M). Both flush at the end of the step, so both idle the same
// (S-1)/(M+S-1) of each stage's time when forward and backward times are
// uniform. SimulatePipeline runs a schedule on paper: the timeline, the
// bubble and the activations each stage holds, and whether it deadlocks.
#ifndef SHARDTRAIN_CORE_PLAN_PIPELINE_PLAN_H_
#define SHARDTRAIN_CORE_PLAN_PIPELINE_PLAN_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "core/model/model_config.h"

namespace shardtrain {

// --- Stages ---

struct PipelineStage {
  int64_t first_block = 0;  // the stage's blocks: [first_block, end_block)
  int64_t end_block = 0;
  bool embeddings = false;     // token and position embeddings (stage 0)
  bool head = false;           // final LayerNorm and LM head (the last stage)
  double flops_per_token = 0;  // forward, of everything the stage holds
};

// Forward FLOPs per token of one transformer block at sequence length
// `seq_len` (24·C² for the projections and MLP, 4·T·C for attention's two
// products), and of the LM head (2·V·C, over the padded vocabulary).
double BlockForwardFlopsPerToken(const ModelConfig& config, int64_t seq_len);
double HeadForwardFlopsPerToken(const ModelConfig& config);

// "4,8" -> {4, 8}: the blocks before which stages 1, 2, ... start.
// InvalidArgument naming --pipeline-split for anything but integers.
absl::StatusOr<std::vector<int64_t>> ParsePipelineSplit(std::string_view text);

// Cuts `config`'s blocks into `stages` contiguous stages: at `split` when it
// is given, else balanced (the costliest stage as cheap as a contiguous cut
// allows; among equal cuts, the one with the most blocks early). Refused,
// naming the flag and the numbers: stages < 1 or above the model's blocks;
// a split whose length is not stages - 1, out of order, or leaving a stage
// empty. With `virtual_stages` V > 1 (interleaved schedules), the model is
// cut into stages x V model stages; rank r of the pipeline holds model
// stages r, r + S, r + 2S, ... (VirtualStageOf), and the refusals say so.
absl::StatusOr<std::vector<PipelineStage>> PartitionPipeline(
    const ModelConfig& config, int64_t seq_len, int64_t stages,
    const std::vector<int64_t>& split, int64_t virtual_stages = 1);

// The model stage that pipeline rank `stage` (of `stages`) runs as its
// chunk `chunk` of an interleaved schedule: chunk * stages + stage.
inline int64_t ModelStageOf(int64_t stages, int64_t stage, int64_t chunk) {
  return chunk * stages + stage;
}

// "blocks 0-5, embeddings", "block 11, head", for the mesh's layout line.
std::string DescribeStage(const PipelineStage& stage);

// --- Schedules ---
//
// Interleaved (Megatron's virtual pipeline, `--virtual-stages V`): each of
// the S ranks runs V chunks of the model (model stages r, r + S, ...), so a
// micro-batch crosses the pipeline V times and the fill and drain take 1/V
// as long: the bubble is (S-1)/(V·M+S-1) of each rank's time, for V times
// the point-to-point traffic. Under 1F1B the ranks run the micro-batches in
// groups of S through each chunk in turn (forward chunk 0 of micro-batches
// 0..S-1, chunk 1 of the same, ...; backwards from the last chunk), after
// 2(S-r-1) + (V-1)S warm-up forwards on rank r; M must be a multiple of S.
// Under GPipe every chunk's forwards go first, in chunk order, then every
// backward in reverse.

// Zero bubble (ZB-H1, `zb-h1`; Qi et al., "Zero Bubble Pipeline
// Parallelism", 2023): each backward is split in two, B (the input's
// gradient, which the stage before waits for) and W (the weights'
// gradients, which nobody waits for), so a stage can run W where 1F1B
// would wait. Our order is made on paper by list scheduling at equal F, B
// and W times: a free stage runs the next B if its gradient has arrived,
// else the next F if its input has arrived and it holds fewer than S - s
// micro-batches between F and B (1F1B's bound) and fewer than S between F
// and W (the most any 1F1B stage holds, stage 0's), else its oldest W
// waiting. Its bubble (the simulator, equal F, B and W): 1/13 of the step
// at S = 2, M = 4 (1F1B 1/5), 5/29 at S = 4, M = 8 (1F1B 3/11); at most two
// thirds of 1F1B's idle time. Not interleaved.
enum class PipelineSchedule { kGpipe, kOneFOneB, kZeroBubble };

// "gpipe", "1f1b" or "zb-h1"; InvalidArgument naming --pipeline-schedule
// otherwise.
absl::StatusOr<PipelineSchedule> ParsePipelineSchedule(std::string_view name);
const char* PipelineScheduleName(PipelineSchedule schedule);

// Refuses what an interleaved schedule cannot run, naming the flags and the
// numbers: V < 1; V > 1 with a single stage; M not a multiple of S under
// 1F1B with V > 1; V > 1 under zb-h1.
absl::Status CheckVirtualStages(PipelineSchedule schedule, int64_t stages,
                                int64_t micro_batches, int64_t virtual_stages);

struct PipelineAction {
  // kBackward: the whole backward, or under zb-h1 its input-gradient part
  // (B); kWeight: zb-h1's weight-gradient part (W) of a micro-batch whose B
  // has run.
  enum class Kind { kForward, kBackward, kWeight };
  Kind kind = Kind::kForward;
  int64_t micro_batch = 0;
  int64_t chunk = 0;  // the rank's chunk (0 unless interleaved)
  bool operator==(const PipelineAction& other) const {
    return kind == other.kind && micro_batch == other.micro_batch &&
           chunk == other.chunk;
  }
};

// The order stage `stage` (of `stages`) runs a step of `micro_batches`:
// every micro-batch's forward once through each of its `virtual_stages`
// chunks and, after it, its backward once (under zb-h1 its B, and after
// that its W). Interleaved, CheckVirtualStages must accept the numbers.
std::vector<PipelineAction> StageActions(PipelineSchedule schedule,
                                         int64_t stages, int64_t stage,
                                         int64_t micro_batches,
                                         int64_t virtual_stages = 1);

struct PipelineTimeline {
  double makespan = 0;  // the step, from the first forward to the last
  // Per stage: the most micro-batch chunks forwarded and not yet
  // backwarded (whose activations the stage holds) at once.
  std::vector<int64_t> peak_in_flight;
  // The idle share of all stages' time over the makespan.
  double bubble_fraction = 0;
};

// Runs every stage's StageActions with a stage's forward of one
// micro-batch taking `forward` and its backward `backward` time units (a
// chunk's 1/V of them; under zb-h1, B and W half of `backward` each): a
// forward waits for the previous model stage's
// forward of its micro-batch, a backward for the next model stage's
// backward of it; sends do not block (the engine posts them
// asynchronously). Internal if the stages' orders deadlock, or if the
// transfers the engine posts for the schedule (LowerStageActions) would not
// complete under NCCL's rule (CheckPointToPointOrder); InvalidArgument for
// what CheckVirtualStages refuses.
absl::StatusOr<PipelineTimeline> SimulatePipeline(
    PipelineSchedule schedule, int64_t stages, int64_t micro_batches,
    double forward, double backward, int64_t virtual_stages = 1);

// --- Point-to-point order ---
//
// NCCL matches the transfers between two ranks by their order on that pair
// (tags are ignored), runs one pair's transfers one after another, and a
// send does not complete until its receive is posted (beyond what it can
// buffer). So the two ends of a pair must post their transfers in the same
// order, a send on one end matched by a receive on the other; two sends
// facing each other never complete. A stage's compute order (StageActions)
// is not its neighbour's: under 1F1B stage 0 of 2 forwards twice before its
// first backward while stage 1 alternates, so posting each transfer where
// its compute needs it deadlocks at 12 MB activations. Lowering fixes the
// order: the schedule is run on paper (SimulatePipeline's rule), and on
// each pair of ranks every transfer takes its place by when it is made
// (ties: the lower rank's first), so both ends agree. A rank posts each
// send as the compute that made it ends, and each receive at the latest
// when its compute needs it or before its own next send on that pair,
// whichever comes first (asynchronous; the buffer is held from then). This
// covers the wrap-around pair of interleaved schedules (rank S-1 sends
// chunk v's output to rank 0's chunk v+1), on which activations flow both
// ways when S = 2.

struct PipelineOp {
  enum class Kind {
    kForward,  // compute only: every transfer is an op of its own
    kBackward,
    kWeight,    // zb-h1's W: compute only, no transfer
    kPostRecv,  // post an asynchronous receive (a buffer held until waited)
    kWaitRecv,  // wait for a posted receive
    kPostSend,  // post an asynchronous send (completed by the step's end)
  };
  enum class Payload { kActivation, kGradient };
  Kind kind = Kind::kForward;
  int64_t micro_batch = 0;
  // The rank's chunk the op serves: the compute's; a transfer's is the
  // chunk that sends it or receives into it.
  int64_t chunk = 0;
  Payload payload = Payload::kActivation;  // transfers only
  int64_t peer = 0;                        // transfers only: the other stage
  bool operator==(const PipelineOp& other) const {
    return kind == other.kind && micro_batch == other.micro_batch &&
           chunk == other.chunk &&
           (kind == Kind::kForward || kind == Kind::kBackward ||
            kind == Kind::kWeight ||
            (payload == other.payload && peer == other.peer));
  }
};

// "F3", "B0", "W0", "recv a2 from 0", "wait a2", "send g1 to 2": for
// messages;
// an op of chunk c > 0 says "(chunk c)" after the micro-batch.
std::string DescribeOp(const PipelineOp& op);

// Stage `stage`'s compute (StageActions) with its transfers placed as above.
// Internal when a receive's turn on its pair would come after a send its
// stage has not yet computed (no schedule here does that);
// InvalidArgument for what CheckVirtualStages refuses.
absl::StatusOr<std::vector<PipelineOp>> LowerStageActions(
    PipelineSchedule schedule, int64_t stages, int64_t stage,
    int64_t micro_batches, int64_t virtual_stages = 1);

// Every stage's ops as LowerStageActions places them, index = stage.
absl::StatusOr<std::vector<std::vector<PipelineOp>>> LowerAllStages(
    PipelineSchedule schedule, int64_t stages, int64_t micro_batches,
    int64_t virtual_stages = 1);

// The transfers each stage posts in the order a stage would if it posted
// each where its compute needs it (a receive at the start of the forward or
// backward that needs it, waited at once; a send at the end of the one that
// made it). Unsafe on NCCL for 1F1B; kept to show that it is.
std::vector<PipelineOp> NaiveStageOps(PipelineSchedule schedule, int64_t stages,
                                      int64_t stage, int64_t micro_batches,
                                      int64_t virtual_stages = 1);

// Runs every stage's ops under NCCL's rule (per pair: in posting order, one
// at a time, a send completes only with its receive; a wait blocks the
// stage) with compute taking no time. OK when every op completes;
// FailedPrecondition naming the stages and the ops that face each other
// when they cannot, or a transfer matched with another micro-batch's or
// chunk's.
absl::Status CheckPointToPointOrder(
    const std::vector<std::vector<PipelineOp>>& stage_ops);

}  // namespace shardtrain

#endif  // SHARDTRAIN_CORE_PLAN_PIPELINE_PLAN_H_
