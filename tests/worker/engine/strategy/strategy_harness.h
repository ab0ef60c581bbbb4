// The strategy tests' one harness: seeded models and batches, the training
// loop every test runs, ranks as threads joined by the in-process
// Communicator, full parameters read back through ExportModel (so any
// strategy, sharded or not, is compared the same way) and the comparison
// against single-device training. strategy_contract_test runs every
// distributed row of StrategyKinds() through it; a strategy's own test file
// adds only what is particular to it.
#ifndef SHARDTRAIN_TESTS_WORKER_ENGINE_STRATEGY_STRATEGY_HARNESS_H_
#define SHARDTRAIN_TESTS_WORKER_ENGINE_STRATEGY_STRATEGY_HARNESS_H_

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/run/train_config.h"
#include "tests/fakes/in_process_communicator.h"
#include "worker/engine/comm/communicator.h"
#include "worker/engine/model/gpt2.h"
#include "worker/engine/strategy/strategy.h"

namespace shardtrain::test {

// A GPT-2 model of `spec` initialised from `seed` (identical on every rank).
Gpt2 MakeModel(const std::string& spec, uint64_t seed);
// A model of any family.
CausalLm MakeCausalLm(const std::string& spec, uint64_t seed);

// `steps` global batches of `rows` windows of seq_len + 1 tokens in [0, vocab).
torch::Tensor MakeBatches(int64_t steps, int64_t rows, int64_t seq_len,
                          int64_t vocab);

// Rows [first, first + count) of global batch `step` as (inputs, targets).
std::pair<torch::Tensor, torch::Tensor> Slice(const torch::Tensor& batches,
                                              int64_t step, int64_t first,
                                              int64_t count);

using ParamMap = std::map<std::string, torch::Tensor>;

// What a run gives to compare.
struct TrainResult {
  std::vector<double> losses;  // mean over ranks, per step
  std::vector<double> norms;   // before clipping, per step
  ParamMap params;             // full, after the last step
  double eval_loss = 0;        // ForwardLoss on batch 0, at the end
  // Bytes this rank put on the wire in each micro-step, in order.
  std::vector<int64_t> micro_comm_bytes;
  // Of those, the bytes sent between shard groups (HSDP's replica group).
  std::vector<int64_t> micro_inter_group_bytes;
  // With whole_steps: the communication of each step.
  std::vector<CommStats> step_comm;
  int64_t state_bytes = 0;  // ModelStateBytes() after the last step
  // With record_gradients: GradientSlices() after each step's backward
  // (copies), in step order.
  std::vector<std::vector<StateSlice>> gradients;
};

// How a run trains: global batches [first_step, last_step), each step
// `micro_steps` micro-batches of this rank's rows, synced on the last.
struct TrainLoop {
  int64_t first_step = 0;
  int64_t last_step = 0;
  int64_t micro_steps = 1;
  double lr = 1e-4;
  double max_norm = 1.0;
  // Called after each step's backward (and its synchronisation), before
  // clipping; tests use it to look at gradients.
  std::function<void(int64_t step)> after_backward;
  // Gpt2Impl::set_activation_checkpointing of every rank's model.
  int64_t activation_checkpointing = 0;
  // Hand each step's micro-batches to ForwardBackwardStep at once (as the
  // trainer does) instead of ForwardBackward one at a time.
  bool whole_steps = false;
  // The in-process communicator's point-to-point behaviour (TrainRanks):
  // kNcclOrder makes a transfer posted out of NCCL's order hang (and fail
  // the run after kNcclOrderTimeout) instead of being buffered.
  PointToPoint point_to_point = PointToPoint::kBuffered;
  // Keep every step's gradients (TrainResult::gradients).
  bool record_gradients = false;
  // Called on each rank after a step's backward, before the gradients are
  // recorded: a test that breaks one tensor's gradient on purpose.
  std::function<void(int64_t step, Strategy& strategy)> tamper;
};

inline constexpr std::chrono::seconds kNcclOrderTimeout{30};

// Steps [first_step, last_step) of `micro_steps` micro-batches at `lr`.
TrainLoop MakeLoop(int64_t first_step, int64_t last_step, int64_t micro_steps,
                   double lr, double max_norm = 1.0);

// Runs `loop` on `strategy` (set up already) as `rank` of `world`: fills
// losses, norms, micro_comm_bytes, state_bytes and eval_loss, not params.
// Each data-parallel replica (Strategy::data_parallel_rank) trains on its
// share of the global batch's rows.
void Train(Strategy& strategy, const torch::Tensor& batches, int64_t rank,
           int64_t world, const TrainLoop& loop, TrainResult* result);

// The whole model's parameters, by name, on every rank: ExportModel (a
// collective for sharded strategies) into `dir`, read back into a model of
// `spec`. Ranks of one run pass the same `dir`.
ParamMap FullParameters(Strategy& strategy, const std::string& spec,
                        const std::string& dir);

// Builds rank `rank`'s strategy of a `world`-rank run over `comm`.
using StrategyMaker = std::function<std::unique_ptr<Strategy>(
    int64_t rank, int64_t world, Communicator* comm)>;

// A maker for the StrategyKinds() row `name`, through the real factory.
StrategyMaker FactoryMaker(const std::string& name);
// The same for a whole mesh: `config`'s strategy, stages, tensor ranks.
StrategyMaker FactoryMaker(const TrainConfig& config);

// Single-device training of a model of `spec` (seed `seed`) on the whole
// global batches.
TrainResult TrainSingle(const std::string& spec, uint64_t seed,
                        const torch::Tensor& batches, const TrainLoop& loop);

// `world` ranks as threads, each a model of `spec` (seed `seed`) under
// make(rank, world, comm), trained by `loop`; every rank's result.
std::vector<TrainResult> TrainRanks(const std::string& spec, uint64_t seed,
                                    const torch::Tensor& batches, int64_t world,
                                    const TrainLoop& loop,
                                    const StrategyMaker& make);

struct Tolerance {
  double rel = 1e-5;    // losses, norms, eval loss: relative
  double param = 1e-5;  // final parameters: absolute
};

// Every step's loss and norm, the eval loss and the final parameters match;
// prints the worst differences under `what`.
void ExpectSameTraining(const TrainResult& expected, const TrainResult& actual,
                        const Tolerance& tolerance, const std::string& what);

// Step `step`'s gradients of a run as whole global tensors by parameter
// name, put together from every rank's slices.
ParamMap GlobalGradients(const std::vector<TrainResult>& ranks, size_t step);

// Per parameter: max |a - b| over max |b| (b: the reference).
std::map<std::string, double> GradientDiffs(const ParamMap& reference,
                                            const ParamMap& actual);

// Every step's every gradient within `rel` of one device's, tensor by
// tensor; prints the worst under `what`.
void ExpectSameGradients(const TrainResult& single,
                         const std::vector<TrainResult>& ranks, double rel,
                         const std::string& what);

// A TrainLoop::tamper that doubles the gradient of parameter `name` on
// every rank (what a scale bug confined to one tensor would do).
std::function<void(int64_t, Strategy&)> DoubleGradientOf(
    const std::string& name);

// Step 0's gradients of `ranks` against `single`'s: `tampered`'s off by more
// than half its largest element, every other within `rel` — the tensor by
// tensor check catches what the norm alone would blur.
void ExpectOnlyTamperedGradientDiffers(const TrainResult& single,
                                       const std::vector<TrainResult>& ranks,
                                       const std::string& tampered, double rel);

double RelDiff(double a, double b);
double MaxAbsDiff(const ParamMap& a, const ParamMap& b);

}  // namespace shardtrain::test

#endif  // SHARDTRAIN_TESTS_WORKER_ENGINE_STRATEGY_STRATEGY_HARNESS_H_
