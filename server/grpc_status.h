// The one place absl::Status becomes grpc::Status (same codes, same message).
#ifndef SHARDTRAIN_SERVER_GRPC_STATUS_H_
#define SHARDTRAIN_SERVER_GRPC_STATUS_H_

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace shardtrain {

grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace shardtrain

#endif  // SHARDTRAIN_SERVER_GRPC_STATUS_H_
