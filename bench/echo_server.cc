// echo_server: the gRPC floor. Serves the same attnserve.v1 Attend and
// AttendStream RPCs with no compute: the response's output is the request's
// query bytes. attn_bench against it vs against attnserve, same flags, gives
// the server's own overhead (bench/overhead.sh).
#include <csignal>
#include <cstdio>
#include <deque>
#include <memory>
#include <string>

#include <pthread.h>

#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include "absl/base/thread_annotations.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/synchronization/mutex.h"
#include "attnserve/v1/attention.grpc.pb.h"

ABSL_FLAG(std::string, address, "127.0.0.1:0",
          "host:port; port 0 picks a free one (printed as 'echo_server listening on HOST:PORT').");

namespace attnserve::bench {
namespace {

namespace pb = ::attnserve::v1;

// What attnserve would do with the bytes, minus the attention: one copy of
// the query into the response (attnserve's engine writes its output there).
void Echo(const pb::AttendRequest& request, pb::AttendResponse* response) {
  response->set_id(request.id());
  *response->mutable_output() = request.query();
  response->mutable_timing()->set_batch_requests(1);
}

// Same flow control as attnserve's AttendStream: one write in flight, a
// bounded backlog, and no reads while the backlog is full.
class EchoStream : public grpc::ServerBidiReactor<pb::AttendRequest, pb::AttendStreamResponse> {
 public:
  EchoStream() { StartRead(&request_); }

  void OnReadDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    if (!ok) {
      reads_done_ = true;
      MaybeFinishLocked();
      return;
    }
    auto r = std::make_unique<pb::AttendStreamResponse>();
    r->set_id(request_.id());
    Echo(request_, r->mutable_response());
    backlog_.push_back(std::move(r));
    if (!writing_) WriteLocked();
    if (backlog_.size() < kMaxBacklog) {
      StartRead(&request_);
    } else {
      read_paused_ = true;
    }
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    backlog_.pop_front();
    writing_ = false;
    if (!ok) {
      failed_ = true;
      MaybeFinishLocked();
      return;
    }
    if (!backlog_.empty()) WriteLocked();
    if (read_paused_ && backlog_.size() < kMaxBacklog) {
      read_paused_ = false;
      StartRead(&request_);
    }
    MaybeFinishLocked();
  }

  void OnDone() override { delete this; }

 private:
  static constexpr size_t kMaxBacklog = 64;

  void WriteLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    writing_ = true;
    StartWrite(backlog_.front().get());
  }
  void MaybeFinishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_ || writing_) return;
    if (failed_ || (reads_done_ && backlog_.empty())) {
      finished_ = true;
      Finish(grpc::Status::OK);
    }
  }

  pb::AttendRequest request_;
  absl::Mutex mu_;
  std::deque<std::unique_ptr<pb::AttendStreamResponse>> backlog_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool read_paused_ ABSL_GUARDED_BY(mu_) = false;
  bool reads_done_ ABSL_GUARDED_BY(mu_) = false;
  bool failed_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

class EchoService final : public pb::AttentionService::CallbackService {
  grpc::ServerUnaryReactor* Attend(grpc::CallbackServerContext* context,
                                   const pb::AttendRequest* request,
                                   pb::AttendResponse* response) override {
    Echo(*request, response);
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
  grpc::ServerBidiReactor<pb::AttendRequest, pb::AttendStreamResponse>* AttendStream(
      grpc::CallbackServerContext*) override {
    return new EchoStream;
  }
};

int Main(int argc, char** argv) {
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGTERM);
  sigaddset(&stop, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop, nullptr);
  absl::ParseCommandLine(argc, argv);

  grpc::EnableDefaultHealthCheckService(true);
  EchoService service;
  grpc::ServerBuilder builder;
  int port = 0;
  const std::string address = absl::GetFlag(FLAGS_address);
  builder.AddListeningPort(address, grpc::InsecureServerCredentials(), &port);
  // Same message limit as attnserve's default (64 MiB) plus headroom.
  builder.SetMaxReceiveMessageSize(1 << 30);
  builder.SetMaxSendMessageSize(1 << 30);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || port == 0) {
    std::fprintf(stderr, "echo_server: cannot listen on %s\n", address.c_str());
    return 1;
  }
  const std::string host = address.substr(0, address.rfind(':'));
  std::fprintf(stderr, "echo_server listening on %s:%d\n", host.c_str(), port);
  std::fflush(stderr);
  int sig = 0;
  while (sigwait(&stop, &sig) != 0) {
  }
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  return 0;
}

}  // namespace
}  // namespace attnserve::bench

int main(int argc, char** argv) { return attnserve::bench::Main(argc, argv); }
