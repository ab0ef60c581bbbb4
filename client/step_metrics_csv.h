// The one CSV layout of step metrics, written by `shardtrain metrics --csv`
// and by the compare study's per-strategy files: a header, then one row per
// step and rank in the order given, a column per StepField in its order;
// doubles in their shortest exact form; an optional field (val_loss,
// pipeline_stage) empty where the step has none.
#ifndef SHARDTRAIN_CLIENT_STEP_METRICS_CSV_H_
#define SHARDTRAIN_CLIENT_STEP_METRICS_CSV_H_

#include <string>
#include <vector>

#include "shardtrain/v1/job.pb.h"

namespace shardtrain::cli {

std::string StepMetricsCsv(const std::vector<v1::StepMetrics>& steps);

}  // namespace shardtrain::cli

#endif  // SHARDTRAIN_CLIENT_STEP_METRICS_CSV_H_
