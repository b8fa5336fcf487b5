// Fuzz target: bytes as a weights.safetensors file. SafetensorsFile::FromBytes
// must refuse or accept without touching memory outside the input; an
// accepted file's tensors are read, and it is handed to the weight loader
// for a small layer in each layout (the loader checks names and shapes
// against the file). Aborts on a crash or sanitizer report, an error without
// a message, or an accepted file whose entries break the promises of
// safetensors.h.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "engine/attention_layer.h"
#include "engine/model/safetensors.h"
#include "engine/model/weight_loader.h"

namespace attnserve {
namespace {

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "safetensors_fuzzer: %s\n", what.c_str());
  std::abort();
}

LayerConfig SmallLayer(bool gqa) {
  LayerConfig c;
  c.name = "fuzz";
  c.has_projections = true;
  c.num_heads = 2;
  c.num_kv_heads = gqa ? 1 : 2;
  c.head_dim = 2;
  c.embed_dim = 4;
  c.query_dim = c.key_dim = c.value_dim = c.out_dim = 4;
  return c;
}

void RunOne(const uint8_t* data, size_t size) {
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::FromBytes(
      std::string_view(reinterpret_cast<const char*>(data), size), "weights.safetensors");
  if (!file.ok()) {
    if (file.status().message().empty()) Fail("refused without a message");
    return;
  }
  const SafetensorsFile& f = **file;
  for (const auto& [name, entry] : f.entries()) {
    if (entry.end < entry.begin || entry.end > size) Fail("entry out of the file: " + name);
    if (entry.end - entry.begin !=
        static_cast<uint64_t>(entry.num_elements) * DTypeSize(entry.dtype)) {
      Fail("entry byte range does not match its shape: " + name);
    }
    if (f.Find(name) != &entry) Fail("Find disagrees with entries(): " + name);
    const std::vector<float> values = f.ReadAsFloat(entry);
    if (static_cast<int64_t>(values.size()) != entry.num_elements) Fail("ReadAsFloat size: " + name);
  }
  for (WeightLayout layout : {WeightLayout::kTorchMha, WeightLayout::kSeparateQkv,
                              WeightLayout::kFusedQkvPerHead, WeightLayout::kKerasDense}) {
    for (bool gqa : {false, true}) {
      if (gqa && layout != WeightLayout::kSeparateQkv) continue;
      WeightSpec spec;
      spec.layout = layout;
      AttentionLayer layer;
      layer.config = SmallLayer(gqa);
      absl::StatusOr<LayerWeights> weights = LoadLayerWeights(f, layer.config, spec);
      if (!weights.ok()) {
        if (weights.status().message().empty()) Fail("loader refused without a message");
        continue;
      }
      layer.weights = *std::move(weights);
      if (absl::Status s = ValidateLayer(layer); !s.ok()) {
        Fail("loaded weights the layer check refuses: " + s.ToString());
      }
      (void)MeasureWeightBounds(layer.weights);
    }
  }
}

}  // namespace
}  // namespace attnserve

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  attnserve::RunOne(data, size);
  return 0;
}
