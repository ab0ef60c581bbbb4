// `shardtrain compare`: the strategy comparison study.
#ifndef SHARDTRAIN_CLIENT_STUDY_COMMANDS_H_
#define SHARDTRAIN_CLIENT_STUDY_COMMANDS_H_

#include "CLI/CLI.hpp"

namespace shardtrain::cli {

void AddCompareCommand(CLI::App* app, int* exit_code, int argc, char** argv);

}  // namespace shardtrain::cli

#endif  // SHARDTRAIN_CLIENT_STUDY_COMMANDS_H_
