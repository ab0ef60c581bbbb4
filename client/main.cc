// shardtrain: the command-line client. Each command group registers itself
// from its own file; this file parses and maps errors to exit codes
// (see exit_code.h).
#include <iostream>
#include <new>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "client/checkpoint_commands.h"
#include "client/daemon_command.h"
#include "client/data_commands.h"
#include "client/exit_code.h"
#include "client/job_commands.h"
#include "client/plan_command.h"
#include "client/study_commands.h"
#include "client/tokenize_command.h"
#include "common/atomic_file.h"
#include "common/cli_usage.h"
#include "core/run/strategy_kinds.h"

int main(int argc, char** argv) {
  namespace cli = shardtrain::cli;
  // An interrupted export or data preparation leaves no temporary file.
  shardtrain::RemoveTemporaryFilesOnInterrupt();
  const std::string about = absl::StrCat(
      "shardtrain: train language models on a mesh of devices (",
      shardtrain::StrategyDisplayNames(),
      ", pipeline stages and tensor parallelism), and compare the meshes");
  CLI::App app{about, "shardtrain"};
  app.require_subcommand(1);
  app.option_defaults()->always_capture_default();
  int exit_code = cli::kExitOk;
  cli::AddDataCommands(&app, &exit_code);
  cli::AddTokenizeCommand(&app, &exit_code);
  cli::AddJobCommands(&app, &exit_code, argc, argv);
  cli::AddCompareCommand(&app, &exit_code, argc, argv);
  cli::AddPlanCommand(&app, &exit_code);
  cli::AddCheckpointCommands(&app, &exit_code);
  cli::AddDaemonCommand(&app, &exit_code);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return shardtrain::ReportParseError(app, e, "shardtrain");
  } catch (const std::bad_alloc&) {
    // An input sized beyond this machine's memory: an error, not an abort.
    return cli::ReportFailure(
        "out of memory: the input asks for more memory than this machine "
        "has");
  }
  return exit_code;
}
