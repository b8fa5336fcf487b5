// cuBLASLt matmul descriptors for the projections. Row-major y = x W^T is
// column-major y^T = W x^T: with W [out, in] row-major seen as a column-major
// [in, out] matrix, A = W (op T), B = x^T ([in, rows], op N), D = y^T
// ([out, rows]); the epilogue bias has one value per row of D, i.e. per
// output feature.
#include "engine/cuda/projection_gemm.h"

#include <climits>

#include "absl/strings/str_cat.h"
#include "engine/cuda/attention_kernels.h"
#include "engine/cuda/cuda_status.h"

namespace attnserve::cuda {
namespace {

constexpr size_t kWorkspaceBytes = size_t{32} << 20;  // what cuBLAS suggests for Hopper

cudaDataType_t CudaType(DType type) {
  switch (type) {
    case DType::kFloat16:
      return CUDA_R_16F;
    case DType::kBFloat16:
      return CUDA_R_16BF;
    default:
      return CUDA_R_32F;
  }
}

// Owners for the cuBLASLt descriptors of one call.
struct MatmulDesc {
  cublasLtMatmulDesc_t desc = nullptr;
  ~MatmulDesc() {
    if (desc != nullptr) cublasLtMatmulDescDestroy(desc);
  }
};
struct Layout {
  cublasLtMatrixLayout_t layout = nullptr;
  ~Layout() {
    if (layout != nullptr) cublasLtMatrixLayoutDestroy(layout);
  }
};
struct Preference {
  cublasLtMatmulPreference_t pref = nullptr;
  ~Preference() {
    if (pref != nullptr) cublasLtMatmulPreferenceDestroy(pref);
  }
};

}  // namespace

absl::StatusOr<std::unique_ptr<ProjectionGemm>> ProjectionGemm::Create(cudaStream_t stream) {
  std::unique_ptr<ProjectionGemm> gemm(new ProjectionGemm(stream));
  ATTNSERVE_CUBLAS_CALL(cublasLtCreate(&gemm->lt_));
  ATTNSERVE_CUBLAS_CALL(cublasCreate(&gemm->blas_));
  ATTNSERVE_CUBLAS_CALL(cublasSetStream(gemm->blas_, stream));
  absl::StatusOr<DeviceBuffer> workspace = DeviceBuffer::Allocate(kWorkspaceBytes);
  if (!workspace.ok()) return workspace.status();
  gemm->workspace_ = std::move(*workspace);
  ATTNSERVE_CUBLAS_CALL(
      cublasSetWorkspace(gemm->blas_, gemm->workspace_.data(), gemm->workspace_.size()));
  return gemm;
}

ProjectionGemm::~ProjectionGemm() {
  if (blas_ != nullptr) cublasDestroy(blas_);
  if (lt_ != nullptr) cublasLtDestroy(lt_);
}

absl::Status ProjectionGemm::Linear(DType type, const void* x, int64_t rows, int64_t in,
                                    const void* w, const void* bias, int64_t out, void* y) {
  if (rows <= 0 || in <= 0 || out <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CUDA backend: projection dims must be >= 1, got rows ", rows, ", in ", in, ", out ", out));
  }
  const cudaDataType_t data_type = CudaType(type);
  MatmulDesc op;
  ATTNSERVE_CUBLAS_CALL(cublasLtMatmulDescCreate(&op.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t trans_a = CUBLAS_OP_T;
  const cublasOperation_t trans_b = CUBLAS_OP_N;
  ATTNSERVE_CUBLAS_CALL(cublasLtMatmulDescSetAttribute(op.desc, CUBLASLT_MATMUL_DESC_TRANSA,
                                                       &trans_a, sizeof(trans_a)));
  ATTNSERVE_CUBLAS_CALL(cublasLtMatmulDescSetAttribute(op.desc, CUBLASLT_MATMUL_DESC_TRANSB,
                                                       &trans_b, sizeof(trans_b)));
  if (bias != nullptr) {
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    ATTNSERVE_CUBLAS_CALL(cublasLtMatmulDescSetAttribute(op.desc, CUBLASLT_MATMUL_DESC_EPILOGUE,
                                                         &epilogue, sizeof(epilogue)));
    // The bias is of the output type (the default for these types).
    ATTNSERVE_CUBLAS_CALL(cublasLtMatmulDescSetAttribute(op.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                         &bias, sizeof(bias)));
  }
  Layout a, b, d;
  ATTNSERVE_CUBLAS_CALL(cublasLtMatrixLayoutCreate(&a.layout, data_type, static_cast<uint64_t>(in),
                                                   static_cast<uint64_t>(out), in));
  ATTNSERVE_CUBLAS_CALL(cublasLtMatrixLayoutCreate(&b.layout, data_type, static_cast<uint64_t>(in),
                                                   static_cast<uint64_t>(rows), in));
  ATTNSERVE_CUBLAS_CALL(cublasLtMatrixLayoutCreate(&d.layout, data_type, static_cast<uint64_t>(out),
                                                   static_cast<uint64_t>(rows), out));

  const ShapeKey key{static_cast<int>(type), rows, in, out, bias != nullptr};
  auto it = choices_.find(key);
  if (it == choices_.end()) {
    Preference pref;
    ATTNSERVE_CUBLAS_CALL(cublasLtMatmulPreferenceCreate(&pref.pref));
    const uint64_t max_workspace = workspace_.size();
    ATTNSERVE_CUBLAS_CALL(
        cublasLtMatmulPreferenceSetAttribute(pref.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                             &max_workspace, sizeof(max_workspace)));
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
        lt_, op.desc, a.layout, b.layout, d.layout, d.layout, pref.pref, 1, &result, &found);
    Choice choice;
    // NOT_SUPPORTED (or no result) means no cuBLASLt kernel for this shape.
    if (status == CUBLAS_STATUS_SUCCESS && found > 0) {
      choice.use_lt = true;
      choice.algo = result.algo;
    } else if (status != CUBLAS_STATUS_NOT_SUPPORTED && status != CUBLAS_STATUS_SUCCESS) {
      return CublasStatus(status, "cublasLtMatmulAlgoGetHeuristic");
    }
    it = choices_.emplace(key, choice).first;
  }
  if (!it->second.use_lt) return LinearFallback(type, x, rows, in, w, bias, out, y);

  const float alpha = 1.0f;
  const float beta = 0.0f;
  ATTNSERVE_CUBLAS_CALL(cublasLtMatmul(lt_, op.desc, &alpha, w, a.layout, x, b.layout, &beta, y,
                                       d.layout, y, d.layout, &it->second.algo, workspace_.data(),
                                       workspace_.size(), stream_));
  return absl::OkStatus();
}

absl::Status ProjectionGemm::LinearFallback(DType type, const void* x, int64_t rows, int64_t in,
                                            const void* w, const void* bias, int64_t out, void* y) {
  if (rows > INT_MAX || in > INT_MAX || out > INT_MAX) {
    return absl::ResourceExhaustedError(absl::StrCat("CUDA backend: projection of ", rows, " x ",
                                                     in, " -> ", out, " is too large"));
  }
  const cudaDataType_t data_type = CudaType(type);
  const float alpha = 1.0f;
  const float beta = 0.0f;
  ATTNSERVE_CUBLAS_CALL(
      cublasGemmEx(blas_, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(out), static_cast<int>(rows),
                   static_cast<int>(in), &alpha, w, data_type, static_cast<int>(in), x, data_type,
                   static_cast<int>(in), &beta, y, data_type, static_cast<int>(out),
                   CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  if (bias != nullptr) {
    ATTNSERVE_CUDA_CALL(LaunchAddBias(y, bias, type, rows, out, stream_));
  }
  return absl::OkStatus();
}

}  // namespace attnserve::cuda
