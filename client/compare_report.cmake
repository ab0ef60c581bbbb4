# shardtrain_compare_report: the strategy comparison study's report — summary
# table, findings, per-strategy CSVs and a self-contained report.html whose
# chart code is inlined from the chart.js npm package (AssetsDir() comes from
# shardtrain_text). Torch-free, no gRPC calls.
add_library(shardtrain_compare_report compare_report.cc step_metrics_csv.cc)
target_link_libraries(shardtrain_compare_report
  PUBLIC shardtrain_proto absl::status absl::statusor
  PRIVATE shardtrain_train_config shardtrain_text nlohmann_json::nlohmann_json
          absl::strings absl::str_format)
