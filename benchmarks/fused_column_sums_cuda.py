"""A pointwise producer fused with a sum over its rows (a Linear's bias gradient, summed while the gradient is
computed): g = x * y + x over [B, N, C] float32, g stored, and g summed either over N into [B, C] partial rows
(staged: the first of two stages, the second sums B rows) or over all B * N rows at once. Hand-written NVRTC
designs differ in that, in the threads per block along the rows (rows per thread) and in the columns per thread
(scalar or float4 accesses). They are timed against the
same producer without the sum (a float4 pointwise kernel: the bytes the fused kernel must move) and against
eager (the product, then ATen's sum).

    python benchmarks/fused_column_sums_cuda.py [--shapes 32x197x3072,32x197x768,8x128x3072] [--repeats 50]

Every variant is checked against torch first. Prints one line per (shape, variant): us per call and TB/s of the
bytes a fused kernel moves (x, y read, g written; the partials are small).
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

FUSED = r"""
// Block: W * NY threads (W along the columns, NY along the rows); each thread V adjacent columns of one batch b, rows ty, ty + NY, ... of N.
extern "C" __global__ void __launch_bounds__(@W@ * @NY@)
fused(const float* __restrict__ x, const float* __restrict__ y, float* __restrict__ g, float* __restrict__ partial, long long n) {
  constexpr int W = @W@, NY = @NY@, V = @V@, N = @N@, C = @C@, B = @B@;  // B blocks of N rows, one partial each
  constexpr int GROUPS = (C + W * V - 1) / (W * V);
  __shared__ float sums[NY][W * V];
  const int tx = threadIdx.x % W, ty = threadIdx.x / W;
  for (int blk = blockIdx.x; blk < B * GROUPS; blk += gridDim.x) {
    const int b = blk / GROUPS, c0 = (blk % GROUPS) * W * V + tx * V;
    const bool active = c0 < C;
    const int c = active ? c0 : 0;
    float acc[V];
#pragma unroll
    for (int v = 0; v < V; ++v) acc[v] = 0.0f;
#pragma unroll @UNROLL@
    for (int r = ty; r < N; r += NY) {
      const long long at = (static_cast<long long>(b) * N + r) * C + c;
      if (V == 4) {
        const float4 a = *reinterpret_cast<const float4*>(x + at);
        const float4 m = *reinterpret_cast<const float4*>(y + at);
        float4 out;
        out.x = a.x * m.x + a.x; out.y = a.y * m.y + a.y; out.z = a.z * m.z + a.z; out.w = a.w * m.w + a.w;
        if (active) *reinterpret_cast<float4*>(g + at) = out;
        acc[0] += out.x; acc[V > 1 ? 1 : 0] += out.y; acc[V > 2 ? 2 : 0] += out.z; acc[V > 3 ? 3 : 0] += out.w;
      } else {
        const float a = x[at], m = y[at];
        const float out = a * m + a;
        if (active) g[at] = out;
        acc[0] += out;
      }
    }
#pragma unroll
    for (int v = 0; v < V; ++v) sums[ty][tx * V + v] = acc[v];
    __syncthreads();
    for (int half = NY / 2; half > 0; half /= 2) {
      if (ty < half)
        for (int v = 0; v < V; ++v) sums[ty][tx * V + v] += sums[ty + half][tx * V + v];
      __syncthreads();
    }
    if (ty == 0 && active)
      for (int v = 0; v < V; ++v) partial[static_cast<long long>(b) * C + c + v] = sums[0][tx * V + v];
    __syncthreads();
  }
}
"""

POINTWISE = r"""
extern "C" __global__ void __launch_bounds__(256)
pointwise(const float4* __restrict__ x, const float4* __restrict__ y, float4* __restrict__ g, long long n) {
  for (long long i = blockIdx.x * 256ll + threadIdx.x; i < n; i += gridDim.x * 256ll) {  // n: float4s
    const float4 a = x[i], m = y[i];
    float4 out;
    out.x = a.x * m.x + a.x; out.y = a.y * m.y + a.y; out.z = a.z * m.z + a.z; out.w = a.w * m.w + a.w;
    g[i] = out;
  }
}
"""

# name: (staged: partial sums per leading index [B, C], else one sum over all B * N rows [C];
#        threads along columns W, threads along rows NY, columns per thread V, unroll)
VARIANTS = {
    "staged W32 NY32 V1": (True, 32, 32, 1, 8),
    "staged W32 NY8 V1": (True, 32, 8, 1, 8),
    "staged W32 NY4 V1": (True, 32, 4, 1, 8),
    "staged W32 NY8 V4": (True, 32, 8, 4, 4),
    "staged W8 NY32 V4": (True, 8, 32, 4, 4),
    "one sum W8 NY128 V1": (False, 8, 128, 1, 8),
    "one sum W8 NY64 V1": (False, 8, 64, 1, 8),
    "one sum W16 NY64 V1": (False, 16, 64, 1, 8),
    "one sum W32 NY32 V1": (False, 32, 32, 1, 8),
    "one sum W8 NY32 V4": (False, 8, 32, 4, 4),
    "one sum W4 NY64 V4": (False, 4, 64, 4, 4),
    "one sum W2 NY128 V4": (False, 2, 128, 4, 4),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="32x197x3072,32x197x768,8x128x3072,8x128x768")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    from kiln import _C
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  arch {_C.cuda.target_arch()}")
    for shape in args.shapes.split(","):
        b, n, c = (int(v) for v in shape.split("x"))
        x, y = torch.randn(b, n, c, device="cuda"), torch.randn(b, n, c, device="cuda")
        g, partials, total = torch.empty_like(x), torch.empty(b, c, device="cuda"), torch.empty(c, device="cuda")
        gigabytes = 3 * x.numel() * 4 / 1e9
        expected_g = x * y + x
        expected_partials = expected_g.double().sum(1).float()
        expected_total = expected_g.double().sum((0, 1)).float()
        results = {}

        def point():
            vectors = x.numel() // 4
            _C.cuda.launch_pointwise(POINTWISE, "pointwise", [x, y, g], vectors, 256, max(1, vectors // (132 * 8 * 256)))
        point()
        torch.testing.assert_close(g, expected_g)
        results["float4 pointwise, no sum"] = median_ms(point, args.repeats) * 1e3
        results["eager: x * y + x, then .sum(1)"] = median_ms(lambda: (x * y + x).sum(1), args.repeats) * 1e3
        for name, (staged, w, ny, v, unroll) in VARIANTS.items():
            if c % v:
                continue
            batches, rows = (b, n) if staged else (1, b * n)
            partial, expected = (partials, expected_partials) if staged else (total, expected_total)
            text = FUSED
            for key, value in (("W", w), ("NY", ny), ("V", v), ("N", rows), ("C", c), ("B", batches), ("UNROLL", unroll)):
                text = text.replace(f"@{key}@", str(value))
            blocks = batches * ((c + w * v - 1) // (w * v))

            def launch(text=text, blocks=blocks, threads=w * ny, partial=partial):
                _C.cuda.launch_pointwise(text, "fused", [x, y, g, partial], blocks * threads, threads)
            try:
                g.zero_()
                partial.zero_()
                launch()
                torch.testing.assert_close(g, expected_g)
                torch.testing.assert_close(partial, expected, rtol=1e-4, atol=1e-3 * rows ** 0.5)
                results[name] = median_ms(launch, args.repeats) * 1e3
            except Exception as e:  # noqa: BLE001 - a variant that fails is reported, the others still run
                print(f"{shape} {name}: {type(e).__name__}: {str(e)[:300]}")
        for name, us in results.items():
            print(f"{shape:>12} {name:<34} {us:8.2f} us {gigabytes / us * 1e6 / 1e3:6.2f} TB/s")


if __name__ == "__main__":
    main()
