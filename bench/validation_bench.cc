// The cost of the request path's value rules (server/request/validation.cc):
// ValidateAttendInputs on one large sdpa request, next to a memcpy of the
// same bytes as its peer. docs/OPERATIONS.md quotes the ratio.
#include <cstring>
#include <string>

#include "benchmark/benchmark.h"
#include "engine/model/builtin_models.h"
#include "server/request/validation.h"

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

BENCHMARK_CAPTURE(BM_Validate, fp32, DType::kFloat32)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Validate, fp16, DType::kFloat16)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Validate, bf16, DType::kBFloat16)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Memcpy)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace attnserve

BENCHMARK_MAIN();
