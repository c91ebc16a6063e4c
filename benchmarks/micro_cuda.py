"""relu((x + 1) * 2) on 64M floats: a hand-written NVRTC kernel with float4 access (compiled and launched by
kiln._C.cuda) against eager PyTorch and against torch's copy_ of the same bytes (the practical bandwidth limit).

    python benchmarks/micro_cuda.py [--numel 67108864] [--repeats 50] [--inductor]

Timed with CUDA events around each call, after a warm-up; the median is reported, with achieved TB/s counting
one read and one write of the tensor. --inductor adds torch.compile for comparison.
The kernels below are also what tests/python/test_cuda_runtime.py compiles and checks against torch.
"""
import argparse
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)
if os.path.isfile(os.path.join(REPO_ROOT, "python", "kiln", "__init__.py")):
    sys.path.insert(0, os.path.join(REPO_ROOT, "python"))

# Two kernels in one program, as the CUDA backend will emit them: a pointwise kernel with 128-bit access where
# both pointers are 16-byte aligned (scalar tail after the last full float4), and a sum with warp shuffles.
ADD_MUL_RELU_PROGRAM = r"""
#include "kiln_pointwise.cuh"
#include "kiln_reduce.cuh"

__device__ __forceinline__ float add_mul_relu(float v) { return fmaxf((v + 1.0f) * 2.0f, 0.0f); }

// relu((x + 1) * 2), elementwise over n floats.
extern "C" __global__ void add_mul_relu_f32(const float* __restrict__ x, float* __restrict__ out, long long n) {
  const long long first = kiln::global_thread_index();
  const long long stride = kiln::global_thread_count();
  long long scalar_start = 0;
  if (kiln::aligned16(x) && kiln::aligned16(out)) {
    const long long vectors = n / 4;
    for (long long i = first; i < vectors; i += stride) {
      float4 v = kiln::load_float4(x, i);
      v.x = add_mul_relu(v.x);
      v.y = add_mul_relu(v.y);
      v.z = add_mul_relu(v.z);
      v.w = add_mul_relu(v.w);
      kiln::store_float4(out, i, v);
    }
    scalar_start = vectors * 4;
  }
  for (long long i = scalar_start + first; i < n; i += stride) out[i] = add_mul_relu(x[i]);
}

// total[0] += sum of x[0:n]; total must start at zero. One atomic per block.
extern "C" __global__ void sum_f32(const float* __restrict__ x, float* __restrict__ total, long long n) {
  float partial = 0.0f;
  for (long long i = kiln::global_thread_index(); i < n; i += kiln::global_thread_count()) partial += x[i];
  const float block_total = kiln::block_sum(partial);
  if (threadIdx.x == 0) atomicAdd(total, block_total);
}
"""

BLOCK = 256
FLOATS_PER_THREAD = 4  # one float4 per thread on the aligned path: the grid covers n in one sweep


def kiln_add_mul_relu(x, out):
    """out = relu((x + 1) * 2) through the float4 kernel, on torch's current stream."""
    from kiln import _C
    _C.cuda.launch_pointwise(ADD_MUL_RELU_PROGRAM, "add_mul_relu_f32", [x, out], x.numel(), BLOCK,
                             elements_per_thread=FLOATS_PER_THREAD)


def kiln_sum(x, total):
    """total[0] += x.sum() through the warp-shuffle kernel (total starts at zero)."""
    from kiln import _C
    _C.cuda.launch_pointwise(ADD_MUL_RELU_PROGRAM, "sum_f32", [x, total], x.numel(), BLOCK, elements_per_thread=8)


def median_ms(fn, repeats, warmup=5):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=64 * 1024 * 1024)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--inductor", action="store_true", help="also time torch.compile")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("micro_cuda.py needs a CUDA device")
    from kiln import _C
    x = torch.randn(args.numel, device="cuda")
    out = torch.empty_like(x)
    copy_target = torch.empty_like(x)

    kiln_add_mul_relu(x, out)
    torch.testing.assert_close(out, torch.relu((x + 1) * 2))

    def eager():
        return torch.relu((x + 1) * 2)

    systems = {
        "torch copy_ (same bytes)": lambda: copy_target.copy_(x),
        "eager relu((x+1)*2)": eager,
        "kiln NVRTC float4 kernel": lambda: kiln_add_mul_relu(x, out),
    }
    if args.inductor:
        compiled = torch.compile(eager)
        compiled()
        systems["torch.compile"] = compiled

    bytes_moved = 2 * x.numel() * x.element_size()
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  NVRTC {_C.cuda.nvrtc_version()} "
          f"({_C.cuda.target_arch()})  numel {args.numel}  median of {args.repeats}")
    results = {name: median_ms(fn, args.repeats) for name, fn in systems.items()}
    copy_ms = results["torch copy_ (same bytes)"]
    print(f"{'system':<28}{'ms':>9}{'TB/s':>8}{'vs copy_':>10}")
    for name, ms in results.items():
        print(f"{name:<28}{ms:>9.3f}{bytes_moved / ms / 1e9:>8.2f}{copy_ms / ms:>9.0%}")


if __name__ == "__main__":
    main()
