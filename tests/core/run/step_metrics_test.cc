#include "core/run/step_metrics.h"

#include <gtest/gtest.h>

namespace shardtrain {
namespace {

TEST(StepMetricsTest, FormatsTheLlmcStepLine) {
  StepMetrics m;
  m.step = 12;
  m.total_steps = 500;
  m.loss = 5.43117;
  m.grad_norm = 1.2345;
  m.lr = 6e-4;
  m.step_seconds = 0.312;
  m.mfu = 0.381;
  m.tokens_per_second = 52410.4;
  m.memory_peak_bytes = 1288490189;  // 1.2 GiB
  EXPECT_EQ(m.FormatLine(),
            "step 12/500 | loss 5.4312 | norm 1.23 | lr 6.0e-04 | 312 ms | "
            "38.1% MFU | 52,410 tok/s | mem 1.2 GiB");
}

TEST(StepMetricsTest, JsonRoundTripKeepsEveryField) {
  StepMetrics m;
  m.step = 3;
  m.total_steps = 9;
  m.epoch = 1;
  m.rank = 2;
  m.loss = 4.25;
  m.grad_norm = 0.5;
  m.lr = 1e-4;
  m.step_seconds = 0.125;
  m.tokens = 4096;
  m.tokens_per_second = 32768;
  m.mfu = 0.25;
  m.memory_allocated_bytes = 100;
  m.memory_peak_bytes = 200;
  m.memory_reserved_bytes = 300;
  m.model_state_bytes = 400;
  m.comm_seconds = 0.01;
  m.comm_bytes = 999;
  m.comm_inter_group_bytes = 333;
  m.pipeline_stage = 1;
  m.pipeline_bubble_seconds = 0.02;
  m.p2p_bytes = 555;
  m.val_loss = 4.5;
  auto back = StepMetrics::FromJson(m.ToJson());
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->ToJson(), m.ToJson());
  EXPECT_DOUBLE_EQ(back->val_loss, 4.5);
  EXPECT_EQ(back->memory_reserved_bytes, 300);
  EXPECT_EQ(back->model_state_bytes, 400);
  EXPECT_EQ(back->comm_inter_group_bytes, 333);
  EXPECT_EQ(back->pipeline_stage, 1);
  EXPECT_DOUBLE_EQ(back->pipeline_bubble_seconds, 0.02);
  EXPECT_EQ(back->p2p_bytes, 555);
}

TEST(FormatTest, ParsesSizesAsUsersWriteThem) {
  EXPECT_EQ(*ParseBytes("80GiB"), int64_t{80} << 30);
  EXPECT_EQ(*ParseBytes("512 MiB"), int64_t{512} << 20);
  EXPECT_EQ(*ParseBytes("512m"), int64_t{512} << 20);
  EXPECT_EQ(*ParseBytes("1.5G"), int64_t{3} << 29);
  EXPECT_EQ(*ParseBytes("2GB"), 2000000000);
  EXPECT_EQ(*ParseBytes("4096"), 4096);
  for (const char* bad : {"", "GiB", "-1G", "0", "12 parsecs", "1e3", "1..2G",
                          "99999999999TiB"}) {
    const absl::StatusOr<int64_t> bytes = ParseBytes(bad);
    ASSERT_FALSE(bytes.ok()) << bad;
    EXPECT_NE(bytes.status().message().find("is not a size"),
              std::string::npos);
  }
}

TEST(StepMetricsTest, JsonWithoutEvalHasNoValLoss) {
  StepMetrics m;
  EXPECT_EQ(m.ToJson().find("val_loss"), std::string::npos);
  // Nor pipeline fields without pipeline stages; read back as no stage.
  EXPECT_EQ(m.ToJson().find("pipeline"), std::string::npos);
  EXPECT_EQ(StepMetrics::FromJson(m.ToJson())->pipeline_stage, -1);
  EXPECT_FALSE(StepMetrics::FromJson("{\"step\": 1}").ok());
  EXPECT_FALSE(StepMetrics::FromJson("not json").ok());
}

TEST(FormatTest, HumanUnits) {
  EXPECT_EQ(FormatBytes(512), "512 B");
  EXPECT_EQ(FormatBytes(1536), "1.5 KiB");
  EXPECT_EQ(FormatBytes(int64_t{3} << 30), "3.0 GiB");
  EXPECT_EQ(FormatThousands(0), "0");
  EXPECT_EQ(FormatThousands(999), "999");
  EXPECT_EQ(FormatThousands(1234567), "1,234,567");
  EXPECT_EQ(FormatThousands(-1000), "-1,000");
  EXPECT_EQ(FormatDuration(0.0424), "42 ms");
  EXPECT_EQ(FormatDuration(2.5), "2.50 s");
  EXPECT_EQ(FormatDuration(125), "2m05s");
  EXPECT_EQ(FormatDuration(7300), "2h01m");
}

}  // namespace
}  // namespace shardtrain
