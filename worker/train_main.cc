// shardtrain-train: the standalone trainer. Flags or a YAML file (--config,
// same keys) build a TrainConfig; the run is driven by the engine's Trainer.
// Reads torchrun's RANK / WORLD_SIZE variables, so torchrun-style launchers
// can start it too.
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <thread>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/cli_usage.h"
#include "common/dist_env.h"
#include "common/exit_codes.h"
#include "core/checkpoint/checkpoint_export.h"
#include "core/model/model_config.h"
#include "core/plan/auto_mesh.h"
#include "core/run/strategy_kinds.h"
#include "core/run/train_config.h"
#include "core/run/train_flags.h"
#include "worker/calibration.h"
#include "worker/engine/support/cpu_threads.h"
#include "worker/local_ranks.h"
#include "worker/training_run.h"

namespace shardtrain {
namespace {

// More ranks than cores on this host: each gets a slice of a core, so ranks
// start and step slowly. Said before they start.
void WarnIfOversubscribed(int64_t ranks, std::ostream& out) {
  const int64_t cores = std::thread::hardware_concurrency();
  if (cores < 1 || ranks <= cores) return;
  out << "shardtrain-train: warning: " << ranks << " ranks on " << cores
      << " cores: each rank gets about 1/" << (ranks + cores - 1) / cores
      << " of a core, so the ranks take long to start and every step is "
         "slow (one rank per core or fewer runs at full speed)"
      << std::endl;
}

// Prints `s` as the command's error; its exit code.
int Fail(const absl::Status& s, int code) {
  std::cerr << "shardtrain-train: " << s.message() << "\n";
  return code;
}

// What the command line asks for.
struct Command {
  TrainConfig config;
  std::string config_file;
  LocalRanksOptions launch;
  bool calibrate = false;
};

// The YAML file sets the base values; flags given on the command line win,
// so it is read before CLI11 assigns the flags.
absl::Status ReadConfigFile(int argc, char** argv, Command* command) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::string(argv[i]) == "--config") command->config_file = argv[i + 1];
  }
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.rfind("--config=", 0) == 0) command->config_file = arg.substr(9);
  }
  if (command->config_file.empty()) return absl::OkStatus();
  return LoadYamlTrainConfigFile(command->config_file, &command->config);
}

void AddCommandFlags(CLI::App& app, Command* command) {
  app.option_defaults()->always_capture_default();
  app.add_option("--config", command->config_file,
                 "YAML file with the same keys as the flags");
  AddTrainFlags(app, command->config);
  LocalRanksOptions& launch = command->launch;
  app.add_option("--nproc", launch.nproc,
                 "start N ranks on this host, like torchrun --nproc-per-node")
      ->check(CLI::Range(1, 1024));
  app.add_option("--nnodes", launch.nnodes,
                 "hosts in the run (each runs this command with its "
                 "--node-rank), like torchrun --nnodes")
      ->check(CLI::Range(1, 4096));
  app.add_option("--node-rank", launch.node_rank,
                 "this host's index in [0, --nnodes)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--master-addr", launch.master_addr,
                 "host of node 0 (its rendezvous store), reachable from all")
      ->capture_default_str();
  app.add_option("--master-port", launch.master_port,
                 "rendezvous port (0: a free one on one host, 29500 across "
                 "hosts)")
      ->check(CLI::Range(0, 65535));
  app.add_flag("--calibrate", command->calibrate,
               "measure this host once for `shardtrain plan`'s step times: "
               "training FLOP/s of one thread on --model (at --batch-size x "
               "--seq-len), AdamW, and the all-reduce between --nproc ranks "
               "(default 2); cached in ~/.cache/shardtrain/host_rates.json");
}

// --strategy auto: the launcher picks the mesh and hands it to its ranks; a
// rank started by another launcher picks it alone (the same choice from the
// same cached rates). The exit code when the command ends here.
std::optional<int> ChooseAutoMesh(Command& command, AutoChoice* choice) {
  TrainConfig& config = command.config;
  const LocalRanksOptions& launch = command.launch;
  const bool is_rank = std::getenv("RANK") != nullptr;
  // The rest of the command must hold whatever the mesh.
  TrainConfig probe = config;
  probe.strategy = "single";
  if (absl::Status s = probe.Validate(); !s.ok()) return Fail(s, 2);
  if (launch.nnodes > 1) {
    std::cerr << "shardtrain-train: --strategy auto runs on one host "
                 "(--nnodes 1): each host would choose from its own rates; "
                 "run `shardtrain plan --fit` and pass its mesh\n";
    return 2;
  }
  const char* handed = std::getenv(kAutoMeshVariable);
  if (is_rank && handed != nullptr) {
    if (absl::Status s = ApplyYamlTrainConfig(handed, &config); !s.ok()) {
      std::cerr << "shardtrain-train: " << kAutoMeshVariable << ": "
                << s.message() << "\n";
      return 2;
    }
    return std::nullopt;
  }
  int64_t world = int64_t{launch.nproc} * launch.nnodes;
  int64_t per_host = launch.nproc;
  if (is_rank) {
    absl::StatusOr<DistEnv> env = DistEnvFromEnvironment();
    if (env.ok()) {
      world = env->world_size;
      per_host = env->local_world_size > 0 ? env->local_world_size : world;
    }
  }
  std::ostringstream quiet;
  const bool speak = !is_rank || std::getenv("RANK") == std::string("0");
  if (absl::Status s = ResolveAutoStrategy(&config, world, per_host,
                                           is_rank ? "" : "/proc/self/exe",
                                           speak ? std::cout : quiet, choice);
      !s.ok()) {
    return Fail(s, ExitCodeFor(s));
  }
  ::setenv(kAutoMeshVariable, MeshFieldsYaml(config).c_str(), 1);
  return std::nullopt;
}

// What every rank would refuse is said once, before any starts: the ranks
// the mesh needs (one for single; S, or a multiple of S with ddp, for S
// stages) and the data directory. Calibration trains nothing.
absl::Status CheckBeforeTheRanks(const Command& command) {
  if (std::getenv("RANK") != nullptr || command.calibrate) {
    return absl::OkStatus();
  }
  absl::Status s = command.config.CheckMeshWorld(
      int64_t{command.launch.nproc} * command.launch.nnodes,
      "--nproc x --nnodes");
  if (s.ok()) s = command.config.CheckDataDirectory();
  return s;
}

// This process is one rank (started by --nproc, torchrun or the
// coordinator, or alone): calibrates or trains.
int RunThisRank(const Command& command, const AutoChoice& auto_choice) {
  absl::StatusOr<DistEnv> env = DistEnvFromEnvironment();
  if (!env.ok()) return Fail(env.status(), 2);
  if (command.calibrate) {
    absl::Status s = RunCalibrationRank(command.config, *env, &std::cout);
    return s.ok() ? 0 : Fail(s, ExitCodeFor(s));
  }
  if (absl::Status s =
          command.config.CheckMeshWorld(env->world_size, "WORLD_SIZE");
      !s.ok()) {
    return Fail(s, 2);
  }
  absl::Status run = RunTrainingRank(command.config, *env, &std::cout, {});
  if (!run.ok()) return Fail(run, ExitCodeFor(run));
  // A run of one process that chose its mesh itself.
  if (env->rank == 0) ReportAutoOutcome(auto_choice, command.config, std::cout);
  return 0;
}

int Main(int argc, char** argv) {
  Command command;
  if (absl::Status s = ReadConfigFile(argc, argv, &command); !s.ok()) {
    return Fail(s, 2);
  }
  CLI::App app{absl::StrCat("shardtrain-train: train a causal language model (",
                            absl::StrJoin(ModelFamilyNames(), ", "),
                            ") on one device or a mesh (", StrategyNameList(),
                            ", pipeline stages, tensor parallelism)")};
  AddCommandFlags(app, &command);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return ReportParseError(app, e, "shardtrain-train");
  }
  TrainConfig& config = command.config;
  LocalRanksOptions& launch = command.launch;
  // --init-from without --model: the model the weights hold (a Hugging Face
  // config.json, llm.c's header, a checkpoint's metadata). Given, --model
  // is checked against them when they load.
  if (!config.init_from.empty() && app.count("--model") == 0 &&
      config.model == TrainConfig().model) {
    absl::StatusOr<ModelWeights> weights = OpenModelWeights(config.init_from);
    if (weights.ok()) config.model = weights->config.ToSpec();
  }
  if (command.calibrate) {
    if (config.data.empty()) config.data = "-";  // reads no data
    if (app.count("--nproc") == 0 && launch.nnodes == 1) launch.nproc = 2;
  }
  AutoChoice auto_choice;
  if (config.strategy == "auto" && !command.calibrate) {
    if (std::optional<int> code = ChooseAutoMesh(command, &auto_choice)) {
      return *code;
    }
  }
  if (absl::Status s = config.Validate(); !s.ok()) return Fail(s, 2);
  if (absl::Status s = CheckBeforeTheRanks(command); !s.ok()) {
    return Fail(s, 2);
  }
  // --nproc N outside a distributed run: launch N ranks of this very command
  // line and wait for them. The ranks have RANK set and go on to train.
  if ((launch.nproc > 1 || launch.nnodes > 1) &&
      std::getenv("RANK") == nullptr) {
    if (config.device == "cpu") WarnIfOversubscribed(launch.nproc, std::cerr);
    const int code = RunLocalRanks(std::move(launch), argc, argv);
    if (code == 0) ReportAutoOutcome(auto_choice, config, std::cout);
    return code;
  }
  return RunThisRank(command, auto_choice);
}

}  // namespace
}  // namespace shardtrain

int main(int argc, char** argv) {
  shardtrain::ReexecForFasterBlasKernels(argv);
  return shardtrain::Main(argc, argv);
}
