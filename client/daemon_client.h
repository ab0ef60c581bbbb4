// DaemonClient: the CLI's connection to shardtraind. Finds the address
// (--address, else SHARDTRAIN_ADDRESS, else the local daemon's state dir
// endpoint file, else 127.0.0.1:50551), the token (SHARDTRAIN_TOKEN or
// --token-file) and TLS roots (--tls-ca or SHARDTRAIN_TLS_CA), and turns gRPC
// errors into one-line messages and exit codes.
#ifndef SHARDTRAIN_CLIENT_DAEMON_CLIENT_H_
#define SHARDTRAIN_CLIENT_DAEMON_CLIENT_H_

#include <grpcpp/grpcpp.h>

#include <functional>
#include <memory>
#include <string>

#include "CLI/CLI.hpp"
#include "absl/status/statusor.h"
#include "common/state_dir.h"  // DefaultStateDir(): where the local daemon lives
#include "shardtrain/v1/cluster_service.grpc.pb.h"
#include "shardtrain/v1/job_service.grpc.pb.h"

namespace shardtrain::cli {

struct ConnectionOptions {
  std::string address;     // empty: resolved as described above
  std::string token_file;  // empty: SHARDTRAIN_TOKEN
  std::string tls_ca;      // empty: SHARDTRAIN_TLS_CA; both empty: plaintext
};

// Adds --address, --token-file and --tls-ca to `app`.
void AddConnectionFlags(CLI::App* app, ConnectionOptions* options);

class DaemonClient {
 public:
  // Reads the token file / CA file; errors name the file.
  static absl::StatusOr<std::unique_ptr<DaemonClient>> Connect(
      const ConnectionOptions& options);

  const std::string& address() const { return address_; }
  v1::JobService::Stub& jobs() { return *jobs_; }
  v1::ClusterService::Stub& cluster() { return *cluster_; }

  // A context carrying the token (when there is one).
  std::unique_ptr<grpc::ClientContext> Context() const;

  // Runs one unary call with such a context; on failure prints it (Report)
  // and returns its exit code, else kExitOk.
  int Call(const std::function<grpc::Status(grpc::ClientContext*)>& rpc) const;

  // Prints the error as one line and returns the exit code: 3 (with a hint
  // on starting a daemon) when the daemon is unreachable, 2 for an invalid
  // argument, else 1.
  int Report(const grpc::Status& status) const;

 private:
  std::string address_;
  std::string token_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::JobService::Stub> jobs_;
  std::unique_ptr<v1::ClusterService::Stub> cluster_;
};

}  // namespace shardtrain::cli

#endif  // SHARDTRAIN_CLIENT_DAEMON_CLIENT_H_
