#pragma once
// Device helpers for kiln's generated pointwise kernels (compiled by NVRTC; included by name).
// Pointwise kernels walk their elements with a grid-stride loop, so any grid size is correct and the
// launcher picks one for occupancy; 64-bit indices, since tensors pass 2^31 elements.
namespace kiln {

__device__ __forceinline__ long long global_thread_index() {
  return static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ long long global_thread_count() {
  return static_cast<long long>(gridDim.x) * blockDim.x;
}

// 128-bit loads and stores (ld.global.v4) need 16-byte aligned addresses: torch's allocations are, views
// with an offset may not be, so kernels test at run time and fall back to scalar access.
__device__ __forceinline__ bool aligned16(const void* pointer) {
  return (reinterpret_cast<unsigned long long>(pointer) & 15ull) == 0;
}

__device__ __forceinline__ float4 load_float4(const float* __restrict__ base, long long vector_index) {
  return reinterpret_cast<const float4*>(base)[vector_index];
}

__device__ __forceinline__ void store_float4(float* __restrict__ base, long long vector_index, float4 value) {
  reinterpret_cast<float4*>(base)[vector_index] = value;
}

}  // namespace kiln
