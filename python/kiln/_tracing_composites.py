"""Python twins of ATen composites that compute sizes from their input's, for traces with symbolic sizes
(csrc/trace/calls.cpp, call_recorded). Run on the fakes, `x.narrow(-1, 1, n)` records slice(x, -1, 1, 1 + n) with an
end ATen computed in C++, a literal the graph cannot follow when the size changes. Inlined by the tracer instead,
each twin computes those ints in traced Python, where they are expressions over the size symbols, and calls the ops
the composite calls. Each does exactly what its composite does, down to the view it returns; where a case is not
one it covers (a tensor start, an out-of-range index), it calls the composite's own overload, which raises eager's
error or records it as before. Re-exported by kiln._tracing, where the tracer looks its helpers up."""
import torch

_aten = torch.ops.aten


def _wrapped_dim(dim, ndim):
    return dim + ndim if dim < 0 else dim


def narrow(self, dim, start, length):
    """at::narrow: slice(self, dim, start, start + length) after its range checks."""
    if not isinstance(start, int) or not isinstance(length, int) or not isinstance(dim, int):
        return _aten.narrow.default(self, dim, start, length)
    d = _wrapped_dim(dim, self.dim())
    if self.dim() == 0 or not 0 <= d < self.dim():
        return _aten.narrow.default(self, dim, start, length)
    size = self.shape[d]
    if start < 0:
        start = start + size
    if start < 0 or start > size or length < 0 or start + length > size:
        return _aten.narrow.default(self, dim, start, length)
    return _aten.slice.Tensor(self, d, start, start + length, 1)


def chunk(self, chunks, dim=0):
    """at::chunk: split(self, ceil(size / chunks), dim) (the pieces' number is the split rule's to guard)."""
    if not isinstance(chunks, int) or not isinstance(dim, int) or self.dim() == 0 or chunks <= 0:
        return _aten.chunk.default(self, chunks, dim)
    d = _wrapped_dim(dim, self.dim())
    if not 0 <= d < self.dim():
        return _aten.chunk.default(self, chunks, dim)
    size = self.shape[d]
    if size == 0:
        return _aten.chunk.default(self, chunks, dim)
    return _aten.split.Tensor(self, (size + chunks - 1) // chunks, d)


def diff(self, n=1, dim=-1, prepend=None, append=None):
    """at::diff: prepend and append concatenated, then n times the difference of two narrows (logical_xor for
    bools)."""
    if not isinstance(n, int) or not isinstance(dim, int) or n < 0 or self.dim() == 0:
        return _aten.diff.default(self, n, dim, prepend, append)
    d = _wrapped_dim(dim, self.dim())
    if not 0 <= d < self.dim():
        return _aten.diff.default(self, n, dim, prepend, append)
    if prepend is not None or append is not None:
        parts = [t for t in (prepend, self, append) if t is not None]
        if not all(isinstance(t, torch.Tensor) and t.dim() == self.dim() for t in parts):
            return _aten.diff.default(self, n, dim, prepend, append)
        self = _aten.cat.default(parts, d)
    if n >= self.shape[d]:  # (ATen stops at an empty result)
        return _aten.diff.default(self, n, d)
    for _ in range(n):
        size = self.shape[d]
        later = _aten.slice.Tensor(self, d, 1, size, 1)
        earlier = _aten.slice.Tensor(self, d, 0, size - 1, 1)
        self = _aten.logical_xor.default(later, earlier) if self.dtype == torch.bool else later - earlier
    return self


def unflatten(self, dim, sizes):
    """at::unflatten: a view with dim replaced by `sizes` (one of them may be -1). Named sizes are refused by the
    overload called instead (the call then runs eagerly)."""
    if not isinstance(dim, int) or not isinstance(sizes, (list, tuple)) or self.dim() == 0:
        return _aten.unflatten.int(self, dim, sizes)
    if len(sizes) == 0 or not all(isinstance(s, int) for s in sizes):
        return _aten.unflatten.int(self, dim, sizes)
    d = _wrapped_dim(dim, self.dim())
    if not 0 <= d < self.dim():
        return _aten.unflatten.int(self, dim, sizes)
    shape = self.shape
    return _aten.view.default(self, [*shape[:d], *sizes, *shape[d + 1:]])


def tensor_split(self, indices_or_sections, dim=0):
    """at::tensor_split by a number of sections (the first size % sections pieces one longer) or by a list of
    indices: slices of dim."""
    if not isinstance(dim, int) or self.dim() == 0:
        return _aten.tensor_split.sections(self, indices_or_sections, dim) if isinstance(indices_or_sections, int) \
            else torch._C._VariableFunctions.tensor_split(self, indices_or_sections, dim)
    d = _wrapped_dim(dim, self.dim())
    if not 0 <= d < self.dim():
        return torch._C._VariableFunctions.tensor_split(self, indices_or_sections, dim)
    size = self.shape[d]
    if isinstance(indices_or_sections, int):
        sections = indices_or_sections
        if sections <= 0:
            return _aten.tensor_split.sections(self, sections, dim)
        shortest, longer = size // sections, size % sections
        pieces, start = [], 0
        for i in range(sections):
            length = shortest + 1 if i < longer else shortest
            pieces.append(_aten.slice.Tensor(self, d, start, start + length, 1))
            start = start + length
        return tuple(pieces)
    if isinstance(indices_or_sections, (list, tuple)) and all(isinstance(i, int) for i in indices_or_sections):
        pieces, start = [], 0
        for index in indices_or_sections:
            pieces.append(_aten.slice.Tensor(self, d, start, index, 1))
            start = index
        pieces.append(_aten.slice.Tensor(self, d, start, size, 1))
        return tuple(pieces)
    return torch._C._VariableFunctions.tensor_split(self, indices_or_sections, dim)


SYMBOLIC_TWINS = {
    torch.Tensor.narrow: narrow, torch.narrow: narrow,
    torch.Tensor.chunk: chunk, torch.chunk: chunk,
    torch.Tensor.diff: diff, torch.diff: diff,
    torch.Tensor.unflatten: unflatten, torch.unflatten: unflatten,
    torch.Tensor.tensor_split: tensor_split, torch.tensor_split: tensor_split,
}
