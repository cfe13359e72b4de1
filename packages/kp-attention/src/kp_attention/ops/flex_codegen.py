"""Flex mods traced with torch.fx and written out as Triton functions that kp's flex kernels call.

A score_mod `f(score, b, h, q_idx, kv_idx)` or mask_mod `f(b, h, q_idx, kv_idx)` is traced once per
fingerprint (its code, the values it closes over and the globals it names; tensors by dtype, rank and
requires_grad only), and the trace becomes a module of @triton.jit functions, written to a per-process folder
(Triton reads a kernel's source from its file):

    fwd(score, b, h, q_idx, kv_idx, C0, C1, C2, C3, META)           the modded score (fp32), for a score_mod
    bwd(grad, score, b, h, q_idx, kv_idx, C0..C3, META, G0..G3, valid)
        d(mod)/d(score) * grad, and grad * d(mod)/d(capture) added atomically into G_k at each read element
    fwd(b, h, q_idx, kv_idx, C0, C1, C2, C3, META)                  a bool, for a mask_mod

Inside a kernel score is a (rows, cols) fp32 tile, b and h are scalars, q_idx a column and kv_idx a row of int32
indices, so the traced expression broadcasts as it did on PyTorch tensors. Tensors the mod reads (a bias table,
document ids, ALiBi slopes) are its captures, C0..C3 at most, found again at each call in the function's closure
or globals (`captures`), so a new tensor of the same dtype and rank reuses the kernel. META (int64, 8 per
capture) holds their sizes and strides; an index outside a capture wraps once if negative, as in PyTorch, and is
then clamped into it (PyTorch would raise; a kernel must never read outside the tensor).

The reference path evaluates the same trace with PyTorch (`Mod.evaluate`), captures substituted.
"""

import dataclasses
import hashlib
import importlib.util
import inspect
import math
import operator
import os
import sys
import tempfile
import types
from collections.abc import Callable
from typing import Optional

import torch
import torch.fx as fx

from kp_core import jit_keys

MAX_CAPTURES = 4
MAX_CAPTURE_DIMS = 4
META_STRIDE = 8  # per capture: 4 sizes, 4 strides
SCORE_ARGS = ("score", "b", "h", "q_idx", "kv_idx")
MASK_ARGS = ("b", "h", "q_idx", "kv_idx")

_BINARY = {
    operator.add: "+",
    operator.sub: "-",
    operator.mul: "*",
    operator.truediv: "/",
    operator.and_: "&",
    operator.or_: "|",
    operator.xor: "^",
    operator.eq: "==",
    operator.ne: "!=",
    operator.lt: "<",
    operator.le: "<=",
    operator.gt: ">",
    operator.ge: ">=",
}
_TORCH_BINARY = {
    "add": operator.add,
    "sub": operator.sub,
    "subtract": operator.sub,
    "mul": operator.mul,
    "multiply": operator.mul,
    "div": operator.truediv,
    "true_divide": operator.truediv,
    "floor_divide": operator.floordiv,
    "remainder": operator.mod,
    "fmod": None,  # C remainder: not the same as %, not supported
    "eq": operator.eq,
    "ne": operator.ne,
    "lt": operator.lt,
    "le": operator.le,
    "gt": operator.gt,
    "ge": operator.ge,
    "bitwise_and": operator.and_,
    "logical_and": operator.and_,
    "bitwise_or": operator.or_,
    "logical_or": operator.or_,
    "bitwise_xor": operator.xor,
    "logical_xor": operator.xor,
    "__and__": operator.and_,
    "__or__": operator.or_,
    "__xor__": operator.xor,
    "__add__": operator.add,
    "__sub__": operator.sub,
    "__mul__": operator.mul,
    "__truediv__": operator.truediv,
    "__floordiv__": operator.floordiv,
    "__mod__": operator.mod,
    "__eq__": operator.eq,
    "__ne__": operator.ne,
    "__lt__": operator.lt,
    "__le__": operator.le,
    "__gt__": operator.gt,
    "__ge__": operator.ge,
    "maximum": "maximum",
    "minimum": "minimum",
}
# unary float functions: Triton expression of x (helpers from flex_kernels where tl has none)
_FLOAT_UNARY = {
    "tanh": "tanh({})",
    "exp": "tl.exp({})",
    "exp2": "tl.math.exp2({})",
    "log": "tl.log({})",
    "log2": "tl.math.log2({})",
    "sqrt": "tl.sqrt({})",
    "rsqrt": "(1.0 / tl.sqrt({}))",
    "sigmoid": "sigmoid({})",
    "sin": "tl.sin({})",
    "cos": "tl.cos({})",
}
_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


class ModError(ValueError):
    """A mod kp cannot compile: the message names the function and what to change."""


@dataclasses.dataclass(frozen=True)
class Value:
    name: str  # a Triton expression or variable
    kind: str  # "f" float, "i" int, "b" bool
    tile: bool  # depends on q_idx, kv_idx or score (else a scalar of b, h and constants)
    grad: bool = False  # a float on the path from score or a capture that needs a gradient


@dataclasses.dataclass
class Mod:
    """One traced mod and its generated Triton functions."""

    kind: str  # "score" or "mask"
    name: str  # the user's function, for messages
    key: str  # the op's handle for it (hash of the generated source)
    graph: fx.GraphModule
    paths: tuple  # where each capture lives in the function (see captures)
    capture_kinds: tuple  # per capture: (dtype, ndim, requires_grad) at trace time
    module: types.ModuleType  # the generated Triton functions

    def evaluate(self, captures: tuple, *args) -> torch.Tensor:
        """The mod in PyTorch on broadcast index tensors (the reference path), captures substituted."""
        out = _Evaluator(self.graph, captures).run(*args)
        return torch.as_tensor(out, device=args[-1].device)


class _Evaluator(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, captures: tuple):
        super().__init__(gm)
        self._by_name = dict(zip(gm._kp_capture_names, captures))

    def get_attr(self, target, args, kwargs):
        return self._by_name[target]


# ---- fingerprints and capture paths ----


def _referenced_names(code: types.CodeType) -> set:
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _referenced_names(c)
    return names


def _children(fn):
    """(path step, value) of what fn's trace can read: closure cells and the globals its code names (and the items
    of a tuple or list of functions, such as and_masks closes over)."""
    if isinstance(fn, (tuple, list)):
        yield from ((("item", i), v) for i, v in enumerate(fn))
        return
    code = getattr(fn, "__code__", None)
    if code is None:
        return
    for i, cell in enumerate(fn.__closure__ or ()):
        try:
            yield ("cell", i), cell.cell_contents
        except ValueError:  # an empty cell
            continue
    g = getattr(fn, "__globals__", {})
    for name in sorted(_referenced_names(code)):
        if name in g:
            yield ("global", name), g[name]


def _fingerprint(fn: Callable, depth: int = 0):
    """A hashable key of what the trace of fn depends on, or None where a value cannot be keyed (then traced per
    call)."""
    if depth > 6:
        return None
    parts = [getattr(fn, "__code__", None) or type(fn).__name__]
    for step, value in _children(fn):
        if isinstance(value, torch.Tensor):
            parts.append((step, "T", value.dtype, value.dim(), value.requires_grad))
        elif isinstance(value, types.FunctionType) or _functions(value):
            sub = _fingerprint(value, depth + 1)
            if sub is None:
                return None
            parts.append((step, sub))
        elif isinstance(value, (int, float, bool, str, type(None), torch.dtype)):
            parts.append((step, type(value).__name__, value))
        elif isinstance(value, (types.ModuleType, types.BuiltinFunctionType, type)):
            parts.append((step, "M", id(value)))
        elif isinstance(value, tuple) and all(isinstance(v, (int, float, bool)) for v in value):
            parts.append((step, value))
        else:
            return None
    return tuple(parts)


def _find(fn: Callable, target: torch.Tensor, depth: int = 0) -> Optional[tuple]:
    for step, value in _children(fn):
        if value is target:
            return (step,)
        if (isinstance(value, types.FunctionType) or _functions(value)) and depth < 6:
            sub = _find(value, target, depth + 1)
            if sub is not None:
                return (step, *sub)
    return None


def _functions(value) -> bool:
    return isinstance(value, (tuple, list)) and len(value) > 0 and all(callable(v) for v in value)


def captures(fn: Callable, paths: tuple) -> tuple:
    """The tensors at `paths` in fn now (plain attribute reads, which torch.compile traces)."""
    out = []
    for path in paths:
        value = fn
        for kind, where in path:
            if kind == "cell":
                value = value.__closure__[where].cell_contents
            elif kind == "global":
                value = value.__globals__[where]
            else:
                value = value[where]
        out.append(value)
    return tuple(out)


# ---- tracing ----

_CACHE: dict = {}
_BY_KEY: dict = {}
_FOLDER: Optional[str] = None


def by_key(key: str) -> Optional[Mod]:
    """The mod a key names ('' for none)."""
    if not key:
        return None
    mod = _BY_KEY.get(key)
    if mod is None:
        raise KeyError(f"kp_attention.flex: no traced mod has key {key!r} in this process (trace it first)")
    return mod


def _fn_name(fn: Callable) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def trace(fn: Callable, kind: str) -> Mod:
    """The Mod of fn (a score_mod for kind 'score', a mask_mod for 'mask'), traced and generated once per
    fingerprint."""
    name = _fn_name(fn)
    arg_names = SCORE_ARGS if kind == "score" else MASK_ARGS
    if not callable(fn):
        raise TypeError(f"{kind}_mod must be callable, got {type(fn).__name__}")
    try:
        sig = inspect.signature(fn)
        n_args = len([p for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)])
    except (TypeError, ValueError):
        n_args = -1
    if n_args != len(arg_names):
        raise TypeError(f"{kind}_mod {name} must take {len(arg_names)} arguments {arg_names}, it takes {n_args}")
    key = _fingerprint(fn)
    key = None if key is None else (kind, key)
    if key is not None and key in _CACHE:
        return _CACHE[key]
    mod = _trace(fn, kind, name, arg_names)
    if key is not None:
        if len(_CACHE) > 512:
            _CACHE.clear()
        _CACHE[key] = mod
    return mod


def _trace(fn: Callable, kind: str, name: str, arg_names: tuple) -> Mod:
    # fx names the graph's inputs after the traced function's parameters: these, whatever fn calls its own
    if kind == "score":

        def traceable(score, b, h, q_idx, kv_idx):
            return fn(score, b, h, q_idx, kv_idx)

    else:

        def traceable(b, h, q_idx, kv_idx):
            return fn(b, h, q_idx, kv_idx)

    try:
        gm = fx.symbolic_trace(traceable)
    except fx.proxy.TraceError as e:
        raise ModError(
            f"{kind}_mod {name}: {e} (a Python `if`, `and`/`or` or bool() on a traced value: use torch.where, & and |)"
        ) from None
    except Exception as e:  # what the function itself raised on proxies
        raise ModError(f"{kind}_mod {name} cannot be traced: {type(e).__name__}: {e}") from None
    tensors, paths, names = [], [], []
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        t = getattr(gm, node.target)
        for i, seen in enumerate(tensors):
            if seen is t:
                node.target = names[i]
                break
        else:
            path = _find(fn, t)
            if path is None:
                raise ModError(
                    f"{kind}_mod {name} reads a tensor that is neither in its closure nor a global it names "
                    f"(shape {tuple(t.shape)}): make it one"
                )
            tensors.append(t)
            paths.append(path)
            names.append(node.target)
    if len(tensors) > MAX_CAPTURES:
        raise ModError(f"{kind}_mod {name} reads {len(tensors)} tensors; at most {MAX_CAPTURES} are supported")
    for t in tensors:
        if t.dim() > MAX_CAPTURE_DIMS:
            raise ModError(f"{kind}_mod {name} reads a {t.dim()}-D tensor; at most {MAX_CAPTURE_DIMS}-D")
        if t.is_complex():
            raise ModError(f"{kind}_mod {name} reads a complex tensor")
    gm._kp_capture_names = names
    kinds = tuple((t.dtype, t.dim(), bool(t.requires_grad and t.is_floating_point())) for t in tensors)
    source = _Writer(gm, kind, name, kinds).source()
    digest = hashlib.sha1(source.encode()).hexdigest()[:16]
    module = _load(f"kp_flex_{kind}_{digest}", source)
    key = f"{kind}:{digest}"
    mod = Mod(kind, name, key, gm, tuple(paths), kinds, module)
    _BY_KEY[key] = mod
    return mod


def _load(module_name: str, source: str) -> types.ModuleType:
    global _FOLDER
    if module_name in sys.modules:
        return sys.modules[module_name]
    if _FOLDER is None:
        _FOLDER = tempfile.mkdtemp(prefix="kp_flex_")
    path = os.path.join(_FOLDER, f"{module_name}.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    jit_keys.settle_module(vars(module))  # its functions' cache keys the same in every process (kp_core.jit_keys)
    return module


# ---- code generation ----


def _literal(x) -> str:
    if isinstance(x, bool):
        return "True" if x else "False"
    if isinstance(x, int):
        return repr(x)
    if isinstance(x, float):
        if math.isnan(x):
            return 'float("nan")'
        if math.isinf(x):
            return 'float("inf")' if x > 0 else 'float("-inf")'
        return repr(x)
    raise TypeError(type(x).__name__)


def _kind_of_dtype(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "b"
    if dtype in _INT_DTYPES:
        return "i"
    return "f"


class _Writer:
    """Writes the Triton source of one traced mod (forward, and for a score_mod the backward)."""

    def __init__(self, gm: fx.GraphModule, kind: str, name: str, capture_kinds: tuple):
        self.gm, self.kind, self.name, self.caps = gm, kind, name, capture_kinds
        self.capture_index = {n: i for i, n in enumerate(gm._kp_capture_names)}

    def fail(self, what: str):
        raise ModError(f"{self.kind}_mod {self.name}: {what} is not supported in a mod")

    # (lines, values per node, capture reads + the output); backward: captures that need a gradient are read with
    # tile-shaped indices, one element per score
    def forward_lines(self, backward: bool) -> tuple[list, dict, list]:
        lines, values, reads = [], {}, []
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                arg = node.target  # the traced function's parameters are named `args`
                values[node] = Value(
                    arg,
                    "f" if arg == "score" else "i",
                    arg in ("score", "q_idx", "kv_idx"),
                    grad=arg == "score",
                )
            elif node.op == "get_attr":
                k = self.capture_index[node.target]
                values[node] = ("capture", k)
                if self.caps[k][1] == 0:  # a 0-D tensor is a value, read where it is met
                    values[node] = self.read(k, [], False, lines, reads, backward)
            elif node.op in ("call_function", "call_method"):
                v = self.emit(node, values, lines, reads, backward)
                values[node] = v
            elif node.op == "output":
                out = node.args[0]
                if not isinstance(out, fx.Node):
                    if self.kind == "mask" and isinstance(out, bool):
                        return lines, values, reads + [("out", Value(_literal(out), "b", False))]
                    self.fail(f"returning {type(out).__name__}")
                return lines, values, reads + [("out", values[out])]
            else:
                self.fail(node.op)
        self.fail("a mod without output")

    def operand(self, a, values) -> Value:
        if isinstance(a, fx.Node):
            v = values[a]
            if isinstance(v, tuple):
                self.fail("a captured tensor used whole (index it with q_idx, kv_idx, h or b)")
            return v
        if isinstance(a, bool):
            return Value(_literal(a), "b", False)
        if isinstance(a, int):
            return Value(_literal(a), "i", False)
        if isinstance(a, float):
            return Value(_literal(a), "f", False)
        self.fail(f"an argument of type {type(a).__name__}")

    def var(self, lines: list, expr: str, kind: str, tile: bool, grad: bool = False) -> Value:
        name = f"v{len(lines)}"
        lines.append(f"{name} = {expr}")
        return Value(name, kind, tile, grad)

    def emit(self, node: fx.Node, values: dict, lines: list, reads: list, backward: bool) -> Value:
        target, args, kwargs = node.target, list(node.args), dict(node.kwargs)
        fname = target if isinstance(target, str) else getattr(target, "__name__", str(target))
        if fname == "__getitem__" or target is operator.getitem:
            return self.emit_read(node, args, values, lines, reads, backward)
        if (
            target in _BINARY
            or target in (operator.floordiv, operator.mod, operator.pow)
            or (fname in _TORCH_BINARY and len(args) == 2 and not kwargs)
        ):
            op = target if (target in _BINARY or target in (operator.floordiv, operator.mod, operator.pow)) else None
            if op is None:
                op = _TORCH_BINARY[fname]
                if op is None:
                    self.fail(fname)
            a, b = (self.operand(x, values) for x in args)
            return self.binary(op, a, b, lines, node)
        if fname in ("neg", "__neg__", "negative"):
            a = self.operand(args[0], values)
            return self.var(lines, f"-{a.name}", a.kind, a.tile, a.grad)
        if fname in ("invert", "__invert__", "bitwise_not", "logical_not"):
            a = self.operand(args[0], values)
            if a.kind == "b" or fname == "logical_not":
                return self.var(lines, f"({a.name}) == 0", "b", a.tile)
            return self.var(lines, f"~{a.name}", "i", a.tile)
        if fname in ("abs", "__abs__"):
            a = self.operand(args[0], values)
            return self.var(lines, f"tl.abs({a.name})", a.kind, a.tile, a.grad)
        if fname in _FLOAT_UNARY:
            a = self.operand(args[0], values)
            x = a.name if a.kind == "f" else f"({a.name}).to(tl.float32)"
            return self.var(lines, _FLOAT_UNARY[fname].format(x), "f", a.tile, a.grad)
        if fname == "where":
            c, a, b = (self.operand(x, values) for x in args)
            kind = "f" if "f" in (a.kind, b.kind) else ("i" if "i" in (a.kind, b.kind) else "b")
            return self.var(
                lines, f"tl.where({c.name}, {a.name}, {b.name})", kind, c.tile or a.tile or b.tile, a.grad or b.grad
            )
        if fname in ("clamp", "clip"):
            a = self.operand(args[0], values)
            lo = args[1] if len(args) > 1 else kwargs.get("min")
            hi = args[2] if len(args) > 2 else kwargs.get("max")
            out = a
            if lo is not None:
                out = self.binary("maximum", out, self.operand(lo, values), lines, node)
            if hi is not None:
                out = self.binary("minimum", out, self.operand(hi, values), lines, node)
            return out
        if fname in ("to", "float", "int", "long", "bool", "type", "double", "half", "bfloat16"):
            a = self.operand(args[0], values)
            dtype = {"float": torch.float32, "double": torch.float32, "half": torch.float32}.get(fname)
            dtype = {"int": torch.int32, "long": torch.int64, "bool": torch.bool}.get(fname, dtype)
            if fname == "bfloat16":
                dtype = torch.float32
            if fname in ("to", "type"):
                dtype = next((x for x in (*args[1:], *kwargs.values()) if isinstance(x, torch.dtype)), None)
                if dtype is None:
                    self.fail(f".{fname}() without a dtype")
            kind = _kind_of_dtype(dtype)
            if kind == a.kind:
                return a
            if kind == "b":
                return self.var(lines, f"({a.name}) != 0", "b", a.tile)
            ty = "tl.float32" if kind == "f" else ("tl.int64" if dtype == torch.int64 else "tl.int32")
            return self.var(lines, f"({a.name}).to({ty})", kind, a.tile, a.grad and kind == "f")
        if fname in ("zeros_like", "ones_like", "full_like"):
            a = self.operand(args[0], values)
            fill = {"zeros_like": 0, "ones_like": 1}.get(fname, args[1] if len(args) > 1 else kwargs.get("fill_value"))
            if not isinstance(fill, (int, float, bool)):
                self.fail(f"{fname} with a non-constant fill")
            dtype = kwargs.get("dtype")
            kind = a.kind if dtype is None else _kind_of_dtype(dtype)
            lit = _literal(bool(fill) if kind == "b" else float(fill) if kind == "f" else int(fill))
            return self.var(lines, f"tl.where({a.name} == {a.name}, {lit}, {lit})", kind, a.tile)
        self.fail(f"{node.op} {fname}")

    def binary(self, op, a: Value, b: Value, lines: list, node) -> Value:
        tile, grad = a.tile or b.tile, a.grad or b.grad
        if op in ("maximum", "minimum"):
            kind = "f" if "f" in (a.kind, b.kind) else a.kind
            return self.var(lines, f"tl.{op}({a.name}, {b.name})", kind, tile, grad)
        if op in (operator.floordiv, operator.mod):
            if "f" in (a.kind, b.kind):
                if op is operator.mod:
                    self.fail("% of floats")
                return self.var(lines, f"tl.floor({a.name} / {b.name})", "f", tile, False)
            helper = "floordiv" if op is operator.floordiv else "floormod"
            return self.var(lines, f"{helper}({a.name}, {b.name})", "i", tile)
        if op is operator.pow:
            if not (isinstance(node.args[1], int) and 0 <= node.args[1] <= 4) and node.args[1] != 0.5:
                self.fail("** other than by 0-4 or 0.5")
            e = node.args[1]
            if e == 0.5:
                return self.var(lines, f"tl.sqrt(({a.name}).to(tl.float32))", "f", a.tile, a.grad)
            expr = " * ".join([a.name] * e) if e else f"tl.where({a.name} == {a.name}, 1, 1)"
            return self.var(lines, f"({expr})", a.kind, a.tile, a.grad)
        sym = _BINARY[op]
        if sym in ("==", "!=", "<", "<=", ">", ">="):
            return self.var(lines, f"({a.name}) {sym} ({b.name})", "b", tile)
        if sym in ("&", "|", "^"):
            if "f" in (a.kind, b.kind):
                self.fail(f"{sym} of floats")
            kind = "b" if a.kind == b.kind == "b" else "i"
            return self.var(lines, f"({a.name}) {sym} ({b.name})", kind, tile)
        kind = "f" if sym == "/" or "f" in (a.kind, b.kind) else "i"
        return self.var(lines, f"({a.name}) {sym} ({b.name})", kind, tile, grad)

    def emit_read(self, node, args, values, lines, reads, backward) -> Value:
        base = values.get(args[0]) if isinstance(args[0], fx.Node) else None
        if not isinstance(base, tuple):
            self.fail("indexing a value that is not a captured tensor")
        k = base[1]
        ndim = self.caps[k][1]
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        if len(index) != ndim:
            self.fail(f"indexing a {ndim}-D captured tensor with {len(index)} indices (index every dimension)")
        index_values = []
        for ix in index:
            if isinstance(ix, (slice, type(None), type(Ellipsis))):
                self.fail("slicing a captured tensor")
            v = self.operand(ix, values)
            if v.kind == "f":
                self.fail("a float index")
            index_values.append(v)
        return self.read(k, index_values, any(v.tile for v in index_values), lines, reads, backward)

    def read(self, k: int, index: list, tile: bool, lines: list, reads: list, backward: bool) -> Value:
        """A load of capture k at `index` (Values, one per dimension)."""
        dtype, _, needs_grad = self.caps[k]
        spread = backward and needs_grad  # one element per (row, col): the gradient adds once per score
        parts = [
            f"offset(META + {k * META_STRIDE}, {j}, {f'({v.name}) + zi' if spread else v.name})"
            for j, v in enumerate(index)
        ]
        if not parts:
            parts = ["zi" if spread else "0"]
        off_name = self.var(lines, " + ".join(parts), "i", tile or spread).name
        kind = _kind_of_dtype(dtype)
        load = f"tl.load(C{k} + {off_name})"
        if kind == "f":
            load += ".to(tl.float32)"
        v = self.var(lines, load, kind, tile or spread, grad=needs_grad)
        reads.append((k, off_name, v.name))
        return v

    def source(self) -> str:
        caps = ", ".join(f"C{i}" for i in range(MAX_CAPTURES))
        head = [
            f'"""Generated by kp_attention.ops.flex_codegen from {self.kind}_mod {self.name}."""',
            "import triton",
            "import triton.language as tl",
            "",
            "from kp_attention.ops.flex_blocks import floordiv, floormod, offset, sigmoid, tanh",
            "",
            "",
            "@triton.jit",
        ]
        lines, values, reads = self.forward_lines(backward=False)
        out = reads.pop()[1]
        if self.kind == "score":
            head.append(f"def fwd(score, b, h, q_idx, kv_idx, {caps}, META):")
            body = [*lines, f"return ({out.name}).to(tl.float32) + tl.zeros(score.shape, dtype=tl.float32)"]
        else:
            if out.kind == "f":
                self.fail("a mask_mod returning floats")
            head.append(f"def fwd(b, h, q_idx, kv_idx, {caps}, META):")
            body = [*lines, f"return (({out.name}) != 0) & (q_idx >= 0) & (kv_idx >= 0)"]
        src = head + ["    " + x for x in body]
        if self.kind == "score":
            src += ["", "", "@triton.jit"]
            grads = ", ".join(f"G{i}" for i in range(MAX_CAPTURES))
            src.append(f"def bwd(grad, score, b, h, q_idx, kv_idx, {caps}, META, {grads}, valid):")
            src += ["    " + x for x in self.backward_body()]
        return "\n".join(src) + "\n"

    def backward_body(self) -> list:
        lines, values, reads = self.forward_lines(backward=True)
        out = reads.pop()[1]
        body = ["zi = (q_idx + kv_idx) * 0", *lines]
        # reverse mode over the float nodes on a gradient path
        adj: dict = {}
        order = [n for n in self.gm.graph.nodes if n.op in ("call_function", "call_method")]
        out_node = next(n for n in self.gm.graph.nodes if n.op == "output").args[0]
        tmp = [0]

        def new(expr: str) -> str:
            tmp[0] += 1
            name = f"g{tmp[0]}"
            body.append(f"{name} = {expr}")
            return name

        def add(node, expr: str):
            if not isinstance(node, fx.Node):
                return
            v = values.get(node)
            if isinstance(v, tuple) or v is None or not v.grad:
                return
            adj[node] = new(expr if node not in adj else f"{adj[node]} + {expr}")

        if isinstance(out_node, fx.Node) and out.grad:
            adj[out_node] = "grad"
        for node in reversed(order):
            if node not in adj:
                continue
            g = adj[node]
            y = values[node].name
            t, args = node.target, node.args
            fname = t if isinstance(t, str) else getattr(t, "__name__", str(t))
            op = t if t in _BINARY or t in (operator.pow,) else _TORCH_BINARY.get(fname)

            def val(a):
                return self.operand(a, values).name

            if fname == "__getitem__" or t is operator.getitem:
                continue  # a capture read: its adjoint goes to G below
            if op is operator.add:
                add(args[0], g)
                add(args[1], g)
            elif op is operator.sub:
                add(args[0], g)
                add(args[1], f"-{g}")
            elif op is operator.mul:
                add(args[0], f"{g} * ({val(args[1])})")
                add(args[1], f"{g} * ({val(args[0])})")
            elif op is operator.truediv:
                add(args[0], f"{g} / ({val(args[1])})")
                add(args[1], f"-{g} * ({val(args[0])}) / (({val(args[1])}) * ({val(args[1])}))")
            elif op is operator.pow:
                e = args[1]
                if e == 0.5:
                    add(args[0], f"{g} * 0.5 / {y}")
                elif e >= 1:
                    power = " * ".join([f"({val(args[0])})"] * (e - 1)) or "1.0"
                    add(args[0], f"{g} * {e} * {power}")
            elif op in ("maximum", "minimum"):
                cmp = ">=" if op == "maximum" else "<="
                a, b = val(args[0]), val(args[1])
                add(args[0], f"tl.where(({a}) {cmp} ({b}), {g}, 0.0)")
                add(args[1], f"tl.where(({a}) {cmp} ({b}), 0.0, {g})")
            elif fname in ("neg", "__neg__", "negative"):
                add(args[0], f"-{g}")
            elif fname in ("abs", "__abs__"):
                a = val(args[0])
                add(args[0], f"tl.where({a} > 0, {g}, tl.where({a} < 0, -{g}, 0.0))")
            elif fname == "tanh":
                add(args[0], f"{g} * (1.0 - {y} * {y})")
            elif fname == "exp":
                add(args[0], f"{g} * {y}")
            elif fname == "exp2":
                add(args[0], f"{g} * {y} * 0.6931471805599453")
            elif fname == "log":
                add(args[0], f"{g} / ({val(args[0])})")
            elif fname == "log2":
                add(args[0], f"{g} / (({val(args[0])}) * 0.6931471805599453)")
            elif fname == "sqrt":
                add(args[0], f"{g} * 0.5 / {y}")
            elif fname == "rsqrt":
                add(args[0], f"-0.5 * {g} * {y} * {y} * {y}")
            elif fname == "sigmoid":
                add(args[0], f"{g} * {y} * (1.0 - {y})")
            elif fname == "sin":
                add(args[0], f"{g} * tl.cos({val(args[0])})")
            elif fname == "cos":
                add(args[0], f"-{g} * tl.sin({val(args[0])})")
            elif fname == "where":
                c = val(args[0])
                add(args[1], f"tl.where({c}, {g}, 0.0)")
                add(args[2], f"tl.where({c}, 0.0, {g})")
            elif fname in ("clamp", "clip"):
                lo = args[1] if len(args) > 1 else node.kwargs.get("min")
                hi = args[2] if len(args) > 2 else node.kwargs.get("max")
                a = val(args[0])
                ok = " & ".join(
                    [f"(({a}) >= ({val(lo)}))" for _ in [0] if lo is not None]
                    + [f"(({a}) <= ({val(hi)}))" for _ in [0] if hi is not None]
                )
                add(args[0], f"tl.where({ok}, {g}, 0.0)" if ok else g)
                for bound, cmp in ((lo, "<"), (hi, ">")):
                    if bound is not None:
                        add(bound, f"tl.where(({a}) {cmp} ({val(bound)}), {g}, 0.0)")
            elif fname in ("to", "float", "double", "half", "bfloat16", "type"):
                add(args[0], g)
            else:
                self.fail(f"the gradient of {fname}")
        score_node = next(n for n in self.gm.graph.nodes if n.op == "placeholder" and n.target == "score")
        for k, off, name in reads:
            if not self.caps[k][2]:
                continue
            node = next(n for n, v in values.items() if isinstance(v, Value) and v.name == name)
            if node in adj:
                body.append(f"tl.atomic_add(G{k} + {off}, ({adj[node]}).to(G{k}.dtype.element_ty), mask=valid)")
        ds = adj.get(score_node)
        zeros = "tl.zeros(score.shape, dtype=tl.float32)"
        body.append(f"return {zeros}" if ds is None else f"return {ds} + {zeros}")
        return body
