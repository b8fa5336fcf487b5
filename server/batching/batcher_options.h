// BatcherOptions: how one model's dynamic batcher forms batches and bounds its
// queue. Settable per model (server flags as defaults, config.pbtxt overrides).
#ifndef ATTNSERVE_SERVER_BATCHING_BATCHER_OPTIONS_H_
#define ATTNSERVE_SERVER_BATCHING_BATCHER_OPTIONS_H_

#include <cstdint>

#include "absl/status/status.h"

namespace attnserve {

struct BatcherOptions {
  // Most requests in one batch. 1 turns batching off (every request runs
  // alone). Must be >= 1. Default: 32.
  int max_batch_requests = 32;

  // Most query tokens in one batch, summed over its requests (a request's
  // tokens are batch * query length). A single request with more tokens than
  // this still runs, alone, rather than waiting forever. 0 = no token limit.
  // Default: 8192 tokens.
  int64_t max_batch_tokens = 8192;

  // Longest time the oldest queued request waits for others to join its
  // batch before the batch closes anyway. 0 = close as soon as a worker is
  // free: batches then form from what arrived while the workers were busy,
  // so a lone request pays no delay and a loaded server still batches (the
  // Triton default). Default: 0 us.
  int64_t max_queue_delay_us = 0;

  // Most requests waiting in the queue (requests already taken into a batch
  // being computed do not count). Schedule answers RESOURCE_EXHAUSTED beyond
  // it. Must be >= 1. Default: 1024 requests.
  int max_queue_size = 1024;

  // Most bytes of requests waiting in the queue, summed over them (a
  // request's bytes: InferenceRequest::bytes, its inputs plus the outputs
  // allocated for it). Schedule answers RESOURCE_EXHAUSTED at once to a
  // request that would take the sum past it, so that a flood of large
  // requests cannot hold more than this much memory per model; a request
  // into an empty queue is always accepted (the per-request limits bound
  // it), so no single request is refused forever. Set from the server flag
  // for every model (not in config.pbtxt). Must be >= 1. Default: 1 GiB.
  int64_t max_queue_bytes = int64_t{1} << 30;

  // Worker threads, each computing one batch at a time (engine instances of
  // the model). 0 = no threads: the owner drives the batcher by calling
  // ProcessReadyBatches() (tests, single-threaded tools). Default: 1.
  int instances = 1;

  // After two batches of a single request in a row, how long a worker keeps
  // polling the empty queue before it goes to sleep, in microseconds. A
  // sleeping worker takes 55-80 us to wake up on a VM (a third of a tiny
  // request's round trip, bench/overhead.sh); polling catches the next
  // request at once, for at most this much CPU per lone request. Under load
  // batches hold several requests and no worker polls, which leaves the CPU
  // to gRPC and the engine. One worker of a model polls at a time. Set from
  // the server flag for every model (not in config.pbtxt). 0 = never poll.
  // Must be <= 10000. Default: 200 us.
  int64_t idle_spin_us = 200;

  // After a batch that answered session requests (decode steps), how long
  // the next batch may wait for those sessions' next requests, in
  // microseconds; also at most as long as that batch took. A session's next
  // step is sent when its answer arrives, so without the wait the steps of
  // many sessions settle into two alternating half-size batches; with it
  // they compute together. Only requests already queued wait, for at most
  // this long; a batch that answered no session request makes no one wait.
  // Set from the server flag for every model (not in config.pbtxt). 0 = no
  // wait. Must be <= 1000000. Default: 5000 us.
  int64_t session_wait_us = 5000;

  // After a batch of stateless requests at least half full (at least
  // max(2, max_batch_requests / 2) requests: the server is batching
  // heavily), the next batch waits for as many requests as that batch
  // answered to join the queue, for at most that batch's own time. Clients
  // in a closed loop (each sends again when answered) then fill whole
  // batches instead of settling into two alternating part-full ones; on two
  // vCPUs shared with the clients, full batches let the engine and the
  // transport take turns rather than compete (docs/PERFORMANCE.md, "Refill
  // wait"). Every wait is checked: it is a hit when the answered requests
  // came back in time and at least twice as fast as requests arrived while
  // the batch computed; open-loop traffic, which does not follow answers,
  // arrives as fast in both (and a wait whose arrivals are no faster
  // halfway through is cut short there). A miss puts the wait off for the
  // next 2, 4, ... up to 1024 such batches; a hit resets that. Lighter load
  // (smaller batches) never waits. Models with several instances never
  // wait either: an idle instance takes what is queued while another
  // computes (measured: waiting cost two single-threaded instances 20%).
  // Set from the server flag for every model (not in config.pbtxt).
  // Default: true.
  bool refill_wait = true;
};

// InvalidArgument naming the field and value when an option is out of range.
absl::Status ValidateBatcherOptions(const BatcherOptions& options);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_BATCHING_BATCHER_OPTIONS_H_
