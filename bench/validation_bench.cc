// The cost of the request path's value rules (server/request/validation.cc):
// ValidateAttendInputs on one large sdpa request, next to a memcpy of the
// same bytes as its peer. docs/OPERATIONS.md quotes the ratio. And the copy
// of a tensor off the wire that now makes that pass as it goes
// (server/transport/payload_copier.h), with helpers and without, against
// the copy followed by the pass (the path before it); docs/PERFORMANCE.md,
// "Copying the tensors off the wire".
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "benchmark/benchmark.h"
#include "engine/model/builtin_models.h"
#include "server/request/validation.h"
#include "server/request/value_scan.h"
#include "server/transport/payload_copier.h"

namespace attnserve {
namespace {

// A 16 MiB query [1, 1, L, 64] (L = 65536 in fp32, 131072 in fp16/bf16) and
// 8 keys: almost all the bytes validation reads are the query's.
struct Request {
  std::string q, k, v;
  AttendInputs inputs;

  explicit Request(DType dtype) {
    const int64_t elem = static_cast<int64_t>(DTypeSize(dtype));
    const int64_t lq = (int64_t{16} << 20) / (64 * elem);
    q.assign(static_cast<size_t>(lq * 64 * elem), '\0');
    k.assign(static_cast<size_t>(8 * 64 * elem), '\0');
    v = k;
    for (size_t i = 0; i < q.size(); i += 2) q[i + 1] = 0x3c;  // finite, nonzero
    auto input = [&](const std::string& data, Shape shape) {
      InputTensor t;
      t.present = true;
      t.dtype = dtype;
      t.shape = std::move(shape);
      t.data = data;
      return t;
    };
    inputs.query = input(q, {1, 1, lq, 64});
    inputs.key = input(k, {1, 1, 8, 64});
    inputs.value = input(v, {1, 1, 8, 64});
  }
};

void BM_Validate(benchmark::State& state, DType dtype) {
  const Request r(dtype);
  const auto layer = MakeSdpaLayer();
  for (auto _ : state) {
    auto validated = ValidateAttendInputs(r.inputs, layer->config);
    if (!validated.ok()) state.SkipWithError(std::string(validated.status().message()).c_str());
    benchmark::DoNotOptimize(validated);
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(r.q.size()));
}

void BM_Memcpy(benchmark::State& state) {
  const Request r(DType::kFloat32);
  std::string dst(r.q.size(), '\0');
  for (auto _ : state) {
    std::memcpy(dst.data(), r.q.data(), r.q.size());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(r.q.size()));
}

// A 16 MiB fp16 tensor as gRPC hands it over: in 16 KiB slices; its
// destination 64-byte aligned, as request memory is (engine/host_buffer.h).
struct Wire {
  std::string bytes;
  std::vector<absl::string_view> pieces;
  std::unique_ptr<char[], void (*)(char*)> buffer;
  char* dst;
  Wire()
      : bytes(size_t{16} << 20, '\0'),
        buffer(static_cast<char*>(::operator new(bytes.size(), std::align_val_t{64})),
               [](char* p) { ::operator delete(p, std::align_val_t{64}); }),
        dst(buffer.get()) {
    for (size_t i = 0; i < bytes.size(); i += 2) bytes[i + 1] = 0x3c;  // finite
    std::memset(dst, 0, bytes.size());
    for (size_t at = 0; at < bytes.size(); at += 16384) {
      pieces.emplace_back(bytes.data() + at, std::min<size_t>(16384, bytes.size() - at));
    }
  }
};

// PayloadCopier::Copy with state.range(0) helpers: the copy and the scan.
void BM_CopyAndScan(benchmark::State& state) {
  Wire w;
  PayloadCopier copier(static_cast<int>(state.range(0)));
  for (auto _ : state) {
    benchmark::DoNotOptimize(copier.Copy(w.pieces, w.dst, 2));
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(w.bytes.size()));
}

// The path before the copier: each slice copied, then one pass over all.
void BM_CopyThenScan(benchmark::State& state) {
  Wire w;
  for (auto _ : state) {
    size_t at = 0;
    for (const absl::string_view piece : w.pieces) {
      std::memcpy(w.dst + at, piece.data(), piece.size());
      at += piece.size();
    }
    benchmark::DoNotOptimize(
        ScanValues(w.dst, static_cast<int64_t>(w.bytes.size() / 2), 2));
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(w.bytes.size()));
}

BENCHMARK_CAPTURE(BM_Validate, fp32, DType::kFloat32)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Validate, fp16, DType::kFloat16)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Validate, bf16, DType::kBFloat16)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Memcpy)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_CopyThenScan)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_CopyAndScan)->Arg(0)->Arg(1)->Arg(3)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace attnserve

BENCHMARK_MAIN();
