// `shardtrain data ...`: local dataset commands, no daemon needed.
//   data prepare --corpus brown --out DIR
//   data prepare --text PATH... --out DIR
//   data inspect FILE.bin [--count N]
#ifndef SHARDTRAIN_CLIENT_DATA_COMMANDS_H_
#define SHARDTRAIN_CLIENT_DATA_COMMANDS_H_

#include "CLI/CLI.hpp"

namespace shardtrain::cli {

// Adds the `data` command group to `app`. A chosen command runs once parsing
// has succeeded and stores its ExitCode in *exit_code, which must outlive
// `app`'s parse.
void AddDataCommands(CLI::App* app, int* exit_code);

}  // namespace shardtrain::cli

#endif  // SHARDTRAIN_CLIENT_DATA_COMMANDS_H_
