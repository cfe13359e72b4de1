"""The bad-input fuzzer (kp_conformance.fuzz) over the public callables no kernel spec owns: model patching and
conversion, layer constructors, sparsify, kp-distributed's setup and checkpoints. Their arguments are settings and
models, not tensors: every refused value must raise a TypeError/ValueError that names the argument."""

import os
import tempfile

import torch
from torch import nn

import kp_attention
import kp_conformance as kc
import kp_distributed
import kp_losses
import kp_norms
import kp_precision
import kp_sparsity
from kp_conformance import fuzz

kc.declare(
    kc.Spec(
        name="api",
        package="kp-conformance",
        ops=(),
        reference="the documented argument domains of each public callable",
        dtypes=(),
        properties=("bad_input",),
    )
)

MODEL = fuzz.Scalar(bad=(None, "model", nn.Linear))  # not a module (a class is not an instance)
FILTER = fuzz.Scalar(bad=(3, "all"))


def _model():
    return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))


def _target(name, package, fn, valid, args, **kw):
    return fuzz.Target(name, package, fn, valid, args, launches=False, **kw)


def _torch_linear(in_features, out_features, **kw):
    """torch's own nn.Linear on the same sizes: its errors for impossible sizes are torch's to give."""
    return nn.Linear(in_features, out_features)


API_TARGETS = [
    _target(
        "kp_losses.patch",
        "kp-losses",
        kp_losses.patch,
        lambda d: dict(model=_model(), skip_logits=True),
        dict(model=MODEL, skip_logits=fuzz.Scalar(bad=(1, "yes")), float8=fuzz.Scalar(bad=("e4m3", 8))),
    ),
    _target("kp_losses.unpatch", "kp-losses", kp_losses.unpatch, lambda d: dict(model=_model()), dict(model=MODEL)),
    _target("kp_losses.patchable", "kp-losses", kp_losses.patchable, lambda d: dict(model=_model()), dict(model=MODEL)),
    _target(
        "kp_losses.CrossEntropyLoss(...)",
        "kp-losses",
        kp_losses.CrossEntropyLoss,
        lambda d: dict(weight=torch.ones(5, device=d), reduction="sum", label_smoothing=0.1, z_loss=1e-4, softcap=30.0),
        dict(
            weight=fuzz.Scalar(bad=("w", torch.ones(5, dtype=torch.int64), torch.ones(2, 5))),
            ignore_index=fuzz.Scalar(bad=(1.5, None)),
            reduction=fuzz.Scalar(bad=("avg", None)),
            label_smoothing=fuzz.Scalar(bad=(-0.1, 2.0, None)),
            z_loss=fuzz.Scalar(bad=(-1.0, float("inf"))),
            softcap=fuzz.Scalar(bad=(0.0, "30")),
        ),
    ),
    _target(
        "kp_losses.LinearCrossEntropyLoss(...)",
        "kp-losses",
        kp_losses.LinearCrossEntropyLoss,
        lambda d: dict(head=nn.Linear(4, 5, device=d), reduction="none", chunk_size=2),
        dict(
            head=fuzz.Scalar(bad=(None, nn.Identity(), nn.Linear)),
            ce_weight=fuzz.Scalar(bad=("w", torch.ones(5, dtype=torch.int64))),
            reduction=fuzz.Scalar(bad=("avg",)),
            label_smoothing=fuzz.Scalar(bad=(1.5,)),
            chunk_size=fuzz.Scalar(bad=(0, -1, 2.5, True)),
            float8=fuzz.Scalar(bad=("blockwise", True)),
        ),
    ),
    _target(
        "kp_norms.patch",
        "kp-norms",
        kp_norms.patch,
        lambda d: dict(model=_model(), rms_norm=True, layer_norm=True, swiglu=True),
        dict(
            model=MODEL,
            rms_norm=fuzz.Scalar(bad=(1, None)),
            layer_norm=fuzz.Scalar(bad=("yes",)),
            swiglu=fuzz.Scalar(bad=(0,)),
            module_filter_fn=FILTER,
            mlp_classes=fuzz.Scalar(bad=([nn.Linear(2, 2)], [int])),
        ),
    ),
    _target(
        "kp_attention.patch",
        "kp-attention",
        kp_attention.patch,
        lambda d: dict(model=_model()),
        dict(model=MODEL),
    ),
    _target(
        "kp_precision.convert_to_float8_training",
        "kp-precision",
        kp_precision.convert_to_float8_training,
        lambda d: dict(model=_model(), recipe="tensorwise"),
        dict(model=MODEL, module_filter_fn=FILTER, recipe=fuzz.Scalar(bad=("columnwise", 1))),
    ),
    _target(
        "kp_precision.convert_to_float8_inference",
        "kp-precision",
        kp_precision.convert_to_float8_inference,
        lambda d: dict(model=_model(), recipe="rowwise"),
        dict(model=MODEL, module_filter_fn=FILTER, recipe=fuzz.Scalar(bad=("x", None))),
    ),
    _target(
        "kp_precision.prepare_qat",
        "kp-precision",
        kp_precision.prepare_qat,
        lambda d: dict(model=_model(), weight="int4", group_size=32),
        dict(
            model=MODEL,
            module_filter_fn=FILTER,
            weight=fuzz.Scalar(bad=("int3", None)),
            group_size=fuzz.Scalar(bad=(-1, 0, 16.0, "32")),
            activation=fuzz.Scalar(bad=("int4", "x")),
        ),
    ),
    _target(
        "kp_precision.convert",
        "kp-precision",
        kp_precision.convert,
        lambda d: dict(model=kp_precision.prepare_qat(_model())),
        dict(model=MODEL),
    ),
    _target(
        "kp_precision.QATLinear(...)",
        "kp-precision",
        kp_precision.QATLinear,
        lambda d: dict(in_features=64, out_features=32, weight_dtype="int4", group_size=32),
        dict(
            weight_dtype=fuzz.Scalar(bad=("int3",)),
            group_size=fuzz.Scalar(bad=(5, -32, 0, "32")),
            activation=fuzz.Scalar(bad=("int4",)),
        ),
    ),
    _target(
        "kp_precision.Float8InferenceLinear(...)",
        "kp-precision",
        kp_precision.Float8InferenceLinear,
        lambda d: dict(in_features=32, out_features=32, recipe="rowwise"),
        dict(
            in_features=fuzz.Scalar(bad=(30,)),
            out_features=fuzz.Scalar(bad=(8,)),
            recipe=fuzz.Scalar(bad=("x",)),
            activation=fuzz.Scalar(bad=("tanh",)),
        ),
    ),
    _target(
        "kp_precision.Float8Linear(...)",
        "kp-precision",
        kp_precision.Float8Linear,
        lambda d: dict(in_features=32, out_features=32),
        dict(in_features=fuzz.Scalar(bad=(30,)), config=fuzz.Scalar(bad=("delayed", 1))),
    ),
    _target(
        "kp_precision.FusedLinearActivation(...)",
        "kp-precision",
        kp_precision.FusedLinearActivation,
        lambda d: dict(in_features=32, out_features=32, activation="gelu"),
        dict(in_features=fuzz.Scalar(bad=(-1,)), activation=fuzz.Scalar(bad=("tanh", 1))),
        torch_fn=_torch_linear,
    ),
    _target(
        "kp_precision.auto_filter",
        "kp-precision",
        kp_precision.auto_filter,
        lambda d: dict(recipe="tensorwise", tokens=8192, min_speedup=1.05),
        dict(recipe=fuzz.Scalar(bad=("x",)), tokens=fuzz.Scalar(bad=(-1, 0, 1.5))),
    ),
    _target(
        "kp_sparsity.sparsify",
        "kp-sparsity",
        kp_sparsity.sparsify,
        lambda d: dict(model=_model(), route="dense"),
        dict(
            model=MODEL,
            module_filter_fn=FILTER,
            method=fuzz.Scalar(bad=("x", None)),
            route=fuzz.Scalar(bad=("x",)),
        ),
    ),
    _target(
        "kp_sparsity.sparsify_for_training",
        "kp-sparsity",
        kp_sparsity.sparsify_for_training,
        lambda d: dict(model=_model(), route="dense"),
        dict(
            model=MODEL,
            module_filter_fn=FILTER,
            activation_filter_fn=FILTER,
            mask_every=fuzz.Scalar(bad=(0, -1, 1.5)),
            decay=fuzz.Scalar(bad=(-1.0, "0")),
            route=fuzz.Scalar(bad=("x",)),
        ),
    ),
    _target(
        "kp_sparsity.SparseActivationLinear(...)",
        "kp-sparsity",
        kp_sparsity.SparseActivationLinear,
        lambda d: dict(in_features=32, out_features=32, route="dense"),
        dict(in_features=fuzz.Scalar(bad=(30,)), route=fuzz.Scalar(bad=("x", None))),
    ),
    _target(
        "kp_sparsity.SparseTrainingLinear(...)",
        "kp-sparsity",
        kp_sparsity.SparseTrainingLinear,
        lambda d: dict(in_features=32, out_features=32),
        dict(mask_every=fuzz.Scalar(bad=(0, -2, 1.5)), decay=fuzz.Scalar(bad=(-1.0, "0"))),
    ),
    _target(
        "kp_sparsity.to_sparse_2_4",
        "kp-sparsity",
        kp_sparsity.to_sparse_2_4,
        lambda d: dict(weight=torch.randn(32, 64, dtype=torch.float16), backend="cutlass"),
        dict(backend=fuzz.Scalar(bad=("x", 1))),
    ),
    _target(
        "kp_distributed.shard",
        "kp-distributed",
        kp_distributed.shard,
        lambda d: dict(model=_model(), strategy="full"),
        dict(
            model=MODEL,
            strategy=fuzz.Scalar(bad=("x", None)),
            mixed_precision=fuzz.Scalar(bad=(("x", "y"), "bf16")),
            prefetch=fuzz.Scalar(bad=(-1, 1.5)),
        ),
    ),
    _target(
        "kp_distributed.make_mesh",
        "kp-distributed",
        kp_distributed.make_mesh,
        lambda d: dict(strategy="full"),
        dict(strategy=fuzz.Scalar(bad=("x", None))),
    ),
    _target(
        "kp_distributed.Checkpointer(...)",
        "kp-distributed",
        kp_distributed.Checkpointer,
        lambda d: dict(folder=os.path.join(tempfile.gettempdir(), "kp-api-ckpt"), keep=3),
        dict(folder=fuzz.Scalar(bad=(None, 3)), keep=fuzz.Scalar(bad=(0, -1, 1.5, True))),
    ),
    _target(
        "kp_distributed.compress",
        "kp-distributed",
        kp_distributed.compress,
        lambda d: dict(ddp_model=_model(), kind="bf16"),
        dict(ddp_model=MODEL),
    ),
    _target(
        "kp_distributed.export",
        "kp-distributed",
        kp_distributed.export,
        lambda d: dict(model=_model(), path=os.path.join(tempfile.gettempdir(), "kp-api-weights.pt")),
        dict(model=MODEL),
    ),
    _target(
        "kp_distributed.overlap",
        "kp-distributed",
        kp_distributed.overlap,
        lambda d: dict(intervals=[("gemm", 0.0, 2.0), ("nccl:all_gather", 1.0, 3.0)]),
        dict(intervals=fuzz.Scalar(bad=(None, 3))),
    ),
    _target(
        "kp_distributed.kernel_intervals",
        "kp-distributed",
        kp_distributed.kernel_intervals,
        lambda d: dict(prof=None),
        dict(prof=fuzz.Scalar(bad=(None, "trace.json"))),
    ),
    *(
        _target(f"{package.replace('-', '_')}.unpatch", package, f, lambda d: dict(model=_model()), dict(model=MODEL))
        for package, f in (("kp-norms", kp_norms.unpatch), ("kp-attention", kp_attention.unpatch))
    ),
    _target(
        "kp_attention.and_masks",
        "kp-attention",
        lambda a, b: kp_attention.and_masks(a, b),
        lambda d: dict(a=kp_attention.noop_mask, b=kp_attention.noop_mask),
        dict(a=fuzz.Scalar(bad=(None, 3)), b=fuzz.Scalar(bad=("causal",))),
    ),
    _target(
        "kp_attention.or_masks",
        "kp-attention",
        lambda a, b: kp_attention.or_masks(a, b),
        lambda d: dict(a=kp_attention.noop_mask, b=kp_attention.noop_mask),
        dict(a=fuzz.Scalar(bad=(None,)), b=fuzz.Scalar(bad=(1.0,))),
    ),
    _target(
        "kp_precision.attach_float8",
        "kp-precision",
        kp_precision.attach_float8,
        lambda d: dict(x=torch.randn(16, 16), cast=kp_precision.quantize(torch.randn(16, 16))),
        dict(x=fuzz.Scalar(bad=([1.0], torch.randn(16, 32))), cast=fuzz.Scalar(bad=(3, torch.randn(16, 16)))),
    ),
    _target(
        "kp_precision.mx_matmul",
        "kp-precision",
        kp_precision.mx_matmul,
        lambda d: dict(
            a=kp_precision.mx_quantize(torch.randn(32, 32)), b=kp_precision.mx_quantize(torch.randn(32, 32))
        ),
        dict(a=fuzz.Scalar(bad=(torch.randn(32, 32), None)), out_dtype=fuzz.Scalar(bad=(torch.int8, "bf16"))),
    ),
    _target(
        "kp_precision.precompute_float8_scales",
        "kp-precision",
        kp_precision.precompute_float8_scales,
        lambda d: dict(model=_model()),
        dict(model=MODEL),
    ),
    _target(
        "kp_precision.QuantizedLinear(...)",
        "kp-precision",
        kp_precision.QuantizedLinear,
        lambda d: dict(qat=kp_precision.QATLinear(32, 32)),
        dict(qat=fuzz.Scalar(bad=(nn.Linear(32, 32), None))),
    ),
    _target(
        "kp_precision.Float8AllGatherWeight(...)",
        "kp-precision",
        kp_precision.Float8AllGatherWeight,
        lambda d: dict(tensor=torch.randn(32, 32)),
        dict(tensor=fuzz.Scalar(bad=([1.0], None))),
    ),
    _target(
        "kp_sparsity.SparseLinear(...)",
        "kp-sparsity",
        kp_sparsity.SparseLinear,
        lambda d: dict(weight=torch.randn(32, 32), bias=None, in_features=32, out_features=32),
        dict(weight=fuzz.Scalar(bad=(None, [1.0])), bias=fuzz.Scalar(bad=(1.0,))),
    ),
    *(
        _target(f"kp_distributed.{f.__name__}", "kp-distributed", f, lambda d: dict(model=_model()), dict(model=MODEL))
        for f in (kp_distributed.fingerprint, kp_distributed.find_blocks)
    ),
]


test_bad_input_fuzz = kc.fuzz_test("api", API_TARGETS)
