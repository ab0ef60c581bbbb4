#include "core/run/lr_schedule.h"

#include <algorithm>
#include <cmath>

namespace shardtrain {

LrSchedule::LrSchedule(double max_lr, double min_lr_ratio, int64_t warmup_steps,
                       int64_t total_steps)
    : max_lr_(max_lr),
      min_lr_(max_lr * min_lr_ratio),
      warmup_steps_(warmup_steps),
      total_steps_(total_steps) {}

double LrSchedule::At(int64_t step) const {
  if (step < warmup_steps_) {
    return max_lr_ * static_cast<double>(step + 1) / warmup_steps_;
  }
  const int64_t decay_steps = total_steps_ - warmup_steps_;
  if (decay_steps <= 1) return max_lr_;
  const double progress = std::clamp(
      static_cast<double>(step - warmup_steps_) / (decay_steps - 1), 0.0, 1.0);
  const double coeff = 0.5 * (1.0 + std::cos(M_PI * progress));
  return min_lr_ + coeff * (max_lr_ - min_lr_);
}

}  // namespace shardtrain
