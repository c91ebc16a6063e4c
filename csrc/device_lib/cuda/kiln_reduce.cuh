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

// Combiners for the generated reductions; max and min propagate NaN like torch.amax/amin.
namespace kiln {

struct SumCombine {
  template <typename T>
  __device__ __forceinline__ static T combine(T a, T b) { return a + b; }
};
struct MaxCombine {
  template <typename T>
  __device__ __forceinline__ static T combine(T a, T b) { return (a != a || a > b) ? a : b; }
};
struct MinCombine {
  template <typename T>
  __device__ __forceinline__ static T combine(T a, T b) { return (a != a || a < b) ? a : b; }
};

// Every lane ends with the combination of all 32 lanes' values. All 32 lanes must call it.
template <typename Combine, typename T>
__device__ __forceinline__ T warp_reduce(T value) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2)
    value = Combine::combine(value, __shfl_xor_sync(kFullWarpMask, value, offset));
  return value;
}

// The combination over the whole block (blockDim.y == 1, blockDim.x a multiple of 32), returned to every
// thread. Unlike block_sum it ends with a barrier, so a kernel may call it any number of times in a row
// (softmax: a max, then a sum) without a race on the shared totals.
template <typename Combine, typename T>
__device__ T block_reduce(T value, T identity) {
  __shared__ T warp_totals[kWarpSize];
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  value = warp_reduce<Combine>(value);
  if (lane == 0) warp_totals[warp] = value;
  __syncthreads();
  const int warps = blockDim.x / kWarpSize;
  value = lane < warps ? warp_totals[lane] : identity;
  value = warp_reduce<Combine>(value);
  __syncthreads();
  return value;
}

// Column reductions (blockDim.x == Columns outputs side by side, 8, 16 or 32; blockDim.y a power of two, at most
// 1024 / Columns, threads splitting each one's reduced range): the combination over threadIdx.y for each
// threadIdx.x, returned to every thread of that column. A tree over a shared tile, halving the rows in use per
// step. Every thread of the block must call it; it ends with a barrier, so a kernel may call it any number of
// times in a row.
template <typename Combine, int Columns, typename T>
__device__ T column_reduce(T value) {
  __shared__ T partial[1024];
  const unsigned x = threadIdx.x, y = threadIdx.y;
  partial[y * Columns + x] = value;
  __syncthreads();
  for (unsigned half = blockDim.y / 2; half > 0; half /= 2) {
    if (y < half) partial[y * Columns + x] = Combine::combine(partial[y * Columns + x], partial[(y + half) * Columns + x]);
    __syncthreads();
  }
  value = partial[x];
  __syncthreads();
  return value;
}

}  // namespace kiln
