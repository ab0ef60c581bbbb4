// Learning rate at each step: linear warmup, then cosine decay to
// lr * min_lr_ratio at the last step (nanoGPT / llm.c). Torch-free.
#ifndef SHARDTRAIN_CORE_RUN_LR_SCHEDULE_H_
#define SHARDTRAIN_CORE_RUN_LR_SCHEDULE_H_

#include <cstdint>

namespace shardtrain {

class LrSchedule {
 public:
  LrSchedule(double max_lr, double min_lr_ratio, int64_t warmup_steps,
             int64_t total_steps);
  // `step` is 0-based: the lr used by the step-th optimizer update.
  double At(int64_t step) const;

 private:
  double max_lr_;
  double min_lr_;
  int64_t warmup_steps_;
  int64_t total_steps_;
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_CORE_RUN_LR_SCHEDULE_H_
