"""Shared pytest set-up for kiln's Python tests (tests/python).

- `fresh_kiln`: kiln with every cache dropped and counters zeroed (kiln.reset()) before the test.
- `device`: runs a test body once per device: "cpu" always, "cuda" marked `cuda`.
- Tests marked `cuda` skip cleanly where torch sees no CUDA device.
- benchmarks/ is importable, so tests use the same seed models as the benchmarks.
- On machines whose CPU advertises AMX that the (virtual) machine does not let processes use, oneDNN's
  bfloat16 matmuls die with SIGILL in eager PyTorch itself. A child process probes that once; where it dies,
  oneDNN is capped below AMX for the whole run (ONEDNN_MAX_CPU_ISA, read on oneDNN's first use).
"""
import os
import subprocess
import sys


def _cap_onednn_isa_if_amx_faults():
    if "ONEDNN_MAX_CPU_ISA" in os.environ or sys.platform != "linux":
        return
    try:
        with open("/proc/cpuinfo") as f:
            if "amx_bf16" not in f.read():
                return
    except OSError:
        return
    probe = ("import torch\n"
             "with torch.autocast('cpu', dtype=torch.bfloat16):\n"
             "    torch.nn.functional.linear(torch.randn(8, 64), torch.randn(64, 64))\n")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=300)
    if result.returncode != 0:
        os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX512_CORE_BF16"


_cap_onednn_isa_if_amx_faults()

import pytest  # noqa: E402
import torch  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCHMARKS_DIR = os.path.join(REPO_ROOT, "benchmarks")
if BENCHMARKS_DIR not in sys.path:
    sys.path.insert(0, BENCHMARKS_DIR)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device (runs on the GPU machine)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip_cuda)


@pytest.fixture
def fresh_kiln():
    """The kiln module, reset: no compiled code, all stats() counters zero."""
    import kiln
    kiln.reset()
    yield kiln
    kiln.reset()


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request):
    return request.param


@pytest.fixture(autouse=True)
def cuda_code_for_cpu_graphs():
    """Every CPU graph a test compiles with the kiln backend is also emitted as CUDA C and compiled to PTX by
    NVRTC (issue 5: code-generation mistakes caught without a GPU). A test whose graphs fail that fails too,
    with NVRTC's message and the source. Skipped where NVRTC is missing."""
    import kiln
    if not kiln._C.cuda.nvrtc_available():
        yield
        return
    kiln._C.set_cuda_ptx_check(True)
    before = len(kiln._C.cuda_ptx_check()["failures"])
    yield
    failures = kiln._C.cuda_ptx_check()["failures"][before:]
    assert not failures, "CUDA C generated for this test's graphs does not compile:\n" + "\n\n".join(failures)


@pytest.fixture(autouse=True)
def compiled_autograd_setting():
    """Each test leaves kiln's compiled-autograd switch as it found it (tests that turn it off restore it)."""
    import kiln
    before = kiln._C.compiled_autograd()
    yield
    kiln.config.set_compiled_autograd(before)
