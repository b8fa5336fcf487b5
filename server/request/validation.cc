// The rules of an AttendRequest, in the order a client would fix them:
// presence, dtypes, shapes, cross-tensor dims, mask, key_lengths, options,
// the server's size and work limits, then the values (the only rules that
// read the data).
#include "server/request/validation.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "engine/mask_broadcast.h"
#include "engine/rope.h"
#include "engine/temperature.h"
#include "server/request/value_scan.h"

namespace attnserve {
namespace {


// DTypeName as an absl::string_view (what absl::StrCat takes).
absl::string_view DTypeLabel(DType dtype) {
  const std::string_view name = DTypeName(dtype);
  return absl::string_view(name.data(), name.size());
}

}  // namespace

absl::StatusOr<TensorView> ViewInput(const InputTensor& tensor, absl::string_view field,
                                     int64_t max_elements) {
  if (!tensor.decode_error.ok()) return tensor.decode_error;
  const Shape& shape = tensor.shape;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".shape: every dim must be >= 1, got ", shape[i], " at dim ", i,
                       " (shape ", ShapeString(shape), ")"));
    }
  }
  // NumElements reports overflow; the limit is checked here so that the
  // message can say which of the two happened.
  absl::StatusOr<int64_t> elements = NumElements(shape);
  if (!elements.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".shape: element count of ",
                                                   ShapeString(shape), " overflows int64"));
  }
  if (*elements > max_elements) {
    return absl::ResourceExhaustedError(
        absl::StrCat(field, ".shape: ", ShapeString(shape), " has ", *elements,
                     " elements, more than the server's limit of ", max_elements,
                     " (--max-tensor-elements)"));
  }
  const size_t element_size = DTypeSize(tensor.dtype);
  // elements <= INT64_MAX and element_size <= 4: compare in 128 bits to stay
  // exact whatever the limit.
  const unsigned __int128 expected =
      static_cast<unsigned __int128>(*elements) * static_cast<unsigned __int128>(element_size);
  if (expected != tensor.data.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".data: expected ", static_cast<uint64_t>(expected), " bytes (shape ",
        ShapeString(shape), " x ", DTypeLabel(tensor.dtype), " ", element_size, " bytes), got ",
        tensor.data.size()));
  }
  // Front ends hand over heap buffers (a protobuf string: operator new, or
  // its 8-byte aligned in-object buffer), so element reads are aligned.
  return TensorView{tensor.dtype, shape, tensor.data.data()};
}

namespace {

absl::Status RankError(absl::string_view field, int64_t rank, absl::string_view layout,
                       const LayerConfig& layer, const TensorView& view) {
  return absl::InvalidArgumentError(absl::StrCat(
      field, ".shape: expected rank ", rank, " ", layout, " for model '", layer.name,
      "', got rank ", view.rank(), " ", ShapeString(view.shape)));
}

// "key.shape: dim 0 (batch) must equal query's 2, got 3 (key shape [3, 4, 8, 8])".
absl::Status DimMismatch(absl::string_view field, int dim, absl::string_view what,
                         absl::string_view other, int64_t expected, const TensorView& view) {
  return absl::InvalidArgumentError(absl::StrCat(
      field, ".shape: dim ", dim, " (", what, ") must equal ", other, " ", expected, ", got ",
      view.dim(dim), " (", field, " shape ", ShapeString(view.shape), ")"));
}

absl::StatusOr<TensorView> ViewFloatInput(const InputTensor& tensor, absl::string_view field,
                                          const ValidationOptions& options) {
  absl::StatusOr<TensorView> view = ViewInput(tensor, field, options.max_input_elements);
  if (!view.ok()) return view.status();
  if (!IsFloat(view->dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".dtype: must be FLOAT32, FLOAT16 or BFLOAT16, got ", DTypeLabel(view->dtype)));
  }
  return view;
}

absl::Status CheckSameDType(absl::string_view field, const TensorView& view,
                            const TensorView& query) {
  if (view.dtype == query.dtype) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, ".dtype: must match query.dtype (", DTypeLabel(query.dtype),
                   "): mixed input dtypes are not supported, got ", DTypeLabel(view.dtype)));
}

// Head layout (no projections): query [B, Hq, Lq, Dk], key [B, Hkv, Lk, Dk],
// value [B, Hkv, Lk, Dv].
absl::Status CheckHeadLayout(const LayerConfig& layer, const TensorView& q, const TensorView& k,
                             const TensorView& v, TaskDims* dims) {
  if (q.rank() != 4) return RankError("query", 4, "[B, Hq, Lq, Dk]", layer, q);
  if (k.rank() != 4) return RankError("key", 4, "[B, Hkv, Lk, Dk]", layer, k);
  if (v.rank() != 4) return RankError("value", 4, "[B, Hkv, Lk, Dv]", layer, v);
  if (k.dim(0) != q.dim(0)) return DimMismatch("key", 0, "batch", "query's", q.dim(0), k);
  if (v.dim(0) != q.dim(0)) return DimMismatch("value", 0, "batch", "query's", q.dim(0), v);
  if (v.dim(1) != k.dim(1)) return DimMismatch("value", 1, "kv heads", "key's", k.dim(1), v);
  if (v.dim(2) != k.dim(2)) return DimMismatch("value", 2, "key length", "key's", k.dim(2), v);
  if (k.dim(3) != q.dim(3)) return DimMismatch("key", 3, "head_dim", "query's", q.dim(3), k);
  if (q.dim(1) % k.dim(1) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "query.shape: query heads Hq (dim 1) must be a multiple of key/value heads Hkv, got Hq=",
        q.dim(1), " and Hkv=", k.dim(1), " (query ", ShapeString(q.shape), ", key ",
        ShapeString(k.shape), ")"));
  }
  // A head-layout model may pin its dims (0 = any).
  if (layer.num_heads > 0 && q.dim(1) != layer.num_heads) {
    return DimMismatch("query", 1, "heads", absl::StrCat("model '", layer.name, "' num_heads"),
                       layer.num_heads, q);
  }
  if (layer.num_kv_heads > 0 && k.dim(1) != layer.num_kv_heads) {
    return DimMismatch("key", 1, "kv heads",
                       absl::StrCat("model '", layer.name, "' num_kv_heads"), layer.num_kv_heads,
                       k);
  }
  if (layer.head_dim > 0 && q.dim(3) != layer.head_dim) {
    return DimMismatch("query", 3, "head_dim", absl::StrCat("model '", layer.name, "' head_dim"),
                       layer.head_dim, q);
  }
  dims->batch = q.dim(0);
  dims->num_heads = q.dim(1);
  dims->num_kv_heads = k.dim(1);
  dims->q_len = q.dim(2);
  dims->kv_len = k.dim(2);
  dims->head_dim = q.dim(3);
  dims->head_dim_v = v.dim(3);
  return absl::OkStatus();
}

// Projection layout: query [B, Lq, query_dim], key [B, Lk, key_dim], value
// [B, Lk, value_dim]; key and value may both be absent (self-attention).
absl::Status CheckTokenLayout(const LayerConfig& layer, const TensorView& q,
                              const TensorView* k, const TensorView* v, TaskDims* dims) {
  if (q.rank() != 3) return RankError("query", 3, "[B, Lq, query_dim]", layer, q);
  const std::string model = absl::StrCat("model '", layer.name, "'");
  if (q.dim(2) != layer.query_dim) {
    return DimMismatch("query", 2, "query_dim", absl::StrCat(model, " query_dim"),
                       layer.query_dim, q);
  }
  int64_t kv_len = q.dim(1);
  if (k != nullptr) {
    if (k->rank() != 3) return RankError("key", 3, "[B, Lk, key_dim]", layer, *k);
    if (v->rank() != 3) return RankError("value", 3, "[B, Lk, value_dim]", layer, *v);
    if (k->dim(0) != q.dim(0)) return DimMismatch("key", 0, "batch", "query's", q.dim(0), *k);
    if (v->dim(0) != q.dim(0)) return DimMismatch("value", 0, "batch", "query's", q.dim(0), *v);
    if (v->dim(1) != k->dim(1)) {
      return DimMismatch("value", 1, "key length", "key's", k->dim(1), *v);
    }
    if (k->dim(2) != layer.key_dim) {
      return DimMismatch("key", 2, "key_dim", absl::StrCat(model, " key_dim"), layer.key_dim,
                         *k);
    }
    if (v->dim(2) != layer.value_dim) {
      return DimMismatch("value", 2, "value_dim", absl::StrCat(model, " value_dim"),
                         layer.value_dim, *v);
    }
    kv_len = k->dim(1);
  }
  dims->batch = q.dim(0);
  dims->q_len = q.dim(1);
  dims->kv_len = kv_len;
  dims->num_heads = layer.num_heads;
  dims->num_kv_heads = layer.num_kv_heads;  // >= 1: ValidateLayer checked it
  dims->head_dim = layer.head_dim;
  dims->head_dim_v = ValueHeadDim(layer);
  return absl::OkStatus();
}

absl::Status CheckMask(const InputTensor& input, const TaskDims& d,
                       const ValidationOptions& options, TensorView* mask) {
  absl::StatusOr<TensorView> view = ViewInput(input, "attn_mask", options.max_input_elements);
  if (!view.ok()) return view.status();
  const Shape scores = {d.batch, d.num_heads, d.q_len, d.kv_len};
  const std::string target = absl::StrCat("[B, Hq, Lq, Lk] = ", ShapeString(scores));
  if (view->rank() < 2 || view->rank() > 4) {
    return absl::InvalidArgumentError(absl::StrCat(
        "attn_mask.shape: expected rank 2 to 4 broadcastable to ", target, ", got rank ",
        view->rank(), " ", ShapeString(view->shape)));
  }
  // NumPy broadcasting, right-aligned: each mask dim is 1 or the score dim.
  static constexpr const char* kDimNames[] = {"B", "Hq", "Lq", "Lk"};
  const int64_t offset = 4 - view->rank();
  for (int64_t i = 0; i < view->rank(); ++i) {
    const int64_t want = scores[static_cast<size_t>(offset + i)];
    const int64_t got = view->dim(static_cast<int>(i));
    if (got != 1 && got != want) {
      return absl::InvalidArgumentError(absl::StrCat(
          "attn_mask.shape: ", ShapeString(view->shape), " does not broadcast to ", target,
          ": dim ", i, " is ", got, ", must be 1 or ", kDimNames[offset + i], "=", want,
          " (accepted e.g. [Lq, Lk], [B, 1, Lq, Lk], [1, Hq, Lq, Lk], [B, Hq, Lq, Lk])"));
    }
  }
  // The engine reads the mask through MakeMaskParams; make sure it agrees,
  // so that nothing the engine would reject gets past validation.
  absl::StatusOr<MaskParams> params =
      MakeMaskParams(*view, d.batch, d.num_heads, d.q_len, d.kv_len);
  if (!params.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("attn_mask.shape: ", ShapeString(view->shape), " rejected against ", target,
                     ": ", params.status().message()));
  }
  *mask = *std::move(view);
  return absl::OkStatus();
}

absl::Status CheckKeyLengths(absl::Span<const int64_t> lengths, const TaskDims& d) {
  if (lengths.empty()) return absl::OkStatus();
  if (static_cast<int64_t>(lengths.size()) != d.batch) {
    return absl::InvalidArgumentError(absl::StrCat(
        "key_lengths: expected one value per batch element (B=", d.batch, ") or none, got ",
        lengths.size(), " values"));
  }
  for (size_t i = 0; i < lengths.size(); ++i) {
    if (lengths[i] < 0 || lengths[i] > d.kv_len) {
      return absl::InvalidArgumentError(absl::StrCat("key_lengths[", i, "]: must be in [0, Lk=",
                                                     d.kv_len, "], got ", lengths[i]));
    }
  }
  return absl::OkStatus();
}

// Elements of `shape` as bytes of `dtype`, or ResourceExhausted naming
// `field` when over `limit_bytes`.
absl::Status CheckOutputSize(absl::string_view field, const Shape& shape, DType dtype,
                             int64_t limit_bytes) {
  const int64_t element_size = static_cast<int64_t>(DTypeSize(dtype));
  absl::StatusOr<int64_t> elements = NumElements(shape, limit_bytes / element_size);
  if (elements.ok()) return absl::OkStatus();
  return absl::ResourceExhaustedError(
      absl::StrCat(field, ": shape ", ShapeString(shape), " x ", DTypeLabel(dtype),
                   " is over the server's limit of ", limit_bytes, " bytes"));
}

// The +Inf pattern of each float dtype (value_scan.h).
constexpr int32_t kFloat32Inf = 0x7f800000, kFloat16Inf = 0x7c00, kBFloat16Inf = 0x7f80;

// The scan of a float input: the one its front end made while copying the
// bytes (`known`: of these bytes, read at this dtype's width), else one pass
// now.
ValueScan Scan(const TensorView& view, const std::optional<ValueScan>& known) {
  const int width = static_cast<int>(DTypeSize(view.dtype));
  if (known.has_value() && known->width == width) return *known;
  return ScanValues(view.data, view.num_elements(), width);
}

int32_t InfBits(DType dtype) {
  switch (dtype) {
    case DType::kFloat16: return kFloat16Inf;
    case DType::kBFloat16: return kBFloat16Inf;
    default: return kFloat32Inf;
  }
}

// The value of a magnitude bit pattern of `dtype`, widened to double.
double BitsValue(DType dtype, int32_t bits) {
  switch (dtype) {
    case DType::kFloat16: return HalfToFloat(static_cast<uint16_t>(bits));
    case DType::kBFloat16: return BFloat16ToFloat(static_cast<uint16_t>(bits));
    default: {
      float f;
      std::memcpy(&f, &bits, sizeof f);
      return f;
    }
  }
}

// "[0, 1, 3, 7]": the row-major index of element `i` of `shape`.
std::string ElementIndex(const Shape& shape, int64_t i) {
  Shape index(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    index[d] = i % shape[d];
    i /= shape[d];
  }
  return ShapeString(index);
}

// InvalidArgument naming the first element that is NaN or +Inf (or -Inf
// when `refuse_negative_inf`); runs only once a scan has found one, so it
// need not be fast.
absl::Status NonfiniteError(absl::string_view field, const TensorView& view,
                            absl::string_view rule, bool refuse_negative_inf) {
  for (int64_t i = 0, n = view.num_elements(); i < n; ++i) {
    const float x = LoadAsFloat(view.dtype, view.data, i);
    if (std::isfinite(x) || (!refuse_negative_inf && x == -INFINITY)) continue;
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".data: element ", ElementIndex(view.shape, i), " is ",
        std::isnan(x) ? "NaN" : (x > 0 ? "+inf" : "-inf"), "; ", rule));
  }
  return absl::InternalError(absl::StrCat(field, ".data: scan and search disagree"));
}

constexpr absl::string_view kRefused =
    "non-finite inputs are refused (--nonfinite-inputs=reject)";

// max|x| of a float input, or InvalidArgument at its first NaN/Inf.
absl::StatusOr<double> FiniteMaxAbs(absl::string_view field, const TensorView& view,
                                    const std::optional<ValueScan>& known) {
  const ValueScan scan = Scan(view, known);
  if (scan.max_abs_bits >= InfBits(view.dtype)) {
    return NonfiniteError(field, view, kRefused, /*refuse_negative_inf=*/true);
  }
  return BitsValue(view.dtype, scan.max_abs_bits);
}

// The largest positive value of a float mask (0 if none), or InvalidArgument
// at its first NaN or +Inf. -Inf means "masked" and is what SDPA users send.
absl::StatusOr<double> MaskMaxPositive(const TensorView& mask,
                                       const std::optional<ValueScan>& known) {
  const ValueScan scan = Scan(mask, known);
  const int32_t inf = InfBits(mask.dtype);
  if (scan.max_positive_bits >= inf || scan.max_abs_bits > inf) {
    return NonfiniteError("attn_mask", mask,
                          "a float mask may hold -inf (masked) but not NaN or +inf; "
                          "non-finite inputs are refused (--nonfinite-inputs=reject)",
                          /*refuse_negative_inf=*/false);
  }
  return BitsValue(mask.dtype, scan.max_positive_bits);
}

// The largest finite value an engine computing in `precision` may hold.
double PrecisionMax(Precision precision) {
  switch (precision) {
    case Precision::kFloat16: return 65504.0;
    case Precision::kBFloat16: return 3.3895313892515355e38;
    case Precision::kFloat32: break;
  }
  return FLT_MAX;
}

const char* PrecisionName(Precision precision) {
  switch (precision) {
    case Precision::kFloat16: return "float16";
    case Precision::kBFloat16: return "bfloat16";
    case Precision::kFloat32: break;
  }
  return "float32";
}

constexpr char kRefusedSuffix[] = "; such inputs are refused (--nonfinite-inputs=reject)";

// The scores of a QK-norm layer against its precision: the norm bounds each
// head's query and key by their 2-norms, sqrt(features) * max|w| (1 + max|w|
// with weight_offset; the features of one head, or of the whole projection),
// whatever the projections; RoPE before the norm scales them by its
// attention factor (YaRN's, LongRoPE's), the temperature by its largest
// factor at any position.
absl::Status CheckNormedScores(const TaskDims& dims, const LayerConfig& layer,
                               const LayerWeightBounds& bounds, double scale, double mask_max) {
  const QkNormConfig& norm = layer.qk_norm;
  auto head_norm = [&](double max_w, int64_t heads) {
    const double features =
        static_cast<double>(norm.whole_projection ? heads * dims.head_dim : dims.head_dim);
    return std::sqrt(features) * (norm.weight_offset ? 1.0 + max_w : max_w);
  };
  const double rope = norm.after_rope ? 1.0 : std::fabs(RopeAttentionFactor(layer.rope));
  double temperature = 1.0;
  if (layer.temperature_tuning.enabled) {  // monotonic in the position
    temperature = std::max(std::fabs(QueryTemperature(layer.temperature_tuning, 0)),
                           std::fabs(QueryTemperature(layer.temperature_tuning,
                                                      kMaxRotaryPosition)));
  }
  const double q = head_norm(bounds.q_norm, dims.num_heads) * rope * temperature;
  const double k = head_norm(bounds.k_norm, dims.num_kv_heads) * rope;
  // Relative position embeddings: each head's query and key against a
  // table vector of head_dim values of at most their largest.
  const double dim = std::sqrt(static_cast<double>(dims.head_dim));
  const double score_bound =
      (q * k + (q * bounds.relative_key + k * bounds.relative_query) * dim) * scale + mask_max;
  const double limit = PrecisionMax(layer.precision);
  if (!(score_bound <= limit)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "query/key/scale: scores may overflow %s: the QK-norm bounds each head's query by %g "
        "and key by %g (sqrt(features) * the largest norm weight%s), * max(1, scale %g)%s = "
        "%g exceeds %g%s",
        PrecisionName(layer.precision), q, k,
        rope != 1.0 || temperature != 1.0 ? ", * RoPE's attention factor and the temperature"
                                          : "",
        scale, mask_max > 0 ? absl::StrFormat(" + max attn_mask %g", mask_max) : "",
        score_bound, limit, kRefusedSuffix));
  }
  return absl::OkStatus();
}

// Bounds of a projection model's intermediate values against its precision
// (validation.h): projected Q, K, V, scores, weighted sums, output.
absl::Status CheckProjectedBounds(const AttentionTask& task, const TaskDims& dims,
                                  const LayerConfig& layer, const LayerWeightBounds& bounds,
                                  double max_q, double max_k, double max_v, double mask_max) {
  const double limit = PrecisionMax(layer.precision);
  const char* precision = PrecisionName(layer.precision);
  struct Projected {
    const char* field;
    double input;
    const ProjectionBound& bound;
  };
  const Projected projected[] = {{"query", max_q, bounds.q},
                                 {"key", max_k, bounds.k},
                                 {"value", max_v, bounds.v}};
  double values[3];
  for (int i = 0; i < 3; ++i) {
    const Projected& p = projected[i];
    values[i] = p.bound.Apply(p.input);
    if (!(values[i] <= limit)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s.data: its projection may overflow %s: max|%s| %g * the weights' largest row sum "
          "%g + largest bias %g = %g exceeds %g%s",
          p.field, precision, p.field, p.input, p.bound.gain, p.bound.bias, values[i], limit,
          kRefusedSuffix));
    }
  }
  if (layer.latent.enabled) {
    const double latent = bounds.latent.Apply(max_q);
    if (!(latent <= limit)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "query.data: its latent projections may overflow %s: max|query| %g * the latent "
          "weights' largest row sum %g + largest bias %g = %g exceeds %g%s",
          precision, max_q, bounds.latent.gain, bounds.latent.bias, latent, limit,
          kRefusedSuffix));
    }
  }
  if (layer.output_gate) {
    const double gate = bounds.g.Apply(max_q);
    if (!(gate <= limit)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "query.data: its output gate projection may overflow %s: max|query| %g * the gate "
          "weights' largest row sum %g + largest bias %g = %g exceeds %g%s",
          precision, max_q, bounds.g.gain, bounds.g.bias, gate, limit, kRefusedSuffix));
    }
  }
  const double scale = std::max(1.0, static_cast<double>(task.scale));
  // Relative position embeddings add Q . (a table vector) and K . (another).
  const double score_bound = (values[0] * values[1] + values[0] * bounds.relative_key +
                              values[1] * bounds.relative_query) *
                                 static_cast<double>(dims.head_dim) * scale +
                             mask_max;
  if (layer.qk_norm.enabled) {
    if (absl::Status s = CheckNormedScores(dims, layer, bounds, scale, mask_max); !s.ok()) {
      return s;
    }
  } else if (!(score_bound <= limit)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "query/key/scale: scores may overflow %s: max|projected query| %g * max|projected key| "
        "%g%s * head_dim %d * max(1, scale %g)%s = %g exceeds %g%s",
        precision, values[0], values[1],
        bounds.relative_key > 0 || bounds.relative_query > 0
            ? absl::StrFormat(" (+ the relative position embeddings' %g and %g against them)",
                              bounds.relative_key, bounds.relative_query)
            : "",
        dims.head_dim, static_cast<double>(task.scale),
        mask_max > 0 ? absl::StrFormat(" + max attn_mask %g", mask_max) : "", score_bound, limit,
        kRefusedSuffix));
  }
  // The value norm (Gemma 3n, Gemma 4) bounds each normalised feature by
  // sqrt(head_dim_v), however small or large the projection.
  const double max_value =
      layer.v_norm_eps > 0 ? std::sqrt(static_cast<double>(dims.head_dim_v)) : values[2];
  const double sum_bound = max_value * static_cast<double>(dims.kv_len);
  if (!(sum_bound <= limit)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "value.data: weighted sums may overflow %s: max|projected value| %g * Lk %d = %g "
        "exceeds %g%s",
        precision, max_value, dims.kv_len, sum_bound, limit, kRefusedSuffix));
  }
  // Each head's output is a convex combination of projected values.
  const double out_bound = bounds.o.Apply(max_value);
  if (!(out_bound <= limit)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "value.data: the output projection may overflow %s: max|projected value| %g * the "
        "output weights' largest row sum %g + largest bias %g = %g exceeds %g%s",
        precision, max_value, bounds.o.gain, bounds.o.bias, out_bound, limit, kRefusedSuffix));
  }
  return absl::OkStatus();
}

// The scan `input`'s front end made of the bytes `view` holds, if any.
std::optional<ValueScan> KnownScan(const InputTensor& input, const TensorView& view) {
  if (input.data.data() != view.data || input.data.size() != view.byte_size()) {
    return std::nullopt;
  }
  return input.scan;
}

// The values rules of ValidateAttendInputs (see validation.h).
absl::Status CheckValues(const AttendInputs& request, const AttentionTask& task,
                         const TaskDims& dims, const LayerConfig& layer,
                         const LayerWeightBounds* weight_bounds) {
  absl::StatusOr<double> max_q =
      FiniteMaxAbs("query", task.query, KnownScan(request.query, task.query));
  if (!max_q.ok()) return max_q.status();
  // Self-attention (projection models, no key/value sent): key = value = query.
  double max_k = *max_q, max_v = *max_q;
  if (!task.key.empty()) {
    absl::StatusOr<double> k = FiniteMaxAbs("key", task.key, KnownScan(request.key, task.key));
    if (!k.ok()) return k.status();
    absl::StatusOr<double> v =
        FiniteMaxAbs("value", task.value, KnownScan(request.value, task.value));
    if (!v.ok()) return v.status();
    max_k = *k;
    max_v = *v;
  }
  double mask_max = 0;
  if (!task.attn_mask.empty() && IsFloat(task.attn_mask.dtype)) {
    absl::StatusOr<double> m =
        MaskMaxPositive(task.attn_mask, KnownScan(request.attn_mask, task.attn_mask));
    if (!m.ok()) return m.status();
    mask_max = *m;
  }
  if (layer.has_projections) {
    if (weight_bounds == nullptr) return absl::OkStatus();
    return CheckProjectedBounds(task, dims, layer, *weight_bounds, *max_q, max_k, max_v,
                                mask_max);
  }
  const double scale = std::max(1.0, static_cast<double>(task.scale));
  const double score_bound =
      *max_q * max_k * static_cast<double>(dims.head_dim) * scale + mask_max;
  if (score_bound > FLT_MAX) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "query/key/scale: scores may overflow float32: max|query| %g * max|key| %g * "
        "head_dim %d * max(1, scale %g)%s = %g exceeds FLT_MAX %g; such inputs are refused "
        "(--nonfinite-inputs=reject)",
        *max_q, max_k, dims.head_dim, static_cast<double>(task.scale),
        mask_max > 0 ? absl::StrFormat(" + max attn_mask %g", mask_max) : "", score_bound,
        static_cast<double>(FLT_MAX)));
  }
  const double sum_bound = max_v * static_cast<double>(dims.kv_len);
  if (sum_bound > FLT_MAX) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "value.data: weighted sums may overflow float32: max|value| %g * Lk %d = %g exceeds "
        "FLT_MAX %g; such inputs are refused (--nonfinite-inputs=reject)",
        max_v, dims.kv_len, sum_bound, static_cast<double>(FLT_MAX)));
  }
  return absl::OkStatus();
}

// The request's matrix-product multiply-adds (see
// ValidationOptions::max_multiply_adds), in double: exact enough for a limit
// and never overflows.
struct Work {
  double attention = 0;
  double projections = 0;
};

Work RequestWork(const LayerConfig& layer, const TaskDims& d) {
  Work w;
  const double b = static_cast<double>(d.batch), lq = static_cast<double>(d.q_len),
               lk = static_cast<double>(d.kv_len), hq = static_cast<double>(d.num_heads),
               hkv = static_cast<double>(d.num_kv_heads), dk = static_cast<double>(d.head_dim),
               dv = static_cast<double>(d.head_dim_v);
  w.attention = b * hq * lq * lk * (dk + dv);
  if (layer.latent.enabled) {
    // The latents, then the query, keys' nope part and values from them.
    const LatentAttention& m = layer.latent;
    const double in = static_cast<double>(layer.query_dim);
    const double q_rank = static_cast<double>(m.q_lora_rank);
    const double kv_rank = static_cast<double>(m.kv_lora_rank);
    const double nope = dk - static_cast<double>(m.rope_dim);
    const double q_in = m.q_lora_rank > 0 ? q_rank : in;
    w.projections = b * lq * (in * (q_rank + kv_rank + static_cast<double>(m.rope_dim)) +
                              q_in * hq * dk + kv_rank * hq * (nope + dv) +
                              hq * dv * static_cast<double>(layer.out_dim));
  } else if (layer.has_projections) {
    w.projections = b * (lq * static_cast<double>(layer.query_dim) * hq * dk +
                         lk * static_cast<double>(layer.key_dim) * hkv * dk +
                         lk * static_cast<double>(layer.value_dim) * hkv * dv +
                         lq * hq * dv * static_cast<double>(layer.out_dim));
  }
  return w;
}

}  // namespace

namespace {

// What a session request may not carry: the cache holds one sequence, and
// masks, lengths and weights would span tokens the client no longer sends.
absl::Status CheckSessionRules(const AttendInputs& request, const TaskDims& dims) {
  if (dims.batch != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "query.shape: dim 0 (batch) must be 1 with session_id (a session holds one sequence; "
        "batch sessions by sending concurrent requests), got ", dims.batch));
  }
  if (request.attn_mask.present) {
    return absl::InvalidArgumentError(
        "attn_mask: not supported with session_id (the query attends causally over every "
        "cached token)");
  }
  if (!request.key_lengths.empty()) {
    return absl::InvalidArgumentError(
        "key_lengths: not supported with session_id (every appended row is a token)");
  }
  if (request.need_weights) {
    return absl::InvalidArgumentError(
        "need_weights: not supported with session_id (the weights would span the whole cache; "
        "send the sequence statelessly to get them)");
  }
  return absl::OkStatus();
}

// positions, window, softcap and sinks (attend_inputs.h), into the task.
absl::Status CheckLayerOptions(const AttendInputs& request, const LayerConfig& layer,
                               const TaskDims& dims, const ValidationOptions& options,
                               AttentionTask* task) {
  const std::string model = absl::StrCat("model '", layer.name, "'");
  const int64_t alibi_heads = static_cast<int64_t>(layer.alibi_slopes.size());
  if (alibi_heads > 0 && dims.num_heads != alibi_heads) {  // an sdpa model's (mha: its own)
    return absl::InvalidArgumentError(absl::StrCat(
        "query.shape: ", model, " has ALiBi slopes for ", alibi_heads,
        " query heads (alibi_slopes), so Hq must be ", alibi_heads, ", got ", dims.num_heads));
  }
  if (!request.positions.empty()) {
    if (layer.rope.type == RopeConfig::Type::kNone) {
      return absl::InvalidArgumentError(absl::StrCat(
          "positions: ", model, " has no rotary embedding, so positions would change nothing; "
          "leave them out"));
    }
    if (layer.attention_chunk > 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "positions: not supported by ", model, ", whose chunked attention (attention_chunk ",
          layer.attention_chunk, ") follows the token index: send each sequence unpadded, or "
          "right-padded with key_lengths"));
    }
    if (!request.session_id.empty()) {
      return absl::InvalidArgumentError(
          "positions: not supported with session_id (a session numbers its tokens itself: "
          "prefill at 0..L-1, then each appended token at the next position)");
    }
    if (dims.q_len > dims.kv_len) {
      return absl::InvalidArgumentError(absl::StrCat(
          "positions: need Lq <= Lk: the queries are the last Lq of the Lk key tokens, got Lq ",
          dims.q_len, " and Lk ", dims.kv_len));
    }
    const int64_t expected = dims.batch * dims.kv_len;
    if (static_cast<int64_t>(request.positions.size()) != expected) {
      return absl::InvalidArgumentError(absl::StrCat(
          "positions: must hold one position per key token, [B, Lk] = [", dims.batch, ", ",
          dims.kv_len, "] = ", expected, " values (the queries are the last Lq of them), got ",
          request.positions.size()));
    }
    const size_t lk = static_cast<size_t>(dims.kv_len);
    for (size_t i = 0; i < request.positions.size(); ++i) {
      const int64_t pos = request.positions[i];
      if (pos < 0 || pos > kMaxRotaryPosition) {
        return absl::InvalidArgumentError(absl::StrCat("positions[", i / lk, ", ", i % lk,
                                                       "]: must be in [0, ", kMaxRotaryPosition,
                                                       "], got ", pos));
      }
      if (i % lk != 0 && pos < request.positions[i - 1]) {
        return absl::InvalidArgumentError(absl::StrCat(
            "positions[", i / lk, ", ", i % lk, "]: ", pos, " after ", request.positions[i - 1],
            ": positions must not decrease along a sequence (the pads of a left-padded sequence "
            "may all be 0)"));
      }
    }
    task->positions = request.positions;
  }
  const bool per_request = request.window != 0 || request.softcap != 0.0f ||
                           request.sinks.present;
  if (per_request && layer.has_projections) {
    const char* field = request.window != 0 ? "window" : request.softcap != 0.0f ? "softcap"
                                                                                 : "sinks";
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": per request only for models without projections; ", model,
        " has projections, and its config fixes sliding_window, softcap and sinks"));
  }
  if (request.window < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "window: must be >= 0 (0 = the model's, ", layer.sliding_window, "), got ",
        request.window));
  }
  if (request.window != 0 && !request.session_id.empty() && layer.sliding_window > 0 &&
      request.window != layer.sliding_window) {
    return absl::InvalidArgumentError(absl::StrCat(
        "window: ", model, " has sliding_window ", layer.sliding_window,
        ", and its sessions release the keys outside it; a session request may not ask for ",
        request.window));
  }
  task->window = request.window;
  if (!std::isfinite(request.softcap) || request.softcap < 0.0f) {
    return absl::InvalidArgumentError(absl::StrCat(
        "softcap: must be finite and >= 0 (0 = the model's), got ", request.softcap));
  }
  task->softcap = request.softcap;
  if (request.sinks.present) {
    absl::StatusOr<TensorView> sinks =
        ViewInput(request.sinks, "sinks", options.max_input_elements);
    if (!sinks.ok()) return sinks.status();
    if (sinks->dtype != DType::kFloat32) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sinks.dtype: must be FLOAT32 (one logit per query head), got ",
          DTypeLabel(sinks->dtype)));
    }
    if (sinks->shape != Shape{dims.num_heads}) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sinks.shape: must be [Hq] = [", dims.num_heads, "], got ", ShapeString(sinks->shape)));
    }
    const float* values = static_cast<const float*>(sinks->data);
    for (int64_t h = 0; h < dims.num_heads; ++h) {
      if (!std::isfinite(values[h])) {
        return absl::InvalidArgumentError(absl::StrCat(
            "sinks.data: must be finite, got ", values[h], " at head ", h,
            "; non-finite inputs are refused (--nonfinite-inputs=reject)"));
      }
    }
    task->sinks = absl::MakeConstSpan(values, static_cast<size_t>(dims.num_heads));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ValidatedRequest> ValidateAttendInputs(const AttendInputs& request,
                                                      const LayerConfig& layer,
                                                      const ValidationOptions& options,
                                                      const LayerWeightBounds* weight_bounds) {
  if (!request.decode_error.ok()) return request.decode_error;
  // Presence.
  if (!request.query.present) {
    return absl::InvalidArgumentError(absl::StrCat(
        "query: required (model '", layer.name, "' takes ",
        layer.has_projections ? "[B, Lq, query_dim]" : "[B, Hq, Lq, Dk]", ")"));
  }
  const bool has_key = request.key.present;
  const bool has_value = request.value.present;
  if (has_key != has_value) {
    return absl::InvalidArgumentError(absl::StrCat(
        has_key ? "value" : "key", ": required because ", has_key ? "key" : "value",
        " is given (key and value are given together, or both omitted for self-attention)"));
  }
  if (has_key && layer.latent.enabled) {
    return absl::InvalidArgumentError(absl::StrCat(
        "key: not accepted by model '", layer.name,
        "' (latent attention: its keys and values come from the query's own tokens; omit key "
        "and value)"));
  }
  if (!has_key && !layer.kv_source.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "key: required by model '", layer.name, "': its keys and values are those of ",
        layer.kv_source, " (KV sharing), so key and value must carry that layer's input hidden "
        "states [B, Lk, ", layer.key_dim, "]"));
  }
  if (!has_key && !layer.has_projections) {
    return absl::InvalidArgumentError(absl::StrCat(
        "key: required by model '", layer.name,
        "' (no projections: key [B, Hkv, Lk, Dk] and value [B, Hkv, Lk, Dv] must be given)"));
  }
  if (!has_key && (layer.key_dim != layer.query_dim || layer.value_dim != layer.query_dim)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "key: required by model '", layer.name,
        "': self-attention (key and value omitted) needs query_dim == key_dim == value_dim, "
        "got query_dim=",
        layer.query_dim, " key_dim=", layer.key_dim, " value_dim=", layer.value_dim));
  }

  // Each tensor on its own: dtype, dims, bytes.
  ValidatedRequest out;
  AttentionTask& task = out.task;
  absl::StatusOr<TensorView> query = ViewFloatInput(request.query, "query", options);
  if (!query.ok()) return query.status();
  task.query = *std::move(query);
  if (has_key) {
    absl::StatusOr<TensorView> key = ViewFloatInput(request.key, "key", options);
    if (!key.ok()) return key.status();
    absl::StatusOr<TensorView> value = ViewFloatInput(request.value, "value", options);
    if (!value.ok()) return value.status();
    if (absl::Status s = CheckSameDType("key", *key, task.query); !s.ok()) return s;
    if (absl::Status s = CheckSameDType("value", *value, task.query); !s.ok()) return s;
    task.key = *std::move(key);
    task.value = *std::move(value);
  }

  // Ranks and dims across tensors and against the layer.
  TaskDims& dims = out.dims;
  absl::Status layout =
      layer.has_projections
          ? CheckTokenLayout(layer, task.query, has_key ? &task.key : nullptr,
                             has_key ? &task.value : nullptr, &dims)
          : CheckHeadLayout(layer, task.query, task.key, task.value, &dims);
  if (!layout.ok()) return layout;
  if (!request.session_id.empty()) {
    if (absl::Status s = CheckSessionRules(request, dims); !s.ok()) return s;
  } else if (layer.sparse_index_topk > 0 && dims.kv_len > layer.sparse_index_topk) {
    // A session's whole length is checked where it is known (SessionManager).
    return absl::InvalidArgumentError(absl::StrCat(
        has_key ? "key" : "query", ": ", dims.kv_len, " keys; model '", layer.name,
        "' is served for at most sparse_index_topk = ", layer.sparse_index_topk,
        " (DeepSeek's sparse attention: past it the indexer keeps each query's top ",
        layer.sparse_index_topk, " keys, which attnserve does not compute)"));
  }

  // Masking.
  if (request.attn_mask.present) {
    if (absl::Status s = CheckMask(request.attn_mask, dims, options, &task.attn_mask); !s.ok()) {
      return s;
    }
  }
  if (absl::Status s = CheckKeyLengths(request.key_lengths, dims); !s.ok()) return s;
  task.key_lengths = request.key_lengths;
  // A session's query attends causally over everything cached.
  task.causal = request.causal || layer.causal || !request.session_id.empty();

  // Options.
  const float scale = request.scale;
  if (!std::isfinite(scale) || scale < 0.0f) {
    return absl::InvalidArgumentError(absl::StrCat(
        "scale: must be finite and >= 0 (0 = the model's default, 1/sqrt(head_dim)), got ",
        scale));
  }
  task.scale = ResolveScale(layer, scale, dims.head_dim);
  if (absl::Status s = CheckLayerOptions(request, layer, dims, options, &task); !s.ok()) return s;
  if (!request.output_dtype_error.ok()) return request.output_dtype_error;
  if (!request.output_dtype.has_value()) {
    out.output_dtype = task.query.dtype;
  } else if (!IsFloat(*request.output_dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "output_dtype: must be FLOAT32, FLOAT16, BFLOAT16 or unset (= the query's dtype), got ",
        DTypeLabel(*request.output_dtype)));
  } else {
    out.output_dtype = *request.output_dtype;
  }
  // average_weights alone is ignored, as in nn.MultiheadAttention.
  task.average_weights = request.need_weights && request.average_weights;

  // Server limits.
  out.output_shape = OutputShape(layer, dims);
  if (absl::Status s =
          CheckOutputSize("output", out.output_shape, out.output_dtype, options.max_output_bytes);
      !s.ok()) {
    return s;
  }
  if (request.need_weights) {
    out.weights_shape = WeightsShape(dims, task.average_weights);
    if (!NumElements(out.weights_shape, options.max_returned_weights).ok()) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "need_weights: weights ", ShapeString(out.weights_shape),
          " are over the server's limit of ", options.max_returned_weights,
          " returned weights per request (--max-returned-weights); ask for average_weights, "
          "fewer tokens, or no weights"));
    }
    if (absl::Status s = CheckOutputSize("weights", out.weights_shape, out.output_dtype,
                                         options.max_output_bytes);
        !s.ok()) {
      return s;
    }
  }
  // Work, before any compute: a small message can ask for seconds of it.
  const Shape scores = {dims.batch, dims.num_heads, dims.q_len, dims.kv_len};
  if (!NumElements(scores, options.max_attention_scores).ok()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "query/key: ", ShapeString(scores), " = ",
        absl::StrFormat("%.0f", static_cast<double>(dims.batch) * dims.num_heads * dims.q_len *
                                    dims.kv_len),
        " attention scores [B, Hq, Lq, Lk] are over the server's limit of ",
        options.max_attention_scores, " per request (--max-attention-scores)"));
  }
  const Work work = RequestWork(layer, dims);
  if (work.attention + work.projections > static_cast<double>(options.max_multiply_adds)) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "query/key/value: %.0f multiply-adds (attention B*Hq*Lq*Lk*(Dk+Dv) = %.0f, "
        "projections %.0f) are over the server's limit of %d per request "
        "(--max-multiply-adds)",
        work.attention + work.projections, work.attention, work.projections,
        options.max_multiply_adds));
  }

  // Values: the one pass over the data, last.
  if (options.nonfinite_inputs == NonfiniteInputs::kReject) {
    if (absl::Status s = CheckValues(request, task, dims, layer, weight_bounds); !s.ok()) return s;
  }
  return out;
}

}  // namespace attnserve
