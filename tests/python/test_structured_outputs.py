"""Structured values in traced code and outputs: torch.return_types (structseqs), namedtuples, dataclasses
and HuggingFace-style ModelOutput, plus per-instance entries of identical layers.

Each case is compared with eager: the same types all the way down (a structseq stays
torch.return_types.max, a dataclass stays itself, ModelOutput keeps its keys), values and gradients through
kiln.testing.assert_same_as_eager, and asserts how many graphs and graph breaks kiln made. Every tensor
that comes back must be real data: a trace-time fake (a meta tensor) leaking out was issue 3's silent wrong
answer.
"""
import collections
import dataclasses
import warnings
from typing import Optional

import pytest
import torch
import torch.nn as nn

import kiln
from kiln.testing import assert_same_as_eager, random_tensor

PRINTED = []


@kiln.disable
def record(*values):
    """A stand-in for print: an untraceable call (a graph break) whose effect the tests can see."""
    PRINTED.append(values)


Pair = collections.namedtuple("Pair", "first second")
Scaled = collections.namedtuple("Scaled", ["value", "scale"], defaults=[2.0])


@dataclasses.dataclass
class Stats:
    mean: torch.Tensor
    spread: torch.Tensor
    label: str = "stats"

    @property
    def upper(self):
        return self.mean + self.spread


@dataclasses.dataclass(frozen=True)
class Frozen:
    out: torch.Tensor
    extras: list


class ModelOutput(collections.OrderedDict):
    """A small stand-in for transformers.utils.ModelOutput: an OrderedDict subclass whose dataclass
    subclasses hold their non-None fields as keys too; indexable by key and by position."""

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None:
                self[field.name] = value

    def __getitem__(self, key):
        if isinstance(key, str):
            return dict(self.items())[key]
        return self.to_tuple()[key]

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        super().__setattr__(key, value)

    def __setattr__(self, name, value):
        if name in self.keys() and value is not None:
            super().__setitem__(name, value)
        super().__setattr__(name, value)

    def to_tuple(self):
        return tuple(self[k] for k in self.keys())


@dataclasses.dataclass
class CausalLMOutput(ModelOutput):
    loss: Optional[torch.Tensor] = None
    logits: torch.Tensor = None
    hidden_states: Optional[tuple] = None


# ---- comparing structured outputs -------------------------------------------------------------------------
def _structure(value):
    """The output as plain containers, each record tagged with its type and fields, for comparison."""
    if isinstance(value, tuple) and (hasattr(value, "_fields") or type(value).__module__ == "torch.return_types"):
        names = getattr(value, "_fields", None) or type(value).__match_args__
        return {"__type__": type(value).__qualname__, **{n: _structure(getattr(value, n)) for n in names},
                "__items__": [_structure(v) for v in value]}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {"__type__": type(value).__qualname__}
        out.update({f.name: _structure(getattr(value, f.name)) for f in dataclasses.fields(value)})
        if isinstance(value, dict):
            out["__keys__"] = list(value.keys())
            out["__values__"] = [_structure(v) for v in value.values()]
        return out
    if isinstance(value, (tuple, list)):
        return type(value)(_structure(v) for v in value)
    if isinstance(value, dict):
        return {k: _structure(v) for k, v in value.items()}
    return value


def _assert_no_fakes(value):
    for leaf in torch.utils._pytree.tree_leaves(_structure(value)):
        if isinstance(leaf, torch.Tensor):
            assert leaf.device.type != "meta", "a trace-time fake tensor came back from a compiled frame"


def check(fn, *args, graphs, breaks, calls=2, grads=True):
    """Compiled matches eager (types, fields, values, gradients) on `calls` calls; explain's counts match."""
    kiln.reset()
    compiled = kiln.compile(fn)
    for _ in range(calls):
        expected, actual = fn(*args), compiled(*args)
        assert type(actual) is type(expected), (type(actual), type(expected))
        _assert_no_fakes(actual)
        assert_same_as_eager(lambda *a: _structure(fn(*a)), *args,
                             compiled=lambda *a: _structure(compiled(*a)), grads=grads)
    stats = kiln.stats()
    assert stats["graph_breaks"] == breaks, stats
    assert stats["fallbacks"] == 0, stats
    result = kiln.explain(fn)(*args)
    assert result.graph_count == graphs, result
    assert result.graph_break_count == breaks, result
    return actual


# ---- torch.return_types ------------------------------------------------------------------------------------
def max_along_rows(x):
    return torch.max(x, 1)


def test_structseq_returned_whole(fresh_kiln):
    out = check(max_along_rows, random_tensor(5, 4, requires_grad=True), graphs=1, breaks=0)
    assert type(out) is torch.return_types.max and out.values.device.type == "cpu"
    assert torch.equal(out.indices, out[1])


def sort_unpacked(x):
    values, indices = x.sort(dim=-1, descending=True)
    return values * 2, indices


def test_structseq_unpacked_inside(fresh_kiln):
    check(sort_unpacked, random_tensor(3, 6, requires_grad=True), graphs=1, breaks=0)


def field_reads(x):
    top = torch.topk(x, 2)
    smallest = x.min(dim=0)
    return top.values.sum(-1) + smallest.values.mean(), top.indices, smallest[1]


def test_structseq_fields_read_inside(fresh_kiln):
    check(field_reads, random_tensor(4, 5, requires_grad=True), graphs=1, breaks=0)


def several_return_types(x):
    return torch.median(x, 1), torch.linalg.qr(x), x.cummax(0), torch.var_mean(x, 1)


def test_several_return_types_rebuilt(fresh_kiln):
    out = check(several_return_types, random_tensor(4, 4), graphs=1, breaks=0)
    assert [type(o).__name__ for o in out] == ["median", "linalg_qr", "cummax", "tuple"]
    assert out[1].Q.shape == (4, 4)


def structseq_across_break(x):
    result = torch.max(x.sin(), 0)
    record(result.indices.shape)
    return result, result.values + 1


def test_structseq_kept_across_a_graph_break(fresh_kiln):
    out = check(structseq_across_break, random_tensor(3, 4, requires_grad=True), graphs=2, breaks=1)
    assert type(out[0]) is torch.return_types.max


# ---- namedtuples -------------------------------------------------------------------------------------------
def build_named(x):
    return Pair(x.relu(), second=x * 2), Scaled(x + 1)


def test_namedtuple_built_and_returned(fresh_kiln):
    out = check(build_named, random_tensor(6, requires_grad=True), graphs=1, breaks=0)
    assert out[1].scale == 2.0 and out[0]._fields == ("first", "second")


def named_argument(p):
    first, second = p
    return p.first * p[1] + first - second, Pair(p.second, p.first)


def test_namedtuple_argument_read_by_field_and_index(fresh_kiln):
    check(named_argument, Pair(random_tensor(4, requires_grad=True), random_tensor(4)), graphs=1, breaks=0)


# ---- dataclasses -------------------------------------------------------------------------------------------
def build_stats(x):
    s = Stats(x.mean(0), spread=x.std(0))
    return s, s.upper * 2, s.label


def test_dataclass_built_returned_and_read(fresh_kiln):
    out = check(build_stats, random_tensor(5, 3, requires_grad=True), graphs=1, breaks=0)
    assert isinstance(out[0], Stats) and out[2] == "stats"


def frozen_nested(x):
    inner = Pair(x.exp(), x.log1p())
    return Frozen(out=x * 3, extras=[inner, x.shape[0]])


def test_frozen_dataclass_with_nested_values(fresh_kiln):
    out = check(frozen_nested, random_tensor(4).abs(), graphs=1, breaks=0)
    assert type(out.extras[0]) is Pair and out.extras[1] == 4


def dataclass_across_break(x):
    s = Stats(x.sum(0), x.amax(0))
    record(s.label)
    return s.upper + 1, s


def test_dataclass_kept_across_a_graph_break(fresh_kiln):
    check(dataclass_across_break, random_tensor(3, 2, requires_grad=True), graphs=2, breaks=1)


# ---- ModelOutput ---------------------------------------------------------------------------------------------
class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.head = nn.Linear(16, 5)

    def forward(self, x, labels=None):
        hidden = self.embed(x).tanh()
        logits = self.head(hidden)
        loss = None if labels is None else (logits - labels).pow(2).mean()
        return CausalLMOutput(loss=loss, logits=logits, hidden_states=(x, hidden))


def test_model_output_from_a_module(fresh_kiln):
    torch.manual_seed(0)
    model = TinyLM()
    kiln.reset()
    compiled = kiln.compile(model)
    x, labels = random_tensor(2, 8), random_tensor(2, 5)
    for _ in range(2):
        out, expected = compiled(x, labels), model(x, labels)
        assert type(out) is CausalLMOutput
        assert list(out.keys()) == list(expected.keys()) == ["loss", "logits", "hidden_states"]
        _assert_no_fakes(out)
        torch.testing.assert_close(out.loss, expected.loss)
        torch.testing.assert_close(out["logits"], expected["logits"])
        torch.testing.assert_close(out[2][1], expected[2][1])
        assert out.hidden_states[0] is x  # the argument itself, as eager returns it
    out.loss.backward()
    assert model.head.weight.grad is not None
    no_loss = compiled(x)
    assert no_loss.loss is None and list(no_loss.keys()) == ["logits", "hidden_states"]
    assert kiln.stats()["graph_breaks"] == 0 and kiln.stats()["fallbacks"] == 0
    assert kiln.explain(model)(x, labels).graph_count == 1


def read_model_output(x):
    out = CausalLMOutput(logits=x * 2, hidden_states=(x.sin(),))
    keys = list(out.keys())
    logits, hidden = out.to_tuple()
    return out["logits"] + out[0] + out.logits + logits, hidden[0], keys, len(out), "loss" in out


def test_model_output_item_and_attribute_access(fresh_kiln):
    out = check(read_model_output, random_tensor(3, 3, requires_grad=True), graphs=1, breaks=0)
    assert out[2] == ["logits", "hidden_states"] and out[3] == 2 and out[4] is False


def model_output_across_break(x):
    out = CausalLMOutput(logits=x.relu())
    record(len(out))
    return out.logits * 2, out


def test_model_output_kept_across_a_graph_break(fresh_kiln):
    check(model_output_across_break, random_tensor(4, requires_grad=True), graphs=2, breaks=1)


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        hidden = self.linear(x).relu()
        record(hidden.shape)  # a graph break inside the submodule: it returns a real CausalLMOutput
        return CausalLMOutput(logits=hidden, hidden_states=(x, hidden))


class Wrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = Encoder()

    def forward(self, x):
        inner = self.encoder(x)
        return CausalLMOutput(loss=inner[0].sum(), logits=inner.logits * 2,
                              hidden_states=inner["hidden_states"] + (inner.logits,))


def test_model_output_handed_over_by_a_graph_break(fresh_kiln):
    """The submodule's ModelOutput comes from eager code (after its break): read by index, key and attribute
    in the caller's resume function without another break (guarded by its type and keys)."""
    torch.manual_seed(0)
    model = Wrapper()
    kiln.reset()
    compiled = kiln.compile(model)
    x = random_tensor(3, 4, requires_grad=True)
    for _ in range(2):
        out, expected = compiled(x), model(x)
        assert type(out) is CausalLMOutput and list(out.keys()) == list(expected.keys())
        assert_same_as_eager(lambda t: _structure(model(t)), x, compiled=lambda t: _structure(compiled(t)))
    stats = kiln.stats()
    assert stats["graph_breaks"] == 2 and stats["fallbacks"] == 0 and stats["recompiles"] == 0, stats
    assert kiln.explain(model)(x).graph_count == 4


def named_methods(x):
    p = Pair(x.cos(), x + 1)
    return p._asdict(), p._replace(first=x * 2), len(p), list(p)


def test_namedtuple_methods_run_as_eager(fresh_kiln):
    """_asdict is traced (dict(zip(...))); so is _replace (a new tuple of the class with the named items replaced)."""
    check(named_methods, random_tensor(5, requires_grad=True), graphs=1, breaks=0)


# ---- per-instance entries ------------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        y = self.linear(x).relu()
        record(tuple(y.shape))  # a graph break: each block's forward frame is compiled on its own
        return y + x


class PrintingBlock(Block):
    def forward(self, x):
        y = self.linear(x).relu()
        print("kiln per-instance test:", tuple(y.shape))
        return y + x


class Stack(nn.Module):
    def __init__(self, depth=12, width=8, block=Block):
        super().__init__()
        self.layers = nn.ModuleList(block(width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("block", [Block, PrintingBlock])
def test_identical_layers_compile_per_instance(fresh_kiln, capsys, block):
    torch.manual_seed(0)
    model = Stack(depth=12, block=block)
    compiled = kiln.compile(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the recompile-limit warning would fail the test
        for _ in range(2):
            assert_same_as_eager(model, random_tensor(3, 8, requires_grad=True), compiled=compiled)
    if block is PrintingBlock:
        assert capsys.readouterr().out.count("kiln per-instance test: (3, 8)") == 2 * 2 * 12
    # One entry per block for the forward, none of them eager (no "(eager: ...)" label).
    labels = kiln._C.cache_entries(block.forward.__code__)
    assert len(labels) == 12 and not any("eager" in label for label in labels), labels
    stats = kiln.stats()
    # Each forward is compiled twice (before its break and its resume function after it).
    assert stats["frames_compiled"] >= 24, stats
    if block is Block:  # print's own callees (pytest's capture, in Python) add breaks of their own
        # 12 in the blocks, and 12 in Stack.forward's loop (each `layer(x)` call runs in Python and the loop
        # resumes compiled).
        assert stats["graph_breaks"] == 24, stats


def test_module_instance_limit_still_caps(fresh_kiln, monkeypatch):
    monkeypatch.setattr(kiln.config, "module_instance_limit", 4)
    torch.manual_seed(0)
    model = Stack(depth=6)
    compiled = kiln.compile(model)
    x = random_tensor(2, 8)
    with pytest.warns(RuntimeWarning, match="module instance limit"):
        out = compiled(x)
    torch.testing.assert_close(out, model(x))  # the last two blocks ran eagerly, with eager's answer
    assert len(kiln._C.cache_entries(Block.forward.__code__)) == 4
    # 4 in the blocks; the root and 4 resume entries of Stack.forward's loop (the same limit caps those).
    assert kiln.stats()["graph_breaks"] == 9, kiln.stats()


def test_one_instance_still_has_the_recompile_limit(fresh_kiln, monkeypatch):
    monkeypatch.setattr(kiln.config, "recompile_limit", 3)
    block = Block(4)
    compiled = kiln.compile(block)
    with pytest.warns(RuntimeWarning, match="recompile limit for one module instance"):
        for n in range(1, 6):  # a new shape each call: recompiles of one instance
            assert_same_as_eager(block, random_tensor(n, 4), compiled=compiled)


def test_fake_detector_sees_fakes_inside_records():
    """The last line of defence (tracer.cpp refuse_escaping_fake) looks inside what a constant may hold."""
    from kiln import _tracing

    fake = torch.empty(2, device="meta")
    assert _tracing.holds_meta_tensor(torch.return_types.max((fake, fake)))
    assert _tracing.holds_meta_tensor({"a": [1, (2, Stats(torch.ones(1), fake))]})
    assert not _tracing.holds_meta_tensor({"a": [1, (2, Stats(torch.ones(1), torch.zeros(1)))], "b": "meta"})
