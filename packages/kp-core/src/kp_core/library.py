"""One declaration per op: kp-core derives the torch.library ops, autograd, the eager path and the registry.

    NORM = kp_core.op(
        "kp::norm", forward, forward_fake,
        backward=backward, backward_fake=backward_fake, save=save,
        grad_inputs=("x", "weight", "bias"), same_grad={"residual": "x"}, differentiable_outputs=2,
        package="kp-norms", spec="norm", dtypes=kp_core.FLOAT_DTYPES,
    )
    y, s, mean, rstd = NORM(x, residual, weight, bias, eps, ...)

The contract a package follows:
- `forward(*args)` is the launcher, with type annotations (they are the op's schema, so its module must not use
  `from __future__ import annotations`); `forward_fake` returns empty tensors with the outputs' shapes, strides
  and dtypes. Either may return None in place of an output that carries nothing in this call (a norm's
  statistics in inference): the eager path passes None on, which costs no allocation; the custom op, whose
  schema wants a tensor, gets a zero-size one with the first tensor argument's device and dtype.
- `save(args, outputs)` picks what the backward needs: a tuple of tensors (or None).
- `backward(*output_grads, *saved, *constants)` gets the gradients of the first `differentiable_outputs`
  outputs (None, or zeros under torch.compile, for an output that received none), the saved tensors, then the
  forward's non-tensor arguments in order. It returns one tensor per name in `grad_inputs`, None (or an empty
  tensor) standing for an input that was None. `same_grad={"residual": "x"}` gives an input another one's gradient.

From that, kp-core makes `kp::<name>` and `kp::<name>_backward` with `torch.library.custom_op` (fake kernels,
`register_autograd`), registers both in the kernel registry, and the declared object is what callers use:
under torch.compile it calls the custom op (one node, no graph break); in eager mode it skips the
dispatcher, which costs tens of microseconds a call, and runs the launchers through one shared
`torch.autograd.Function`, or directly when no gradient is needed.

Under torch.compile on a GPU the op does not stay a unit: when AOTAutograd functionalises the graph, the op's
launcher is traced (what `torch.library.triton_op` does), and each kernel it launches goes to inductor through
`torch.library.wrap_triton`. Inductor then launches kp's kernels from its own generated code, at its own host
cost per kernel, instead of calling back into Python per op (about 50-100 us an op). The op stays a unit (a
`custom_op` called from the graph) where tracing cannot work or must not: under Triton's interpreter (inductor
cannot launch interpreted kernels), with symbolic shapes (the launchers' tile choices need concrete sizes), for
an op not declared `inline=True` (kp declares it for the ops whose traced form was checked on a GPU: its
launcher must be traceable, reading no tensor value on the host, passing no TMA descriptor, keeping no tensor
across calls), while launches are recorded or a guard is installed (both need each launch to pass through Python), under
torch.export (the exported program keeps the op), and with KP_INLINE=0.

`custom_op` + this rule rather than `triton_op`: `triton_op` decides at declaration, and on CPU under Triton's
interpreter an op made with it fails `torch.compile(fullgraph=True)` and `opcheck`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kp_core import backend, launches


@dataclass(frozen=True)
class KernelInfo:
    """One op in the registry (`registered_kernels`), as its `kp_core.op` declaration gave it.

    Attributes:
        name: the op's name ("kp::norm"; its backward is "kp::norm_backward").
        package: the package that declared it ("kp-norms").
        spec: the conformance spec that covers it ("norm").
        dtypes: the dtypes its kernels take.
        op: the torch.library custom op.

    Examples:
        >>> import kp_core
        >>> import kp_norms
        >>> info = kp_core.registered_kernels()["kp::norm"]
        >>> info.package, info.spec
        ('kp-norms', 'norm')
    """

    name: str  # "kp::norm"
    package: str  # "kp-norms"
    spec: str  # conformance spec that covers it, e.g. "norm"
    dtypes: tuple[torch.dtype, ...]
    op: object


_REGISTRY: dict[str, KernelInfo] = {}


def registered_kernels() -> dict[str, KernelInfo]:
    """Every op declared with kp_core.op so far, by name ("kp::norm"): its package, conformance spec, dtypes.

    A package's ops are declared when it is imported. The dict is a copy.

    Examples:
        >>> import kp_core
        >>> import kp_norms
        >>> "kp::norm" in kp_core.registered_kernels()
        True
    """
    return dict(_REGISTRY)


def _is_tensor(annotation) -> bool:
    return "Tensor" in str(annotation)


class Op:
    """A declared op (see the module docstring); call it with the forward's arguments. Made by `kp_core.op`.

    Args:
        name: "kp::<op>": the custom op's name, and the registry's.
        forward: the launcher; its annotated signature is the op's schema (tensor arguments annotated with a
            Tensor type; outputs a tensor or a tuple of tensors, some of which may be None).
        forward_fake: empty outputs with the forward's shapes, strides and dtypes.
        package: the declaring package ("kp-norms").
        spec: the conformance spec that covers the op.
        dtypes: the dtypes its kernels take.
        backward: the backward launcher, declared with backward_fake and save (all three or none).
        backward_fake: empty gradients with the backward's shapes and dtypes.
        save: (args, outputs) -> the tensors the backward needs.
        grad_inputs: the forward arguments the backward returns gradients for, in its order.
        same_grad: input -> another input whose gradient it gets.
        differentiable_outputs: how many leading outputs carry gradients (all by default).
        mutates_args: the arguments the forward writes in place.
        inline: whether torch.compile may trace the launcher into its graph on a GPU.

    Attributes:
        name: the op's name.
        op: the `torch.library.custom_op` (called under torch.compile).
        backward_op: the backward's custom op, or None.

    Examples:
        >>> import torch
        >>> import kp_core
        >>> def forward(x: torch.Tensor) -> torch.Tensor:
        ...     kp_core.reference("kp::example_twice")  # a launcher would call kp_core.launch on a GPU
        ...     return x * 2
        >>> def forward_fake(x: torch.Tensor) -> torch.Tensor:
        ...     return torch.empty_like(x)
        >>> TWICE = kp_core.Op(
        ...     "kp::example_twice", forward, forward_fake, package="my-package", spec="twice", dtypes=(torch.float32,)
        ... )
        >>> TWICE(torch.ones(3)), TWICE
        (tensor([2., 2., 2.]), kp_core.Op('kp::example_twice'))
    """

    def __init__(
        self,
        name: str,
        forward: Callable,
        forward_fake: Callable,
        *,
        package: str,
        spec: str,
        dtypes: Sequence[torch.dtype],
        backward: Callable | None = None,
        backward_fake: Callable | None = None,
        save: Callable | None = None,
        grad_inputs: Sequence[str] = (),
        same_grad: dict[str, str] | None = None,
        differentiable_outputs: int | None = None,
        mutates_args: Sequence[str] = (),
        inline: bool = False,
    ):
        if (backward is None) != (save is None) or (backward is None) != (backward_fake is None):
            raise TypeError(f"{name}: backward, backward_fake and save are declared together")
        self.name = name
        self.forward = forward
        self.backward = backward
        self._save = save
        params = list(inspect.signature(forward).parameters.values())
        names = [p.name for p in params]
        tensor = [_is_tensor(p.annotation) for p in params]
        self._constants = tuple(i for i, t in enumerate(tensor) if not t)
        self._tensors = tuple(i for i, t in enumerate(tensor) if t)
        # For each forward argument: the index of its gradient among backward's results, or None.
        grad_of = {n: k for k, n in enumerate(grad_inputs)}
        for alias, source in (same_grad or {}).items():
            grad_of[alias] = grad_of[source]
        unknown = set(grad_of) - set(names)
        if unknown:
            raise TypeError(f"{name}: grad_inputs / same_grad name {sorted(unknown)}, not arguments of {names}")
        self._grad_index = tuple(grad_of.get(n) for n in names)
        self._tensor_grad_index = tuple(self._grad_index[i] for i in self._tensors)
        self._mutated = tuple(names.index(n) for n in mutates_args)
        self._n_grad_outputs = differentiable_outputs
        self.op = torch.library.custom_op(
            name, _schema_outputs(forward, name, self._mutated), mutates_args=tuple(mutates_args)
        )
        self.op.register_fake(_schema_outputs(forward_fake))
        if inline:
            _inline_under_compile(self.op, forward)
        _REGISTRY[name] = KernelInfo(name, package, spec, tuple(dtypes), self.op)
        launches.PACKAGES[name] = launches.PACKAGES[f"{name}_backward"] = package  # whose logger speaks for it
        self.backward_op = None
        if backward is not None:
            self.backward_op = torch.library.custom_op(
                f"{name}_backward", _schema_outputs(backward, f"{name}_backward"), mutates_args=()
            )
            self.backward_op.register_fake(_schema_outputs(backward_fake))
            if inline:
                _inline_under_compile(self.backward_op, backward)
            self.op.register_autograd(self._op_backward, setup_context=self._setup_context)
            _REGISTRY[f"{name}_backward"] = KernelInfo(
                f"{name}_backward", package, spec, tuple(dtypes), self.backward_op
            )

    def __repr__(self) -> str:
        return f"kp_core.Op({self.name!r})"

    def __call__(self, *args):
        if torch.compiler.is_compiling():
            return self.op(*args)
        if self.backward is not None and torch.is_grad_enabled():
            tensors = [args[i] for i in self._tensors]
            for a in tensors:
                if a is not None and a.requires_grad:
                    # Only the tensors go to apply (autograd's inputs); every argument it is given costs time.
                    if torch._C._are_functorch_transforms_active():
                        return _Function.apply(self, args, *tensors)
                    return _APPLY(self, args, *tensors)
        guard = launches._guard
        out = self.forward(*args) if guard is None else guard.call(self.name, self.forward, args, self._mutated)
        for i in self._mutated:  # what the dispatcher does for a mutating op: autograd sees the write
            if args[i] is not None:
                torch.autograd.graph.increment_version(args[i])
        return out

    # ---- the autograd formula, shared by the custom op and the eager Function ----

    def _saved(self, ctx, args, outputs) -> None:
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        ctx.save_for_backward(*self._save(args, outputs))
        ctx.constants = tuple([args[i] for i in self._constants])
        ctx.n_grads = n = len(outputs) if self._n_grad_outputs is None else self._n_grad_outputs
        if len(outputs) > n:
            ctx.mark_non_differentiable(*[o for o in outputs[n:] if o is not None])

    def _input_grads(self, absent, needs_input_grad, results) -> tuple:
        """The backward's results per forward argument: None where there is no gradient to give."""
        return tuple(
            None if k is None or absent[i] or not needs_input_grad[i] else results[k]
            for i, k in enumerate(self._grad_index)
        )

    def _setup_context(self, ctx, inputs, output) -> None:
        self._saved(ctx, inputs, output)
        ctx.absent = tuple(a is None for a in inputs)

    def _op_backward(self, ctx, *grads):
        results = self.backward_op(*grads[: ctx.n_grads], *ctx.saved_tensors, *ctx.constants)
        results = results if isinstance(results, tuple) else (results,)
        return self._input_grads(ctx.absent, ctx.needs_input_grad, results)


def _schema_outputs(fn: Callable, name: str | None = None, mutated: tuple = ()) -> Callable:
    """A launcher (or fake) as the custom op's implementation: the same signature (the op's schema), with each
    None output replaced by a zero-size tensor on the first tensor argument's device and dtype. A launcher (with
    its op's `name`) runs under the installed guard, if any."""

    @functools.wraps(fn)
    def impl(*args):
        guard = launches._guard if name is not None else None
        out = fn(*args) if guard is None else guard.call(name, fn, args, mutated)
        if isinstance(out, tuple) and any(o is None for o in out):
            like = next(a for a in args if isinstance(a, torch.Tensor))
            out = tuple(like.new_empty((0,)) if o is None else o for o in out)
        return out

    return impl


def _inlinable(types, args: tuple, kwargs: dict) -> bool:
    """Whether this call of an op, met while AOTAutograd functionalises a graph, may be traced into it (see the
    module docstring)."""
    if not launches.inline_enabled() or backend.interpreter_enabled() or not backend.has_triton():
        return False
    try:
        from torch.export._trace import custom_triton_ops_decomposition_disabled

        if custom_triton_ops_decomposition_disabled():
            return False
    except ImportError:
        pass
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    if any(t is not torch.Tensor and not issubclass(t, (FakeTensor, FunctionalTensor)) for t in types):
        return False  # a tensor subclass: its own dispatch decides
    values = (*args, *kwargs.values())
    tensors = [a for a in values if isinstance(a, torch.Tensor)]
    if not tensors or not all(t.is_cuda for t in tensors):
        return False
    symbolic = (torch.SymInt, torch.SymFloat, torch.SymBool)
    return not any(isinstance(a, symbolic) for a in values) and not any(
        isinstance(d, torch.SymInt) for t in tensors for d in (*t.shape, *t.stride(), t.storage_offset())
    )


def _inline_under_compile(custom, fn: Callable) -> None:
    """Let AOTAutograd's functionalisation trace `fn` (a launcher) in place of the custom op, when it may."""
    from torch._subclasses.functional_tensor import FunctionalTensorMode

    impl = _schema_outputs(fn)

    def decompose(mode, op, types, args, kwargs):
        if not _inlinable(types, args, kwargs):
            return mode.__torch_dispatch__(op, types, args, kwargs)
        with mode, launches.inlining():
            return impl(*args, **kwargs)

    custom.register_torch_dispatch(FunctionalTensorMode, decompose)


class _Function(torch.autograd.Function):
    """The eager path of every declared op with a backward: the same launchers, no dispatcher. apply gets the
    op, all its arguments, then its tensor arguments again (the inputs autograd tracks)."""

    @staticmethod
    def forward(ctx, op: Op, args: tuple, *tensors):
        ctx.set_materialize_grads(False)  # an output nobody used must not cost a pass over zeros
        guard = launches._guard
        outputs = op.forward(*args) if guard is None else guard.call(op.name, op.forward, args, op._mutated)
        op._saved(ctx, args, outputs if isinstance(outputs, tuple) else (outputs,))
        ctx.op = op
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        op = ctx.op
        args = (*grads[: ctx.n_grads], *ctx.saved_tensors, *ctx.constants)
        guard = launches._guard
        results = op.backward(*args) if guard is None else guard.call(f"{op.name}_backward", op.backward, args, ())
        results = results if isinstance(results, tuple) else (results,)
        # needs_input_grad covers (op, args, *tensors) and is False for a tensor argument that was None.
        needs = ctx.needs_input_grad
        return (
            None,
            None,
            *[None if k is None or not needs[2 + j] else results[k] for j, k in enumerate(op._tensor_grad_index)],
        )


# autograd.Function.apply without its Python wrapper, which only adds functorch's handling (taken above when a
# functorch transform is active) and default-argument binding (for setup_context, which _Function does not use).
_APPLY = super(torch.autograd.Function, _Function).apply


def vjp(fn: Callable, primals: Sequence, cotangents) -> tuple:
    """The gradients of fn(*primals) (a tensor or a tuple of them) against `cotangents`, per primal (None stays
    None): the reference path of a backward. torch.func.vjp rather than torch.autograd.grad, which finds no graph
    inside a custom op's backward under torch.compile (the dispatcher runs it below autograd).

    Args:
        fn: a function of the primals returning a tensor or a tuple of tensors.
        primals: its arguments: tensors (any shape and floating dtype) or None.
        cotangents: the output gradients: a tensor, or a tuple matching fn's outputs (their shapes and dtypes).

    Examples:
        >>> import torch
        >>> import kp_core
        >>> a, b = torch.tensor([2.0]), torch.tensor([3.0])
        >>> kp_core.vjp(lambda a, b, c: a * b, (a, b, None), torch.tensor([1.0]))
        (tensor([3.]), tensor([2.]), None)
    """
    where = [i for i, p in enumerate(primals) if p is not None]

    def inner(*present):
        full = list(primals)
        for i, p in zip(where, present):
            full[i] = p
        return fn(*full)

    _, pull = torch.func.vjp(inner, *[primals[i] for i in where])
    grads = [None] * len(primals)
    for i, g in zip(where, pull(cotangents)):
        grads[i] = g
    return tuple(grads)


def op(name: str, forward: Callable, forward_fake: Callable, **declaration) -> Op:
    """Declare an op; see the module docstring for the contract. The arguments are `Op`'s.

    Examples:
        A forward only op (its launcher here runs the reference path; a package's calls `kp_core.launch`):

        >>> import torch
        >>> import kp_core
        >>> def forward(x: torch.Tensor, scale: float) -> torch.Tensor:
        ...     kp_core.reference("kp::example_scale")
        ...     return x * scale
        >>> def forward_fake(x: torch.Tensor, scale: float) -> torch.Tensor:
        ...     return torch.empty_like(x)
        >>> SCALE = kp_core.op(
        ...     "kp::example_scale", forward, forward_fake, package="my-package", spec="scale", dtypes=(torch.float32,)
        ... )
        >>> SCALE(torch.ones(2), 3.0)
        tensor([3., 3.])
        >>> kp_core.registered_kernels()["kp::example_scale"].package
        'my-package'
    """
    return Op(name, forward, forward_fake, **declaration)
