"""Which implementation runs an attention call: kp's Triton kernel, PyTorch's fused SDPA (cuDNN or
FlashAttention-2), or FlashAttention-4's CuTe DSL kernel (kp-attention[fa4], SM 9.0+), one rule for every entry
point (flash_attention, the varlen and KV-cache functions, the SDPA drop-in, kp_attention.flash_attn, patch).

    backend="auto"   the default: per call signature (op, shapes, dtype, mask options, whether a backward follows,
                     the GPU), the fastest of the implementations that can take the call and pass the conformance
                     rule there, measured once on tensors of that signature, kept for the process and on disk
                     (`cache_path()`, keyed by the GPU and every version the choice depends on), logged under
                     KP_LOG=info
    backend="kp"     kp's kernel (kp's own tests and the conformance specs pin it)
    backend="torch"  torch.nn.functional.scaled_dot_product_attention (its own pick of fused kernel);
                     "torch:cudnn" / "torch:flash": that kernel of torch's (an error where it cannot run)
    backend="fa4"    FlashAttention-4 (kp_attention.ops.attention_fa4)

A forced "torch" or "fa4" that cannot take the call raises ValueError saying why (`torch_refuses`,
`attention_fa4.refuses`); "auto" then leaves it out. PyTorch's fused kernels stand for a call only where they give
what kp gives: fp16/bf16 on a CUDA device, no softcap, ALiBi, window, dropout, mask (a row a mask hides entirely is
NaN there and 0 in kp), lse or learnable sink, causal with Sq != Sk only where the call's diagonal is top-left as
torch's (the SDPA drop-in; FlashAttention's is bottom-right), and no deterministic backward asked for.
FlashAttention-4 takes fp16/bf16, head dims 8 to 256 in multiples of 8, causal, windows, softcap, GQA, varlen,
paged caches and lse, but no ALiBi, mask or dropout. KNOWN_FAILURES lists where a backend runs but misses the
conformance rule (found by the suite's per-backend cells): "auto" never picks it there. Off a GPU "auto" is
kp's kernel and costs nothing. `kp_core.pin("attention_backend", backend=...)` overrides the argument.

"auto" times the candidates on fresh random tensors of the signature (torch's cuDNN and FlashAttention-2 kernels
separately, as "torch:cudnn" and "torch:flash") in an eager call, and, for a call without a backward, replayed from
a CUDA graph too (the GPU's time alone: at decoding's batch 1 the eager figure is the host's). A call captured into
a CUDA graph takes the replayed choice, a call torch.compile traces the eager one, each as an eager call of its
signature made it in this process, else kp's kernel (a forced backend is taken as it is). kp.optimize and the
benchmarks run one eager step first for that reason.
`timer` (a function of (name, fn) returning ms) replaces the measurement, `graph_timer` the replayed one: tests
inject timings with them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _disable_current_modes

import kp_core

BACKENDS = ("auto", "kp", "torch", "fa4")
AUTO, KP, TORCH, FA4 = BACKENDS
TORCH_KERNELS = ("torch:cudnn", "torch:flash")  # what "auto" times of torch's on a GPU (SDPBackend names below)
_SDPA = {"torch:cudnn": "CUDNN_ATTENTION", "torch:flash": "FLASH_ATTENTION"}
TORCH_OP = "torch::scaled_dot_product_attention"  # the launch record's op of a call torch's kernels ran
# backend -> [(why, predicate of the call's features)]: where the conformance suite found it missing the rule
# (its per-backend cells; docs/ops/attention.md). "auto" leaves the backend out where a predicate holds.
# FlashAttention-4's backward (4.0.0b36, H200, 2026-12-02) meets the rule at head dims up to 64 and at 128, and
# misses it above 64 elsewhere: its SM 9.0 backward has one configuration per head-dim range (64, 96, 128, 192, 256:
# FA3's), tuned at the range's top. At D 80, bfloat16 and float16, dq / dk / dv are off by 0.23 to 2.4 where the
# bound is 1e-2 to 8e-2, with or without grouped-query heads, causal or not (smallest case: B 1, Sq 1, Sk 97, Hq 2 /
# Hkv 1, not causal; the spec's test_known_failures keeps it, strict); at D 112 (111 padded) bfloat16 misses by 4x
# torch's error (dq 2.9e-2, bound 2.2e-2) and float16 does not compile ("failed to partition (112, 80)"). Other dims
# above 64 (72 to 120, 136 to 256) were not measured and are left out with them. D 64 and 128 met the rule on a grid
# of fp16 and bf16, grouped or not, causal or not, Sq x Sk from 1 x 97 to 1000 x 1000; D 64 in both dtypes also with
# softcap 20, window (16, -1) and scale 0.3 (Sq x Sk 1 x 2 to 200 x 200).
KNOWN_FAILURES: dict[str, list[tuple[str, Callable[[dict], bool]]]] = {
    TORCH: [],
    FA4: [
        (
            "backward at a head dim above 64 other than 128: off by 0.2 to 2.4 at D 80 (bound about 1e-2), 4x "
            "torch's error or no compile at D 112, others not measured",
            lambda call: call.get("training", False) and call.get("head_dim", 0) > 64 and call["head_dim"] != 128,
        ),
    ],
}
timer: Callable[[str, Callable[[], object]], float] | None = None
graph_timer: Callable[[str, Callable[[], object]], float] | None = None  # replaces _replay_ms (tests)
REPLAY = "graph replay"  # a decision key's last part for the choice of a call being captured
_DECIDED: dict[tuple, str] = {}  # "auto"'s measured choices (what decided() shows)
_ROUTED: dict[tuple, str] = {}  # every call signature routed so far -> its implementation (route's fast path)
# An entry point's checked call signatures -> what it worked out for them (its checks and route skipped): the
# KV-cache function's, whose decoding steps repeat one signature and are host-bound at batch 1
CALLS: dict[tuple, tuple] = {}
MAX_CALLS = 4096
_DISK: dict | None = None  # the cache file's entries, read once
log = logging.getLogger("kp.attention")


def check(op: str, backend) -> None:
    if backend not in BACKENDS and backend not in TORCH_KERNELS:
        raise ValueError(f"{op}: backend must be one of {BACKENDS + TORCH_KERNELS}, got {backend!r}")


def torch_refuses(
    q,
    k,
    *,
    causal: bool,
    window,
    softcap: float,
    alibi,
    mask,
    lse: bool,
    dropout: bool = False,
    top_left=False,
    deterministic: bool = False,
) -> str | None:
    """Why PyTorch's fused SDPA cannot stand for this call of q (B, Sq, Hq, D), k (B, Sk, Hkv, D); None if it can.
    window: the call's (left, right) after causal ((-1, 0) when causal); top_left: the call's causal diagonal is
    torch's (the SDPA drop-in); deterministic: a deterministic backward is asked for and a gradient is wanted."""
    if not q.is_cuda:
        return "not on a CUDA device"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"{q.dtype} (torch's fused kernels take fp16 and bf16)"
    for what, present in (("softcap", softcap > 0), ("ALiBi", alibi is not None), ("a mask", mask is not None)):
        if present:
            return f"{what} (torch's fused kernels have none, or give NaN where kp gives 0)"
    if dropout:
        return "dropout (kp draws its mask its own way: the same call gives the same values on either backend)"
    if tuple(window) != ((-1, 0) if causal else (-1, -1)):
        return "a sliding window"
    if causal and q.shape[1] != k.shape[1] and not top_left:
        return "causal with Sq != Sk (torch's diagonal is top-left)"
    if lse:
        return "lse asked for (torch's fused kernels return none; a learnable sink needs it too)"
    if deterministic:
        return "a deterministic backward asked for (torch's fused backward may add with atomics)"
    return None


def known_failure(backend: str, call: dict) -> str | None:
    """Why the conformance suite found `backend` missing the rule on a call with these features, or None."""
    for why, applies in KNOWN_FAILURES.get(backend, ()):
        if applies(call):
            return f"known failure of {backend}: {why}"
    return None


def torch_attention(q, k, v, *, causal: bool, scale: float, kernel: str = TORCH) -> torch.Tensor:
    """(B, Sq, Hq, D) in and out, through torch's (B, H, S, D) layout; kernel "torch" (torch's own pick) or one
    of TORCH_KERNELS (that kernel or an error, never a silent fallback to another)."""
    t = [x.transpose(1, 2) for x in (q, k, v)]
    return sdpa(t[0], t[1], t[2], kernel, is_causal=causal, scale=scale, enable_gqa=q.shape[2] != k.shape[2]).transpose(
        1, 2
    )


def sdpa(query, key, value, kernel: str, **options) -> torch.Tensor:
    """F.scaled_dot_product_attention on `kernel` (see torch_attention), recorded as a launch of TORCH_OP (but
    not while torch.compile traces it, as kp's own launches)."""
    if not torch.compiler.is_compiling():
        kp_core.note_launch(TORCH_OP, kernel, TORCH)
    if kernel == TORCH:
        return F.scaled_dot_product_attention(query, key, value, **options)
    if torch.compiler.is_compiling():  # what torch.compile understands
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(getattr(SDPBackend, _SDPA[kernel])):
            return F.scaled_dot_product_attention(query, key, value, **options)
    # sdpa_kernel's own switching, without its context manager's cost (14 us a call on a CPU core; a decoding
    # step's attention is about that long on the GPU)
    switches = _sdp_switches()
    before = [get() for get, _, _ in switches]
    try:
        for _, set_, name in switches:
            set_(name == _SDPA[kernel])
        return F.scaled_dot_product_attention(query, key, value, **options)
    finally:
        for (_, set_, _), was in zip(switches, before):
            set_(was)


_SWITCHES: list = []


def _sdp_switches() -> list:
    """(getter, setter, SDPBackend name) of every SDPA backend torch can switch, as sdpa_kernel switches them."""
    if not _SWITCHES:
        for name, backend in _SDP_NAMES.items():
            get, set_ = (
                getattr(torch._C, f"_get_{name}_sdp_enabled", None),
                getattr(torch._C, f"_set_sdp_use_{name}", None),
            )
            if get is not None and set_ is not None:  # "overrideable" from torch 2.5 on
                _SWITCHES.append((get, set_, backend))
    return _SWITCHES


_SDP_NAMES = {
    "cudnn": "CUDNN_ATTENTION",
    "flash": "FLASH_ATTENTION",
    "mem_efficient": "EFFICIENT_ATTENTION",
    "math": "MATH",
    "overrideable": "OVERRIDEABLE",
}


def candidates(device: torch.device) -> tuple[str, ...]:
    """The implementations "auto" may time on `device`, before the call's refusals."""
    return (KP, *TORCH_KERNELS, FA4) if device.type == "cuda" else (KP, TORCH, FA4)


def route(
    op: str,
    backend: str,
    device: torch.device,
    key: tuple,
    training: bool,
    describe: Callable[[], tuple[dict, dict, Callable, Callable]],
) -> str:
    """The implementation this call runs: "kp", "fa4", "torch" or one of TORCH_KERNELS.

    backend: the caller's argument (after kp_core.settings' "attention_backend" pin); key: the call's signature
    beyond op and device, everything the refusals and the choice depend on. The answer is kept per signature, so
    that a repeated call costs one dict lookup; only a new one calls describe(), which gives (refused, features,
    sample, run): refused maps a backend, or one of TORCH_KERNELS alone, to why it cannot take the call (None: it
    can), features are the call's options for KNOWN_FAILURES, sample() gives fresh inputs of the signature (a tuple,
    its first three tensors requiring grad when training) and run(name, *inputs) runs implementation `name` on
    them, returning its output (with training its backward is timed too)."""
    capturing_now = capturing(device)
    memo = (op, backend, *key, device, training, capturing_now)
    found = _ROUTED.get(memo)
    if found is not None:
        return found
    check(op, backend)
    if backend == KP:
        return KP
    refused, features, sample, run = describe()
    compiling = torch.compiler.is_compiling()
    if backend != AUTO:
        why = _refusal(refused, backend)
        if why:
            raise ValueError(f"{op}: backend={backend!r} cannot take this call: {why}")
        if not compiling:
            _ROUTED[memo] = backend
        return backend
    names = []
    for name in candidates(device):
        base = name.split(":")[0]
        why = _refusal(refused, name) if base != KP else None
        why = why or known_failure(base, features)
        if why is None:
            names.append(name)
    if names != [KP]:
        full = (op, *key, str(device), training)
        replayed = (*full, REPLAY)
        choice = _DECIDED.get(full)
        if compiling:  # traced: no timing, no file; what an eager call decided, else kp's kernel
            return KP if choice is None else choice
        if choice is None:
            choice = _from_disk(full, names)
            replay_choice = _from_disk(replayed, names) if choice is not None else None
            if replay_choice is not None:
                _DECIDED[replayed] = replay_choice
            if choice is None:
                if capturing_now:
                    return KP  # nothing can be timed while a graph captures: decided by a later eager call
                with _disable_current_modes():
                    choice = _measure(op, full, names, sample, run, training)
            _DECIDED[full] = choice
        if capturing_now:  # the call is being captured: what was fastest replayed from a graph, where that was timed
            choice = _DECIDED.get(replayed, choice)
    else:
        choice = KP
    if not compiling:
        _ROUTED[memo] = choice
    return choice


def _refusal(refused: dict, name: str) -> str | None:
    """Why `name` ("fa4", "torch", "torch:cudnn", ...) cannot take the call: its backend's refusal or its own."""
    return refused.get(name.split(":")[0]) or refused.get(name)


def capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on `device`'s current stream (route's replayed choice then). Traced by
    torch.compile: no (dynamo cannot trace the query; the traced call takes what an eager call decided)."""
    if device.type != "cuda" or torch.compiler.is_compiling():
        return False
    return torch.cuda.is_current_stream_capturing()


def _replay_ms(name: str, fn: Callable[[], object]) -> float:
    """Median ms of fn replayed from a CUDA graph: the GPU's time alone (kp_core.median_ms of an eager call counts
    the host's launch cost where it exceeds the GPU's, as at decoding's batch 1). name: as graph_timer's."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the capture stream, as torch.cuda.graph asks
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return kp_core.median_ms(graph.replay)


def _measure(op, full, names, sample, run, training) -> str:
    inputs = sample()
    time = timer or (lambda name, fn: kp_core.median_ms(fn))
    ms = {}
    with torch.enable_grad() if training else torch.no_grad():
        for name in names:

            def call(name=name):
                out = run(name, *inputs)
                if training:
                    out.backward(torch.ones_like(out))

            try:
                ms[name] = time(f"{op} {name}", call)
            except Exception as e:  # a kernel that turns this shape down (cuDNN's limits, ...): not a candidate
                log.info("%s: %s left out: %s: %s", op, name, type(e).__name__, str(e)[:200])
    choice = min(ms, key=ms.get) if ms else KP
    times = ", ".join(f"{n} {t:.3f} ms" for n, t in sorted(ms.items(), key=lambda item: item[1]))
    log.info("%s %s: %s -> %s", op, _describe(full), times, choice)
    _store(full, choice, ms)
    replay = graph_timer or (_replay_ms if timer is None and inputs[0].is_cuda else None)
    if replay is not None and not training and ms:  # a training step's graph is kp-graphs' (its eager choice)
        _measure_replays(op, full, list(ms), inputs, run, replay)
    return choice


def _measure_replays(op, full, names, inputs, run, replay) -> None:
    """The candidates that ran eagerly, timed replayed from a CUDA graph: the choice for a call being captured."""
    ms = {}
    with torch.no_grad():
        for name in names:
            try:
                ms[name] = replay(f"{op} {name} replayed", lambda name=name: run(name, *inputs))
            except Exception as e:  # a kernel that cannot be captured: left out of the replayed choice
                log.info("%s: %s left out of graph replays: %s: %s", op, name, type(e).__name__, str(e)[:200])
    if ms:
        choice = min(ms, key=ms.get)
        times = ", ".join(f"{n} {t:.3f} ms" for n, t in sorted(ms.items(), key=lambda item: item[1]))
        log.info("%s %s, replayed from a graph: %s -> %s", op, _describe(full), times, choice)
        _DECIDED[(*full, REPLAY)] = choice
        _store((*full, REPLAY), choice, ms)


def _describe(full: tuple) -> str:
    return " ".join(str(part) for part in full[1:])


# ---- the decisions on disk ----


def cache_path() -> Path:
    """Where "auto" keeps its decisions: $KP_CACHE_DIR/attention.json, else ~/.cache/kp/attention.json
    ($XDG_CACHE_HOME respected); KP_ATTENTION_CACHE=0 keeps them in the process only.

    Examples:
        >>> from kp_attention import backend
        >>> backend.cache_path().name
        'attention.json'
    """
    root = os.environ.get("KP_CACHE_DIR")
    if root is None:
        root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kp"
    return Path(root) / "attention.json"


def _disk_enabled() -> bool:
    return os.environ.get("KP_ATTENTION_CACHE", "1") != "0"


def environment(device: torch.device) -> dict:
    """What a measured choice depends on: the GPU, torch, Triton, cuDNN, kp-attention and FlashAttention-4."""
    from importlib.metadata import PackageNotFoundError, version

    import kp_attention

    def installed(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    env = {"torch": torch.__version__, "triton": installed("triton"), "kp_attention": kp_attention.__version__}
    env["flash_attn_4"] = installed("flash-attn-4")
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["capability"] = list(torch.cuda.get_device_capability(device))
        env["cudnn"] = torch.backends.cudnn.version()
    return env


def _entry(full: tuple) -> str:
    device = torch.device(full[-3] if full[-1] == REPLAY else full[-2])  # (..., device, training[, REPLAY])
    text = json.dumps([environment(device), [str(part) for part in full]], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _from_disk(full: tuple, names: list[str]) -> Optional[str]:
    global _DISK
    if not _disk_enabled():
        return None
    if _DISK is None:
        try:
            _DISK = json.loads(cache_path().read_text())
        except (OSError, ValueError):
            _DISK = {}
    found = _DISK.get(_entry(full)) if isinstance(_DISK, dict) else None
    if isinstance(found, dict) and found.get("choice") in names:
        log.info("%s %s: %s (decided earlier, %s)", full[0], _describe(full), found["choice"], cache_path())
        return found["choice"]
    return None


def _store(full: tuple, choice: str, ms: dict) -> None:
    global _DISK
    if not _disk_enabled():
        return
    target = cache_path()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            data = json.loads(target.read_text())
        except (OSError, ValueError):
            data = {}
        data = data if isinstance(data, dict) else {}
        data[_entry(full)] = {"choice": choice, "ms": ms, "call": [str(part) for part in full]}
        tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        tmp.replace(target)  # a reader never sees half a file
        _DISK = data
    except OSError as e:  # a read-only home: the choice still holds for the process
        log.info("could not write %s: %s", target, e)


def decided() -> dict[tuple, str]:
    """The signatures decided so far in this process and their choice (a copy): call signature -> "kp", "fa4",
    "torch:cudnn" or "torch:flash".

    Examples:
        >>> import torch
        >>> import kp_attention
        >>> from kp_attention import backend
        >>> q = torch.randn(1, 64, 4, 32)
        >>> out = kp_attention.flash_attention(q, q, q, causal=True)
        >>> backend.decided()  # off a GPU nothing is measured: "auto" runs kp's kernel
        {}
    """
    return dict(_DECIDED)


def forget() -> None:
    """Drop every decision of this process (the next call of each signature looks on disk, then measures).

    Examples:
        >>> from kp_attention import backend
        >>> backend.forget()
        >>> backend.decided()
        {}
    """
    global _DISK
    _DECIDED.clear()
    _ROUTED.clear()
    CALLS.clear()
    _DISK = None
