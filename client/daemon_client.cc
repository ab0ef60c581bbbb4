#include "client/daemon_client.h"

#include <cstdlib>
#include <fstream>
#include <iostream>
#include <iterator>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "client/exit_code.h"
#include "client/output_format.h"
#include "common/flag_file.h"
#include "common/input_file.h"

namespace shardtrain::cli {
namespace {

std::string Env(const char* name) {
  const char* value = std::getenv(name);
  return value == nullptr ? "" : value;
}

}  // namespace

void AddConnectionFlags(CLI::App* app, ConnectionOptions* options) {
  app->add_option("--address", options->address,
                  "shardtraind host:port (default: $SHARDTRAIN_ADDRESS, else "
                  "the local daemon, else 127.0.0.1:50551)");
  app->add_option("--token-file", options->token_file,
                  "file holding the bearer token (default: $SHARDTRAIN_TOKEN)");
  app->add_option(
      "--tls-ca", options->tls_ca,
      "PEM roots to verify a TLS daemon (default: $SHARDTRAIN_TLS_CA)");
}

absl::StatusOr<std::unique_ptr<DaemonClient>> DaemonClient::Connect(
    const ConnectionOptions& options) {
  auto client = std::make_unique<DaemonClient>();
  client->address_ = options.address;
  if (client->address_.empty()) client->address_ = Env("SHARDTRAIN_ADDRESS");
  if (client->address_.empty()) {
    // The local daemon's address, a line it wrote (read as every file of
    // our own: a FIFO or a device there cannot stall the CLI).
    absl::StatusOr<std::string> endpoint =
        ReadOwnFile(DefaultStateDir() + "/endpoint", 4096, "the endpoint file");
    if (endpoint.ok()) {
      client->address_ = std::string(absl::StripAsciiWhitespace(
          absl::string_view(*endpoint).substr(0, endpoint->find('\n'))));
    }
  }
  if (client->address_.empty()) client->address_ = "127.0.0.1:50551";

  if (!options.token_file.empty()) {
    absl::StatusOr<std::string> token = ReadFlagFile(
        "--token-file", options.token_file, FlagFileOptions::Secret(4096));
    if (!token.ok()) return token.status();
    client->token_ = std::string(absl::StripAsciiWhitespace(*token));
  } else {
    client->token_ =
        std::string(absl::StripAsciiWhitespace(Env("SHARDTRAIN_TOKEN")));
  }
  std::shared_ptr<grpc::ChannelCredentials> credentials =
      grpc::InsecureChannelCredentials();
  const std::string ca =
      options.tls_ca.empty() ? Env("SHARDTRAIN_TLS_CA") : options.tls_ca;
  if (!ca.empty()) {
    absl::StatusOr<std::string> roots = ReadFlagFile("--tls-ca", ca);
    if (!roots.ok()) return roots.status();
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = *roots;
    credentials = grpc::SslCredentials(ssl);
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(256 << 20);  // long metric histories
  client->channel_ =
      grpc::CreateCustomChannel(client->address_, credentials, args);
  client->jobs_ = v1::JobService::NewStub(client->channel_);
  client->cluster_ = v1::ClusterService::NewStub(client->channel_);
  return client;
}

std::unique_ptr<grpc::ClientContext> DaemonClient::Context() const {
  auto context = std::make_unique<grpc::ClientContext>();
  if (!token_.empty())
    context->AddMetadata("authorization", "Bearer " + token_);
  return context;
}

int DaemonClient::Call(
    const std::function<grpc::Status(grpc::ClientContext*)>& rpc) const {
  const std::unique_ptr<grpc::ClientContext> context = Context();
  const grpc::Status status = rpc(context.get());
  return status.ok() ? kExitOk : Report(status);
}

int DaemonClient::Report(const grpc::Status& status) const {
  if (status.error_code() == grpc::StatusCode::UNAVAILABLE) {
    // Where the address came from decides the advice.
    const char* from_env = std::getenv("SHARDTRAIN_ADDRESS");
    const bool set = from_env != nullptr && address_ == from_env;
    std::cerr << "shardtrain: error: no shardtraind at " << address_
              << (set ? " (SHARDTRAIN_ADDRESS)" : "") << " ("
              << TerminalSafe(status.error_message()) << "); "
              << (set ? "check SHARDTRAIN_ADDRESS, or start one with "
                        "`shardtrain daemon`"
                      : "start one with `shardtrain daemon` or set "
                        "SHARDTRAIN_ADDRESS")
              << std::endl;
    return kExitUnreachable;
  }
  if (status.error_code() == grpc::StatusCode::UNAUTHENTICATED) {
    std::cerr << "shardtrain: error: " << TerminalSafe(status.error_message())
              << " (the daemon requires a token: set SHARDTRAIN_TOKEN or "
                 "--token-file)"
              << std::endl;
    return kExitFailure;
  }
  ReportFailure(status.error_message());
  return status.error_code() == grpc::StatusCode::INVALID_ARGUMENT
             ? kExitUsage
             : kExitFailure;
}

}  // namespace shardtrain::cli
