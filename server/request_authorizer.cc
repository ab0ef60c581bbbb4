#include "server/request_authorizer.h"

#include "absl/strings/match.h"

namespace shardtrain {

absl::StatusOr<Caller> RequestAuthorizer::Authenticate(
    const grpc::ServerContext& context) const {
  if (!users_->enabled()) return Caller{};
  const auto& metadata = context.client_metadata();
  auto it = metadata.find("authorization");
  if (it == metadata.end()) {
    return absl::UnauthenticatedError(
        "missing 'authorization: Bearer <token>' metadata "
        "(set SHARDTRAIN_TOKEN or --token-file)");
  }
  const absl::string_view value(it->second.data(), it->second.size());
  constexpr absl::string_view kBearer = "Bearer ";
  std::optional<Caller> caller;
  if (absl::StartsWith(value, kBearer)) {
    caller = users_->Find(value.substr(kBearer.size()));
  }
  if (!caller.has_value()) {
    return absl::UnauthenticatedError("invalid bearer token");
  }
  return *caller;
}

grpc::Status RequestAuthorizer::Check(
    const grpc::ServerContext& context) const {
  absl::StatusOr<Caller> caller = Authenticate(context);
  return caller.ok() ? grpc::Status::OK : ToGrpcStatus(caller.status());
}

}  // namespace shardtrain
