// The one place absl::Status becomes grpc::Status (same codes, same message),
// and where a request gRPC could not decode gets a status that says so.
#ifndef SHARDTRAIN_SERVER_GRPC_STATUS_H_
#define SHARDTRAIN_SERVER_GRPC_STATUS_H_

#include <grpcpp/support/server_interceptor.h>
#include <grpcpp/support/status.h>

#include <memory>

#include "absl/status/status.h"

namespace shardtrain {

grpc::Status ToGrpcStatus(const absl::Status& status);

// A request whose bytes do not parse as the method's message never reaches a
// handler: gRPC answers INTERNAL with an empty message, which reads like a
// server fault. This interceptor turns that answer into INVALID_ARGUMENT
// naming the method and the likely cause. Register it with
// ServerBuilder::experimental().SetInterceptorCreators.
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
MakeMalformedRequestInterceptorFactory();

}  // namespace shardtrain

#endif  // SHARDTRAIN_SERVER_GRPC_STATUS_H_
