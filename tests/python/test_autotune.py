"""mode="max-autotune", "max-autotune-no-cudagraphs" and options={"autotune": True} (runtime/autotune.h).

Every test compares with eager on fresh random inputs, over several calls, so the tuning call and the calls after it
are both checked. On the CPU (everywhere) the modes compile as the default mode does, and every CPU graph's CUDA C is
compiled by NVRTC with its tuning variants (conftest's PTX check), so a variant the emitter cannot write fails here
too. The rest is marked `cuda`: choices timed in a first process and read back from the disk cache in a second,
which times nothing."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kiln
from kiln.errors import KilnError
from kiln.testing import random_tensor, tolerance

MODES = ["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Block(nn.Module):
    """A matmul with a fused epilogue, a layer norm (a row reduction), a softmax, and a column-sum backward."""

    def __init__(self, d=64):
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        h = self.norm(x + self.down(F.gelu(self.up(x))))
        return torch.softmax(h, dim=-1) * h.sum(dim=0, keepdim=True)


def _close(actual, expected, what):
    rtol, atol = tolerance(expected.dtype)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def _check_training(model, compiled, make_input, calls=3):
    for call in range(calls):
        x = make_input()
        x_ref = x.detach().clone().requires_grad_(True)
        x_kiln = x.detach().clone().requires_grad_(True)
        model.zero_grad(set_to_none=True)
        expected = model(x_ref)
        expected.square().sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        actual = compiled(x_kiln)
        actual.square().sum().backward()
        _close(actual, expected, f"call {call}: output")
        _close(x_kiln.grad, x_ref.grad, f"call {call}: input gradient")
        for (name, p), g in zip(model.named_parameters(), grads):
            _close(p.grad, g, f"call {call}: gradient of {name}")


# ---- everywhere ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["max-autotune", "max-autotune-no-cudagraphs"])
def test_autotune_modes_match_eager_on_the_cpu(fresh_kiln, mode):
    model = Block()
    compiled = kiln.compile(model, mode=mode)
    _check_training(model, compiled, lambda: random_tensor(16, 64))
    with torch.no_grad():
        x = random_tensor(16, 64)
        _close(compiled(x), model(x), "no_grad output")


def test_cpu_graphs_say_nothing_is_tuned(fresh_kiln, capfd):
    kiln.config.set_logs("autotune")
    try:
        compiled = kiln.compile(lambda x: torch.relu(x) * 2, mode="max-autotune")
        x = random_tensor(8)
        _close(compiled(x), torch.relu(x) * 2, "output")
    finally:
        kiln.config.set_logs("")
    err = capfd.readouterr().err
    assert "no tuning candidates there; it compiles as in mode='default'" in err, err


def test_autotune_option_is_accepted_and_validated(fresh_kiln):
    model = Block()
    compiled = kiln.compile(model, options={"autotune": True})
    x = random_tensor(8, 64)
    with torch.no_grad():
        _close(compiled(x), model(x), "output")
    with pytest.raises(KilnError, match="option 'autotune' takes a bool"):
        kiln.compile(model, options={"autotune": 1})
    with pytest.raises(KilnError, match="either mode or options"):
        kiln.compile(model, mode="max-autotune", options={"autotune": True})


# ---- CUDA ------------------------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("mode", MODES)
def test_every_mode_matches_eager_in_training_and_inference(fresh_kiln, mode):
    torch.manual_seed(0)
    model = Block(128).cuda()
    compiled = kiln.compile(model, mode=mode)
    _check_training(model, compiled, lambda: random_tensor(64, 128, device="cuda"))
    with torch.no_grad():
        for _ in range(3):
            x = random_tensor(64, 128, device="cuda")
            _close(compiled(x), model(x), "no_grad output")


@pytest.mark.cuda
def test_convolutions_and_batch_norm_under_max_autotune(fresh_kiln):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                          nn.Conv2d(16, 8, 3, stride=2), nn.Flatten(), nn.Linear(8 * 15 * 15, 10)).cuda()
    compiled = kiln.compile(model, mode="max-autotune-no-cudagraphs")
    benchmark = torch.backends.cudnn.benchmark
    with torch.no_grad():
        for _ in range(3):
            x = random_tensor(4, 3, 32, 32, device="cuda")
            _close(compiled(x), model(x), "train-mode output")  # batch statistics: the running ones move in both
    assert torch.backends.cudnn.benchmark == benchmark, "cuDNN's benchmark switch must be restored after each call"


@pytest.mark.cuda
def test_kept_outputs_are_never_overwritten_under_max_autotune(fresh_kiln):
    model = Block(128).cuda()
    compiled = kiln.compile(model, mode="max-autotune")
    kept = []
    with torch.no_grad():
        for _ in range(4):
            x = random_tensor(32, 128, device="cuda")
            kept.append((compiled(x), model(x)))
    for i, (actual, expected) in enumerate(kept):
        _close(actual, expected, f"output of call {i}, kept across later calls")


_TUNING_SCRIPT = textwrap.dedent("""
    import torch, torch.nn as nn, torch.nn.functional as F
    import kiln
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256), nn.LayerNorm(256)).cuda()
    compiled = kiln.compile(model, mode="max-autotune-no-cudagraphs")
    x = torch.randn(512, 256, device="cuda")
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    torch.cuda.synchronize()
    print("OK")
""")


def _run_tuning_process(cache_dir):
    env = dict(os.environ, KILN_CACHE_DIR=str(cache_dir), KILN_LOGS="autotune",
               PYTHONPATH=os.path.join(REPO, "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run([sys.executable, "-c", _TUNING_SCRIPT], capture_output=True, text=True, timeout=300,
                            env=env)
    assert result.returncode == 0 and "OK" in result.stdout, result.stdout + result.stderr
    return [line for line in result.stderr.splitlines() if line.startswith("[kiln:autotune]")]


@pytest.mark.cuda
def test_choices_are_timed_once_then_read_back_from_the_disk_cache(tmp_path):
    first = _run_tuning_process(tmp_path)
    timed = [line for line in first if " elapsed" in line]
    # the fused kernels (bias + gelu, layer norm) and the two matmuls each had candidates to time
    assert len(timed) >= 3, "\n".join(first)
    assert any("aten::addmm" in line or "aten::mm" in line for line in timed), "\n".join(first)
    assert any("kernel" in line for line in timed), "\n".join(first)
    second = _run_tuning_process(tmp_path)
    assert not [line for line in second if " elapsed" in line], "a second process timed again:\n" + "\n".join(second)
    assert len([line for line in second if "from the disk cache" in line]) == len(timed), "\n".join(second)
