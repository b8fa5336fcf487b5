// The attnserve.v1 front end's translation: gRPC's bytes <-> the messages,
// AttendRequest -> the request path's AttendInputs, and a finished
// InferenceRequest -> AttendResponse fields. Everything else about a request
// is shared (server/dispatch).
#ifndef ATTNSERVE_SERVER_TRANSPORT_ATTEND_CODEC_H_
#define ATTNSERVE_SERVER_TRANSPORT_ATTEND_CODEC_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "attnserve/v1/attention.pb.h"
#include "server/request/attend_inputs.h"
#include "server/request/inference_request.h"
#include "server/transport/attend_wire.h"
#include "server/transport/message_codec.h"

namespace attnserve {

// `payloads`, when given, holds tensors' bytes taken out of `request` on the
// wire (attend_wire.h); a tensor's bytes are read from there when set.
//
// Lifetime: the result points into `request` (and `*payloads`), which must
// outlive it.
AttendInputs DecodeAttendRequest(const v1::AttendRequest& request,
                                 const AttendPayloads* payloads = nullptr);

// Fills response->timing from a request answered OK at `now`.
void SetTiming(const InferenceRequest& request, absl::Time now, v1::AttendResponse* response);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_TRANSPORT_ATTEND_CODEC_H_
