"""Python-side helpers of kiln's C++ tracer (csrc/trace/log_calls.cpp, object_copies.cpp) about Python protocols it
rebuilds rather than inlines: which logger calls are deferred after the graph, which objects deepcopy copies by the
default protocol. Re-exported by kiln._tracing, where the tracer looks its helpers up."""


class _PlainLayout:
    pass


# Methods of a logging.Logger (or LoggerAdapter) that only emit a record: those named after a level, and functions set
# on the class that carry a level's name with a suffix (warning_once, warning_advice, info_once: a library's wrappers
# around the level method). exception() and exc_info/stack_info read the Python stack of the moment: not deferred.
_LOG_LEVEL_METHODS = frozenset(("debug", "info", "warning", "warn", "error", "critical", "fatal", "log"))
_LOG_UNDEFERRABLE_KEYWORDS = frozenset(("exc_info", "stack_info"))


def is_log_call(function, self, kwnames):
    """Whether `function` bound to `self`, called with keyword names `kwnames`, is a logging call the compiled frame
    may make after its graph (in program order with the traced assignments) rather than where the traced code made
    it: a level method of a logger, whose only effect is the record it hands to the logger's handlers."""
    import logging
    if not isinstance(self, (logging.Logger, logging.LoggerAdapter)):
        return False
    name = getattr(function, "__name__", None)
    if not isinstance(name, str) or not callable(function):
        return False
    if name not in _LOG_LEVEL_METHODS and name.split("_", 1)[0] not in _LOG_LEVEL_METHODS:
        return False
    return not _LOG_UNDEFERRABLE_KEYWORDS.intersection(kwnames)


def is_plain_constant(value):
    """Whether `value` is an immutable plain value (None, numbers, strings, bytes, torch dtypes, devices and sizes,
    and tuples or frozensets of them): one the trace may hold as a constant for as long as its inputs are the same."""
    import torch
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes, torch.dtype, torch.device)):
        return True
    if isinstance(value, (tuple, frozenset)) and type(value) in (tuple, frozenset, torch.Size):
        return all(is_plain_constant(v) for v in value)
    return False


def is_deferrable_output_call(function, self, kwnames):
    """Whether a plain call `function(...)` (self is None) only writes output, so the compiled frame may make it after
    its graph like a logging call: warnings.warn while no warnings filter turns a warning into an error (then it must
    raise where the code made it)."""
    import warnings
    if function is warnings.warn:
        return not any(f[0] == "error" for f in warnings.filters)
    return False


def deepcopy_refusal(obj):
    """Why copy.deepcopy(obj) of a plain object is not traced as a new object made of copies of its __dict__ (csrc/trace
    /object_copies.cpp), or None when it is: what deepcopy's default protocol does for it (object.__reduce_ex__(4):
    `cls.__new__(cls)`, then its __dict__ updated with a deep copy of the original's, no __setstate__), with the class
    free of anything that would change that (__deepcopy__, a reducer, __getstate__/__setstate__, __slots__, a C base).
    The probes deepcopy makes on the instance (getattr(x, "__deepcopy__"), x.__reduce_ex__) are asked for real."""
    import copy
    import copyreg
    cls = type(obj)
    if cls in copy._deepcopy_dispatch or cls in copyreg.dispatch_table or issubclass(cls, type):
        return f"{cls.__name__} has its own copier"
    if cls.__basicsize__ != _PlainLayout.__basicsize__ or not cls.__dictoffset__ or cls.__new__ is not object.__new__:
        return f"{cls.__name__} is not laid out as a plain Python object (a C base, __slots__ or __new__)"
    if any("__slots__" in vars(base) and vars(base)["__slots__"] not in ((), "__dict__", ("__dict__",), ("__weakref__",),
                                                                          ("__dict__", "__weakref__"))
           for base in cls.__mro__[:-1]):
        return f"{cls.__name__} has __slots__"
    for name in ("__reduce_ex__", "__reduce__", "__getstate__"):
        if getattr(cls, name, None) is not getattr(object, name, None):
            return f"{cls.__name__} defines {name}"
    for name in ("__deepcopy__", "__setstate__", "__getattr__"):
        if hasattr(cls, name):
            return f"{cls.__name__} defines {name}"
    try:
        if getattr(obj, "__deepcopy__", None) is not None or getattr(obj, "__setstate__", None) is not None:
            return "its instance answers __deepcopy__ or __setstate__"
    except Exception as e:  # noqa: BLE001 - eager would raise it from deepcopy: not traced
        return f"reading its copy protocol raised {type(e).__name__}"
    if not isinstance(vars(obj), dict) or type(vars(obj)) is not dict:
        return "its __dict__ is not a dict"
    return None


def deepcopy_is_identity(value):
    """True when copy.deepcopy(value) returns value itself (None, numbers, strings, classes, functions, dtypes...)."""
    import copy
    try:
        return copy.deepcopy(value) is value
    except Exception:  # noqa: BLE001 - not traced; eager raises it
        return False
