// RequestAuthorizer: with --auth-token-file, every JobService and
// ClusterService call must carry `authorization: Bearer <token>`, and the
// token names the caller (server/user_directory.h): a user, who may change
// only their own jobs, or an admin. WorkerService calls are authorized by
// the job's secret instead (workers are the coordinator's own children), and
// the health and reflection services stay open so probes and grpcurl's
// `list` work.
#ifndef SHARDTRAIN_SERVER_REQUEST_AUTHORIZER_H_
#define SHARDTRAIN_SERVER_REQUEST_AUTHORIZER_H_

#include <grpcpp/server_context.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/grpc_status.h"
#include "server/user_directory.h"

namespace shardtrain {

class RequestAuthorizer {
 public:
  // `users` must outlive this; one without a file allows every call.
  explicit RequestAuthorizer(const UserDirectory* users) : users_(users) {}

  // The caller, or UNAUTHENTICATED saying what was missing or wrong.
  absl::StatusOr<Caller> Authenticate(const grpc::ServerContext& context) const;
  // Authenticate's status alone.
  grpc::Status Check(const grpc::ServerContext& context) const;

  bool enabled() const { return users_->enabled(); }

  // A unary call's body: Authenticate, then `call(caller)` (returning
  // absl::StatusOr<Response>), whose value becomes `*response` and whose
  // error becomes the call's status (ToGrpcStatus).
  template <typename Response, typename Call>
  grpc::Status ServeAs(const grpc::ServerContext& context, Response* response,
                       Call&& call) const {
    absl::StatusOr<Caller> caller = Authenticate(context);
    if (!caller.ok()) return ToGrpcStatus(caller.status());
    absl::StatusOr<Response> result = call(*caller);
    if (!result.ok()) return ToGrpcStatus(result.status());
    *response = std::move(*result);
    return grpc::Status::OK;
  }
  // ServeAs for a call that does not depend on who calls.
  template <typename Response, typename Call>
  grpc::Status Serve(const grpc::ServerContext& context, Response* response,
                     Call&& call) const {
    return ServeAs(context, response, [&](const Caller&) { return call(); });
  }

 private:
  const UserDirectory* const users_;
};

}  // namespace shardtrain

#endif  // SHARDTRAIN_SERVER_REQUEST_AUTHORIZER_H_
