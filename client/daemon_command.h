// `shardtrain daemon`: start a local shardtraind unless one answers, and
// `daemon status` / `daemon stop` for the one holding a state directory.
#ifndef SHARDTRAIN_CLIENT_DAEMON_COMMAND_H_
#define SHARDTRAIN_CLIENT_DAEMON_COMMAND_H_

#include "CLI/CLI.hpp"

namespace shardtrain::cli {

void AddDaemonCommand(CLI::App* app, int* exit_code);

}  // namespace shardtrain::cli

#endif  // SHARDTRAIN_CLIENT_DAEMON_COMMAND_H_
