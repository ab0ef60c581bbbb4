#include "common/cli_usage.h"

#include <algorithm>
#include <iostream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace shardtrain {
namespace {

// Edits between a and b: insertions, deletions, substitutions and swaps of
// two neighbouring letters (the typo "lgos" is one swap from "logs").
size_t EditDistance(absl::string_view a, absl::string_view b) {
  std::vector<std::vector<size_t>> d(a.size() + 1,
                                     std::vector<size_t>(b.size() + 1));
  for (size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    for (size_t j = 1; j <= b.size(); ++j) {
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1,
                          d[i - 1][j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
      }
    }
  }
  return d[a.size()][b.size()];
}

// The subcommand the command line chose, deepest first reached.
CLI::App* ChosenCommand(CLI::App& app) {
  CLI::App* command = &app;
  for (;;) {
    std::vector<CLI::App*> chosen = command->get_subcommands();
    if (chosen.empty()) return command;
    command = chosen.front();
  }
}

std::vector<std::string> OptionNames(CLI::App* command) {
  std::vector<std::string> names;
  for (CLI::App* app = command; app != nullptr; app = app->get_parent()) {
    for (const CLI::Option* option : app->get_options()) {
      for (const std::string& name : option->get_lnames()) {
        names.push_back("--" + name);
      }
    }
  }
  return names;
}

std::vector<std::string> CommandNames(CLI::App* command) {
  std::vector<std::string> names;
  for (const CLI::App* sub :
       command->get_subcommands([](CLI::App*) { return true; })) {
    names.push_back(sub->get_name());
  }
  return names;
}

}  // namespace

std::string NearestName(absl::string_view word,
                        const std::vector<std::string>& names) {
  std::string best;
  size_t best_distance = std::max<size_t>(1, word.size() / 3) + 1;
  for (const std::string& name : names) {
    const size_t d = EditDistance(word, name);
    if (d < best_distance) {
      best = name;
      best_distance = d;
    }
  }
  return best;
}

int ReportParseError(CLI::App& app, const CLI::ParseError& error,
                     absl::string_view program) {
  if (error.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) {
    return app.exit(error);  // --help, --version
  }
  CLI::App* command = ChosenCommand(app);
  std::string what = error.what();
  std::string hint;
  // Words nothing took: a mistyped option, or a command that does not exist.
  const std::vector<std::string> unknown = app.remaining(/*recurse=*/true);
  if (!unknown.empty()) {
    const std::string& word = unknown.front();
    if (absl::StartsWith(word, "-")) {
      const std::string name = word.substr(0, word.find('='));
      what = absl::StrCat("unknown option ", name);
      const std::string near = NearestName(name, OptionNames(command));
      if (!near.empty()) hint = absl::StrCat("; did you mean ", near, "?");
    } else if (!CommandNames(command).empty()) {
      what = absl::StrCat("unknown command \"", word, "\"");
      const std::string near = NearestName(word, CommandNames(command));
      if (!near.empty()) hint = absl::StrCat("; did you mean ", near, "?");
    } else {
      what = absl::StrCat("unexpected argument \"", word, "\"");
    }
  }
  const std::string where =
      command == &app ? std::string(program)
                      : absl::StrCat(program, " ", command->get_name());
  std::cerr << program << ": usage error: " << what << hint << " (run `"
            << where << " --help` for usage)" << std::endl;
  return kUsageExitCode;
}

}  // namespace shardtrain
