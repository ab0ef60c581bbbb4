// shardtrain: the command-line client. Each command group registers itself
// from its own file; this file parses and maps errors to exit codes
// (see exit_code.h).
#include <iostream>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "client/checkpoint_commands.h"
#include "client/data_commands.h"
#include "client/exit_code.h"
#include "client/job_commands.h"
#include "client/plan_command.h"
#include "client/study_commands.h"
#include "client/tokenize_command.h"

int main(int argc, char** argv) {
  namespace cli = shardtrain::cli;
  CLI::App app{"shardtrain: train GPT-2 with single-device, DDP or FSDP",
               "shardtrain"};
  app.require_subcommand(1);
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
    if (e.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) {
      return app.exit(e);  // --help
    }
    // CLI11 reports a missing subcommand before an unknown word that was
    // meant as one; name the word.
    const std::vector<std::string> unknown = app.remaining(/*recurse=*/true);
    std::cerr << "shardtrain: usage error: " << e.what()
              << (unknown.empty() ? ""
                                  : "; unknown command \"" + unknown[0] + "\"")
              << " (run with --help for usage)" << std::endl;
    return cli::kExitUsage;
  }
  return exit_code;
}
