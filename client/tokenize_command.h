// `shardtrain tokenize`: GPT-2 text -> ids on stdin/stdout, and back with
// --decode. The literal text "<|endoftext|>" becomes id 50256.
#ifndef SHARDTRAIN_CLIENT_TOKENIZE_COMMAND_H_
#define SHARDTRAIN_CLIENT_TOKENIZE_COMMAND_H_

#include "CLI/CLI.hpp"

namespace shardtrain::cli {

// Adds `tokenize` to `app`; see AddDataCommands for *exit_code.
void AddTokenizeCommand(CLI::App* app, int* exit_code);

}  // namespace shardtrain::cli

#endif  // SHARDTRAIN_CLIENT_TOKENIZE_COMMAND_H_
