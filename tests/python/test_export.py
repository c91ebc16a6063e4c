"""kiln.export, ExportedProgram.save and kiln.load: round trips through a file loaded in a new process (which has
only the file, not the models' source), graph breaks, input checks, corrupted files."""
import json
import os
import subprocess
import sys
import textwrap
import zipfile

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kiln
from kiln.errors import GraphBreakError, KilnError
from kiln.testing import random_tensor, tolerance

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 8)

    def forward(self, x, scale=2.0):
        hidden = torch.nn.functional.gelu(self.fc1(x))
        return self.fc2(hidden) * scale, {"hidden": hidden}


class ConvBnRelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 4, 3, stride=2)
        # Running statistics that are not the identity, so a batch norm that is skipped or run in training mode shows.
        self.bn.running_mean.copy_(torch.randn(8) * 0.1)
        self.bn.running_var.copy_(torch.rand(8) + 0.5)

    def forward(self, x):
        return torch.relu(self.conv2(torch.relu(self.bn(self.conv(x)))))


class TransformerBlock(nn.Module):
    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attention = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        h = self.norm1(x)
        attended, _ = self.attention(h, h, h, need_weights=False)
        x = x + attended
        return x + self.mlp(self.norm2(x))


class AttentionWithMasksThatMaskNothing(nn.Module):
    """Attention under masks that read no input and mask nothing (an all-True bool mask, an all-zero float mask), as
    transformers builds from an all-ones attention mask: kiln's pipeline drops them before its cache key, so the
    saved compiled record is keyed by the graph without them."""

    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        keep = torch.ones(t, t, dtype=torch.bool, device=x.device)
        bias = torch.zeros(b, 1, t, t, device=x.device)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        y = y + F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


MODELS = {
    "mlp": (MLP, lambda device: ((random_tensor(4, 16, device=device),), {"scale": 0.5})),
    "cnn": (ConvBnRelu, lambda device: ((random_tensor(2, 3, 12, 12, device=device),), {})),
    "transformer": (TransformerBlock, lambda device: ((random_tensor(2, 10, 32, device=device),), {})),
    "attention_masks": (AttentionWithMasksThatMaskNothing, lambda device: ((random_tensor(2, 8, 16, device=device),),
                                                                           {})),
}


def compiled_entries(cache_dir):
    """The compiled code in a disk cache, named as an exported file names it ("kernels/cpp/<key>.so"): the C++
    libraries and CUDA images. Code compiled in a process whose cache held only a file's entries shows as a name the
    file does not hold."""
    found = set()
    for kind in ("cpp", "cuda"):
        folder = os.path.join(cache_dir, kind)
        if os.path.isdir(folder):
            # an entry's checksum (<key><suffix>.sum) belongs to the entry
            found |= {f"kernels/{kind}/{name.removesuffix('.sum')}" for name in os.listdir(folder)
                      if not name.startswith(".")}
    return found

# Run in a new interpreter with only the saved file: loads it, runs it on the saved inputs, saves the outputs.
# Prints kiln's compiler counters, to show what the first call compiled.
_CHILD = textwrap.dedent("""
    import json, sys, torch, kiln
    program = kiln.load(sys.argv[1])
    args, kwargs = torch.load(sys.argv[2])
    torch.save(program.module()(*args, **kwargs), sys.argv[3])
    print(json.dumps({k: v for k, v in kiln._C.compiler_stats().items() if isinstance(v, int)}))
""")


def _assert_close_tree(actual, expected):
    if isinstance(expected, torch.Tensor):
        rtol, atol = tolerance(expected.dtype)
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)
    elif isinstance(expected, dict):
        assert list(actual) == list(expected)
        for key in expected:
            _assert_close_tree(actual[key], expected[key])
    elif isinstance(expected, (tuple, list)):
        assert type(actual) is type(expected) and len(actual) == len(expected)
        for a, e in zip(actual, expected):
            _assert_close_tree(a, e)
    else:
        assert actual == expected


def _run_in_new_process(path, args, kwargs, tmp_path):
    inputs, outputs = tmp_path / "inputs.pt", tmp_path / "outputs.pt"
    torch.save((args, kwargs), inputs)
    # An empty disk cache: whatever the first call does not compile came from the file.
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "python"), "KILN_CACHE_DIR": str(tmp_path / "cache"),
           "KILN_LOGS": "recompiles"}
    done = subprocess.run([sys.executable, "-c", _CHILD, str(path), str(inputs), str(outputs)], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return torch.load(outputs), json.loads(done.stdout.splitlines()[-1]), done.stderr


@pytest.mark.parametrize("name", sorted(MODELS))
def test_round_trip_in_new_process(name, device, tmp_path):
    torch.manual_seed(0)
    make, make_inputs = MODELS[name]
    model = make().to(device).eval()
    args, kwargs = make_inputs(device)
    program = kiln.export(model, args, kwargs)
    # In this process: the program agrees with eager on the export inputs, run by kiln's compiler (no fallback).
    before = kiln._C.compiler_stats()
    with torch.no_grad():
        _assert_close_tree(program(*args, **kwargs), model(*args, **kwargs))
    after = kiln._C.compiler_stats()
    assert after["graphs_compiled"] == before["graphs_compiled"] + 1
    assert after["graphs_fallback"] == before["graphs_fallback"], after["last_fallback_reason"]
    path = tmp_path / f"{name}.kiln"
    program.save(path)
    # Fresh inputs of the same sizes, run in a process that has only the file.
    fresh_args, fresh_kwargs = make_inputs(device)
    with torch.no_grad():
        expected = model(*fresh_args, **fresh_kwargs)
    outputs, stats, log = _run_in_new_process(path, fresh_args, fresh_kwargs, tmp_path)
    _assert_close_tree(outputs, expected)
    # The file's compiled code was used: the graph record and the library or CUDA images came from it, nothing was
    # compiled (neither by the C++ compiler nor by NVRTC).
    assert "compiling the saved graph" not in log, log
    assert stats["graph_cache_hits"] == 1 and stats["kernels_compiled"] == 0, stats
    assert stats["graphs_fallback"] == 0, stats
    with zipfile.ZipFile(path) as archive:
        saved = json.loads(archive.read("manifest.json"))["kernels"]
    assert compiled_entries(tmp_path / "cache") <= set(saved), saved
    assert {name.split("/")[1] for name in saved} == {"graphs", "cuda" if device == "cuda" else "cpp"}, saved


@pytest.mark.parametrize("name", sorted(MODELS))
def test_cuda_code_of_exported_graphs_compiles_to_ptx(name):
    """Without a GPU: each exported graph's kernels, emitted as CUDA C (what a CUDA export holds as CUDA images), compile
    to PTX through NVRTC (the conftest's PTX check, which fails the test with NVRTC's message otherwise)."""
    if not kiln._C.cuda.nvrtc_available():
        pytest.skip("NVRTC is not installed")
    torch.manual_seed(0)
    make, make_inputs = MODELS[name]
    args, kwargs = make_inputs("cpu")
    program = kiln.export(make().eval(), args, kwargs)
    before = kiln._C.cuda_ptx_check()["compiled"]
    with torch.no_grad():
        program(*args, **kwargs)
    assert kiln._C.cuda_ptx_check()["compiled"] == before + 1


def test_exported_module_has_the_state_under_its_names():
    torch.manual_seed(0)
    model = MLP().eval()
    x = random_tensor(4, 16)
    module = kiln.export(model, (x,)).module()
    assert isinstance(module, nn.Module)
    assert set(module.state_dict()) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    torch.testing.assert_close(module.state_dict()["fc2.bias"], model.fc2.bias.detach())
    with torch.no_grad():
        _assert_close_tree(module(x), model(x, 2.0))


def test_graph_prints_one_op_per_line():
    program = kiln.export(MLP().eval(), (random_tensor(4, 16),))
    text = str(program.graph)
    assert "aten::addmm.default" in text and "aten::gelu.default" in text
    assert len([line for line in text.splitlines() if "= aten::" in line]) == program.graph.num_nodes


def test_export_runs_in_eval_mode_and_restores_the_flag():
    model = ConvBnRelu().train()
    x = random_tensor(2, 3, 12, 12)
    program = kiln.export(model, (x,))
    assert model.training
    with torch.no_grad():
        _assert_close_tree(program(x), model.eval()(x))


class Branchy(MLP):
    def forward(self, x):
        y = self.fc1(x)
        if y.sum() > 0:  # data-dependent: a graph break
            return y
        return -y


def test_graph_break_raises_with_file_and_line():
    with pytest.raises(GraphBreakError) as error:
        kiln.export(Branchy(), (random_tensor(2, 16),))
    message = str(error.value)
    line = Branchy.forward.__code__.co_firstlineno + 2
    assert f"{os.path.basename(__file__)}:{line}" in message, message
    assert "kiln.export" in message and "torch.where" in message
    assert "fullgraph=True." not in message  # the compile-only hint is not offered


def test_malformed_dynamic_shapes_raise():
    # (tests/python/test_export_dynamic.py covers dynamic_shapes; this is the static suite's guard against a spec that
    # is silently ignored)
    with pytest.raises(KilnError, match="x dim 0 has the dynamic_shapes entry 'batch'"):
        kiln.export(MLP(), (random_tensor(4, 16),), dynamic_shapes={"x": {0: "batch"}})


@pytest.mark.parametrize("load", [False, True])
def test_wrong_inputs_raise(load, tmp_path):
    program = kiln.export(MLP().eval(), (random_tensor(4, 16),))
    if load:
        program.save(tmp_path / "mlp.kiln")
        program = kiln.load(tmp_path / "mlp.kiln")
    run = program.module()
    with pytest.raises(KilnError, match=r"inputs\[0\]\[0\]: expected shape \(4, 16\), got \(5, 16\)"):
        run(random_tensor(5, 16))
    with pytest.raises(KilnError, match=r"inputs\[0\]\[0\]: expected dtype float32, got float64"):
        run(random_tensor(4, 16, dtype=torch.float64))
    with pytest.raises(KilnError, match=r"inputs\[0\]: expected a tuple of 1, got a tuple of 2"):
        run(random_tensor(4, 16), random_tensor(4, 16))
    with pytest.raises(KilnError, match=r"inputs\[0\]\[0\]: expected a tensor, got list"):
        run([1.0])
    with pytest.raises(KilnError, match=r"inputs\[1\]: expected a dict with keys \[\], got keys \['scale'\]"):
        run(random_tensor(4, 16), scale=3.0)


def test_non_contiguous_input_runs_with_the_exported_layout():
    model = MLP().eval()
    program = kiln.export(model, (random_tensor(4, 16),))
    x = random_tensor(16, 4).t()
    with torch.no_grad():
        _assert_close_tree(program(x), model(x))


def test_file_layout(tmp_path):
    path = tmp_path / "mlp.kiln"
    kiln.export(MLP().eval(), (random_tensor(4, 16),)).save(path)
    with zipfile.ZipFile(path) as archive:
        assert {info.compress_type for info in archive.infolist()} == {zipfile.ZIP_STORED}
        manifest = json.loads(archive.read("manifest.json"))
        graph = json.loads(archive.read("graph.json"))
        weights = archive.read("weights.safetensors")
    assert manifest["format"] == "kiln.export" and manifest["format_version"] == 2
    assert manifest["torch_version"] == torch.__version__ and manifest["gpu_arch"] is None
    assert set(manifest["entries"]) >= {"graph.json", "program.json", "weights.safetensors"}
    assert any(node["op"] == "aten::addmm" for node in graph["nodes"])
    kinds = {name.split("/")[1] for name in manifest["kernels"]}
    assert kinds == {"graphs", "cpp"} and set(manifest["kernels"]) <= set(manifest["entries"])
    try:
        from safetensors.torch import load as load_safetensors
    except ImportError:
        return
    assert set(load_safetensors(weights)) == {"state.fc1.weight", "state.fc1.bias", "state.fc2.weight",
                                              "state.fc2.bias"}


class WithConstants(nn.Module):
    def forward(self, x):
        mask = torch.tensor([0.0, float("-inf"), float("nan"), -0.0])
        return torch.nan_to_num(x + mask, nan=1.5, neginf=-2.5) * torch.tensor(3.0)


def test_constants_and_non_finite_numbers_survive_the_file(tmp_path):
    model = WithConstants()
    x = random_tensor(3, 4)
    program = kiln.export(model, (x,))
    program.save(tmp_path / "c.kiln")
    loaded = kiln.load(tmp_path / "c.kiln")
    assert loaded.graph.to_json() == program.graph.to_json()
    _assert_close_tree(loaded(x), model(x))


def _rewrite_entry(path, name, change):
    with zipfile.ZipFile(path) as archive:
        entries = {info.filename: archive.read(info.filename) for info in archive.infolist()}
    entries[name] = change(entries[name])
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as archive:
        for entry, data in entries.items():
            archive.writestr(entry, data)


def _flip_byte(data):
    middle = len(data) // 2
    return data[:middle] + bytes([data[middle] ^ 0x20]) + data[middle + 1:]


@pytest.mark.parametrize("damage", ["truncated", "flipped_graph_byte", "flipped_in_place", "missing_entry",
                                    "bad_json_with_its_hash", "flipped_library_byte", "kernel_named_outside_the_cache",
                                    "not_a_zip"])
def test_corrupted_file_raises(damage, tmp_path):
    path = tmp_path / "mlp.kiln"
    kiln.export(MLP().eval(), (random_tensor(4, 16),)).save(path)
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[:len(data) * 2 // 3])
    elif damage == "flipped_graph_byte":
        _rewrite_entry(path, "graph.json", _flip_byte)
    elif damage == "flipped_in_place":  # a byte of the graph entry changed inside the zip (its CRC then fails)
        start = data.index(b'"nodes"')
        path.write_bytes(data[:start] + b"X" + data[start + 1:])
    elif damage == "missing_entry":
        with zipfile.ZipFile(path) as archive:
            kept = {n: archive.read(n) for n in archive.namelist() if n != "weights.safetensors"}
        with zipfile.ZipFile(path, "w") as archive:
            for entry, content in kept.items():
                archive.writestr(entry, content)
    elif damage == "bad_json_with_its_hash":  # the hash matches, the JSON does not parse
        import hashlib
        bad = b'{"values": [}'
        _rewrite_entry(path, "graph.json", lambda _: bad)
        _rewrite_entry(path, "manifest.json", lambda m: json.dumps({**json.loads(m), "entries": {
            **json.loads(m)["entries"], "graph.json": {"bytes": len(bad), "sha256": hashlib.sha256(bad).hexdigest()}}}
        ).encode())
    elif damage == "flipped_library_byte":
        with zipfile.ZipFile(path) as archive:
            library = next(n for n in archive.namelist() if n.endswith(".so"))
        _rewrite_entry(path, library, _flip_byte)
    elif damage == "kernel_named_outside_the_cache":
        _rewrite_entry(path, "manifest.json", lambda m: json.dumps({**json.loads(m), "kernels": [
            "kernels/cpp/../../../escape.so"]}).encode())
    else:
        path.write_bytes(b"not a zip file at all")
    with pytest.raises(KilnError, match="kiln.load"):
        kiln.load(path)


def test_torch_version_mismatch_recompiles_or_raises(tmp_path, capfd):
    path = tmp_path / "mlp.kiln"
    model = MLP().eval()
    x = random_tensor(4, 16)
    kiln.export(model, (x,)).save(path)
    _rewrite_entry(path, "manifest.json", lambda m: json.dumps({**json.loads(m), "torch_version": "1.0.0"}).encode())
    with pytest.raises(KilnError, match="torch_version 1.0.0 in the file"):
        kiln.load(path, recompile=False)
    kiln.config.set_logs("recompiles")
    try:
        program = kiln.load(path)
    finally:
        kiln.config.set_logs("")
    assert "compiling the saved graph for this machine: torch_version 1.0.0" in capfd.readouterr().err
    with torch.no_grad():
        _assert_close_tree(program(x), model(x, 2.0))
