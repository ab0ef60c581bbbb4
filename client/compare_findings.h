// Internal to the comparison report (compare_report.cc, compare_findings.cc):
// the names and judgements both halves use.
#ifndef SHARDTRAIN_CLIENT_COMPARE_FINDINGS_H_
#define SHARDTRAIN_CLIENT_COMPARE_FINDINGS_H_

#include <string>
#include <vector>

#include "client/compare_report.h"

namespace shardtrain::cli {

// "DDP", "FSDP", "single-device" (core/run/strategy_kinds.h); other names as
// given.
std::string DisplayName(const std::string& strategy);
std::string Capitalised(std::string text);
// Every pair of runs' losses the same training (within summation order).
bool LossCurvesCoincide(const std::vector<StrategySummary>& rows);

}  // namespace shardtrain::cli

#endif  // SHARDTRAIN_CLIENT_COMPARE_FINDINGS_H_
