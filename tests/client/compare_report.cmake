# The comparison report: summary arithmetic, table, findings, written files,
# and report.html rendered by headless Chromium (skipped without chromium).
shardtrain_add_test(NAME compare_report_test
  SOURCES compare_report_test.cc
  LIBS shardtrain_compare_report shardtrain_text nlohmann_json::nlohmann_json
       absl::strings
  LABELS client)
