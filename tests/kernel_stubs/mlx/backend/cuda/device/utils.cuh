// Stand-in for MLX's JIT prelude header (mlx/backend/cuda/device/utils.cuh), enough to compile the
// CUDA sources that mx.fast.cuda_kernel generates with nvcc on a machine without a GPU (CI).
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda/std/array>
#include <cuda/std/limits>
#include <cstdint>

namespace mlx::core::cu {
constexpr int MAX_NDIM = 10;
using Shape = cuda::std::array<int32_t, MAX_NDIM>;
using Strides = cuda::std::array<int64_t, MAX_NDIM>;
}  // namespace mlx::core::cu
