# shardtrain_compare_report: the strategy comparison study's report — summary
# table, findings, per-strategy CSVs and a self-contained report.html whose
# chart code is inlined from the chart.js npm package (AssetsDir() comes from
# shardtrain_text). Torch-free, no gRPC calls.
add_library(shardtrain_compare_report compare_report.cc compare_findings.cc host_load.cc
  step_metrics_csv.cc)
target_link_libraries(shardtrain_compare_report
  PUBLIC shardtrain_proto absl::status absl::statusor absl::time
  PRIVATE shardtrain_common shardtrain_run_config shardtrain_plan shardtrain_checkpoint shardtrain_job_config shardtrain_text
          nlohmann_json::nlohmann_json Threads::Threads
          absl::strings absl::str_format)

# The report's own script and style live as real files (report/); they are
# inlined at build time (CMake re-runs when they change).
file(READ ${CMAKE_CURRENT_SOURCE_DIR}/report/report.js REPORT_JS)
file(READ ${CMAKE_CURRENT_SOURCE_DIR}/report/report.css REPORT_CSS)
configure_file(${CMAKE_CURRENT_SOURCE_DIR}/report/report_assets.h.in
  ${CMAKE_CURRENT_BINARY_DIR}/report_assets.h @ONLY)
set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS
  ${CMAKE_CURRENT_SOURCE_DIR}/report/report.js
  ${CMAKE_CURRENT_SOURCE_DIR}/report/report.css)
target_include_directories(shardtrain_compare_report PRIVATE ${CMAKE_BINARY_DIR})
