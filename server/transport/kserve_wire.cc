// In: one pass over gRPC's slices that copies each top-level
// raw_input_contents entry (field 7, length-delimited) into a host buffer
// and everything else, byte for byte, into a small message that protobuf
// then parses. Protobuf keeps a repeated field's entries in wire order
// whatever lies between them, so the entries in order are exactly what its
// own parse would put in raw_input_contents.
//
// Out: ModelInferResponse's raw_output_contents (field 6) is its last field, so
// the answer is the rest of the message as protobuf writes it, then each
// entry's tag, length and bytes; ModelStreamInferResponse's infer_response
// (field 2) is its last field too.
#include "server/transport/kserve_wire.h"

#include <string>
#include <utility>

#include "server/transport/kserve_codec.h"
#include "server/transport/slice_reader.h"
#include "server/transport/slice_writer.h"

namespace attnserve {
namespace {

constexpr uint32_t kRawInputContents =
    inference::ModelInferRequest::kRawInputContentsFieldNumber;
constexpr uint32_t kRawOutputContents =
    inference::ModelInferResponse::kRawOutputContentsFieldNumber;

// Raw entries taken into buffers at most: a request has one per input, and
// there are seven inputs. More (each buffer a few KiB at least, whatever the
// entry's size) are protobuf's to parse, so that a message of many tiny
// entries cannot ask for far more memory than it holds.
constexpr size_t kMaxRawInputs = 64;

// The message without its raw_input_contents, into `rest`; false: leave the
// bytes to protobuf.
bool Split(grpc::ByteBuffer* bytes, HostBufferPool& pool, PayloadCopier& copier,
           std::string* rest, std::vector<HostBuffer>* raw_inputs) {
  SliceReader in(bytes);
  std::vector<absl::string_view> pieces;
  if (!in.ok()) return false;
  while (in.left() > 0) {
    uint32_t tag;
    std::string raw_tag;
    if (!ReadTag(in, &tag, &raw_tag)) return false;
    if (tag != (kRawInputContents << 3 | kWireLengthDelimited)) {
      *rest += raw_tag;
      if (!CopyBody(tag, in, rest)) return false;
      continue;
    }
    size_t length;
    if (raw_inputs->size() == kMaxRawInputs || !ReadLength(in, 0, &length)) return false;
    absl::StatusOr<HostBuffer> buffer = pool.Allocate(length);
    pieces.clear();
    if (!buffer.ok() || !in.ReadPieces(length, &pieces)) return false;
    copier.Copy(pieces, buffer->data(), /*width=*/0);
    raw_inputs->push_back(*std::move(buffer));
  }
  return true;
}

SliceWriter WriteResponse(const inference::ModelInferResponse& response,
                          std::vector<HostBuffer> buffers) {
  SliceWriter w;
  inference::ModelInferResponse head = response;  // small: its outputs' bytes are buffers
  head.clear_raw_output_contents();
  w.Append(head.SerializeAsString());
  for (int i = 0; i < response.raw_output_contents_size(); ++i) {
    const std::string& own = response.raw_output_contents(i);
    HostBuffer* buffer = static_cast<size_t>(i) < buffers.size() ? &buffers[i] : nullptr;
    if (buffer != nullptr && buffer->size() > 0) {
      w.Append(LengthDelimitedHeader(kRawOutputContents, buffer->size()));
      w.Reference(std::move(*buffer));
    } else {
      w.Append(LengthDelimitedHeader(kRawOutputContents, own.size()));
      w.Append(own);
    }
  }
  return w;
}

}  // namespace

absl::Status ParseModelInferRequest(grpc::ByteBuffer* bytes, absl::string_view what,
                                    int64_t number, HostBufferPool& pool, PayloadCopier& copier,
                                    inference::ModelInferRequest* request,
                                    std::vector<HostBuffer>* raw_inputs) {
  std::string rest;
  const bool split = Split(bytes, pool, copier, &rest, raw_inputs);
  return FinishSplitParse(bytes, what, number, split, rest, request,
                          [raw_inputs] { raw_inputs->clear(); });
}

MutableTensorView AllocateKServeResult(HostBufferPool& pool,
                                       inference::ModelInferResponse* response, OutputName name,
                                       DType dtype, const Shape& shape,
                                       std::vector<HostBuffer>* buffers) {
  MutableTensorView view{dtype, shape, nullptr};
  absl::StatusOr<HostBuffer> buffer = pool.Allocate(view.byte_size());
  if (!buffer.ok() || buffer->size() == 0) {
    buffers->emplace_back();
    return AllocateKServeOutput(response, name, dtype, shape);
  }
  view = AddKServeOutput(response, name, dtype, shape);
  view.data = buffer->data();
  buffers->push_back(*std::move(buffer));
  return view;
}

absl::Status SerializeModelInferResponse(const inference::ModelInferResponse& response,
                                         std::vector<HostBuffer> buffers,
                                         grpc::ByteBuffer* bytes) {
  SliceWriter w = WriteResponse(response, std::move(buffers));
  return w.Finish(response.GetTypeName(), bytes);
}

absl::Status SerializeModelStreamInferResponse(const inference::ModelStreamInferResponse& answer,
                                               std::vector<HostBuffer> buffers,
                                               grpc::ByteBuffer* bytes) {
  SliceWriter w;
  inference::ModelStreamInferResponse head = answer;  // small without its response
  head.clear_infer_response();
  w.Append(head.SerializeAsString());
  if (answer.has_infer_response()) {
    SliceWriter response = WriteResponse(answer.infer_response(), std::move(buffers));
    w.Append(LengthDelimitedHeader(
        inference::ModelStreamInferResponse::kInferResponseFieldNumber, response.size()));
    w.Splice(std::move(response));
  }
  return w.Finish(answer.GetTypeName(), bytes);
}

}  // namespace attnserve
