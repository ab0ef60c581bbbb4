#include "server/request_authorizer.h"

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/flag_file.h"

namespace shardtrain {

absl::StatusOr<std::string> RequestAuthorizer::ReadTokenFile(
    const std::string& path) {
  absl::StatusOr<std::string> read =
      ReadFlagFile("--auth-token-file", path, FlagFileOptions::Secret(4096));
  if (!read.ok()) return read.status();
  std::string token = std::move(*read);
  absl::StripAsciiWhitespace(&token);
  if (token.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--auth-token-file: '", path, "' is empty"));
  }
  return token;
}

grpc::Status RequestAuthorizer::Check(
    const grpc::ServerContext& context) const {
  if (token_.empty()) return grpc::Status::OK;
  const auto& metadata = context.client_metadata();
  auto it = metadata.find("authorization");
  if (it == metadata.end()) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "missing 'authorization: Bearer <token>' metadata "
                        "(set SHARDTRAIN_TOKEN or --token-file)");
  }
  const std::string value(it->second.data(), it->second.size());
  const std::string expected = "Bearer " + token_;
  unsigned char diff = value.size() == expected.size() ? 0 : 1;
  for (size_t i = 0; i < value.size() && i < expected.size(); ++i) {
    diff |= value[i] ^ expected[i];
  }
  if (diff != 0) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "invalid bearer token");
  }
  return grpc::Status::OK;
}

}  // namespace shardtrain
