#pragma once
// Device helpers for kiln's generated reduction kernels: warp reductions with register shuffles, and a
// block reduction built from them through one word of shared memory per warp.
namespace kiln {

constexpr unsigned kFullWarpMask = 0xffffffffu;
constexpr int kWarpSize = 32;

// Every lane ends with the sum of all 32 lanes' values (butterfly exchange: log2(32) shuffles).
template <typename T>
__device__ __forceinline__ T warp_sum(T value) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) value += __shfl_xor_sync(kFullWarpMask, value, offset);
  return value;
}

// Maximum with NaN propagation, like torch.max: a NaN in any lane wins.
template <typename T>
__device__ __forceinline__ T warp_max(T value) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    T other = __shfl_xor_sync(kFullWarpMask, value, offset);
    value = (other != other || other > value) ? other : value;
  }
  return value;
}

// The sum over the whole block, returned to every thread. Needs blockDim.x a multiple of 32 (at most
// 1024) and every thread of the block to call it; a kernel calling it twice needs __syncthreads() between.
template <typename T>
__device__ T block_sum(T value) {
  __shared__ T warp_totals[kWarpSize];
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  value = warp_sum(value);
  if (lane == 0) warp_totals[warp] = value;
  __syncthreads();
  const int warps = blockDim.x / kWarpSize;
  value = lane < warps ? warp_totals[lane] : T(0);
  return warp_sum(value);
}

}  // namespace kiln
