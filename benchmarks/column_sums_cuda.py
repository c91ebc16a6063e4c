"""Column sums (a bias or layer-norm weight gradient: x.sum(0) over a [rows, columns] float32 tensor) written
several ways as NVRTC kernels, timed against ATen's x.sum(0) and against a copy of the same bytes. The designs
differ in the columns one block covers (its threads' bytes per row), the threads per block, and whether the
rows of a column group are split between the blocks of a thread-block cluster (sm_90), combined through
distributed shared memory. Kernels of 10-20 us are timed with the launch's host latency included (CUDA events
around a launch from Python): only the larger shapes compare the designs.

    python benchmarks/column_sums_cuda.py [--shapes 6304x768,6304x3072] [--repeats 50]

Every variant is checked against torch first. Prints one line per (shape, variant): us per call and TB/s.
"""
import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)
if os.path.isfile(os.path.join(REPO_ROOT, "python", "kiln", "__init__.py")):
    sys.path.insert(0, os.path.join(REPO_ROOT, "python"))
sys.path.insert(0, HERE)
from micro_cuda import median_ms  # noqa: E402  (CUDA events around each call, after a warm-up)

KERNEL = r"""
#if @CLUSTER@
// Thread-block clusters (sm_90): this block's rank, the cluster-wide barrier, and a float read from another
// block's shared memory.
__device__ __forceinline__ unsigned cluster_rank() {
  unsigned rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  return rank;
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ float load_remote(const float* local, unsigned rank) {
  unsigned long long shared_address;
  asm volatile("cvta.to.shared.u64 %0, %1;" : "=l"(shared_address) : "l"(local));
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(static_cast<unsigned>(shared_address)), "r"(rank));
  float value;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(value) : "r"(remote) : "memory");
  return value;
}
#endif

// out[c] = sum over r of x[r, c]. Blocks of @THREADS@ threads: @W@ columns side by side, the rest of the threads
// over rows; @RANKS@ blocks (a cluster when @CLUSTER@) share each column group's rows.
extern "C" __global__ void __launch_bounds__(@THREADS@) @CLUSTER_ATTR@
column_sum(const float* __restrict__ x, float* __restrict__ out, long long n) {
  constexpr int W = @W@, NY = @THREADS@ / @W@, RANKS = @RANKS@, ROWS = @ROWS@, COLS = @COLS@;
  __shared__ float partial[@THREADS@];
  const int tx = threadIdx.x % W, ty = threadIdx.x / W;
#if @CLUSTER@
  const int rank = cluster_rank();
#else
  const int rank = blockIdx.x % RANKS;
#endif
  for (int first = (blockIdx.x / RANKS) * W; first < COLS; first += (gridDim.x / RANKS) * W) {
    const bool active = first + tx < COLS;
    const int col = active ? first + tx : COLS - 1;
    float acc = 0.0f;
#pragma unroll 8
    for (int r = ty + rank * NY; r < ROWS; r += NY * RANKS) acc += x[static_cast<long long>(r) * COLS + col];
    partial[ty * W + tx] = acc;
    __syncthreads();
    for (int half = NY / 2; half > 0; half /= 2) {
      if (ty < half) partial[ty * W + tx] += partial[(ty + half) * W + tx];
      __syncthreads();
    }
    acc = partial[tx];
#if @CLUSTER@
    cluster_sync();  // every block's partial[0:W] is final
    if (rank == 0 && ty == 0)
      for (int other = 1; other < RANKS; ++other) acc += load_remote(&partial[tx], other);
    cluster_sync();  // the other blocks keep their shared memory until rank 0 has read it
#endif
    __syncthreads();
    if (rank == 0 && ty == 0 && active) out[col] = acc;
  }
}
"""

# name: (columns per block, threads, ranks, cluster)
VARIANTS = {
    "w8_t1024 (kiln's column)": (8, 1024, 1, False),
    "w32_t1024": (32, 1024, 1, False),
    "w8_t256_cluster8": (8, 256, 8, True),
    "w32_t256_cluster8": (32, 256, 8, True),
    "w32_t1024_cluster8": (32, 1024, 8, True),
    "w32_t1024_cluster4": (32, 1024, 4, True),
    "w32_t512_cluster4": (32, 512, 4, True),
    "w64_t1024_cluster8": (64, 1024, 8, True),
}


def source(rows, cols, w, threads, ranks, cluster):
    text = KERNEL
    for key, value in (("W", w), ("THREADS", threads), ("RANKS", ranks), ("ROWS", rows), ("COLS", cols),
                       ("CLUSTER_ATTR", f"__cluster_dims__({ranks}, 1, 1)" if cluster else ""), ("CLUSTER", int(cluster))):
        text = text.replace(f"@{key}@", str(value))
    return text


def median_us(fn, repeats):
    return median_ms(fn, repeats) * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="6304x768,6304x3072,6304x2304,4096x512,25216x768")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    from kiln import _C
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  arch {_C.cuda.target_arch()}")
    for shape in args.shapes.split(","):
        rows, cols = (int(v) for v in shape.split("x"))
        x = torch.randn(rows, cols, device="cuda")
        out = torch.empty(cols, device="cuda")
        copy_target = torch.empty_like(x)
        gigabytes = x.numel() * 4 / 1e9
        results = {"torch copy_ / 2 (x once)": median_us(lambda: copy_target.copy_(x), args.repeats) / 2,
                   "ATen x.sum(0)": median_us(lambda: x.sum(0), args.repeats)}
        expected = x.double().sum(0).float()
        for name, (w, threads, ranks, cluster) in VARIANTS.items():
            groups = (cols + w - 1) // w
            text = source(rows, cols, w, threads, ranks, cluster)

            def launch(text=text, blocks=groups * ranks, threads=threads):
                _C.cuda.launch_pointwise(text, "column_sum", [x, out], blocks * threads, threads)
            try:
                out.zero_()
                launch()
                torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-3 * rows ** 0.5)
                results[name] = median_us(launch, args.repeats)
            except Exception as e:  # noqa: BLE001 - a variant that fails is reported, the others still run
                print(f"{shape} {name}: {type(e).__name__}: {str(e)[:300]}")
        for name, us in results.items():
            print(f"{shape:>11} {name:<32} {us:8.2f} us {gigabytes / us * 1e6 / 1e3:6.2f} TB/s")


if __name__ == "__main__":
    main()
