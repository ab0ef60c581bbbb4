#include "client/compare_report.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "client/report_assets.h"  // generated: report/report.{js,css}
#include "client/step_metrics_csv.h"
#include "nlohmann/json.hpp"
#include "worker/engine/data/asset_paths.h"
#include "worker/engine/train/step_metrics.h"
#include "worker/engine/train/strategy_kinds.h"

namespace shardtrain::cli {
namespace {

// A spike ratio (max / median gradient norm) above this gets a finding.
constexpr double kGradNormSpikeThreshold = 3.0;

// ---------------------------------------------------------------------------
// Statistics
// ---------------------------------------------------------------------------

double Mean(const std::vector<double>& values) {
  if (values.empty()) return 0;
  double sum = 0;
  for (double v : values) sum += v;
  return sum / static_cast<double>(values.size());
}

// Population standard deviation: the spread of the steps we have, not an
// estimate for unseen ones (and defined for a single step: 0).
double StdDev(const std::vector<double>& values) {
  if (values.empty()) return 0;
  const double mean = Mean(values);
  double sum_sq = 0;
  for (double v : values) sum_sq += (v - mean) * (v - mean);
  return std::sqrt(sum_sq / static_cast<double>(values.size()));
}

// Nearest-rank percentile: the smallest value with at least p% of the values
// at or below it, so the result is always one of the measured values. The
// median everywhere in this file is Percentile(values, 50).
double Percentile(std::vector<double> values, double p) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const auto n = static_cast<double>(values.size());
  auto rank = static_cast<size_t>(std::ceil(p / 100.0 * n));
  rank = std::clamp<size_t>(rank, 1, values.size());
  return values[rank - 1];
}

// Every (rank, step) once, the last report winning: a rank that restarted
// from a checkpoint reports its replayed steps again, and the replay is what
// the final model came from. Sorted by step, then rank.
std::vector<v1::StepMetrics> Deduplicated(
    const std::vector<v1::StepMetrics>& steps) {
  std::map<std::pair<int64_t, int32_t>, const v1::StepMetrics*> latest;
  for (const v1::StepMetrics& m : steps) latest[{m.step(), m.rank()}] = &m;
  std::vector<v1::StepMetrics> out;
  out.reserve(latest.size());
  for (const auto& [key, m] : latest) out.push_back(*m);
  return out;
}

// ---------------------------------------------------------------------------
// Text helpers
// ---------------------------------------------------------------------------

// "DDP", "FSDP", "single-device" (train/strategy_kinds.h); other names as
// given.
std::string DisplayName(const std::string& strategy) {
  const StrategyKind* kind = FindStrategyKind(strategy);
  return kind != nullptr ? kind->display_name : strategy;
}

std::string Capitalised(std::string text) {
  if (!text.empty()) text[0] = absl::ascii_toupper(text[0]);
  return text;
}

std::string EscapeHtml(const std::string& text) {
  return absl::StrReplaceAll(text, {{"&", "&amp;"},
                                    {"<", "&lt;"},
                                    {">", "&gt;"},
                                    {"\"", "&quot;"},
                                    {"'", "&#39;"}});
}

// Inlined script text must not close its <script> element early. The HTML
// parser ends a script at "</script" in any letter case; "<\/script" means
// the same to JavaScript inside a string, regex or comment, which is the only
// place such text can occur in valid code.
std::string EscapeScriptText(const std::string& text) {
  static constexpr char kCloser[] = "</script";
  constexpr size_t kCloserSize = sizeof(kCloser) - 1;
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '<' && i + kCloserSize <= text.size() &&
        absl::EqualsIgnoreCase(absl::string_view(text).substr(i, kCloserSize),
                               kCloser)) {
      out += "<\\/";
      ++i;  // the '/' was written above
      continue;
    }
    out.push_back(text[i]);
  }
  return out;
}

std::string ScalingExplanation(const std::string& scaling) {
  if (scaling == "weak") {
    return "Weak scaling: every rank keeps the same per-rank batch, so the "
           "global batch grows with the number of ranks and ideal throughput "
           "grows in proportion.";
  }
  if (scaling == "strong") {
    return "Strong scaling: the global batch is fixed and split across the "
           "ranks, so more ranks means less work per rank for the same "
           "training problem.";
  }
  if (scaling == "budget") {
    return "Memory budget: every rank of every strategy has the same memory "
           "cap, and each strategy runs at the largest per-rank batch its "
           "plan fits under it (the batch/rank column), so the table shows "
           "what the memory a strategy saves buys: a larger batch, more "
           "tokens per step. Losses differ with the batch; compare them at "
           "equal tokens, not equal steps.";
  }
  return absl::StrCat("Scaling mode: ", scaling, ".");
}

// ---------------------------------------------------------------------------
// The table, shared by the markdown and HTML renderings
// ---------------------------------------------------------------------------

const std::vector<std::string>& TableHeader() {
  static const auto* const kHeader =
      new std::vector<std::string>{"strategy",
                                   "world",
                                   "batch/rank",
                                   "steps",
                                   "final train loss",
                                   "final val loss",
                                   "s/epoch",
                                   "tokens/s (mean ± std)",
                                   "step p50",
                                   "step p95",
                                   "peak mem/rank",
                                   "predicted",
                                   "grad norm mean",
                                   "std",
                                   "spike (max/median)",
                                   "MFU"};
  return *kHeader;
}

std::vector<std::string> TableCells(const StrategySummary& row) {
  return {
      row.strategy,
      absl::StrCat(row.world_size),
      row.batch_size > 0 ? absl::StrCat(row.batch_size) : "-",
      absl::StrCat(row.steps),
      absl::StrFormat("%.4f", row.final_train_loss),
      row.final_val_loss < 0 ? "-"
                             : absl::StrFormat("%.4f", row.final_val_loss),
      row.seconds_per_epoch > 0 ? FormatDuration(row.seconds_per_epoch) : "-",
      absl::StrCat(FormatThousands(std::llround(row.tokens_per_second_mean)),
                   " ± ",
                   FormatThousands(std::llround(row.tokens_per_second_std))),
      FormatDuration(row.step_seconds_p50),
      FormatDuration(row.step_seconds_p95),
      FormatBytes(row.peak_memory_bytes_per_rank),
      row.predicted_peak_bytes_per_rank > 0
          ? FormatBytes(row.predicted_peak_bytes_per_rank)
          : "-",
      absl::StrFormat("%.3f", row.grad_norm_mean),
      absl::StrFormat("%.3f", row.grad_norm_std),
      absl::StrFormat("%.2f", row.grad_norm_spike_ratio),
      absl::StrFormat("%.1f%%", row.mfu_mean * 100),
  };
}

std::string HtmlTable(const std::vector<StrategySummary>& rows) {
  std::string out = "<table>\n<thead><tr>";
  for (const std::string& h : TableHeader()) {
    absl::StrAppend(&out, "<th>", EscapeHtml(h), "</th>");
  }
  out += "</tr></thead>\n<tbody>\n";
  for (const StrategySummary& row : rows) {
    out += "<tr>";
    for (const std::string& cell : TableCells(row)) {
      absl::StrAppend(&out, "<td>", EscapeHtml(cell), "</td>");
    }
    out += "</tr>\n";
  }
  out += "</tbody>\n</table>\n";
  return out;
}

// ---------------------------------------------------------------------------
// Files
// ---------------------------------------------------------------------------

absl::StatusOr<std::string> ReadChartJs(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) {
    return absl::NotFoundError(absl::StrCat(
        "chart.js not found at ", path,
        " (dist/chart.umd.js of the chart.js npm package); scripts/setup "
        "installs it"));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::PermissionDeniedError(absl::StrCat("cannot read ", path));
  }
  return std::string((std::istreambuf_iterator<char>(in)),
                     std::istreambuf_iterator<char>());
}

absl::Status WriteWholeFile(const std::string& path,
                            const std::string& contents) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(contents.data(), static_cast<std::streamsize>(contents.size()));
  out.close();
  if (!out) return absl::InternalError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

std::string ReportMarkdown(const std::vector<StrategyRun>& runs,
                           const std::vector<StrategySummary>& summaries,
                           const CompareOptions& options) {
  std::string out = absl::StrCat(
      "# ", options.title.empty() ? "Strategy comparison" : options.title,
      "\n\n", ScalingExplanation(options.scaling), "\n\n## Summary\n\n",
      FormatSummaryTable(summaries), "\n## Findings\n\n");
  const std::vector<std::string> findings = Findings(summaries);
  if (findings.empty()) out += "No steps were recorded to compare.\n";
  for (const std::string& f : findings) absl::StrAppend(&out, "- ", f, "\n");
  out += "\n## Files\n\n";
  for (const StrategyRun& run : runs) {
    absl::StrAppend(&out, "- `", run.strategy, ".csv`: every rank's steps of ",
                    "job `", run.job_id, "`\n");
  }
  out += "- `report.html`: the table, findings and charts in one file\n";
  return out;
}

// The charts' data: per strategy, rank 0's curves and each rank's peak memory.
nlohmann::json ChartData(const std::vector<StrategyRun>& runs) {
  nlohmann::json strategies = nlohmann::json::array();
  for (const StrategyRun& run : runs) {
    nlohmann::json steps = nlohmann::json::array();
    std::map<int32_t, int64_t> peak_by_rank;
    for (const v1::StepMetrics& m : Deduplicated(run.steps)) {
      int64_t& peak = peak_by_rank[m.rank()];
      peak = std::max(peak, m.memory_peak_bytes());
      if (m.rank() != 0) continue;
      nlohmann::json step = {{"step", m.step()},
                             {"loss", m.loss()},
                             {"grad_norm", m.grad_norm()},
                             {"tokens_per_second", m.tokens_per_second()}};
      if (m.has_val_loss()) step["val_loss"] = m.val_loss();
      steps.push_back(std::move(step));
    }
    nlohmann::json peaks = nlohmann::json::array();
    for (const auto& [rank, bytes] : peak_by_rank) {
      peaks.push_back({{"rank", rank}, {"bytes", bytes}});
    }
    strategies.push_back({{"strategy", run.strategy},
                          {"label", DisplayName(run.strategy)},
                          {"job_id", run.job_id},
                          {"world_size", run.world_size},
                          {"steps", std::move(steps)},
                          {"peak_memory", std::move(peaks)}});
  }
  return {{"strategies", std::move(strategies)}};
}

std::string ReportHtml(const std::vector<StrategyRun>& runs,
                       const std::vector<StrategySummary>& summaries,
                       const CompareOptions& options,
                       const std::string& chart_js) {
  const std::string title =
      options.title.empty() ? "Strategy comparison" : options.title;
  // '<' occurs in JSON only inside strings, where \u003c means the same; the
  // blob then cannot end its <script> element or open a comment.
  const std::string json =
      absl::StrReplaceAll(ChartData(runs).dump(), {{"<", "\\u003c"}});

  std::string out = absl::StrCat(
      "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n",
      "<title>", EscapeHtml(title), "</title>\n<style>", kStyle, "</style>\n",
      // Registered before chart.js so that its own errors are caught too.
      "<script>window.reportErrors = [];\n"
      "window.onerror = function (message) {\n"
      "  window.reportErrors.push(String(message));\n};</script>\n",
      "</head>\n<body>\n<h1>", EscapeHtml(title), "</h1>\n<p>",
      EscapeHtml(ScalingExplanation(options.scaling)), "</p>\n",
      "<h2>Summary</h2>\n", HtmlTable(summaries), "<h2>Findings</h2>\n<ul>\n");
  for (const std::string& f : Findings(summaries)) {
    absl::StrAppend(&out, "<li>", EscapeHtml(f), "</li>\n");
  }
  out += "</ul>\n<h2>Charts</h2>\n";
  for (const char* id :
       {"chart-loss", "chart-grad-norm", "chart-throughput", "chart-memory"}) {
    absl::StrAppend(&out, "<div class=\"chart\"><canvas id=\"", id,
                    "\"></canvas></div>\n");
  }
  out += "<h2>Jobs</h2>\n<ul>\n";
  for (const StrategyRun& run : runs) {
    absl::StrAppend(&out, "<li>", EscapeHtml(DisplayName(run.strategy)),
                    ": job <code>", EscapeHtml(run.job_id), "</code>, ",
                    EscapeHtml(run.strategy), ".csv</li>\n");
  }
  absl::StrAppend(&out, "</ul>\n<pre id=\"render-check\"></pre>\n",
                  "<script type=\"application/json\" id=\"report-data\">", json,
                  "</script>\n<script>\n", EscapeScriptText(chart_js),
                  "\n</script>\n", "<script>", kPageScript,
                  "</script>\n</body>\n</html>\n");
  return out;
}

}  // namespace

// Rank 0 speaks for the job on loss, time, throughput, gradient norm and MFU
// (they are global or identical on every rank); memory differs by rank under
// sharding, so its peak is taken over every rank. Throughput figures (tokens/s
// and MFU) skip the first step when there are more, since it pays for warm-up
// (allocator, kernels) rather than training.
StrategySummary Summarise(const StrategyRun& run) {
  StrategySummary summary;
  summary.strategy = run.strategy;
  summary.world_size = run.world_size;
  summary.batch_size = run.batch_size;
  summary.predicted_peak_bytes_per_rank = run.predicted_peak_bytes_per_rank;

  std::vector<v1::StepMetrics> rank0;
  for (const v1::StepMetrics& m : Deduplicated(run.steps)) {
    summary.peak_memory_bytes_per_rank =
        std::max(summary.peak_memory_bytes_per_rank, m.memory_peak_bytes());
    if (m.rank() == 0) rank0.push_back(m);
  }
  if (rank0.empty()) return summary;

  summary.steps = static_cast<int64_t>(rank0.size());
  summary.final_train_loss = rank0.back().loss();
  for (const v1::StepMetrics& m : rank0) {
    if (m.has_val_loss()) summary.final_val_loss = m.val_loss();
  }

  std::vector<double> step_seconds, grad_norms, tokens_per_second, mfu;
  for (size_t i = 0; i < rank0.size(); ++i) {
    step_seconds.push_back(rank0[i].step_seconds());
    grad_norms.push_back(rank0[i].grad_norm());
    if (i == 0 && rank0.size() >= 2) continue;
    tokens_per_second.push_back(rank0[i].tokens_per_second());
    mfu.push_back(rank0[i].mfu());
  }

  summary.step_seconds_p50 = Percentile(step_seconds, 50);
  summary.step_seconds_p95 = Percentile(step_seconds, 95);
  summary.tokens_per_second_mean = Mean(tokens_per_second);
  summary.tokens_per_second_std = StdDev(tokens_per_second);
  summary.mfu_mean = Mean(mfu);
  summary.grad_norm_mean = Mean(grad_norms);
  summary.grad_norm_std = StdDev(grad_norms);
  const double grad_norm_median = Percentile(grad_norms, 50);
  if (grad_norm_median > 0) {
    summary.grad_norm_spike_ratio =
        *std::max_element(grad_norms.begin(), grad_norms.end()) /
        grad_norm_median;
  }

  const double tokens_per_step = static_cast<double>(run.batch_size) *
                                 static_cast<double>(run.grad_accum) *
                                 static_cast<double>(run.seq_len) *
                                 static_cast<double>(run.world_size);
  if (run.train_tokens > 0 && tokens_per_step > 0) {
    summary.seconds_per_epoch = summary.step_seconds_p50 *
                                static_cast<double>(run.train_tokens) /
                                tokens_per_step;
  }
  return summary;
}

std::string FormatSummaryTable(const std::vector<StrategySummary>& rows) {
  auto markdown_row = [](const std::vector<std::string>& cells) {
    std::vector<std::string> escaped;
    for (const std::string& c : cells) {
      escaped.push_back(absl::StrReplaceAll(c, {{"|", "\\|"}}));
    }
    return absl::StrCat("| ", absl::StrJoin(escaped, " | "), " |\n");
  };
  std::string out = markdown_row(TableHeader());
  // Every column but the strategy's name holds a number: right-aligned.
  out += "|---|";
  for (size_t i = 1; i < TableHeader().size(); ++i) out += "---:|";
  out += "\n";
  for (const StrategySummary& row : rows) out += markdown_row(TableCells(row));
  return out;
}

std::vector<std::string> Findings(const std::vector<StrategySummary>& rows) {
  std::vector<const StrategySummary*> ran;
  for (const StrategySummary& row : rows) {
    if (row.steps > 0) ran.push_back(&row);
  }
  std::vector<std::string> findings;
  if (ran.empty()) return findings;

  // DDP is the baseline when present: it keeps a whole replica on every rank,
  // so what sharding saves in memory and costs in communication shows
  // against it. Without DDP, single-device is the reference.
  const StrategySummary* baseline = nullptr;
  for (const char* name : {"ddp", "single"}) {
    for (const StrategySummary* row : ran) {
      if (baseline == nullptr && row->strategy == name) baseline = row;
    }
  }
  if (baseline != nullptr) {
    const std::string base = DisplayName(baseline->strategy);
    for (const StrategySummary* row : ran) {
      if (row == baseline) continue;
      std::vector<std::string> clauses;
      if (baseline->peak_memory_bytes_per_rank > 0) {
        clauses.push_back(absl::StrFormat(
            "peak memory per rank was %.2f× %s's",
            static_cast<double>(row->peak_memory_bytes_per_rank) /
                static_cast<double>(baseline->peak_memory_bytes_per_rank),
            base));
      }
      if (baseline->tokens_per_second_mean > 0) {
        clauses.push_back(absl::StrFormat(
            "%sthroughput %.2f× %s's", clauses.empty() ? "" : "its ",
            row->tokens_per_second_mean / baseline->tokens_per_second_mean,
            base));
      }
      if (clauses.empty()) continue;
      findings.push_back(absl::StrCat(Capitalised(DisplayName(row->strategy)),
                                      " ", absl::StrJoin(clauses, "; "), "."));
    }
  }

  if (ran.size() >= 2) {
    const auto [lowest, highest] = std::minmax_element(
        ran.begin(), ran.end(),
        [](const StrategySummary* a, const StrategySummary* b) {
          return a->final_train_loss < b->final_train_loss;
        });
    findings.push_back(absl::StrFormat(
        "%s reached the lowest final train loss (%.4f); final losses spanned "
        "%.4f (%.4f to %.4f).",
        Capitalised(DisplayName((*lowest)->strategy)),
        (*lowest)->final_train_loss,
        (*highest)->final_train_loss - (*lowest)->final_train_loss,
        (*lowest)->final_train_loss, (*highest)->final_train_loss));

    const auto [slowest, fastest] = std::minmax_element(
        ran.begin(), ran.end(),
        [](const StrategySummary* a, const StrategySummary* b) {
          return a->tokens_per_second_mean < b->tokens_per_second_mean;
        });
    std::string fastest_sentence = absl::StrFormat(
        "%s was the fastest at %s tokens/s",
        Capitalised(DisplayName((*fastest)->strategy)),
        FormatThousands(std::llround((*fastest)->tokens_per_second_mean)));
    if ((*slowest)->tokens_per_second_mean > 0 && slowest != fastest) {
      absl::StrAppend(&fastest_sentence,
                      absl::StrFormat(", %.2f× the slowest (%s)",
                                      (*fastest)->tokens_per_second_mean /
                                          (*slowest)->tokens_per_second_mean,
                                      DisplayName((*slowest)->strategy)));
    }
    findings.push_back(fastest_sentence + ".");
  }

  for (const StrategySummary* row : ran) {
    if (row->grad_norm_spike_ratio > kGradNormSpikeThreshold) {
      findings.push_back(absl::StrFormat(
          "%s's gradient norm spiked to %.1f× its median (above %.0f× is "
          "worth a look: a too-high learning rate or a bad batch).",
          Capitalised(DisplayName(row->strategy)), row->grad_norm_spike_ratio,
          kGradNormSpikeThreshold));
    }
  }
  return findings;
}

absl::Status WriteCompareReport(const std::vector<StrategyRun>& runs,
                                const CompareOptions& options,
                                const std::string& out_dir) {
  std::set<std::string> names;
  for (const StrategyRun& run : runs) {
    if (run.strategy.empty() ||
        run.strategy.find_first_of("/\\") != std::string::npos ||
        run.strategy == "." || run.strategy == "..") {
      return absl::InvalidArgumentError(absl::StrCat(
          "strategy name \"", run.strategy, "\" cannot name a CSV file"));
    }
    if (!names.insert(run.strategy).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("strategy \"", run.strategy, "\" appears twice"));
    }
  }

  // chart.js first: a report without its charts is not written at all.
  const std::string chart_js_path =
      options.chart_js_path.empty()
          ? AssetsDir() + "/node_modules/chart.js/dist/chart.umd.js"
          : options.chart_js_path;
  absl::StatusOr<std::string> chart_js = ReadChartJs(chart_js_path);
  if (!chart_js.ok()) return chart_js.status();

  std::error_code ec;
  std::filesystem::create_directories(out_dir, ec);
  if (ec) {
    return absl::InternalError(
        absl::StrCat("cannot create ", out_dir, ": ", ec.message()));
  }

  std::vector<StrategySummary> summaries;
  summaries.reserve(runs.size());
  for (const StrategyRun& run : runs) summaries.push_back(Summarise(run));

  for (const StrategyRun& run : runs) {
    absl::Status status =
        WriteWholeFile(out_dir + "/" + run.strategy + ".csv",
                       StepMetricsCsv(Deduplicated(run.steps)));
    if (!status.ok()) return status;
  }
  absl::Status status = WriteWholeFile(
      out_dir + "/report.md", ReportMarkdown(runs, summaries, options));
  if (!status.ok()) return status;
  return WriteWholeFile(out_dir + "/report.html",
                        ReportHtml(runs, summaries, options, *chart_js));
}

}  // namespace shardtrain::cli
