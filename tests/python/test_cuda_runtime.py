"""The CUDA groundwork (kiln._C.cuda): NVRTC compilation everywhere, driver-API launches on the GPU machine.

Without a GPU (development machine, CI): the hand-written two-kernel program of benchmarks/micro_cuda.py compiles
to PTX and to an sm_90 cubin through NVRTC, compile errors quote the failing line, NVRTC is found where
DESIGN.md says. Marked `cuda`: launches on fresh random tensors compared with torch, streams, launch errors.
"""
import os
import re
import subprocess
import sys
import threading

import pytest
import torch

import kiln
from kiln import _C
from kiln.errors import KilnError
from micro_cuda import ADD_MUL_RELU_PROGRAM, kiln_add_mul_relu, kiln_sum

cuda = _C.cuda


def reference(x):
    return torch.relu((x + 1) * 2)


# --- NVRTC, no GPU needed ---------------------------------------------------------------------------

def test_nvrtc_version_is_a_pair_of_ints():
    version = cuda.nvrtc_version()
    assert isinstance(version, tuple) and len(version) == 2
    assert all(isinstance(part, int) for part in version)
    assert version >= (11, 2), version
    assert os.path.basename(cuda.nvrtc_library()).startswith("libnvrtc")


def test_two_kernel_program_compiles_to_ptx_with_vector_access_and_shuffles():
    ptx = cuda.compile_ptx(ADD_MUL_RELU_PROGRAM, "add_mul_relu.cu")
    assert ".target sm_90" in ptx
    assert re.search(r"\.entry add_mul_relu_f32\(", ptx)
    assert re.search(r"\.entry sum_f32\(", ptx)
    # float4 body: 128-bit global loads and stores; the scalar tail: 32-bit ones.
    assert re.search(r"ld\.global(\.nc)?\.v4\.f32", ptx)
    assert re.search(r"st\.global\.v4\.f32", ptx)
    assert re.search(r"ld\.global(\.nc)?\.f32", ptx)
    # the reduction: butterfly warp shuffles and one atomic add per block
    assert "shfl.sync.bfly" in ptx
    assert re.search(r"(atom|red)\.global(\.\w+)*\.add\.f32", ptx)


def part(i):
    return (f'#include "kiln_scalar.cuh"\nextern "C" __global__ void part{i}(float* x) {{\n'
            f'  x[threadIdx.x] = x[threadIdx.x] * {i + 2}.0f + 1.0f;\n}}\n')


def test_parts_compile_in_worker_processes_to_the_same_images():
    # A graph's CUDA source in several parts compiles side by side in kiln-nvrtc-worker processes (NVRTC may
    # compile one program at a time per process); each image is the one this process's NVRTC makes.
    before = cuda.nvrtc_worker_stats()
    parts = [part(i) for i in range(3)]
    compiled = cuda.compile_parts(parts, "parts.cu")
    stats = cuda.nvrtc_worker_stats()
    assert stats["unavailable"] == "", stats
    assert os.path.basename(stats["executable"]) == "kiln-nvrtc-worker"
    assert [c["in_worker"] for c in compiled] == [True] * 3
    assert stats["answered"] - before["answered"] == 3
    for source, c in zip(parts, compiled):
        assert c["image"].decode() == cuda.compile_ptx(source, "parts.cu")
    # one part alone compiles in this process
    assert [c["in_worker"] for c in cuda.compile_parts([part(7)], "parts.cu")] == [False]


def test_a_compile_error_in_a_worker_quotes_the_failing_line():
    broken = 'extern "C" __global__ void broken(float* x) {\n  x[0] = not_declared;\n}\n'
    with pytest.raises(KilnError, match=r"(?s)could not compile CUDA program 'parts\.cu'.*parts\.cu:2 \|   x\[0\] = not_declared"):
        cuda.compile_parts([part(0), broken], "parts.cu")


def test_a_dead_worker_is_retired_and_its_part_compiles_here():
    cuda.compile_parts([part(0), part(1)], "parts.cu")  # at least one idle worker now
    idle = cuda.nvrtc_worker_stats()["idle_pids"]
    assert idle
    for pid in idle:
        os.kill(pid, 9)
    failed = cuda.nvrtc_worker_stats()["failed"]
    compiled = cuda.compile_parts([part(i) for i in range(2, 2 + len(idle))], "parts.cu")
    for i, c in enumerate(compiled):
        assert c["image"].decode() == cuda.compile_ptx(part(2 + i), "parts.cu")
    stats = cuda.nvrtc_worker_stats()
    assert stats["failed"] > failed
    assert not set(idle) & set(stats["idle_pids"])
    assert all(c["in_worker"] for c in cuda.compile_parts([part(10), part(11)], "parts.cu"))  # new workers start


def test_line_info_puts_source_lines_in_the_ptx():
    plain = cuda.compile_ptx(ADD_MUL_RELU_PROGRAM, "add_mul_relu.cu")
    with_lines = cuda.compile_ptx(ADD_MUL_RELU_PROGRAM, "add_mul_relu.cu", line_info=True)
    assert ".loc" not in plain
    assert ".loc" in with_lines


def test_cubin_for_sm90_is_an_elf_image():
    cubin = cuda.compile_cubin(ADD_MUL_RELU_PROGRAM, "add_mul_relu.cu", "sm_90")
    assert isinstance(cubin, bytes)
    assert cubin[:4] == b"\x7fELF"
    assert b"add_mul_relu_f32" in cubin and b"sum_f32" in cubin


def test_syntax_error_raises_kiln_error_quoting_the_line():
    source = ('extern "C" __global__ void broken(const float* x, float* out, long long n) {\n'
              "  long long i = threadIdx.x;\n"
              "  out[i] = x[i] * ;\n"
              "}\n")
    with pytest.raises(KilnError) as caught:
        cuda.compile_ptx(source, "broken.cu")
    message = str(caught.value)
    assert "broken.cu:3 | " in message
    assert "out[i] = x[i] * ;" in message
    assert "broken.cu(3): error" in message  # NVRTC's own log is kept


def test_error_in_second_kernel_quotes_only_its_line():
    source = ADD_MUL_RELU_PROGRAM.replace("partial += x[i];", "partial += undefined_name[i];")
    with pytest.raises(KilnError) as caught:
        cuda.compile_ptx(source, "two_kernels.cu")
    message = str(caught.value)
    assert "undefined_name" in message
    quoted = [line for line in message.splitlines() if line.strip().startswith("two_kernels.cu:")]
    assert len(quoted) == 1 and "partial += undefined_name[i];" in quoted[0]


def test_architecture_kinds_are_checked():
    with pytest.raises(KilnError, match="real architecture like sm_90"):
        cuda.compile_cubin(ADD_MUL_RELU_PROGRAM, "p.cu", "compute_90")
    with pytest.raises(KilnError, match="virtual architecture like compute_90"):
        cuda.compile_ptx(ADD_MUL_RELU_PROGRAM, "p.cu", arch="sm_90")


def test_device_helpers_are_available_to_include():
    assert {"kiln_pointwise.cuh", "kiln_reduce.cuh"} <= set(cuda.device_headers())
    assert 90 in cuda.nvrtc_supported_archs()


def test_kiln_nvrtc_path_selects_the_library():
    """KILN_NVRTC_PATH (a folder) is searched first: a new process opens NVRTC from there."""
    library = os.path.realpath(cuda.nvrtc_library())
    folder = os.path.dirname(library)
    code = "import torch; from kiln import _C; print(_C.cuda.nvrtc_library())"
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(kiln.__file__)))
    env = dict(os.environ, KILN_NVRTC_PATH=folder,
               PYTHONPATH=os.pathsep.join(filter(None, [package_parent, os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert os.path.dirname(os.path.realpath(done.stdout.strip())) == folder


# --- launches, on the GPU machine -------------------------------------------------------------------

@pytest.mark.cuda
def test_cubin_targets_the_device_architecture():
    major, minor = torch.cuda.get_device_capability()
    assert cuda.compute_capability(0) == (major, minor)
    arch = cuda.target_arch(0)
    assert arch == f"sm_{major}{minor}"
    assert cuda.compile_cubin(ADD_MUL_RELU_PROGRAM, "add_mul_relu.cu", arch)[:4] == b"\x7fELF"


@pytest.mark.cuda
@pytest.mark.parametrize("n", [1, 7, 1_000_003])
def test_pointwise_launch_matches_torch(n):
    x = torch.randn(n, device="cuda")
    out = torch.full_like(x, float("nan"))
    kiln_add_mul_relu(x, out)
    torch.testing.assert_close(out, reference(x), rtol=1e-5, atol=1e-6)


@pytest.mark.cuda
@pytest.mark.parametrize("n", [7, 1_000_003])
def test_misaligned_views_take_the_scalar_path(n):
    base_x = torch.randn(n + 1, device="cuda")
    base_out = torch.full_like(base_x, float("nan"))
    x, out = base_x[1:], base_out[1:]  # 4 bytes past a 16-byte boundary
    kiln_add_mul_relu(x, out)
    torch.testing.assert_close(out, reference(x), rtol=1e-5, atol=1e-6)
    assert torch.isnan(base_out[0]), "the kernel wrote outside its view"


@pytest.mark.cuda
@pytest.mark.parametrize("n", [1, 7, 1_000_003])
def test_warp_shuffle_sum_matches_torch(n):
    x = torch.randn(n, device="cuda")
    total = torch.zeros(1, device="cuda")
    kiln_sum(x, total)
    torch.testing.assert_close(total[0], x.double().sum().float(), rtol=1e-4, atol=1e-3)


@pytest.mark.cuda
def test_program_is_compiled_once_per_source():
    x = torch.randn(33, device="cuda")
    out = torch.empty_like(x)
    kiln_add_mul_relu(x, out)
    before = cuda.program_cache_stats()
    kiln_add_mul_relu(x, out)
    after = cuda.program_cache_stats()
    assert after["compiled"] == before["compiled"]
    assert after["memory_hits"] == before["memory_hits"] + 1


@pytest.mark.cuda
def test_current_stream_is_torchs():
    assert cuda.current_stream(0) == torch.cuda.current_stream().cuda_stream
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert cuda.current_stream(0) == side.cuda_stream
    assert cuda.current_stream(0) == torch.cuda.current_stream().cuda_stream


@pytest.mark.cuda
def test_launch_on_a_side_stream_is_ordered_after_its_work():
    """On a side stream: a long sleep, then the input is written, then the kernel reads it. Launched on any
    other stream, the kernel would run during the sleep and read the old input (zeros)."""
    n = 1_000_003
    source = torch.randn(n, device="cuda")
    x = torch.zeros(n, device="cuda")
    out = torch.zeros(n, device="cuda")
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # ~25 ms of GPU time on the side stream
        x.copy_(source)
        kiln_add_mul_relu(x, out)
        after = out + 1  # torch work after the kernel, on the same stream
    side.synchronize()
    torch.testing.assert_close(out, reference(source), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(after, reference(source) + 1, rtol=1e-5, atol=1e-6)


@pytest.mark.cuda
def test_launch_from_a_new_thread():
    x = torch.randn(1000, device="cuda")
    out = torch.zeros_like(x)
    torch.cuda.synchronize()
    errors = []

    def worker():
        try:
            kiln_add_mul_relu(x, out)
            torch.cuda.synchronize()
        except Exception as error:  # reported to the main thread below
            errors.append(error)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert not errors, errors
    torch.testing.assert_close(out, reference(x), rtol=1e-5, atol=1e-6)


@pytest.mark.cuda
def test_rejected_launch_raises_and_later_launches_work():
    x = torch.randn(4096, device="cuda")
    out = torch.zeros_like(x)
    with pytest.raises(KilnError, match=r"add_mul_relu_f32.*block \(2048, 1, 1\).*CUDA_ERROR_INVALID_VALUE"):
        cuda.launch_pointwise(ADD_MUL_RELU_PROGRAM, "add_mul_relu_f32", [x, out], x.numel(), 2048)
    kiln_add_mul_relu(x, out)
    torch.testing.assert_close(out, reference(x), rtol=1e-5, atol=1e-6)


@pytest.mark.cuda
def test_unknown_kernel_and_cpu_tensors_raise():
    x = torch.randn(8, device="cuda")
    with pytest.raises(KilnError, match="no kernel named 'missing_kernel'"):
        cuda.launch_pointwise(ADD_MUL_RELU_PROGRAM, "missing_kernel", [x, x], 8, 128)
    with pytest.raises(KilnError, match="kernels need CUDA tensors"):
        cuda.launch_pointwise(ADD_MUL_RELU_PROGRAM, "add_mul_relu_f32", [x.cpu(), x], 8, 128)
