// submit_job: submits one job to a shardtraind and prints its id. For tests
// written in other languages (tests/deploy) that have no gRPC client.
#include <grpcpp/grpcpp.h>

#include <iostream>

#include "CLI/CLI.hpp"
#include "shardtrain/v1/job_service.grpc.pb.h"

int main(int argc, char** argv) {
  std::string address, model = "gpt2-tiny", data = "brown", strategy = "ddp";
  int world_size = 2;
  int64_t max_steps = 20, batch_size = 2, seq_len = 64;
  CLI::App app{"submit_job"};
  app.add_option("--address", address)->required();
  app.add_option("--model", model);
  app.add_option("--data", data);
  app.add_option("--strategy", strategy);
  app.add_option("--world-size", world_size);
  app.add_option("--max-steps", max_steps);
  app.add_option("--batch-size", batch_size);
  app.add_option("--seq-len", seq_len);
  CLI11_PARSE(app, argc, argv);

  shardtrain::v1::SubmitJobRequest request;
  shardtrain::v1::JobSpec* spec = request.mutable_spec();
  spec->set_model(model);
  spec->set_data(data);
  spec->mutable_strategy()->set_name(strategy);
  spec->set_world_size(world_size);
  spec->mutable_trainer()->set_max_steps(max_steps);
  spec->mutable_trainer()->set_batch_size(batch_size);
  spec->mutable_trainer()->set_seq_len(seq_len);
  auto stub = shardtrain::v1::JobService::NewStub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  shardtrain::v1::Job job;
  const grpc::Status status = stub->SubmitJob(&context, request, &job);
  if (!status.ok()) {
    std::cerr << "submit_job: " << status.error_message() << "\n";
    return 1;
  }
  std::cout << job.id() << "\n";
  return 0;
}
