"""The C++ loader of exported programs (include/kiln/export.h) through examples/export_cpp: programs exported and
saved here (on the CPU, and on CUDA where there is a GPU) are loaded and run by the example executable, a process
without Python, and its outputs compared with eager's; the file's compiled code must run as it is (backend kiln, no
code compiled again); wrong inputs and corrupted files make it fail with the message; the executable links no
libpython.

The example is built once per session with cmake + ninja into build/export_cpp from the static libraries of the
kiln build folder (build/dev or build/gpu, made by scripts/setup.sh; KILN_BUILD_DIR overrides); the tests skip with
the reason when cmake, ninja or those libraries are missing."""
import json
import os
import shutil
import sys
import subprocess
import zipfile

import pytest
import torch
import torch.nn as nn

import kiln
from kiln.export import _safetensors_bytes, _tensors_from_safetensors
from kiln.testing import random_tensor, tolerance
from test_export import AttentionWithMasksThatMaskNothing, compiled_entries

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The kiln build folder whose static libraries the example links: KILN_BUILD_DIR, else scripts/setup.sh's folder for
# this machine (build/dev on the development machine and CI, build/gpu on the GPU machine).
KILN_BUILD = os.environ.get("KILN_BUILD_DIR") or next(
    (d for d in (os.path.join(ROOT, "build", "dev"), os.path.join(ROOT, "build", "gpu")) if os.path.isdir(d)),
    os.path.join(ROOT, "build", "dev"))
EXAMPLE_BUILD = os.path.join(ROOT, "build", "export_cpp")
EXAMPLE = os.path.join(EXAMPLE_BUILD, "kiln_export_example")


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, stride=2)
        self.fc = nn.Linear(16, 10)
        with torch.no_grad():  # running statistics that are not the identity, so a skipped batch norm shows
            self.bn.running_mean.copy_(torch.randn(8) * 0.1)
            self.bn.running_var.copy_(torch.rand(8) + 0.5)

    def forward(self, x, mask):
        y = torch.relu(self.bn(self.conv(x)))
        y = torch.relu(self.conv2(y)).mean(dim=(2, 3))
        return {"logits": self.fc(y), "masked": y * mask}


def _tool(name):
    return shutil.which(name) or shutil.which(name, path=os.path.join(ROOT, ".venv", "bin"))


@pytest.fixture(scope="module")
def example():
    cmake, ninja = _tool("cmake"), _tool("ninja")
    if not cmake or not ninja:
        pytest.skip("cmake and ninja are needed to build examples/export_cpp")
    libraries = [os.path.join(KILN_BUILD, f"lib{name}.a") for name in ("kiln_export", "kiln_runtime", "kiln_base")]
    if not all(os.path.exists(lib) for lib in libraries):
        pytest.skip(f"kiln's static libraries are not built in {KILN_BUILD} (bash scripts/setup.sh builds them)")
    env = dict(os.environ, CCACHE_BASEDIR=ROOT)
    if not os.path.exists(os.path.join(EXAMPLE_BUILD, "build.ninja")):
        subprocess.run([cmake, "-S", os.path.join(ROOT, "examples", "export_cpp"), "-B", EXAMPLE_BUILD, "-G", "Ninja",
                        f"-DCMAKE_MAKE_PROGRAM={ninja}", f"-DKILN_BUILD_DIR={KILN_BUILD}",
                        f"-DPython_EXECUTABLE={sys.executable}"],
                       check=True, capture_output=True, env=env)
    built = subprocess.run([ninja, "-C", EXAMPLE_BUILD], capture_output=True, text=True, env=env)
    assert built.returncode == 0, built.stdout + built.stderr
    return EXAMPLE


def _run(example, program_path, inputs, tmp_path, cache_dir, logs="perf,fallbacks"):
    """(completed process, {name: tensor} outputs or None): the example run on `inputs` in a fresh process."""
    inputs_path, outputs_path = tmp_path / "inputs.safetensors", tmp_path / "outputs.safetensors"
    inputs_path.write_bytes(_safetensors_bytes({f"input.{i}": t for i, t in enumerate(inputs)}))
    if outputs_path.exists():
        outputs_path.unlink()
    env = dict(os.environ, KILN_CACHE_DIR=str(cache_dir), KILN_LOGS=logs)
    done = subprocess.run([example, str(program_path), "--inputs", str(inputs_path), "--outputs", str(outputs_path),
                           "--iterations", "3"], capture_output=True, text=True, env=env, timeout=300)
    outputs = _tensors_from_safetensors(outputs_path.read_bytes()) if outputs_path.exists() else None
    return done, outputs


def _export(model, args, tmp_path):
    program = kiln.export(model.eval(), args)
    path = tmp_path / "model.kiln"
    program.save(path)
    return path


def _check_against_eager(example, tmp_path, model, args, flatten=lambda out: [out], backend="kiln"):
    """Exports `model` on args(), runs the file in the example on fresh args() and compares with eager's result. With
    backend "kiln", the file's compiled code must have run as it is: its C++ library or CUDA images were loaded from
    the disk cache the example started with (holding nothing but the file's entries), none compiled again."""
    path = _export(model, args(), tmp_path)
    fresh = args()  # fresh inputs, not the exported ones
    with torch.no_grad():
        expected = flatten(model(*fresh))
    cache = tmp_path / "cache"
    done, outputs = _run(example, path, fresh, tmp_path, cache)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"backend {backend}" in done.stdout, done.stdout
    assert len(outputs) == len(expected)
    for i, want in enumerate(expected):
        rtol, atol = tolerance(want.dtype)
        torch.testing.assert_close(outputs[f"output.{i}"], want.cpu(), rtol=rtol, atol=atol)
    if backend == "kiln":
        with zipfile.ZipFile(path) as archive:
            saved = set(json.loads(archive.read("manifest.json"))["kernels"])
        assert compiled_entries(cache) <= saved, done.stdout
    return done


@pytest.mark.parametrize("make, args, flatten", [
    (MLP, lambda device: (random_tensor(4, 16, device=device),), lambda out: [out]),
    (SmallCNN, lambda device: (random_tensor(2, 3, 12, 12, device=device), random_tensor(2, 16, device=device)),
     lambda out: [out["logits"], out["masked"]]),
], ids=["mlp", "cnn"])
def test_example_matches_eager(example, tmp_path, device, make, args, flatten):
    torch.manual_seed(0)
    # backend kiln: the file's compiled code ran (its C++ library or CUDA kernels, through kiln's runtime), not the
    # interpreter.
    _check_against_eager(example, tmp_path, make().to(device).eval(), lambda: args(device), flatten)


def test_attention_masks_that_mask_nothing_run_the_compiled_code(example, tmp_path, device):
    """The pipeline drops attention masks that mask nothing (an all-True bool mask, an all-zero float mask) before its
    cache key; the loader drops them too, through the same step, and runs the file's compiled record."""
    torch.manual_seed(0)
    model = AttentionWithMasksThatMaskNothing().to(device).eval()
    done = _check_against_eager(example, tmp_path, model, lambda: (random_tensor(2, 8, 16, device=device),))
    assert "2 attention masks that mask nothing dropped" in done.stderr, done.stderr


def test_wrong_input_shape_and_dtype(example, tmp_path):
    path = _export(MLP(), (random_tensor(4, 16),), tmp_path)
    done, _ = _run(example, path, [random_tensor(5, 16)], tmp_path, tmp_path / "cache")
    assert done.returncode == 1
    assert "inputs[0][0]: expected shape (4, 16), got (5, 16)" in done.stderr
    done, _ = _run(example, path, [random_tensor(4, 16, dtype=torch.float64)], tmp_path, tmp_path / "cache")
    assert done.returncode == 1
    assert "inputs[0][0]: expected dtype float32, got float64" in done.stderr


def test_corrupted_and_truncated_files(example, tmp_path):
    path = _export(MLP(), (random_tensor(4, 16),), tmp_path)
    data = path.read_bytes()
    weights = data.index(b"state.fc1.weight")  # inside weights.safetensors' header
    corrupted = tmp_path / "corrupted.kiln"
    corrupted.write_bytes(data[:weights] + b"X" + data[weights + 1:])
    done, _ = _run(example, corrupted, [random_tensor(4, 16)], tmp_path, tmp_path / "cache")
    assert done.returncode == 1 and "corrupted" in done.stderr, done.stderr
    truncated = tmp_path / "truncated.kiln"
    truncated.write_bytes(data[: len(data) // 2])
    done, _ = _run(example, truncated, [random_tensor(4, 16)], tmp_path, tmp_path / "cache")
    assert done.returncode == 1 and "not a zip file" in done.stderr, done.stderr


def test_example_links_no_python(example):
    libraries = subprocess.run(["ldd", example], capture_output=True, text=True).stdout
    assert "libpython" not in libraries and "libtorch_python" not in libraries, libraries
    undefined = subprocess.run(["nm", "-u", example], capture_output=True, text=True).stdout
    assert not [line for line in undefined.splitlines() if line.split()[-1].startswith(("Py", "_Py"))]


class FoldedTable(nn.Module):
    """A table computed from no input, which kiln's pipeline folds into a constant that the file does not hold (the
    loader folds it again), and an in-place op, which the pipeline makes functional before compiling."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        y = self.fc(x) * torch.tensor([2.0, 3.0]).sum() + torch.arange(16.0).cumsum(0)
        return y.relu_()


def test_folded_constants_and_in_place_ops_run_the_compiled_code(example, tmp_path):
    _check_against_eager(example, tmp_path, FoldedTable().eval(), lambda: (random_tensor(4, 16),))


def test_files_without_compiled_code_run_on_the_interpreter(example, tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules["kiln.export"], "_compiled_code", lambda program: {})  # a save with no disk cache
    done = _check_against_eager(example, tmp_path, MLP().eval(), lambda: (random_tensor(4, 16),), backend="eager")
    assert "(the file holds no compiled code" in done.stdout, done.stdout


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 8)

    def forward(self, x, y):
        return torch.relu(self.fc(x)) + y


def test_dynamic_program_runs_new_sizes(example, tmp_path, device):
    """A program exported with dynamic_shapes runs at sizes the export never saw: the file's compiled code at the
    export's sizes, the graph specialised to the others on the interpreter (logged); sizes outside the declared range
    and dims sharing a Dim that differ are refused with the argument and dim named."""
    from torch.export import Dim

    torch.manual_seed(0)
    model = TwoInputs().to(device).eval()
    batch = Dim("batch", max=64)
    path = tmp_path / "model.kiln"
    kiln.export(model, (random_tensor(4, 16, device=device), random_tensor(4, 8, device=device)),
                dynamic_shapes={"x": {0: batch}, "y": {0: batch}}).save(path)
    for size in (4, 13, 37):
        fresh = [random_tensor(size, 16, device=device), random_tensor(size, 8, device=device)]
        with torch.no_grad():
            expected = model(*fresh)
        done, outputs = _run(example, path, fresh, tmp_path, tmp_path / "cache", logs="fallbacks,dynamic,recompiles")
        assert done.returncode == 0, done.stdout + done.stderr
        assert "backend kiln" in done.stdout, done.stdout
        rtol, atol = tolerance(expected.dtype)
        torch.testing.assert_close(outputs["output.0"], expected.cpu(), rtol=rtol, atol=atol)
        assert ("these sizes run on the eager interpreter" in done.stderr) == (size != 4), done.stderr
        assert f"compiling the specialisation at s0 = {size}" in done.stderr, done.stderr
    done, _ = _run(example, path, [random_tensor(65, 16), random_tensor(65, 8)], tmp_path, tmp_path / "cache")
    assert done.returncode == 1
    assert "inputs[0][0] dim 0 (Dim 'batch') is 65, outside its range [2, 64]" in done.stderr, done.stderr
    done, _ = _run(example, path, [random_tensor(5, 16), random_tensor(6, 8)], tmp_path, tmp_path / "cache")
    assert done.returncode == 1
    assert "dims that share Dim 'batch' must be equal" in done.stderr, done.stderr
    done, _ = _run(example, path, [random_tensor(5, 17), random_tensor(5, 8)], tmp_path, tmp_path / "cache")
    assert done.returncode == 1
    assert "dim 1 was exported static" in done.stderr, done.stderr
