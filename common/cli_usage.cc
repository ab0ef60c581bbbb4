#include "common/cli_usage.h"

#include <algorithm>
#include <iostream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace shardtrain {
namespace {

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

// CLI11's "Could not convert: --lr = abc" as "--lr expects a number, got
// 'abc'", from the option's declared type.
std::string ConversionText(CLI::App* command, const std::string& what) {
  constexpr absl::string_view kPrefix = "Could not convert: ";
  const size_t equals = what.find(" = ");
  if (!absl::StartsWith(what, kPrefix) || equals == std::string::npos) {
    return what;
  }
  const std::string name = what.substr(kPrefix.size(), equals - kPrefix.size());
  const std::string value = what.substr(equals + 3);
  const CLI::Option* option = nullptr;
  for (CLI::App* app = command; app != nullptr && option == nullptr;
       app = app->get_parent()) {
    option = app->get_option_no_throw(name);
  }
  std::string expected = "a value of its type";
  if (option != nullptr) {
    const std::string type = option->get_type_name();
    if (absl::StrContains(type, "INT")) {
      expected = "a whole number";
    } else if (absl::StrContains(type, "FLOAT")) {
      expected = "a number";
    } else if (absl::StrContains(type, "BOOL")) {
      expected = "true or false";
    } else if (!type.empty()) {
      expected = absl::StrCat("a ", type);
    }
  }
  return absl::StrCat(name, " expects ", expected, ", got '", value, "'");
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

int ReportParseError(CLI::App& app, const CLI::ParseError& error,
                     absl::string_view program) {
  if (error.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) {
    return app.exit(error);  // --help, --version
  }
  CLI::App* command = ChosenCommand(app);
  std::string what = error.what();
  std::string hint;
  if (error.get_name() == "ConversionError")
    what = ConversionText(command, what);
  // Words nothing took: a mistyped option, or a command that does not exist.
  const std::vector<std::string> unknown = app.remaining(/*recurse=*/true);
  if (!unknown.empty()) {
    const std::string& word = unknown.front();
    if (absl::StartsWith(word, "-")) {
      const std::string name = word.substr(0, word.find('='));
      what = absl::StrCat("unknown option ", name);
      const std::string near = NearestName(name, OptionNames(command));
      if (near == name && command != &app) {
        // The command's own option, given before the command.
        what =
            absl::StrCat(name, " is an option of the command; it goes after ",
                         command->get_name());
        hint = absl::StrCat(": ", program, " ", command->get_name(), " ", name,
                            " ...");
      } else if (!near.empty()) {
        hint = absl::StrCat("; did you mean ", near, "?");
      }
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
