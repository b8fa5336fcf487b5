// ServerOptions checks and flag-name spelling.
#include "server/server_options.h"

#include <climits>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"

namespace attnserve {
namespace {

// "host:port" or "[v6]:port" with a numeric port in [0, 65535].
absl::Status CheckHostPort(const std::string& flag, const std::string& address) {
  const size_t colon = address.rfind(':');
  int port = -1;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(address.substr(colon + 1), &port) || port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--", flag, ": expected host:port (e.g. 127.0.0.1:50051, 0.0.0.0:0), got '", address,
        "'"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckServerOptions(const ServerOptions& options) {
  if (absl::Status s = CheckHostPort("address", options.address); !s.ok()) return s;
  if (!options.http.address.empty()) {
    if (absl::Status s = CheckHostPort("http-address", options.http.address); !s.ok()) return s;
  }
  if (absl::Status s = CheckHostPort("metrics-address", options.metrics_address); !s.ok()) {
    return s;
  }
  if (options.metrics_threads < 1 || options.metrics_threads > 1024) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--metrics-threads: must be in [1, 1024], got ", options.metrics_threads));
  }
  if (options.metrics_request_timeout.count() < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--metrics-request-timeout: must be >= 1ms, got ",
                     options.metrics_request_timeout.count(), " ms"));
  }
  if (options.malloc_trim_interval.count() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--malloc-trim-interval: must be >= 0 (0 = never), got ",
                     options.malloc_trim_interval.count(), " ms"));
  }
  if (options.malloc_arena_max < 0 || options.malloc_arena_max > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("--malloc-arena-max: must be in [0, 1024] (0 = glibc's default), got ",
                     options.malloc_arena_max));
  }
  if (options.malloc_mmap_threshold < 0 || options.malloc_mmap_threshold > (int64_t{32} << 20)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--malloc-mmap-threshold: must be in [0, 33554432] bytes (0 = glibc's default), got ",
        options.malloc_mmap_threshold));
  }
  if (options.malloc_trim_threshold < 0 || options.malloc_trim_threshold > (int64_t{1} << 30)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--malloc-trim-threshold: must be in [0, 1073741824] bytes (0 = glibc's default), got ",
        options.malloc_trim_threshold));
  }
  if (options.payload_copy_threads < -1 || options.payload_copy_threads > 64) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--payload-copy-threads: must be in [-1, 64] (-1 = one per CPU beyond the first), got ",
        options.payload_copy_threads));
  }
  if (options.validation.max_attention_scores < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-attention-scores: must be >= 1, got ",
                     options.validation.max_attention_scores));
  }
  if (options.backend != "auto" && options.backend != "cpu" && options.backend != "reference" &&
      options.backend != "cuda") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--backend: expected auto, cpu, reference or cuda, got '", options.backend, "'"));
  }
  if (options.engine_threads < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--threads: must be >= 0 (0 = one per core), got ", options.engine_threads));
  }
  if (options.max_message_bytes < 1 || options.max_message_bytes > INT_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("--max-message-bytes: must be in [1, ",
                                                   INT_MAX, "], got ",
                                                   options.max_message_bytes));
  }
  if (options.default_model.empty()) {
    return absl::InvalidArgumentError("--default-model: must not be empty");
  }
  if (options.shutdown_grace.count() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--shutdown-grace: must be >= 0, got ",
                                                   options.shutdown_grace.count(), " ms"));
  }
  if (options.validation.max_multiply_adds < 1) {
    return absl::InvalidArgumentError(absl::StrCat("--max-multiply-adds: must be >= 1, got ",
                                                   options.validation.max_multiply_adds));
  }
  if (options.validation.max_input_elements < 1) {
    return absl::InvalidArgumentError(absl::StrCat("--max-tensor-elements: must be >= 1, got ",
                                                   options.validation.max_input_elements));
  }
  if (options.validation.max_returned_weights < 1) {
    return absl::InvalidArgumentError(absl::StrCat("--max-returned-weights: must be >= 1, got ",
                                                   options.validation.max_returned_weights));
  }
  const ConnectionLimits& c = options.connections;
  if (c.max_concurrent_streams < 1) {
    return absl::InvalidArgumentError(absl::StrCat("--max-concurrent-streams: must be >= 1, got ",
                                                   c.max_concurrent_streams));
  }
  const std::pair<const char*, std::chrono::milliseconds> durations[] = {
      {"keepalive-time", c.keepalive_time},
      {"keepalive-timeout", c.keepalive_timeout},
      {"max-connection-idle", c.max_connection_idle},
      {"max-connection-age", c.max_connection_age},
      {"max-connection-age-grace", c.max_connection_age_grace}};
  for (const auto& [flag, value] : durations) {
    if (value.count() < 0 || value.count() > INT_MAX) {
      return absl::InvalidArgumentError(absl::StrCat("--", flag, ": must be in [0, ", INT_MAX,
                                                     "] ms, got ", value.count(), " ms"));
    }
  }
  if (c.keepalive_time.count() < 1000 || c.keepalive_timeout.count() < 1) {
    return absl::InvalidArgumentError(
        "--keepalive-time must be >= 1s and --keepalive-timeout >= 1ms");
  }
  if (absl::Status s = CheckTlsOptions(options.tls); !s.ok()) return s;
  if (absl::Status s = CheckSessionOptions(options.sessions); !s.ok()) return s;
  if (absl::Status s = ValidateBatcherOptions(options.batching); !s.ok()) {
    // The option names match the flags, spelled with dashes.
    std::string message(s.message());
    absl::StrReplaceAll({{"_", "-"}}, &message);
    return absl::InvalidArgumentError(absl::StrCat("--", message));
  }
  return absl::OkStatus();
}

std::vector<std::string> NormalizeFlagNames(const std::vector<std::string>& args) {
  std::vector<std::string> out;
  out.reserve(args.size());
  bool flags_done = false;
  for (size_t i = 0; i < args.size(); ++i) {
    std::string arg = args[i];
    if (i > 0 && !flags_done) {
      if (arg == "--") {
        flags_done = true;
      } else if (absl::StartsWith(arg, "-")) {
        const size_t name_begin = absl::StartsWith(arg, "--") ? 2 : 1;
        const size_t name_end = std::min(arg.find('='), arg.size());
        for (size_t c = name_begin; c < name_end; ++c) {
          if (arg[c] == '-') arg[c] = '_';
        }
      }
    }
    out.push_back(std::move(arg));
  }
  return out;
}

std::vector<std::string> RepeatedFlagValues(const std::vector<std::string>& args,
                                            const std::string& name) {
  std::vector<std::string> values;
  for (size_t i = 1; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg == "--") break;
    for (const std::string& prefix : {"--" + name, "-" + name}) {
      if (arg == prefix && i + 1 < args.size()) {
        for (absl::string_view v : absl::StrSplit(args[++i], ',', absl::SkipEmpty())) {
          values.emplace_back(v);
        }
        break;
      }
      if (absl::StartsWith(arg, prefix + "=")) {
        for (absl::string_view v :
             absl::StrSplit(absl::string_view(arg).substr(prefix.size() + 1), ',',
                            absl::SkipEmpty())) {
          values.emplace_back(v);
        }
        break;
      }
    }
  }
  return values;
}

absl::StatusOr<NonfiniteInputs> ParseNonfiniteInputs(const std::string& value) {
  if (value == "reject") return NonfiniteInputs::kReject;
  if (value == "propagate") {
    return absl::InvalidArgumentError(
        "--nonfinite-inputs: 'propagate' (NaN rows as PyTorch gives them) is not implemented: "
        "the engines would need PyTorch's NaN and +inf semantics in their softmax; use "
        "'reject'");
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--nonfinite-inputs: expected reject, got '", value, "'"));
}

absl::StatusOr<ResponseCompression> ParseResponseCompression(const std::string& value) {
  if (value == "none") return ResponseCompression::kNone;
  if (value == "low") return ResponseCompression::kLow;
  if (value == "medium" || value == "med") return ResponseCompression::kMedium;
  if (value == "high") return ResponseCompression::kHigh;
  return absl::InvalidArgumentError(absl::StrCat(
      "--grpc-response-compression-level: expected none, low, medium or high, got '", value,
      "'"));
}

}  // namespace attnserve
