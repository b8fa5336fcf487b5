// LoadLayerWeights for each checkpoint layout: where every row of the
// canonical weights comes from, and the messages for missing/misshapen tensors.
#include "engine/model/weight_loader.h"

#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

WeightSpec Spec(WeightLayout layout, bool qkv_bias = true, bool out_bias = true) {
  WeightSpec spec;
  spec.layout = layout;
  spec.q_bias = spec.k_bias = spec.v_bias = qkv_bias;
  spec.out_bias = out_bias;
  return spec;
}

struct NamedTensor {
  std::string name;
  Shape shape;
  std::vector<float> values;  // stored as F32
};

// Values that identify their position: start + 0.001 * i.
std::vector<float> Iota(int64_t n, float start) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = start + 0.001f * static_cast<float>(i);
  return v;
}

NamedTensor T(std::string name, Shape shape, float start) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return {std::move(name), shape, Iota(n, start)};
}

std::unique_ptr<SafetensorsFile> MakeFile(const std::vector<NamedTensor>& tensors) {
  std::string data;
  std::vector<std::string> entries;
  for (const NamedTensor& t : tensors) {
    size_t begin = data.size();
    data.append(reinterpret_cast<const char*>(t.values.data()), t.values.size() * 4);
    entries.push_back(absl::StrCat("\"", t.name, "\":{\"dtype\":\"F32\",\"shape\":[",
                                   absl::StrJoin(t.shape, ","), "],\"data_offsets\":[", begin,
                                   ",", data.size(), "]}"));
  }
  std::string header = absl::StrCat("{", absl::StrJoin(entries, ","), "}");
  uint64_t n = header.size();
  std::string bytes(8, '\0');
  std::memcpy(bytes.data(), &n, 8);
  auto file = SafetensorsFile::FromBytes(bytes + header + data, "repo/m/weights.safetensors");
  EXPECT_TRUE(file.ok()) << file.status();
  return std::move(*file);
}

LayerConfig Config(int64_t embed, int64_t heads, int64_t kv_heads, int64_t head_dim) {
  LayerConfig c;
  c.name = "m";
  c.has_projections = true;
  c.embed_dim = embed;
  c.num_heads = heads;
  c.num_kv_heads = kv_heads;
  c.head_dim = head_dim;
  c.query_dim = c.key_dim = c.value_dim = c.out_dim = embed;
  return c;
}

std::vector<float> Values(const Tensor& t) {
  const float* p = t.data_as<float>();
  return std::vector<float>(p, p + t.num_elements());
}

// Rows [row0, row0 + rows) of `m` viewed as [*, cols].
std::vector<float> Rows(const std::vector<float>& m, int64_t cols, int64_t row0, int64_t rows) {
  return std::vector<float>(m.begin() + row0 * cols, m.begin() + (row0 + rows) * cols);
}

TEST(WeightLoaderTest, TorchMhaPackedInProjectionSplitsIntoThirds) {
  NamedTensor in_w = T("in_proj_weight", {12, 4}, 1.0f);
  NamedTensor in_b = T("in_proj_bias", {12}, 2.0f);
  NamedTensor out_w = T("out_proj.weight", {4, 4}, 3.0f);
  NamedTensor out_b = T("out_proj.bias", {4}, 4.0f);
  auto file = MakeFile({in_w, in_b, out_w, out_b});
  auto w = LoadLayerWeights(*file, Config(4, 2, 2, 2), WeightSpec{});
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->wq.shape(), (Shape{4, 4}));
  EXPECT_EQ(Values(w->wq), Rows(in_w.values, 4, 0, 4));
  EXPECT_EQ(Values(w->wk), Rows(in_w.values, 4, 4, 4));
  EXPECT_EQ(Values(w->wv), Rows(in_w.values, 4, 8, 4));
  EXPECT_EQ(Values(w->bq), Rows(in_b.values, 1, 0, 4));
  EXPECT_EQ(Values(w->bk), Rows(in_b.values, 1, 4, 4));
  EXPECT_EQ(Values(w->bv), Rows(in_b.values, 1, 8, 4));
  EXPECT_EQ(Values(w->wo), out_w.values);
  EXPECT_EQ(Values(w->bo), out_b.values);
}

TEST(WeightLoaderTest, TorchMhaSeparateWeightsWhenKdimVdimDiffer) {
  NamedTensor q = T("q_proj_weight", {4, 4}, 1.0f);
  NamedTensor k = T("k_proj_weight", {4, 3}, 2.0f);
  NamedTensor v = T("v_proj_weight", {4, 5}, 3.0f);
  auto file = MakeFile({q, k, v, T("out_proj.weight", {4, 4}, 4.0f)});
  LayerConfig c = Config(4, 2, 2, 2);
  c.key_dim = 3;
  c.value_dim = 5;
  WeightSpec spec;
  spec.q_bias = spec.k_bias = spec.v_bias = spec.out_bias = false;
  auto w = LoadLayerWeights(*file, c, spec);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(Values(w->wq), q.values);
  EXPECT_EQ(w->wk.shape(), (Shape{4, 3}));
  EXPECT_EQ(Values(w->wk), k.values);
  EXPECT_EQ(w->wv.shape(), (Shape{4, 5}));
  EXPECT_EQ(Values(w->wv), v.values);
  EXPECT_EQ(w->bq.byte_size(), 0u);
  EXPECT_EQ(w->bo.byte_size(), 0u);
}

TEST(WeightLoaderTest, SeparateQkvWithGqaPrefixAndOverride) {
  const std::string p = "model.layers.1.self_attn.";
  NamedTensor q = T(p + "q_proj.weight", {8, 6}, 1.0f);
  NamedTensor k = T(p + "k_proj.weight", {4, 6}, 2.0f);
  NamedTensor v = T(p + "v_proj.weight", {4, 6}, 3.0f);
  NamedTensor o = T(p + "dense.weight", {6, 8}, 4.0f);
  NamedTensor ob = T(p + "dense.bias", {6}, 5.0f);
  // An unrelated layer in the same file is ignored.
  auto file = MakeFile({T("model.layers.0.self_attn.q_proj.weight", {8, 6}, 9.0f), q, k, v, o, ob});
  LayerConfig c = Config(6, 4, 2, 2);
  WeightSpec spec;
  spec.layout = WeightLayout::kSeparateQkv;
  spec.tensor_prefix = p;
  spec.tensor_names = {{"out_weight", "dense.weight"}, {"out_bias", "dense.bias"}};
  spec.q_bias = spec.k_bias = spec.v_bias = false;
  auto w = LoadLayerWeights(*file, c, spec);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(Values(w->wq), q.values);
  EXPECT_EQ(w->wk.shape(), (Shape{4, 6}));
  EXPECT_EQ(Values(w->wk), k.values);
  EXPECT_EQ(Values(w->wv), v.values);
  EXPECT_EQ(w->wo.shape(), (Shape{6, 8}));
  EXPECT_EQ(Values(w->wo), o.values);
  EXPECT_EQ(Values(w->bo), ob.values);
}

TEST(WeightLoaderTest, FusedQkvPerHeadDeinterleavesHeads) {
  const int64_t h = 2, hd = 3, in = 4;
  NamedTensor qkv = T("qkv.weight", {h * 3 * hd, in}, 1.0f);
  NamedTensor qkv_b = T("qkv.bias", {h * 3 * hd}, 2.0f);
  auto file = MakeFile({qkv, qkv_b, T("out_proj.weight", {in, h * hd}, 3.0f),
                        T("out_proj.bias", {in}, 4.0f)});
  auto w = LoadLayerWeights(*file, Config(in, h, h, hd),
                            Spec(WeightLayout::kFusedQkvPerHead));
  ASSERT_TRUE(w.ok()) << w.status();
  const Tensor* parts[3] = {&w->wq, &w->wk, &w->wv};
  const Tensor* biases[3] = {&w->bq, &w->bk, &w->bv};
  for (int part = 0; part < 3; ++part) {
    std::vector<float> expected, expected_bias;
    for (int64_t head = 0; head < h; ++head) {
      // Fused output row (head, part, d) = head * 3 * hd + part * hd + d.
      auto rows = Rows(qkv.values, in, head * 3 * hd + part * hd, hd);
      expected.insert(expected.end(), rows.begin(), rows.end());
      auto b = Rows(qkv_b.values, 1, head * 3 * hd + part * hd, hd);
      expected_bias.insert(expected_bias.end(), b.begin(), b.end());
    }
    EXPECT_EQ(Values(*parts[part]), expected) << "part " << part;
    EXPECT_EQ(Values(*biases[part]), expected_bias) << "part " << part;
  }
}

TEST(WeightLoaderTest, KerasKernelsAreTransposedIn2dAnd3dForms) {
  const int64_t in = 4, h = 2, hd = 2, out = 3;
  NamedTensor kq = T("query/kernel", {in, h, hd}, 1.0f);  // EinsumDense form
  NamedTensor kk = T("key/kernel", {in, h * hd}, 2.0f);   // Dense form
  NamedTensor kv = T("value/kernel", {in, h, hd}, 3.0f);
  NamedTensor ko = T("attention_output/kernel", {h, hd, out}, 4.0f);
  NamedTensor bq = T("query/bias", {h, hd}, 5.0f);
  auto file = MakeFile({kq, kk, kv, ko, bq, T("attention_output/bias", {out}, 6.0f)});
  LayerConfig c = Config(in, h, h, hd);
  c.out_dim = out;
  WeightSpec spec = Spec(WeightLayout::kKerasDense);
  spec.k_bias = spec.v_bias = false;
  auto w = LoadLayerWeights(*file, c, spec);
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_EQ(w->wq.shape(), (Shape{h * hd, in}));
  ASSERT_EQ(w->wo.shape(), (Shape{out, h * hd}));
  for (int64_t o = 0; o < h * hd; ++o) {
    for (int64_t i = 0; i < in; ++i) {
      EXPECT_EQ(w->wq.data_as<float>()[o * in + i], kq.values[i * h * hd + o]);
      EXPECT_EQ(w->wk.data_as<float>()[o * in + i], kk.values[i * h * hd + o]);
    }
  }
  for (int64_t o = 0; o < out; ++o) {
    for (int64_t i = 0; i < h * hd; ++i) {
      EXPECT_EQ(w->wo.data_as<float>()[o * h * hd + i], ko.values[i * out + o]);
    }
  }
  EXPECT_EQ(Values(w->bq), bq.values);
  EXPECT_EQ(w->bk.byte_size(), 0u);
}

TEST(WeightLoaderTest, MissingTensorNamesFileTensorAndExpectedShape) {
  auto file = MakeFile({T("layers.0.attn.out_proj.weight", {4, 4}, 1.0f)});
  WeightSpec spec;
  spec.tensor_prefix = "layers.0.attn.";
  auto w = LoadLayerWeights(*file, Config(4, 2, 2, 2), spec);
  ASSERT_FALSE(w.ok());
  EXPECT_THAT(w.status().message(),
              AllOf(HasSubstr("repo/m/weights.safetensors"),
                    HasSubstr("tensor 'layers.0.attn.in_proj_weight' is missing"),
                    HasSubstr("expected shape [12, 4]"),
                    HasSubstr("'layers.0.attn.out_proj.weight'")));
}

TEST(WeightLoaderTest, WrongShapeNamesExpectedAndActual) {
  auto file = MakeFile({T("in_proj_weight", {12, 5}, 1.0f)});
  auto w = LoadLayerWeights(*file, Config(4, 2, 2, 2), WeightSpec{});
  ASSERT_FALSE(w.ok());
  EXPECT_THAT(w.status().message(),
              AllOf(HasSubstr("repo/m/weights.safetensors"), HasSubstr("tensor 'in_proj_weight'"),
                    HasSubstr("has shape [12, 5]; expected [12, 4]")));
}

TEST(WeightLoaderTest, BiasInFileWithFlagOffIsAnError) {
  auto file = MakeFile({T("in_proj_weight", {12, 4}, 1.0f), T("in_proj_bias", {12}, 2.0f),
                        T("out_proj.weight", {4, 4}, 3.0f)});
  auto w = LoadLayerWeights(*file, Config(4, 2, 2, 2), Spec(WeightLayout::kTorchMha, false, false));
  ASSERT_FALSE(w.ok());
  EXPECT_THAT(w.status().message(),
              AllOf(HasSubstr("tensor 'in_proj_bias'"), HasSubstr("is in the file but q_bias"),
                    HasSubstr("false")));

  auto hf = MakeFile({T("q_proj.weight", {4, 4}, 1.0f), T("k_proj.weight", {4, 4}, 1.0f),
                      T("v_proj.weight", {4, 4}, 1.0f), T("o_proj.weight", {4, 4}, 1.0f),
                      T("o_proj.bias", {4}, 1.0f)});
  w = LoadLayerWeights(*hf, Config(4, 2, 2, 2), Spec(WeightLayout::kSeparateQkv, false, false));
  ASSERT_FALSE(w.ok());
  EXPECT_THAT(w.status().message(),
              AllOf(HasSubstr("tensor 'o_proj.bias'"), HasSubstr("out_bias is false")));
  EXPECT_TRUE(
      LoadLayerWeights(*hf, Config(4, 2, 2, 2), Spec(WeightLayout::kSeparateQkv, false, true)).ok());
}

// QK-norm weights: read ([head_dim] each, or as wide as the Q and K
// projections with whole_projection) when the spec asks, named when missing
// or misshapen, and an error when in the file without qk_norm.
TEST(WeightLoaderTest, QkNormWeightsAreReadOnlyWhenConfigured) {
  const std::string p = "model.layers.2.self_attn.";
  auto projections = [&] {
    return std::vector<NamedTensor>{T(p + "q_proj.weight", {8, 6}, 1.0f),
                                    T(p + "k_proj.weight", {4, 6}, 2.0f),
                                    T(p + "v_proj.weight", {4, 6}, 3.0f),
                                    T(p + "o_proj.weight", {6, 8}, 4.0f)};
  };
  std::vector<NamedTensor> with_norms = projections();
  with_norms.push_back(T(p + "q_norm.weight", {2}, 6.0f));
  with_norms.push_back(T(p + "k_norm.weight", {2}, 7.0f));
  auto file = MakeFile(with_norms);
  LayerConfig c = Config(6, 4, 2, 2);
  WeightSpec spec = Spec(WeightLayout::kSeparateQkv, false, false);
  spec.tensor_prefix = p;
  spec.qk_norm = true;
  auto w = LoadLayerWeights(*file, c, spec);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(Values(w->q_norm), with_norms[4].values);
  EXPECT_EQ(Values(w->k_norm), with_norms[5].values);

  spec.qk_norm = false;  // in the file, not configured: a forgotten qk_norm
  w = LoadLayerWeights(*file, c, spec);
  ASSERT_FALSE(w.ok());
  EXPECT_THAT(w.status().message(),
              AllOf(HasSubstr("'" + p + "q_norm.weight'"), HasSubstr("no qk_norm")));

  spec.qk_norm = true;  // configured, missing
  auto bare = MakeFile(projections());
  w = LoadLayerWeights(*bare, c, spec);
  ASSERT_FALSE(w.ok());
  EXPECT_THAT(w.status().message(), HasSubstr("q_norm.weight' is missing"));

  std::vector<NamedTensor> wide = projections();  // a norm over the whole projection
  wide.push_back(T(p + "q_norm.weight", {8}, 6.0f));
  wide.push_back(T(p + "k_norm.weight", {4}, 7.0f));
  auto wide_file = MakeFile(wide);
  w = LoadLayerWeights(*wide_file, c, spec);  // per head: refused
  ASSERT_FALSE(w.ok());
  EXPECT_THAT(w.status().message(), AllOf(HasSubstr("q_norm.weight"), HasSubstr("[8]")));

  c.qk_norm.whole_projection = true;  // OLMo-2: Q's 4 x 2 features, K's 2 x 2
  w = LoadLayerWeights(*wide_file, c, spec);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(Values(w->q_norm), wide[4].values);
  EXPECT_EQ(Values(w->k_norm), wide[5].values);
  w = LoadLayerWeights(*file, c, spec);  // per-head weights for a whole-projection norm
  ASSERT_FALSE(w.ok());
  EXPECT_THAT(w.status().message(), AllOf(HasSubstr("q_norm.weight"), HasSubstr("[2]")));

  // Cohere: weights per head, stored [heads, head_dim] (or flat).
  c.qk_norm.whole_projection = false;
  c.qk_norm.per_head_weights = true;
  std::vector<NamedTensor> cohere = projections();
  cohere.push_back(T(p + "q_norm.weight", {4, 2}, 6.0f));
  cohere.push_back(T(p + "k_norm.weight", {2, 2}, 7.0f));
  w = LoadLayerWeights(*MakeFile(cohere), c, spec);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->q_norm.shape(), (Shape{8}));
  EXPECT_EQ(Values(w->q_norm), cohere[4].values);
  EXPECT_EQ(Values(w->k_norm), cohere[5].values);
  w = LoadLayerWeights(*wide_file, c, spec);
  ASSERT_TRUE(w.ok()) << w.status();
  w = LoadLayerWeights(*file, c, spec);
  ASSERT_FALSE(w.ok());
  EXPECT_THAT(w.status().message(), AllOf(HasSubstr("q_norm.weight"), HasSubstr("[4, 2]")));
}

// Sinks: [num_heads], read when configured, an error in the file without.
TEST(WeightLoaderTest, SinksAreReadOnlyWhenConfigured) {
  std::vector<NamedTensor> tensors = {T("q_proj.weight", {8, 6}, 1.0f),
                                      T("k_proj.weight", {4, 6}, 2.0f),
                                      T("v_proj.weight", {4, 6}, 3.0f),
                                      T("o_proj.weight", {6, 8}, 4.0f), T("sinks", {4}, 5.0f)};
  auto file = MakeFile(tensors);
  WeightSpec spec = Spec(WeightLayout::kSeparateQkv, false, false);
  spec.sinks = true;
  auto w = LoadLayerWeights(*file, Config(6, 4, 2, 2), spec);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(Values(w->sinks), tensors[4].values);
  spec.sinks = false;
  w = LoadLayerWeights(*file, Config(6, 4, 2, 2), spec);
  ASSERT_FALSE(w.ok());
  EXPECT_THAT(w.status().message(), AllOf(HasSubstr("'sinks'"), HasSubstr("no sinks")));
}

// A relative position bias table is read with relative_bias_distance
// (default name "relative_bias", [num_heads, 2 * distance + 1], renamed by
// tensor_names); of another shape, or in the file without the field, it is
// an error naming the tensor.
TEST(WeightLoaderTest, RelativeBiasIsReadOnlyWithItsDistance) {
  std::vector<NamedTensor> tensors = {
      T("q_proj.weight", {8, 6}, 1.0f), T("k_proj.weight", {4, 6}, 2.0f),
      T("v_proj.weight", {4, 6}, 3.0f), T("o_proj.weight", {6, 8}, 4.0f),
      T("relative_bias", {4, 7}, 5.0f)};
  auto file = MakeFile(tensors);
  const WeightSpec spec = Spec(WeightLayout::kSeparateQkv, false, false);
  LayerConfig config = Config(6, 4, 2, 2);
  config.relative_bias_distance = 3;
  auto w = LoadLayerWeights(*file, config, spec);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(Values(w->relative_bias), tensors[4].values);
  EXPECT_EQ(w->relative_bias.shape(), (Shape{4, 7}));
  config.relative_bias_distance = 2;
  w = LoadLayerWeights(*file, config, spec);
  ASSERT_FALSE(w.ok());
  EXPECT_THAT(w.status().message(),
              AllOf(HasSubstr("'relative_bias'"), HasSubstr("[4, 7]"), HasSubstr("[4, 5]")));
  config.relative_bias_distance = 0;
  w = LoadLayerWeights(*file, config, spec);
  ASSERT_FALSE(w.ok());
  EXPECT_THAT(w.status().message(),
              AllOf(HasSubstr("'relative_bias'"), HasSubstr("no relative_bias_distance")));
  WeightSpec renamed = spec;
  renamed.tensor_names["relative_bias"] = "t5_bias";
  config.relative_bias_distance = 3;
  w = LoadLayerWeights(*MakeFile({tensors[0], tensors[1], tensors[2], tensors[3],
                                  T("t5_bias", {4, 7}, 6.0f)}),
                       config, renamed);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->relative_bias.shape(), (Shape{4, 7}));
}

// Relative position embeddings are read with their flags (default names
// "relative_key" and "relative_query", [num_heads, head_dim, 2 * distance +
// 1], renamed by tensor_names); of another shape, missing, or in the file
// without their flag, an error naming the tensor.
TEST(WeightLoaderTest, RelativeEmbeddingsAreReadOnlyWithTheirFlags) {
  std::vector<NamedTensor> tensors = {
      T("q_proj.weight", {8, 6}, 1.0f), T("k_proj.weight", {4, 6}, 2.0f),
      T("v_proj.weight", {4, 6}, 3.0f), T("o_proj.weight", {6, 8}, 4.0f),
      T("relative_key", {4, 2, 7}, 5.0f), T("relative_query", {4, 2, 7}, 6.0f)};
  auto file = MakeFile(tensors);
  const WeightSpec spec = Spec(WeightLayout::kSeparateQkv, false, false);
  LayerConfig config = Config(6, 4, 2, 2);
  config.relative_embeddings = {3, true, true};
  auto w = LoadLayerWeights(*file, config, spec);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(Values(w->relative_key), tensors[4].values);
  EXPECT_EQ(Values(w->relative_query), tensors[5].values);
  EXPECT_EQ(w->relative_query.shape(), (Shape{4, 2, 7}));
  config.relative_embeddings = {2, true, true};
  w = LoadLayerWeights(*file, config, spec);
  ASSERT_FALSE(w.ok());
  EXPECT_THAT(w.status().message(), AllOf(HasSubstr("'relative_key'"), HasSubstr("[4, 2, 7]"),
                                          HasSubstr("[4, 2, 5]")));
  config.relative_embeddings = {3, true, false};
  w = LoadLayerWeights(*file, config, spec);
  ASSERT_FALSE(w.ok());
  EXPECT_THAT(w.status().message(),
              AllOf(HasSubstr("'relative_query'"), HasSubstr("position_to_content")));
  config.relative_embeddings = {3, true, true};
  w = LoadLayerWeights(*MakeFile({tensors[0], tensors[1], tensors[2], tensors[3], tensors[5]}),
                       config, spec);
  ASSERT_FALSE(w.ok());
  EXPECT_THAT(w.status().message(), HasSubstr("relative_key"));
  WeightSpec renamed = spec;
  renamed.tensor_names["relative_key"] = "pos_key";
  config.relative_embeddings = {3, true, false};
  w = LoadLayerWeights(*MakeFile({tensors[0], tensors[1], tensors[2], tensors[3],
                                  T("pos_key", {4, 2, 7}, 7.0f)}),
                       config, renamed);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->relative_key.shape(), (Shape{4, 2, 7}));
  EXPECT_EQ(w->relative_query.byte_size(), 0u);
}

// The output gate as a linear of its own (AFMoE's gate_proj): read when
// configured (its bias only with gate_bias), an error in the file without;
// Keras kernels are transposed like the others.
TEST(WeightLoaderTest, SeparateOutputGateIsReadOnlyWhenConfigured) {
  std::vector<NamedTensor> tensors = {
      T("q_proj.weight", {8, 6}, 1.0f), T("k_proj.weight", {4, 6}, 2.0f),
      T("v_proj.weight", {4, 6}, 3.0f), T("o_proj.weight", {6, 8}, 4.0f),
      T("gate_proj.weight", {8, 6}, 5.0f), T("gate_proj.bias", {8}, 6.0f)};
  auto file = MakeFile(tensors);
  WeightSpec spec = Spec(WeightLayout::kSeparateQkv, false, false);
  spec.gate = WeightSpec::Gate::kSeparate;
  spec.gate_bias = true;
  auto w = LoadLayerWeights(*file, Config(6, 4, 2, 2), spec);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(Values(w->wg), tensors[4].values);
  EXPECT_EQ(w->wg.shape(), (Shape{8, 6}));
  EXPECT_EQ(Values(w->bg), tensors[5].values);
  spec.gate_bias = false;  // the bias in the file, its flag off
  w = LoadLayerWeights(*file, Config(6, 4, 2, 2), spec);
  ASSERT_FALSE(w.ok());
  EXPECT_THAT(w.status().message(), AllOf(HasSubstr("'gate_proj.bias'"),
                                          HasSubstr("output_gate.bias is false")));
  spec.gate = WeightSpec::Gate::kNone;
  w = LoadLayerWeights(*file, Config(6, 4, 2, 2), spec);
  ASSERT_FALSE(w.ok());
  EXPECT_THAT(w.status().message(), AllOf(HasSubstr("'gate_proj.weight'"),
                                          HasSubstr("no output_gate")));

  NamedTensor kernel = T("gate/kernel", {6, 4, 2}, 7.0f);  // [in, H, hd]
  auto keras = MakeFile({T("query/kernel", {6, 8}, 1.0f), T("key/kernel", {6, 4}, 2.0f),
                         T("value/kernel", {6, 4}, 3.0f),
                         T("attention_output/kernel", {8, 6}, 4.0f), kernel});
  WeightSpec keras_spec = Spec(WeightLayout::kKerasDense, false, false);
  keras_spec.gate = WeightSpec::Gate::kSeparate;
  w = LoadLayerWeights(*keras, Config(6, 4, 2, 2), keras_spec);
  ASSERT_TRUE(w.ok()) << w.status();
  for (int64_t o = 0; o < 8; ++o) {
    for (int64_t i = 0; i < 6; ++i) {
      EXPECT_EQ(w->wg.data_as<float>()[o * 6 + i], kernel.values[i * 8 + o]);
    }
  }
}

// Qwen3-Next's q_proj: [q_h | gate_h] per head, 2 * H * hd rows (and its
// bias likewise), split into the query and the gate row by row.
TEST(WeightLoaderTest, GateInsideTheQueryProjectionIsSplitPerHead) {
  const int64_t h = 3, hd = 2, in = 5;
  NamedTensor qg = T("q_proj.weight", {2 * h * hd, in}, 1.0f);
  NamedTensor qg_bias = T("q_proj.bias", {2 * h * hd}, 9.0f);
  auto file = MakeFile({qg, qg_bias, T("k_proj.weight", {hd, in}, 2.0f),
                        T("v_proj.weight", {hd, in}, 3.0f), T("o_proj.weight", {in, h * hd}, 4.0f)});
  LayerConfig c = Config(in, h, 1, hd);
  WeightSpec spec = Spec(WeightLayout::kSeparateQkv, false, false);
  spec.q_bias = true;
  spec.gate = WeightSpec::Gate::kQueryPerHead;
  auto w = LoadLayerWeights(*file, c, spec);
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_EQ(w->wq.shape(), (Shape{h * hd, in}));
  ASSERT_EQ(w->wg.shape(), (Shape{h * hd, in}));
  for (int64_t head = 0; head < h; ++head) {
    for (int64_t d = 0; d < hd; ++d) {
      const int64_t q_row = head * 2 * hd + d, g_row = q_row + hd, row = head * hd + d;
      for (int64_t i = 0; i < in; ++i) {
        EXPECT_EQ(w->wq.data_as<float>()[row * in + i], qg.values[q_row * in + i]);
        EXPECT_EQ(w->wg.data_as<float>()[row * in + i], qg.values[g_row * in + i]);
      }
      EXPECT_EQ(w->bq.data_as<float>()[row], qg_bias.values[q_row]);
      EXPECT_EQ(w->bg.data_as<float>()[row], qg_bias.values[g_row]);
    }
  }
  // Without the gate, q_proj is twice as tall as a query projection.
  spec.gate = WeightSpec::Gate::kNone;
  w = LoadLayerWeights(*file, c, spec);
  ASSERT_FALSE(w.ok());
  EXPECT_THAT(w.status().message(), AllOf(HasSubstr("q_proj.weight"), HasSubstr("[6, 5]")));
  // Only SEPARATE_QKV has a q_proj to hold it.
  spec = Spec(WeightLayout::kTorchMha, false, false);
  spec.gate = WeightSpec::Gate::kQueryPerHead;
  w = LoadLayerWeights(*file, c, spec);
  ASSERT_FALSE(w.ok());
  EXPECT_THAT(w.status().message(), HasSubstr("needs layout SEPARATE_QKV"));
}

// DeepSeek's tensors: kv_b_proj's rows [k_nope_h | v_h] per head split into
// wk and wv, the query through q_a_proj / q_a_layernorm / q_b_proj (or one
// q_proj), biases by the flags; the other form's tensors and plain
// projections refused.
TEST(WeightLoaderTest, LatentAttentionSplitsKvBPerHead) {
  constexpr int64_t in = 6, h = 2, nope = 3, rope = 2, dv = 4, qr = 5, kvr = 7;
  LayerConfig c = Config(in, h, h, nope + rope);
  c.latent = {true, qr, kvr, rope, dv, 1e-6, 1e-6};
  const NamedTensor kv_b = T("kv_b_proj.weight", {h * (nope + dv), kvr}, 6.0f);
  const NamedTensor kv_a = T("kv_a_proj_with_mqa.weight", {kvr + rope, in}, 4.0f);
  const NamedTensor kv_a_bias = T("kv_a_proj_with_mqa.bias", {kvr + rope}, 4.5f);
  const NamedTensor q_a = T("q_a_proj.weight", {qr, in}, 1.0f);
  const NamedTensor q_b = T("q_b_proj.weight", {h * (nope + rope), qr}, 3.0f);
  std::vector<NamedTensor> tensors = {q_a,
                                      T("q_a_proj.bias", {qr}, 1.5f),
                                      T("q_a_layernorm.weight", {qr}, 2.0f),
                                      q_b,
                                      kv_a,
                                      kv_a_bias,
                                      T("kv_a_layernorm.weight", {kvr}, 5.0f),
                                      kv_b,
                                      T("o_proj.weight", {in, h * dv}, 7.0f)};
  WeightSpec spec = Spec(WeightLayout::kSeparateQkv, false, false);
  spec.q_bias = spec.k_bias = true;
  auto w = LoadLayerWeights(*MakeFile(tensors), c, spec);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(Values(w->wq_a), q_a.values);
  EXPECT_EQ(Values(w->wq), q_b.values);
  EXPECT_EQ(Values(w->wkv_a), kv_a.values);
  EXPECT_EQ(Values(w->bkv_a), kv_a_bias.values);
  EXPECT_EQ(w->q_a_norm.shape(), (Shape{qr}));
  EXPECT_EQ(w->bq_a.shape(), (Shape{qr}));
  EXPECT_EQ(w->bq.byte_size(), 0u);
  ASSERT_EQ(w->wk.shape(), (Shape{h * nope, kvr}));
  ASSERT_EQ(w->wv.shape(), (Shape{h * dv, kvr}));
  for (int64_t head = 0; head < h; ++head) {
    EXPECT_EQ(Rows(Values(w->wk), kvr, head * nope, nope),
              Rows(kv_b.values, kvr, head * (nope + dv), nope));
    EXPECT_EQ(Rows(Values(w->wv), kvr, head * dv, dv),
              Rows(kv_b.values, kvr, head * (nope + dv) + nope, dv));
  }
  AttentionLayer layer;
  layer.config = c;
  layer.weights = *w;
  EXPECT_TRUE(ValidateLayer(layer).ok()) << ValidateLayer(layer);

  // A bias in the file with its flag off; a q_proj beside q_a_proj.
  spec.k_bias = false;
  w = LoadLayerWeights(*MakeFile(tensors), c, spec);
  ASSERT_FALSE(w.ok());
  EXPECT_THAT(w.status().message(), HasSubstr("kv_a_proj_with_mqa.bias"));
  spec.k_bias = true;
  std::vector<NamedTensor> both = tensors;
  both.push_back(T("q_proj.weight", {h * (nope + rope), in}, 8.0f));
  w = LoadLayerWeights(*MakeFile(both), c, spec);
  ASSERT_FALSE(w.ok());
  EXPECT_THAT(w.status().message(), AllOf(HasSubstr("q_proj.weight"), HasSubstr("q_lora_rank")));
  // Without the query's latent: one q_proj, no q_bias.
  c.latent.q_lora_rank = 0;
  std::vector<NamedTensor> plain = {T("q_proj.weight", {h * (nope + rope), in}, 8.0f), kv_a,
                                    kv_a_bias, T("kv_a_layernorm.weight", {kvr}, 5.0f), kv_b,
                                    T("o_proj.weight", {in, h * dv}, 7.0f)};
  spec.q_bias = false;
  w = LoadLayerWeights(*MakeFile(plain), c, spec);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->wq.shape(), (Shape{h * (nope + rope), in}));
  EXPECT_EQ(w->wq_a.byte_size(), 0u);
  // A latent layer reads SEPARATE_QKV's names only; a plain layer refuses
  // DeepSeek's tensors.
  w = LoadLayerWeights(*MakeFile(plain), c, Spec(WeightLayout::kTorchMha, false, false));
  ASSERT_FALSE(w.ok());
  EXPECT_THAT(w.status().message(), HasSubstr("SEPARATE_QKV"));
  c.latent.enabled = false;
  w = LoadLayerWeights(*MakeFile(plain), c, spec);
  ASSERT_FALSE(w.ok());
  EXPECT_THAT(w.status().message(),
              AllOf(HasSubstr("kv_a_proj_with_mqa.weight"), HasSubstr("latent_attention")));
}

TEST(WeightLoaderTest, Bf16PrecisionRoundsWeights) {
  NamedTensor q = T("q_proj.weight", {2, 2}, 1.01f);
  auto file = MakeFile({q, T("k_proj.weight", {2, 2}, 0.0f), T("v_proj.weight", {2, 2}, 0.0f),
                        T("o_proj.weight", {2, 2}, 0.0f)});
  LayerConfig c = Config(2, 1, 1, 2);
  c.precision = Precision::kBFloat16;
  WeightSpec spec = Spec(WeightLayout::kSeparateQkv, false, false);
  auto w = LoadLayerWeights(*file, c, spec);
  ASSERT_TRUE(w.ok()) << w.status();
  for (int i = 0; i < 4; ++i) {
    float got = w->wq.data_as<float>()[i];
    EXPECT_EQ(got, BFloat16ToFloat(FloatToBFloat16(q.values[i])));
    EXPECT_NE(got, q.values[i]);
  }
}

TEST(WeightLoaderTest, UnknownRoleInTensorNamesIsRejected) {
  auto file = MakeFile({});
  WeightSpec spec;
  spec.tensor_names = {{"qkv_weight", "x"}};  // a FUSED role, not TORCH_MHA
  auto w = LoadLayerWeights(*file, Config(4, 2, 2, 2), spec);
  ASSERT_FALSE(w.ok());
  EXPECT_THAT(w.status().message(),
              AllOf(HasSubstr("tensor_names key 'qkv_weight'"), HasSubstr("TORCH_MHA"),
                    HasSubstr("in_proj_weight")));
}

}  // namespace
}  // namespace attnserve
