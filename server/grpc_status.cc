#include "server/grpc_status.h"

#include <string>

namespace shardtrain {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  // absl and gRPC share the canonical code numbering.
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                      std::string(status.message()));
}

namespace {

using grpc::experimental::InterceptionHookPoints;

// One per call. gRPC deserializes a request before the POST_RECV_MESSAGE hook
// and hands the interceptor a null message when the bytes did not parse; the
// handler is then skipped and the call ends with the deserializer's status.
class MalformedRequestInterceptor : public grpc::experimental::Interceptor {
 public:
  explicit MalformedRequestInterceptor(std::string method)
      : method_(std::move(method)) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) final {
    if (methods->QueryInterceptionHookPoint(
            InterceptionHookPoints::POST_RECV_MESSAGE) &&
        methods->GetRecvMessage() == nullptr) {
      malformed_ = true;
    }
    if (malformed_ && methods->QueryInterceptionHookPoint(
                          InterceptionHookPoints::PRE_SEND_STATUS)) {
      methods->ModifySendStatus(grpc::Status(
          grpc::StatusCode::INVALID_ARGUMENT,
          "malformed request: the bytes sent to " + method_ +
              " are not a valid protobuf message of its request type (a "
              "client built from a different proto/, or a corrupted "
              "message); nothing was done"));
    }
    methods->Proceed();
  }

 private:
  const std::string method_;
  bool malformed_ = false;
};

class MalformedRequestInterceptorFactory
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) final {
    // Streaming requests (none in our API today) parse message by message
    // inside the handler; only unary and server-streaming requests are
    // decoded before it runs.
    if (info->type() != grpc::experimental::ServerRpcInfo::Type::UNARY &&
        info->type() !=
            grpc::experimental::ServerRpcInfo::Type::SERVER_STREAMING) {
      return nullptr;
    }
    return new MalformedRequestInterceptor(info->method());
  }
};

}  // namespace

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
MakeMalformedRequestInterceptorFactory() {
  return std::make_unique<MalformedRequestInterceptorFactory>();
}

}  // namespace shardtrain
