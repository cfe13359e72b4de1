"""Training through graphs: a forward graph and a backward graph per bucket, as
torch.cuda.make_graphed_callables captures them, behind an autograd.Function.

The forward graph runs fn on static, bucket-shaped inputs with autograd on; the backward graph runs
torch.autograd.grad of its differentiable outputs, with static gradient buffers, with respect to the inputs that
require grad and the module's parameters that do. A call copies its inputs in (padded), replays the forward
and returns the outputs cut back; its backward copies the incoming gradients in, padded with zeros, replays
the backward graph and returns copies of the gradients, the inputs' cut back. The padded rows get zero
gradient from above, so for a function whose rows do not mix they add nothing to the parameters' gradients.

The two graphs of a bucket hold one step: the forward's saved activations live in the graph's memory until the
backward replays. So each bucket's pair gets a pool of its own (another bucket's replay cannot overwrite them),
and a second forward of the same bucket while the first one's outputs still await their backward is not
replayed (busy() says so, and the caller runs that call eagerly).
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from kp_graphs.buckets import fill_into, pad_to, trim, unflatten
from kp_graphs.capture import capture, warm_up


class TrainGraph:
    def __init__(self, fn, leaves, spec, bucket, dims, pads, warmup, params, name):
        self.dims, self.bucket, self.pads = dims, bucket, pads
        self.pending = None  # a weak reference to an output of the forward whose backward has not run
        pool = torch.cuda.graph_pool_handle()
        self.tensor_idx = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        static = list(leaves)
        for i in self.tensor_idx:
            x = leaves[i]
            static[i] = pad_to(x.detach(), dims, bucket, pads[i]).clone().requires_grad_(x.requires_grad)
        self.static_in = static
        self.grad_idx = [i for i in self.tensor_idx if static[i].requires_grad]
        self.params = list(params)
        # The graphs differentiate with respect to fresh leaves sharing the parameters' storage (the replay reads
        # the same memory), not the parameters themselves: a parameter's gradient node is shared by every live
        # autograd graph that uses it and keeps the stream it was made on, so one made on the default stream by an
        # earlier forward still alive (a loss kept, an activation cached) would send the captured backward's
        # gradient work to that stream, outside the capture, and leave the graph empty or wrong.
        aliases = [p.detach().requires_grad_() for p in self.params]
        names = {id(p): n for n, p in fn.named_parameters()} if isinstance(fn, torch.nn.Module) else {}
        swapped = {names[id(p)]: a for p, a in zip(self.params, aliases, strict=True) if id(p) in names}
        wrt = [static[i] for i in self.grad_idx] + aliases
        args, kwargs = unflatten(static, spec)

        def call():
            if not swapped:
                return fn(*args, **kwargs)
            return torch.func.functional_call(fn, swapped, args, kwargs)

        def differentiable(out):
            flat, out_spec = tree_flatten(out)
            return flat, out_spec, [j for j, o in enumerate(flat) if isinstance(o, torch.Tensor) and o.requires_grad]

        direct = set()  # parameters fn reads other than through the module's registration (their aliases miss them)

        def run():
            flat, _, diff = differentiable(call())
            outs = [flat[j] for j in diff]
            also = self.params if swapped else []
            grads = torch.autograd.grad(outs, wrt + also, [torch.zeros_like(o) for o in outs], allow_unused=True)
            direct.update(i for i, g in enumerate(grads[len(wrt) :]) if g is not None)

        warm_up(run, warmup)
        if direct:
            found = ", ".join(names.get(id(self.params[i]), f"#{i}") for i in sorted(direct))
            raise ValueError(
                f"graphed {name}: fn reads parameter(s) {found} other than as the module's attributes (a reference "
                "kept elsewhere), so the graphs cannot give them gradients; read them through the module"
            )

        self.fwd, self.bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        where = f"bucket {bucket}'s forward"
        out = capture(self.fwd, pool, call, name, where, (fn, args, kwargs))
        self.flat_out, self.out_spec, self.diff = differentiable(out)
        if not self.diff:
            raise ValueError("graphed: under autograd, fn must return at least one tensor that requires grad")
        self.static_grad_out = [torch.empty_like(self.flat_out[j]) for j in self.diff]
        outs = [self.flat_out[j] for j in self.diff]
        self.static_grads = capture(
            self.bwd,
            pool,
            lambda: torch.autograd.grad(outs, wrt, self.static_grad_out, allow_unused=True),
            name,
            f"bucket {bucket}'s backward",
        )

    def busy(self) -> bool:
        """Whether an earlier forward's outputs are alive and their backward has not replayed yet."""
        return self.pending is not None and self.pending() is not None

    def __call__(self, leaves, actual):
        """fn's outputs for this call (cut back), differentiable with respect to the call's inputs that require
        grad and the module's parameters."""
        inputs = [leaves[i] for i in self.grad_idx]
        flat = _Replay.apply(self, leaves, actual, *inputs, *self.params)
        self.pending = weakref.ref(flat[self.diff[0]])
        return tree_unflatten(list(flat), self.out_spec)


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, graph, leaves, actual, *wrt):
        for i in graph.tensor_idx:
            fill_into(graph.static_in[i].detach(), leaves[i].detach(), graph.pads[i])
        graph.fwd.replay()
        ctx.graph, ctx.actual = graph, actual
        out = []
        for o in graph.flat_out:
            if isinstance(o, torch.Tensor):
                o = trim(o.detach(), graph.dims, graph.bucket, actual).clone()
            out.append(o)
        fixed = [o for j, o in enumerate(out) if isinstance(o, torch.Tensor) and j not in graph.diff]
        ctx.mark_non_differentiable(*fixed)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        graph, actual = ctx.graph, ctx.actual
        for buf, j in zip(graph.static_grad_out, graph.diff):
            g = grads[j]
            if g is None:
                buf.zero_()
            else:
                fill_into(buf, g, 0)  # zero gradient for the padding
        graph.bwd.replay()
        graph.pending = None
        n_in = len(graph.grad_idx)
        out = []
        for k, g in enumerate(graph.static_grads):
            if g is None:
                out.append(None)
            elif k < n_in:
                out.append(trim(g, graph.dims, graph.bucket, actual).clone())
            else:
                out.append(g.clone())
        return (None, None, None, *out)
