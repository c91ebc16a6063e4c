"""The fake-tensor recorder: runs torch calls on meta tensors and records the ATen ops they reach.

The tracer (csrc/trace) calls `Recorder.call(fn, args, kwargs)` for every tensor operation it meets.
The call runs for real, but on *fakes* (meta tensors: sizes, strides and dtype without data) under a
`TorchDispatchMode`. The mode sits below autograd and autocast, so it sees the ATen ops eager would run
(`F.linear` with inputs that require grad arrives as `t` + `addmm`); each one becomes a graph node with
its complete schema argument list. `finish()` hands the records to C++ (graph/py_records.h) and returns
a `kiln._C.Graph`.

Devices: every fake is a meta tensor, but each recorded value keeps its *logical* device (the real
tensor's, or the one a factory op asked for): that is what the graph's meta says and what the runtime
uses. Factory ops run on meta and record the device they were given.

Autocast: meta tensors carry no autocast dispatch key, so under `torch.autocast` a call runs on *device
proxies* instead (`_DeviceProxy`: a wrapper around each fake that reports the logical device). Autocast's
own kernels then see eligible tensors and cast them exactly as in eager (nested composites, caches of
casts and all); the casts reach the recording mode as `_to_copy` nodes, and the mode unwraps every proxy
before recording, so the graph and the tracer only ever hold meta fakes.

What cannot run on meta (reading tensor data: item(), bool(), nonzero(), tolist(), .numpy(); ops without
a meta kernel) raises `kiln.errors.Unsupported`, and the failed call leaves no trace in the recorder.
"""
import contextlib
import functools
import operator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

from kiln import _C, _torch_meta, errors
from kiln._op_schema import OpInfo

_MISSING = object()


def _recurrent_op(name):
    """aten::<name>.input for a padded batch (nn.LSTM/GRU/RNN call torch._VF.<name>); None for a packed sequence,
    whose .data overload takes the parameter list fourth (after data, batch sizes and hidden state) and decomposes."""
    return lambda args: None if isinstance(args[3], (list, tuple)) else getattr(torch.ops.aten, name).input


# Composite ops recorded as one node instead of the ops they decompose into: on meta tensors ATen can only pick
# their decomposition (scaled_dot_product_attention's math path; one cell per step and layer of a recurrent layer);
# recorded whole, the run picks the fused kernel on the real device (flash / memory-efficient / cuDNN attention,
# cuDNN's or oneDNN's recurrent layers), exactly as eager does. Each maps the call's arguments to the overload to
# record, or None to let the call decompose.
_WHOLE_OPS = {
    torch.nn.functional.scaled_dot_product_attention: lambda args: torch.ops.aten.scaled_dot_product_attention.default,
    torch._VF.lstm: _recurrent_op("lstm"),
    torch._VF.gru: _recurrent_op("gru"),
    torch._VF.rnn_tanh: _recurrent_op("rnn_tanh"),
    torch._VF.rnn_relu: _recurrent_op("rnn_relu"),
}

# Tensor methods that leave tensor land, or act on autograd's real graph (a hook registered on a fake would be
# dropped: the compiled backward never calls it): refused before they run, so the call is a graph break and runs
# on the real tensor.
_ESCAPING_METHODS = {
    "register_hook": "it registers an autograd hook, which must act on the real tensor's gradient",
    "register_post_accumulate_grad_hook": "it registers an autograd hook, which must act on the real tensor's gradient",
    "retain_grad": "it asks autograd to keep the real tensor's gradient",
    "backward": "it runs autograd's backward pass",
    "numpy": "it copies tensor data into a NumPy array",
    "tolist": "it copies tensor data into Python lists",
    "item": "it reads a tensor's value into Python",
    "__bool__": "it reads a tensor's value into Python",
    "__int__": "it reads a tensor's value into Python",
    "__float__": "it reads a tensor's value into Python",
    "__index__": "it reads a tensor's value into Python",
    "__complex__": "it reads a tensor's value into Python",
    "__array__": "it copies tensor data into a NumPy array",
    "data_ptr": "it exposes the tensor's memory address",
    "untyped_storage": "it exposes the tensor's storage",
    "storage": "it exposes the tensor's storage",
}

# The escaping methods that only read values: answered from the data of a constant made inside the trace.
_VALUE_READS = frozenset(("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "__complex__"))

# Messages of errors that mean "this needs real data", raised where no op name is at hand.
_NEEDS_DATA_PATTERNS = ("meta", "unallocated storage", "doesn't have storage", "data-dependent", "data dependent")


def _needs_data(error):
    text = str(error).lower()
    return any(p in text for p in _NEEDS_DATA_PATTERNS)


_codes_cache = None


def _codes():
    """c10's numbering of dtypes, layouts, memory formats and device types (what graph/ stores)."""
    global _codes_cache
    if _codes_cache is None:
        from kiln import _C

        _codes_cache = _C._enum_codes()
    return _codes_cache


def _device_code(device):
    device = torch.device(device)
    return (_codes()["device_types"][device.type], -1 if device.index is None else device.index)


def _meta_twin(t, requires_grad=False):
    """A meta tensor with t's sizes, strides, storage offset and dtype; a leaf."""
    if t.storage_offset() == 0:
        fake = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="meta")
    else:
        extent = 1 + sum((s - 1) * st for s, st in zip(t.size(), t.stride()) if s > 0)
        storage = torch.empty(t.storage_offset() + extent, dtype=t.dtype, device="meta").untyped_storage()
        fake = torch.empty(0, dtype=t.dtype, device="meta")
        fake.set_(storage, t.storage_offset(), t.size(), t.stride())
    if requires_grad:
        fake.requires_grad_(True)
    return fake


class _DeviceProxy(torch.Tensor):
    """A fake as autocast sees it: `fake`'s sizes, strides and dtype on its logical device (CUDA or CPU),
    with no storage. Exists only while a call runs under autocast (Recorder._call_under_autocast); the
    recording mode unwraps it before any op is recorded or run."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, fake, device, requires_grad):
        proxy = torch.Tensor._make_wrapper_subclass(cls, fake.size(), strides=fake.stride(),
                                                    storage_offset=fake.storage_offset(), dtype=fake.dtype,
                                                    device=device, requires_grad=requires_grad)
        proxy.fake = fake
        return proxy

    def __repr__(self):
        return f"_DeviceProxy({self.fake!r}, device={self.device})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # Only reached with no recording mode active, which Recorder.call never allows.
        raise errors.InternalError(f"a device proxy reached {func} outside kiln's recorder")


def _map_tensors(fn, value):
    """`value` with fn applied to each tensor inside tuples (named ones and structseqs too), lists and dicts."""
    return tree_map_only(torch.Tensor, fn, value)


def _autocast_on():
    return torch.is_autocast_enabled("cuda") or torch.is_autocast_enabled("cpu")


class _RecordingMode(TorchDispatchMode):
    def __init__(self, recorder):
        super().__init__()
        self.recorder = recorder

    # torch wraps dispatch modes' __torch_dispatch__ so that Dynamo skips them; the wrapper imports
    # torch._dynamo on first use (seconds of cold start). kiln is not Dynamo: nothing to skip.
    @classmethod
    def _should_skip_dynamo(cls):
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.recorder._inside_whole_op:  # the meta decomposition of an op recorded as one node
            _torch_meta.avoid_dynamo_import()
            return func(*args, **(kwargs or {}))
        if self.recorder._proxies is not None:
            return self.recorder._record_proxied(func, args, kwargs or {})
        return self.recorder._record(func, args, kwargs or {})


# Older torch ignores _should_skip_dynamo: mark the raw function as its own "disabled" version.
_raw_dispatch = getattr(_RecordingMode.__torch_dispatch__, "__wrapped__", None)
if _raw_dispatch is not None:
    _raw_dispatch.__dynamo_disable = _raw_dispatch


class Recorder:
    """Records the ATen ops of torch calls made on fakes; `finish` turns them into a kiln._C.Graph."""

    def __init__(self):
        self._values = []         # [kind, meta(list), extra] per ValueId (see graph/py_records.h)
        self._value_tensors = []  # the fake (or real constant) each ValueId was made from
        self._nodes = []          # node tuples
        self._size_args = {}      # node index -> its size arguments (size_arguments)
        self._value_of = {}       # id(tensor) -> ValueId (fakes, meta twins of constants)
        self._tensors = {}        # id(tensor) -> tensor: keeps every mapped tensor alive so ids stay unique
        self._fake_of_input = {}  # id(real input) -> (real, fake)
        self._constant_of = {}    # id(real constant) -> (real, ValueId, meta twin)
        self._fresh_constants = set()  # ValueIds made by torch.tensor(...): never written in place
        self._num_inputs = 0
        self._logical_device = None  # (type code, index); see logical_device_code
        self._journal = None      # [(dict, key, old value)] while a call runs, to undo a failed one
        self._op_infos = {}
        self._inside_whole_op = False
        self._proxies = None      # id(fake) -> its _DeviceProxy, while a call runs under autocast
        self._entry_grad_mode = self._grad_mode = torch.is_grad_enabled()  # the mode after the last node

    # ---- public API used by the tracer -----------------------------------------------------------
    def add_input(self, tensor):
        """Registers a real tensor as the next graph input and returns its fake (same tensor -> same fake)."""
        entry = self._fake_of_input.get(id(tensor))
        if entry is not None:
            return entry[1]
        if tensor.layout != torch.strided or tensor.is_quantized or tensor.is_nested or tensor.device.type == "meta":
            raise errors.Unsupported(f"kiln captures dense strided tensors only, got a {tensor.layout} tensor on "
                                     f"{tensor.device}" + (" (a nested tensor)" if tensor.is_nested else ""))
        if not _plain_tensor_type(type(tensor)):
            raise errors.Unsupported(f"a {type(tensor).__qualname__} (a tensor subclass whose __torch_function__ or "
                                     f"__torch_dispatch__ gives its ops their own meaning) runs eagerly")
        fake = _meta_twin(tensor, requires_grad=tensor.requires_grad)
        vid = self._new_value("input", fake, _device_code(tensor.device), self._num_inputs,
                              requires_grad=tensor.requires_grad)
        self._num_inputs += 1
        device = _device_code(tensor.device)
        if self._logical_device is None or (self._logical_device[0] == _codes()["device_types"]["cpu"]
                                            and tensor.device.type != "cpu"):
            self._logical_device = device
        self._fake_of_input[id(tensor)] = (tensor, fake)
        self._map(fake, vid)
        return fake

    def call(self, fn, args=(), kwargs=None):
        """Runs fn(*args, **kwargs) on fakes under the recording mode and returns its result."""
        kwargs = kwargs or {}
        real = self._fresh_constant_read(fn, args)
        if real is not None:
            return fn(real, *args[1:], **kwargs) if getattr(fn, "__self__", None) is None else \
                getattr(real, fn.__name__)(*args, **kwargs)
        self._refuse_escaping_method(fn, args, kwargs)
        if fn in _INDEXING_CALLS and len(args) >= 2 and self.is_fake(args[0]):
            args = (args[0], self._index_lists_as_tensors(args[0], args[1])) + tuple(args[2:])
        num_values, num_nodes = len(self._values), len(self._nodes)
        self._journal = []
        try:
            with _RecordingMode(self):
                whole = _WHOLE_OPS.get(fn)
                whole = whole(args) if whole else None
                if _autocast_on():
                    result = self._call_under_autocast(fn, whole, args, kwargs)
                else:
                    result = self._record_whole(whole, args, kwargs) if whole else fn(*args, **kwargs)
        except errors.KilnError:
            self._undo(num_values, num_nodes)
            raise
        except NotImplementedError as e:
            self._undo(num_values, num_nodes)
            raise errors.Unsupported(f"{_describe(fn)} cannot run on fake tensors: {e}") from e
        except (RuntimeError, TypeError) as e:
            self._undo(num_values, num_nodes)
            if _needs_data(e):
                raise errors.Unsupported(f"{_describe(fn)} cannot run on fake tensors: {e}") from e
            raise
        except BaseException:
            self._undo(num_values, num_nodes)
            raise
        finally:
            self._journal = None
            self._proxies = None
        self._refresh_requires_grad(num_values)
        return result

    def _index_lists_as_tensors(self, fake, index):
        """x[[0, 2]], x[:, [1, 0]]: torch makes an index tensor from a list's data on the indexed tensor's device,
        which for a fake is meta, where the values are lost. The lists are made tensors here, on the device the fake
        stands for, as eager makes them; the recorder keeps each as a graph constant. A list torch reads as a tuple
        of indices (one holding slices, None, ... or lists) is left alone."""
        def as_tensor(items):
            if not _int_list(items):
                return items
            return torch.tensor(items, device=self.device_of(fake))
        if isinstance(index, list):
            return as_tensor(index) if all(isinstance(i, int) for i in index) else index
        if isinstance(index, tuple):
            return tuple(as_tensor(i) if isinstance(i, list) else i for i in index)
        return index

    def record_grad_mode(self, enabled):
        """Appends a kiln::set_grad_enabled node: the runtime switches grad mode there (node_call.cpp).
        The caller has already switched the real mode, so the fakes that follow see what eager sees."""
        self._nodes.append(("kiln::set_grad_enabled", "default", [("bool", bool(enabled))], ["enabled"], 1, [],
                            False, False, False))
        self._grad_mode = bool(enabled)

    @contextlib.contextmanager
    def swapped_state(self, module, fakes_by_name):
        """Temporarily replaces module's parameters/buffers (dotted names) by fakes; restores them on exit."""
        saved = []
        try:
            for name, fake in fakes_by_name.items():
                owner_path, _, attr = name.rpartition(".")
                owner = module.get_submodule(owner_path) if owner_path else module
                for table in (owner._parameters, owner._buffers):
                    if attr in table:
                        saved.append((table, attr, table[attr]))
                        table[attr] = fake
                        break
                else:
                    saved.append((owner, attr, getattr(owner, attr, _MISSING)))
                    object.__setattr__(owner, attr, fake)
            yield module
        finally:
            for where, attr, original in reversed(saved):
                if isinstance(where, dict):
                    where[attr] = original
                elif original is _MISSING:
                    object.__delattr__(where, attr)
                else:
                    object.__setattr__(where, attr, original)

    def is_fake(self, obj):
        return isinstance(obj, torch.Tensor) and self._tensors.get(id(obj)) is obj and obj.device.type == "meta"

    def value_id(self, tensor):
        """The graph value a fake (or a recorded constant) stands for now, or None."""
        if self._tensors.get(id(tensor)) is not tensor:
            return None
        return self._value_of.get(id(tensor))

    def logical_device_code(self):
        """(device type code, index) the fakes stand for: the first non-CPU input's device, else the
        first input's, else torch's default device."""
        if self._logical_device is None:
            return _device_code(torch.get_default_device())
        return self._logical_device

    @property
    def logical_device(self):
        """The real device the fakes stand for (what `fake.device` means in captured code)."""
        codes = {code: name for name, code in _codes()["device_types"].items()}
        type_code, index = self.logical_device_code()
        return torch.device(codes[type_code], None if index < 0 else index)

    def device_of(self, tensor):
        """The logical device of a fake (or a recorded constant's real device)."""
        vid = self.value_id(tensor)
        if vid is None:
            return tensor.device
        type_code, index = self._values[vid][1][4:6]
        codes = {code: name for name, code in _codes()["device_types"].items()}
        return torch.device(codes[type_code], None if index < 0 else index)

    @property
    def num_nodes(self):
        return len(self._nodes)

    def size_arguments(self):
        """[(node index, argument index)] for each recorded argument ATen's schema types SymInt, SymInt[] or SymInt?:
        a size, which under dynamic shapes may have been computed from sizes inside a composite op (trace/symbolic_ints.cpp)."""
        return [(n, a) for n, args in sorted(self._size_args.items()) for a in args]

    def finish(self, outputs):
        """Builds the kiln._C.Graph returning `outputs` (fakes or real constant tensors), in order."""
        from kiln import _C

        output_ids = []
        for i, out in enumerate(outputs):
            if not isinstance(out, torch.Tensor):
                raise errors.KilnError(f"graph output {i} is a {type(out).__name__}, not a tensor")
            vid = self.value_id(out)
            if vid is None:
                if out.device.type == "meta":
                    raise errors.KilnError(f"graph output {i} is a meta tensor this recorder did not create")
                vid = self._constant(out)
            output_ids.append(vid)
        values = [(kind, tuple(meta), extra) for kind, meta, extra in self._values]
        return _C._graph_from_records(values, self._nodes, output_ids)

    # ---- autocast ------------------------------------------------------------------------------------
    def _proxy(self, tensor):
        """The device proxy standing for a fake during this call (one per fake: the recorder keeps every fake
        alive, so ids stay unique); other tensors as they are."""
        if not self.is_fake(tensor):
            return tensor
        proxy = self._proxies.get(id(tensor))
        if proxy is None:
            # A leaf stays a leaf and a result a result: in-place ops on a result (ReLU(inplace=True) after a
            # batch norm) pass autograd's leaf check, as in eager.
            proxy = _DeviceProxy(tensor, self.device_of(tensor), tensor.requires_grad and tensor.is_leaf)
            if tensor.requires_grad and not tensor.is_leaf:
                _C._give_fake_history(proxy)
            self._proxies[id(tensor)] = proxy
        return proxy

    def _call_under_autocast(self, fn, whole, args, kwargs):
        """fn(*args, **kwargs) with every fake replaced by its device proxy, so that autocast's kernels run
        as in eager; returns fakes. Autocast's cache of weight casts is off meanwhile: it is keyed by tensor
        and would outlive the call's proxies (eager's cache saves time, never changes a value)."""
        self._proxies = {}
        proxy_args = _map_tensors(self._proxy, list(args))
        proxy_kwargs = _map_tensors(self._proxy, dict(kwargs))
        owner = getattr(fn, "__self__", None)
        if isinstance(owner, torch.Tensor) and self.is_fake(owner):  # a bound method of a fake
            fn = getattr(self._proxy(owner), fn.__name__)
        cache = torch.is_autocast_cache_enabled()
        torch.set_autocast_cache_enabled(False)
        restore = self._proxy_module_state(proxy_args)
        try:
            if whole is not None:
                # Recorded as one node below; autocast's cast of its floating inputs (scaled_dot_product_attention
                # is a lower-precision op on every device) is applied here, through the proxies.
                dtype = self._autocast_dtype(proxy_args + list(proxy_kwargs.values()))
                if dtype is not None:
                    cast = lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 else t
                    proxy_args = _map_tensors(cast, proxy_args)
                    proxy_kwargs = _map_tensors(cast, proxy_kwargs)
                # Its fakes take the proxies' requires_grad, for autograd to see it when the op runs.
                result = self._record_whole(whole, _map_tensors(self._unproxy_result, proxy_args),
                                            _map_tensors(self._unproxy_result, proxy_kwargs))
            else:
                result = fn(*proxy_args, **proxy_kwargs)
        finally:
            torch.set_autocast_cache_enabled(cache)
            for table, key, fake in restore:
                table[key] = fake
        # Every fake made in the call takes its proxy's requires_grad (what _refresh_requires_grad reads).
        for proxy in list(self._proxies.values()):
            self._unproxy_result(proxy)
        return _map_tensors(self._unproxy_result, result)

    def _proxy_module_state(self, args):
        """Puts proxies in place of the fakes a module argument holds (a leaf module called with its
        parameters swapped for fakes: tracing.call_leaf_module); returns what to put back."""
        restore = []
        for arg in args:
            if not isinstance(arg, torch.nn.Module):
                continue
            for module in arg.modules():
                tables = [module._parameters, module._buffers, module.__dict__]
                for table in tables:
                    for key, value in list(table.items()):
                        if isinstance(value, torch.Tensor) and self.is_fake(value):
                            restore.append((table, key, value))
                            table[key] = self._proxy(value)
        return restore

    def _autocast_dtype(self, values):
        """Autocast's lower-precision dtype for the device of the first proxy among values, if it is on there."""
        for value in values:
            if isinstance(value, _DeviceProxy):
                device = value.device.type
                return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        return None

    def _unproxy(self, tensor):
        return tensor.fake if isinstance(tensor, _DeviceProxy) else tensor

    def _unproxy_result(self, tensor):
        """A result of the call as the tracer holds it: its fake, with the requires_grad autograd gave the
        proxy (autograd ran on the proxies, above the mode, and never saw the fakes)."""
        if not isinstance(tensor, _DeviceProxy):
            return tensor
        fake = tensor.fake
        if tensor.requires_grad and not fake.requires_grad:
            if tensor.is_leaf:
                fake.requires_grad_(True)
            else:  # a result, not a leaf, as in eager (in-place ops on it must pass autograd's leaf check)
                _C._give_fake_history(fake)
        return fake

    def _record_proxied(self, func, args, kwargs):
        """The mode's body under autocast: records func on the fakes behind the proxies; returns proxies (the
        same one for an argument returned in place)."""
        fakes_args = _map_tensors(self._unproxy, list(args))
        fakes_kwargs = _map_tensors(self._unproxy, dict(kwargs))
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in _tensor_args(args, kwargs))
        # The same proxy for an argument returned in place; results made below autograd never require grad.
        return _map_tensors(self._proxy, self._record(func, fakes_args, fakes_kwargs, requires_grad=grad))

    # ---- recording ---------------------------------------------------------------------------------
    def _record_whole(self, func, args, kwargs):
        """Records a composite op as ONE node (see _WHOLE_OPS); its meta decomposition runs unrecorded."""
        self._inside_whole_op = True
        try:
            return self._record(func, args, kwargs)
        finally:
            self._inside_whole_op = False

    def _record(self, func, args, kwargs, requires_grad=None):
        """__torch_dispatch__ body: records func's call as a node and runs it on meta. `requires_grad`: whether
        autograd tracks this op, when the caller knows better than the fakes (the proxies under autocast)."""
        info = self._op_infos.get(func)
        if info is None:
            info = self._op_infos[func] = OpInfo(func)
        if info.op in ("aten::lift_fresh", "aten::lift_fresh_copy"):
            return self._lift_constant(args[0])
        if info.op == "aten::_local_scalar_dense" and self._fresh_real(args[0]) is not None:
            return self._fresh_real(args[0]).item()  # (int(t) of a constant made in the trace: its value)
        if info.refusal is not None:
            raise errors.Unsupported(f"{info.qualified} cannot be captured: {info.refusal}")
        if info.functional_twin is not None and not self._inside_whole_op:
            recorded = self._record_out_as_copy(info, args, kwargs)
            if recorded is not None:
                return recorded

        records, run_values, tensor_metas = [], [], []
        for i, arg in enumerate(info.arguments):
            if not arg.kwarg_only and i < len(args):
                value = args[i]
            elif arg.name in kwargs:
                value = kwargs[arg.name]
            elif arg.has_default_value():
                value = arg.default_value
            else:
                raise errors.InternalError(f"{info.qualified}: argument '{arg.name}' is missing")
            record, run_value = self._convert_arg(info, i, value, tensor_metas)
            records.append(record)
            run_values.append(run_value)
        for i in info.written_args:
            written = records[i][1] if records[i][0] == "tensor" else None
            if written in self._fresh_constants:
                raise errors.Unsupported(f"{info.qualified} writes into a tensor made by torch.tensor(...) "
                                         f"inside the captured code")

        if (not self._inside_whole_op and torch.is_grad_enabled() != self._grad_mode
                and info.op.startswith(("aten::", "prims::"))):
            # Python that runs for real on the fakes switched the mode (a @torch.no_grad() method of torch's own, as
            # spectral norm's power iteration): the runtime must switch it there too. Not for a custom op: what
            # turned grad off there is the autograd.Function wrapping its kernel, which the op's call replays.
            self.record_grad_mode(torch.is_grad_enabled())
        device = self._output_device(info, records, tensor_metas)
        positional = run_values[:info.num_positional]
        keyword = {info.names[i]: run_values[i] for i in range(info.num_positional, len(run_values))}
        try:
            # kiln's shape rules (C++); not for an op recorded whole, whose result must carry autograd's history
            result = None if self._inside_whole_op else _C._meta_from_rules(info.qualified, records, run_values)
            if result is None:
                if info.python_meta is None:
                    info.python_meta = _torch_meta.has_python_meta(info.qualified)
                if info.python_meta:
                    _torch_meta.avoid_dynamo_import()
                result = func(*positional, **keyword)
        except NotImplementedError as e:
            raise errors.Unsupported(f"{info.qualified} has no meta kernel, so kiln cannot capture it: {e}") from e
        except Exception as e:
            if info.data_dependent:
                raise errors.Unsupported(f"{info.qualified} cannot be captured here: its output depends on "
                                         f"tensor data ({e})") from e
            if isinstance(e, RuntimeError) and _needs_data(e):
                raise errors.Unsupported(f"{info.qualified} cannot run on fake tensors: {e}") from e
            raise

        if info.op == "aten::scaled_dot_product_attention" and _fused_attention_layout(positional):
            result = _as_fused_attention_output(result)
        if info.op in _CONVOLUTIONS:
            result = self._convolution_layout(info.op, run_values, result)
        outputs = list(result) if info.returns_list or info.num_returns > 1 else \
            ([] if info.num_returns == 0 else [result])
        node_index = len(self._nodes)
        if requires_grad is None:
            requires_grad = torch.is_grad_enabled() and any(t.requires_grad for t in _tensor_args(args, kwargs))
        if requires_grad:
            # A graph that needs grad gets its backward's metadata from torch's meta kernels (MetaOracle in
            # compile/meta_oracle.cpp), not from kiln's rules: their dynamo-disable wrappers are patched first
            # (else threshold_backward's imports torch._dynamo).
            _torch_meta.avoid_dynamo_import()
        if (not tensor_metas and outputs and torch.Tag.nondeterministic_seeded not in func.tags
                and all(isinstance(o, torch.Tensor) and o.device.type != "meta" for o in outputs)):
            # Python numbers only (torch.div(n, 2, rounding_mode="trunc") of ints): ATen computed the result for real,
            # from values the trace holds as constants (the tracer pins a size it passed to a call that records no
            # op). It is a constant of the graph, as torch.tensor(...) is. (Not a random op's: each call draws anew.)
            lifted = [self._lift_constant(o) for o in outputs]
            return lifted if info.returns_list or info.num_returns > 1 else lifted[0]
        output_ids = []
        for out in outputs:
            if not isinstance(out, torch.Tensor) or out.device.type != "meta":
                raise errors.Unsupported(f"{info.qualified} returned {type(out).__name__}, not a tensor")
            vid = self._new_value("node", out, device, node_index,
                                  requires_grad=requires_grad and (out.is_floating_point() or out.is_complex()))
            self._map(out, vid)
            output_ids.append(vid)
        if info.size_args:
            self._size_args[len(self._nodes)] = info.size_args
        self._nodes.append((info.op, info.overload, records, info.names, info.num_positional, output_ids,
                            info.returns_list, info.mutates_args, info.is_view))
        return result

    def _record_out_as_copy(self, info, args, kwargs):
        """An out= call (`torch.div(a, b, out=u)`, F.normalize's in spectral norm) recorded as its functional twin and
        a copy_ into `out`: in-place copies are what the functionalization passes turn into fresh values and buffer
        write-backs. None (record the out= op as it is) for an `out` the recorder does not know; Unsupported (a graph
        break) when eager would resize or cast it."""
        out_index = info.written_args[0]
        out = kwargs.get(info.names[out_index])
        if not isinstance(out, torch.Tensor) or self.value_id(out) is None:
            return None
        kwargs = {k: v for k, v in kwargs.items() if k != info.names[out_index]}
        result = self._record(info.functional_twin, args, kwargs)
        if result.shape != out.shape or result.dtype != out.dtype:
            raise errors.Unsupported(f"{info.qualified} with an out= tensor eager would resize or cast")
        return self._record(torch.ops.aten.copy_.default, (out, result), {})

    def _convolution_layout(self, op, run_values, result):
        """`result` of a convolution (or its backward) laid out as ATen lays it out on the real device.

        Meta tensors have no device, so torch's meta kernel leaves every result contiguous, where ATen gives a
        channels-last result for channels-last operands (on the CPU even for a channels-last weight alone): the
        graph's outputs would not have eager's strides. ATen's own backend choice answers, asked about stand-ins on
        the real device; an operand layout it cannot judge keeps the meta kernel's answer."""
        backward = op == "aten::convolution_backward"
        first = 1 if backward else 0
        fake_input, weight = run_values[first], run_values[first + 1]
        if weight.dim() not in (4, 5) or (fake_input.is_contiguous() and weight.is_contiguous()):
            return result
        device = self.device_of(fake_input)
        stand_ins = [_DeviceProxy(t, device, False) for t in (fake_input, weight)]
        names = ("stride", "padding", "dilation", "transposed", "output_padding", "groups")
        params = dict(zip(names, run_values[first + 3:first + 9]))
        try:
            if backward:
                backend = torch._C._select_conv_backend(*stand_ins, None, bias_sizes=run_values[3], **params)
            else:
                backend = torch._C._select_conv_backend(*stand_ins, run_values[2], **params)
            memory_format = torch._C._conv_determine_backend_memory_format(*stand_ins, backend)
        except Exception:  # an operand ATen would look into: the meta kernel's layout stands
            return result
        if backward:
            return tuple(t if t is None or i == 2 else t.to(memory_format=memory_format) for i, t in enumerate(result))
        return result.to(memory_format=memory_format)

    def _convert_arg(self, info, index, value, tensor_metas):
        """-> ((tag, payload) for graph/py_records.h, the value to run the op with on meta)."""
        if isinstance(value, torch.Tensor):
            vid, run_value = self._tensor_ref(value)
            tensor_metas.append(self._values[vid][1])
            return ("tensor", vid), run_value
        if value is None:
            if index in info.device_args and not info.has_tensor_args:
                return ("none", None), torch.device("meta")  # factory with the default device
            return ("none", None), None
        if isinstance(value, bool):
            return ("bool", value), value
        if isinstance(value, int):
            if index in info.float_args:
                return ("float", float(value)), value
            return ("int", value), value
        if isinstance(value, float):
            return ("float", value), value
        if isinstance(value, complex):
            return ("complex", value), value
        if isinstance(value, str):
            return ("str", value), value
        if isinstance(value, torch.dtype):
            return ("dtype", _codes()["dtypes"][value]), value
        if isinstance(value, torch.layout):
            return ("layout", _codes()["layouts"][value]), value
        if isinstance(value, torch.memory_format):
            return ("memory_format", _codes()["memory_formats"][value]), value
        if isinstance(value, torch.device):
            # device='meta' comes from a fake's .device (user code's `device=x.device`, or a composite
            # op's internal empty(..., device=input.device)): it means the recorder's logical device.
            code = self.logical_device_code() if value.type == "meta" else _device_code(value)
            return ("device", code), torch.device("meta")
        if isinstance(value, torch.Generator):
            raise errors.Unsupported(f"{info.qualified} was given an explicit torch.Generator")
        if isinstance(value, (list, tuple)):
            kind = info.list_kinds.get(index, "ints")
            if kind == "tensors":
                ids, run_items = [], []
                for item in value:
                    if item is None:
                        ids.append(None)
                        run_items.append(None)
                    else:
                        vid, run_item = self._tensor_ref(item)
                        tensor_metas.append(self._values[vid][1])
                        ids.append(vid)
                        run_items.append(run_item)
                return ("tensors", ids), run_items
            convert = {"ints": int, "floats": float, "bools": bool}[kind]
            return (kind, [convert(v) for v in value]), value
        raise errors.Unsupported(f"{info.qualified}: argument '{info.names[index]}' is a "
                                 f"{type(value).__name__}, which kiln graphs cannot hold")

    def _tensor_ref(self, t):
        """-> (ValueId, the meta tensor to run with) for a tensor argument."""
        if self._tensors.get(id(t)) is t:
            vid = self._value_of[id(t)]
            if t.device.type == "meta":
                return vid, t
        if t.device.type == "meta":
            raise errors.Unsupported("a meta tensor that kiln did not create reached a captured op")
        vid = self._constant(t)
        return vid, self._constant_of[id(t)][2]

    def _constant(self, real):
        entry = self._constant_of.get(id(real))
        if entry is not None and entry[0] is real:
            return entry[1]
        if real.layout != torch.strided or real.is_quantized:
            raise errors.Unsupported(f"kiln graphs hold dense strided constants only, got a {real.layout} tensor")
        twin = _meta_twin(real)
        vid = self._new_value("constant", real, _device_code(real.device), real,
                              requires_grad=real.requires_grad)
        self._journaled_set(self._constant_of, id(real), (real, vid, twin))
        self._map(twin, vid)
        return vid

    def _fresh_real(self, t):
        """The data of `t` when it is the fake of a constant made inside the trace (torch.tensor(...), an op over
        Python numbers), which nothing writes: its values are the trace's; None for anything else."""
        if not isinstance(t, torch.Tensor) or self._tensors.get(id(t)) is not t:
            return None
        vid = self._value_of.get(id(t))
        if vid not in self._fresh_constants:
            return None
        for real, entry_vid, _ in self._constant_of.values():
            if entry_vid == vid:
                return real
        return None

    def _fresh_constant_read(self, fn, args):
        """For a value read (item, tolist, int(), ...) of a fresh constant: the constant's data to read instead."""
        name = getattr(fn, "__name__", None)
        if name not in _VALUE_READS:
            return None
        owner = getattr(fn, "__self__", None)
        if not isinstance(owner, torch.Tensor):
            owner = args[0] if args and getattr(torch.Tensor, name, None) is fn else None
        return self._fresh_real(owner)

    def _lift_constant(self, real):
        """torch.tensor(...) inside captured code: the data becomes a graph constant held by reference."""
        vid = self._constant(real)
        self._fresh_constants.add(vid)
        return self._constant_of[id(real)][2]

    def _output_device(self, info, records, tensor_metas):
        for i in info.device_args:
            if records[i][0] == "device":
                return records[i][1]
        # Like TensorIterator: a 0-dim CPU tensor does not decide the device when others are present.
        for meta in tensor_metas:
            if not (meta[0] == () and meta[4] == _codes()["device_types"]["cpu"]):
                return (meta[4], meta[5])
        if tensor_metas:
            return (tensor_metas[0][4], tensor_metas[0][5])
        return _device_code(torch.get_default_device())

    # ---- bookkeeping -------------------------------------------------------------------------------
    def _new_value(self, kind, tensor, device, extra, requires_grad):
        meta = [tuple(tensor.size()), tuple(tensor.stride()), tensor.storage_offset(),
                _codes()["dtypes"][tensor.dtype], device[0], device[1], bool(requires_grad)]
        self._values.append([kind, meta, extra])
        self._value_tensors.append(tensor)
        return len(self._values) - 1

    def _map(self, tensor, vid):
        self._journaled_set(self._value_of, id(tensor), vid)
        self._tensors[id(tensor)] = tensor

    def _journaled_set(self, table, key, value):
        if self._journal is not None:
            self._journal.append((table, key, table.get(key, _MISSING)))
        table[key] = value

    def _undo(self, num_values, num_nodes):
        for table, key, old in reversed(self._journal or []):
            if old is _MISSING:
                table.pop(key, None)
            else:
                table[key] = old
        del self._values[num_values:]
        del self._value_tensors[num_values:]
        del self._nodes[num_nodes:]
        self._grad_mode = next((n[2][0][1] for n in reversed(self._nodes) if n[0] == "kiln::set_grad_enabled"),
                               self._entry_grad_mode)
        self._size_args = {n: a for n, a in self._size_args.items() if n < num_nodes}
        self._fresh_constants = {v for v in self._fresh_constants if v < num_values}

    def _refresh_requires_grad(self, first_value):
        """Autograd sets requires_grad on results after the mode returns: copy it into the meta of
        values whose fake still stands for them (earlier values of an in-place chain keep the estimate)."""
        for vid in range(first_value, len(self._values)):
            tensor = self._value_tensors[vid]
            if self._values[vid][0] == "node" and self._value_of.get(id(tensor)) == vid:
                self._values[vid][1][6] = bool(tensor.requires_grad)

    def _refuse_escaping_method(self, fn, args, kwargs):
        name = getattr(fn, "__name__", None)
        if name not in _ESCAPING_METHODS and name != "requires_grad_":
            return
        owner = getattr(fn, "__self__", None)
        bound = isinstance(owner, torch.Tensor)
        if not bound:  # the unbound form: torch.Tensor.numpy(fake)
            owner = args[0] if args and getattr(torch.Tensor, name, None) is fn else None
        if owner is None or not self.is_fake(owner):
            return
        if name == "requires_grad_":
            # Turning a value into a leaf that requires grad (or back) changes what autograd records around the
            # graph, which a graph cannot: the call runs eagerly. Asking for what it has already is captured.
            rest = args if bound else args[1:]
            wanted = bool(kwargs.get("requires_grad", rest[0] if rest else True))
            if wanted != owner.requires_grad:
                raise errors.Unsupported("Tensor.requires_grad_() changing requires_grad cannot be captured: the tensor "
                                         "becomes an autograd leaf")
            return
        raise errors.Unsupported(f"Tensor.{name}() cannot be captured: {_ESCAPING_METHODS[name]}")


def _fused_attention_layout(args):
    """True when scaled_dot_product_attention's run will likely pick a fused kernel (flash / memory-efficient on
    CUDA, flash on CPU), whose output is laid out (batch, length, heads, head_dim) and returned transposed to
    (batch, heads, length, head_dim): dense 4-d query, key and value of one floating dtype with unit stride in
    head_dim, head_dim a multiple of 8 up to 256, no boolean mask. On meta tensors ATen can only take the math
    path, whose output is contiguous; recording that layout made `out.transpose(1, 2).reshape(b, n, c)` a copy,
    and the run copied the fused kernel's output into it first (vit on an H200: 310 us per call). A wrong guess
    costs that one copy back: the run copies an extern result that disagrees with its recorded layout before a
    kernel reads it."""
    q, k, v = args[:3]
    mask = args[3] if len(args) > 3 else None
    if mask is not None and mask.dtype == torch.bool:
        return False
    for t in (q, k, v):
        if t.dim() != 4 or t.dtype != q.dtype or t.stride(-1) != 1 or t.size(0) != q.size(0):
            return False
    head_dim = q.size(-1)
    return (q.dtype in (torch.float32, torch.float16, torch.bfloat16) and head_dim % 8 == 0 and
            head_dim <= 256 and k.size(-1) == head_dim and v.size(-1) == head_dim and q.numel() > 0)


def _as_fused_attention_output(result):
    """`result` (batch, heads, length, head_dim) laid out as the fused kernels lay it out. Made from `result` (not
    anew) so that it keeps its autograd history; runs inside the whole op, unrecorded."""
    return result.transpose(1, 2).contiguous().transpose(1, 2)


_CONVOLUTIONS = ("aten::convolution", "aten::_convolution", "aten::convolution_backward")


@functools.lru_cache(maxsize=None)
def _plain_tensor_type(cls):
    """Whether ops on tensors of type `cls` mean what they mean on torch.Tensor: Tensor and Parameter, and
    subclasses that switch both overrides off. Any other subclass (`as_subclass` types, whose results keep the
    subclass; DTensor and other __torch_dispatch__ wrappers) is not recorded as a plain tensor."""
    if cls is torch.Tensor or cls is torch.nn.Parameter:
        return True
    function = getattr(cls.__torch_function__, "__func__", cls.__torch_function__)
    dispatch = getattr(cls.__torch_dispatch__, "__func__", cls.__torch_dispatch__)
    return function is torch._C._disabled_torch_function_impl and dispatch is torch._C._disabled_torch_dispatch_impl


def _tensor_args(args, kwargs):
    """The tensors among an op's arguments (lists included), for the requires_grad estimate."""
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, torch.Tensor))


_INDEXING_CALLS = (operator.getitem, operator.setitem, torch.Tensor.__getitem__, torch.Tensor.__setitem__)


def _int_list(items):
    """A non-empty list (nested lists allowed) whose leaves are Python ints or bools."""
    if not items:
        return False
    return all(_int_list(i) if isinstance(i, list) else isinstance(i, int) for i in items)


def _describe(fn):
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    module = getattr(fn, "__module__", None)
    return f"{module}.{name}" if module and module not in ("builtins",) else name
