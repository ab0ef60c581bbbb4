// StepTimePlan: the time one optimizer step will take on a mesh, predicted
// before anything is launched, from the model's FLOPs, the traffic each mesh
// dimension moves and this host's measured rates (`shardtrain plan --fit`
// ranks the meshes that fit by it; `--strategy auto` trains the first).
// Torch-free.
//
// The model, per rank and step:
//   compute        the rank's training FLOPs (forward, backward and the
//                  forward again of recomputed blocks; 1/T of every block
//                  and of the vocabulary under tensor parallelism, the
//                  slowest stage's under pipeline stages) over its rate:
//                  threads x the measured FLOP/s of one thread, scaled down
//                  when the host's ranks x threads exceed its cores; plus
//                  the measured overhead of each micro-batch's pass (its
//                  stage's share of it), which many small micro-batches
//                  pay
//   parameters     what the step costs per parameter the rank keeps (1/N
//                  of them under FSDP, 1/T under tensor parallelism)
//                  besides FLOPs: AdamW, and the dense gradients' zeroing
//                  and accumulation, each at its measured seconds per
//                  parameter
//   collectives    for each mesh dimension (data-parallel, tensor-parallel,
//                  pipeline) the collectives our strategies issue, as ring
//                  algorithms: calls x steps x latency + wire bytes /
//                  bandwidth, with the measured latency and bandwidth of the
//                  group's kind (ranks of one host, or of several)
//   bubble         pipeline stages: the fill and drain of the step's one
//                  flush, the other stages' time on one micro-batch (a step
//                  of M micro-batches takes (M - 1) t_max + sum of t_s;
//                  S - 1 micro-batch times when the stages are even), 1F1B
//                  and GPipe alike; zb-h1 the share of that its order
//                  leaves idle on paper (SimulatePipeline)
// On CPU (Gloo) collectives run on the cores that compute, so the parts add;
// on GPUs (NCCL) the data-parallel traffic overlaps the computation where
// the engine launches it during it, but for its last call: DDP, FSDP or
// HSDP alone behind the backward that reduces (buckets, per-unit
// reduce-scatters); meshes with pipeline stages or tensor ranks behind the
// step's last micro-batch's backward (buckets, or a sharded mesh's per-unit
// reduce-scatters, its all-gathers behind the first micro-batch's forward);
// of the tensor-parallel traffic, f's backward sums behind the
// column-parallel weights' gradients.
//
// What it leaves out (each shows as error in bench/RESULTS.md §10): kernels
// whose efficiency differs from the calibration's (the rate is measured on
// the model asked for when it can be, at one batch), memory traffic outside
// AdamW (LayerNorm, softmax, the chunked head's gradient accumulation), and
// contention between oversubscribed ranks beyond a fair share of the cores.
#ifndef SHARDTRAIN_CORE_PLAN_STEP_TIME_PLAN_H_
#define SHARDTRAIN_CORE_PLAN_STEP_TIME_PLAN_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/run/train_config.h"

namespace shardtrain {

// A collective's cost between ranks of one kind of group: time = latency x
// the algorithm's steps + wire bytes / bandwidth.
struct LinkRates {
  double latency_seconds = 0;
  double bytes_per_second = 0;
  bool known() const { return bytes_per_second > 0; }
};

// What a host does, measured once (`shardtrain-train --calibrate`) and
// cached (HostRatesCachePath).
struct HostRates {
  std::string device = "cpu";  // "cpu", or the GPU's name
  int64_t cores = 1;           // CPU cores the host's ranks share
  // Achieved training FLOP/s of one compute thread (CPU) or one device (GPU)
  // on the model `compute_model` (forward and backward of a whole step).
  double flops_per_thread = 0;
  std::string compute_model;
  // What a step costs per parameter besides its FLOPs, on one thread
  // (dense gradients zeroed and accumulated; wte's above all), and AdamW's
  // seconds per parameter and step.
  double gradient_seconds_per_parameter = 0;
  double optimizer_seconds_per_parameter = 0;
  // What one forward and backward pass (a micro-batch through the whole
  // model) costs on one thread besides its FLOPs: the operators' dispatch
  // and the lower rate of small products. Measured as the extra time of a
  // step of one-sequence micro-batches over the same tokens in one batch;
  // 0 (older caches): not counted.
  double pass_overhead_seconds = 0;
  LinkRates intra_node;     // ranks on one host
  LinkRates inter_node;     // ranks on different hosts; unknown: intra_node's
  std::string measured_at;  // when, "YYYY-MM-DD HH:MM UTC"

  // Every figure positive; FailedPrecondition naming the missing one.
  absl::Status Check() const;
  std::string ToJson() const;
  static absl::StatusOr<HostRates> FromJson(const std::string& text);
};

// $XDG_CACHE_HOME/shardtrain/host_rates.json (else ~/.cache/...), keyed by
// device and model: {"cpu": {"gpt2-tiny": {...}}}.
std::string HostRatesCachePath();
// The cached rates for `device` ("cpu" or a GPU name) measured on `model`;
// when that model has none, another model's on the same device (its
// compute_model says which). NotFound when the device has none.
absl::StatusOr<HostRates> LoadHostRates(const std::string& device,
                                        const std::string& model);
// Adds (or replaces) the entry for rates.device and rates.compute_model.
absl::Status SaveHostRates(const HostRates& rates);

// The `shardtrain-train --calibrate` command line (after the program) that
// measures rates for `config`'s model on its device, in seconds rather than
// minutes: the model itself when it is small (gpt2-mini on CPU, gpt2 on a
// GPU, or smaller), else that one (LoadHostRates then stands it in), at
// most 256 tokens per sequence.
std::vector<std::string> CalibrationArguments(const TrainConfig& config);

// One mesh dimension's traffic per rank and step.
struct MeshTraffic {
  std::string dimension;  // "data-parallel", "tensor-parallel", "pipeline"
  int64_t ranks = 1;      // in the group
  int64_t calls = 0;      // collectives (or sends) the rank issues
  // What the rank's collectives carry as the engine counts them
  // (StepMetrics::comm_bytes: an all-reduce's tensor, an all-gather's
  // input, a reduce-scatter's input, a send's message).
  int64_t counted_bytes = 0;
  int64_t wire_bytes = 0;  // what the ring algorithms send from the rank
  double seconds = 0;
};

struct StepTimePlan {
  std::string mesh;  // "fsdp4", "tp2", "pp2xddp2", "ddp2xtp2", "single"
  int64_t world_size = 1;
  int64_t data_parallel = 1;
  int64_t tensor_parallel = 1;
  int64_t pipeline_stages = 1;
  int64_t micro_batches = 1;
  int64_t threads_per_rank = 1;
  double compute_seconds = 0;
  double optimizer_seconds = 0;  // AdamW and the per-parameter work
  double bubble_seconds = 0;
  std::vector<MeshTraffic> traffic;  // one entry per dimension with >1 rank
  double exposed_comm_seconds = 0;   // what the traffic adds to the step
  double step_seconds = 0;
  int64_t tokens_per_step = 0;  // all ranks
  double tokens_per_second = 0;

  int64_t counted_bytes() const;
  // "compute", "data-parallel traffic", "pipeline bubble", ...: the largest
  // part of the step.
  std::string Bottleneck() const;
};

// The step of `config` (its strategy, batch, accumulation, seq_len,
// precision, device, stages, micro-batches, tensor parallelism, activation
// checkpointing, threads) at `world_size` ranks, `ranks_per_host` of them on
// each host, at `rates`. Errors: a model spec or mesh that does not parse or
// fit the world size; rates that fail Check().
absl::StatusOr<StepTimePlan> PlanStepTime(const TrainConfig& config,
                                          int64_t world_size,
                                          int64_t ranks_per_host,
                                          const HostRates& rates);

// The largest error of the step-time model measured on meshes with
// pipeline stages or tensor parallelism (bench/RESULTS.md §10c): a gap
// between two such meshes smaller than this is not a prediction to trust.
inline constexpr double kComposedMeshModelError = 0.32;

// A measured rate against its prediction, in words: "52% below the
// prediction", "8% above the prediction", "within 1% of the prediction".
std::string MeasuredAgainstPrediction(double predicted, double measured);

}  // namespace shardtrain

#endif  // SHARDTRAIN_CORE_PLAN_STEP_TIME_PLAN_H_
