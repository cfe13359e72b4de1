"""shard() on a model built from the other kp packages: the example trainer's Llama with kp-norms' RMSNorm and
SwiGLU, kp-attention's flash attention and kp-precision's float8 linears, their weights all-gathered in float8,
each block compiled. Two ranks train as one process does, the kernels themselves run, and a DCP checkpoint of the
float8 weights resumes on a new model. With 2 GPUs the ranks run on them (NCCL, compiled kernels); otherwise on
gloo with CPU tensors, the kernels under Triton's interpreter."""

import contextlib
import importlib.util
import os
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from dist_workers import batch, device, full_params, loss_of, make, spawn, spawn_killed, train

import kp_distributed

TRAINER = Path(__file__).resolve().parents[3] / "examples" / "train_llama.py"
kp_core = pytest.importorskip("kp_core")  # installed with the kernel packages, which this test needs
pytest.importorskip("kp_norms")
pytest.importorskip("kp_attention")
kp_precision = pytest.importorskip("kp_precision")
pytestmark = pytest.mark.skipif(not TRAINER.is_file(), reason="the example trainer lives in the repository")
# dist_workers.batch's tokens: vocab 32; 16 features so that the float8 matmuls take every linear
ARGS = SimpleNamespace(
    seed=0, vocab=32, dim=32, layers=2, heads=4, kv_heads=2, hidden=48, kernels=True, fp8="tensorwise"
)
STEPS = 2
GPUS = torch.cuda.device_count() >= 2
BACKEND = "nccl" if GPUS else "gloo"


def kernels_on(monkeypatch) -> str:
    """Where the kernels run, and the backend kp_core records for them: compiled on the GPUs, else interpreted."""
    if GPUS:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        return "triton"
    problem = kp_core.interpreter_problem()
    if problem is not None:  # e.g. a one-GPU image with Triton 3.6 and NumPy 2.4: CI's CPU run covers these
        pytest.skip(f"not covered here: two CPU ranks run the kernels under Triton's interpreter, and {problem}")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return "interpret"


def example():
    spec = importlib.util.spec_from_file_location("train_llama", TRAINER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def kp_model():
    return example().build(SimpleNamespace(**vars(ARGS), fp8_all_gather=True), device())


@contextlib.contextmanager
def max_all_reduces():
    """Count the MAX all-reduces in the block (a list of 1s): each float8 all-gather reduces its weight's amax
    first, unless precompute_float8_scales did it for all."""
    all_reduce, calls = torch.distributed.all_reduce, []

    def counted(tensor, op=torch.distributed.ReduceOp.SUM, **kw):
        if op == torch.distributed.ReduceOp.MAX:
            calls.append(1)
        return all_reduce(tensor, op, **kw)

    torch.distributed.all_reduce = counted
    try:
        yield calls
    finally:
        torch.distributed.all_reduce = all_reduce


def _sharded(rank, world, folder):
    # compiled blocks: dynamo traces the float8 weights (tensor subclasses) and the kp ops' declarations
    model = kp_distributed.shard(kp_model(), mixed_precision=None, compile_blocks={"backend": "aot_eager"})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with kp_core.record_launches() as record, max_all_reduces() as amax_reductions:
        losses = train(model, opt, STEPS, rank, world)
    w = model.layers[0].down.weight  # outside the forward: the sharded parameter
    ckpt = kp_distributed.Checkpointer(folder)
    ckpt.save(STEPS, model, opt)
    again = kp_distributed.shard(kp_model(), mixed_precision=None)
    opt2 = torch.optim.AdamW(again.parameters(), lr=1e-2)
    step, _ = ckpt.load(again, opt2)
    return {
        "losses": losses,
        "params": full_params(model),
        "ops": sorted({(launch.op, launch.backend) for launch in record.launches}),
        "weight": f"{type(w).__name__}({type(w.to_local()).__name__})",
        "amax_reductions": sum(amax_reductions),
        "resumed": (step, train(again, opt2, 1, rank, world, first=STEPS)),
    }


def _one_process(rank, world, parts):
    """STEPS + 1 steps, each of the sharded run's `parts` rows through the model separately and the mean of their
    losses (the activations' tensorwise float8 scales are then the ranks' own, as in the sharded run); the
    losses, and the parameters after STEPS."""
    model = kp_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS + 1):
        if step == STEPS:
            params = full_params(model)
        loss = sum(loss_of(model, rows) for rows in batch(step).chunk(parts)) / parts
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, params


def test_kp_kernels_and_float8_all_gather_under_shard(tmp_path, monkeypatch):
    # the one-process run in a process of its own, on the same device and path
    kernels = kernels_on(monkeypatch)
    results = spawn(2, _sharded, str(tmp_path / "ckpt"), backend=BACKEND)
    ((want_losses, want_params),) = spawn(1, _one_process, 2, backend=BACKEND)
    for res in results:
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(want_losses[:STEPS]), rtol=1e-5, atol=1e-6)
        for name, p in want_params.items():
            torch.testing.assert_close(res["params"][name], p, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        # the resumed model's next step is the uninterrupted run's third
        assert res["resumed"][0] == STEPS
        torch.testing.assert_close(res["resumed"][1][0], want_losses[STEPS], rtol=1e-5, atol=1e-6)
    # every kp op of the forward and backward ran, none on its PyTorch reference path; the tensorwise casts and
    # transposing copies of the compiled blocks are PyTorch maths there, for the compiler to fuse
    # (kp_precision.shared.cast), bit for bit the kernels' (the one-process run above used the kernels)
    ops = {"norm", "flash_attention", "glu", "scaled_mm"}
    ops |= {f"{op}_backward" for op in ("norm", "flash_attention", "glu")}
    assert {op for op, _ in results[0]["ops"]} == {f"kp::{op}" for op in ops}
    # (on a GPU, scaled_mm takes cuBLAS's float8 matmul where the shape suits it: recorded as "library")
    backends = {backend for _, backend in results[0]["ops"]}
    assert kernels in backends and backends <= {kernels, "library"}
    assert results[0]["weight"] == "DTensor(Float8AllGatherWeight)"
    # per step: the 8 float8 weights (4 a block) gathered for the forward, block 0's 4 again for the backward (the
    # last block stays gathered)
    assert results[0]["amax_reductions"] == STEPS * 12


def _hybrid(rank, world):
    model = kp_distributed.shard(kp_model(), strategy="hybrid", mixed_precision=None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    with max_all_reduces() as amax_reductions:
        for step in range(STEPS + 1):
            losses += train(model, opt, 1, rank, world, first=step)
            kp_precision.precompute_float8_scales(model)  # over the shard dim of the (replicate, shard) mesh
    return {"losses": losses, "amax_reductions": sum(amax_reductions)}


def test_float8_all_gather_with_precomputed_scales_on_a_hybrid_mesh(monkeypatch):
    """2 x 2 HSDP: the float8 scales reduced over each shard group; the ops on their PyTorch reference path (the
    sharding is under test here, and 4 interpreted ranks on CI's 2 cores would take minutes)."""
    monkeypatch.setenv("KP_BACKEND", "reference")
    results = spawn(4, _hybrid)
    ((want_losses, _),) = spawn(1, _one_process, 4)
    for res in results:
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(want_losses), rtol=1e-5, atol=1e-6)
        # the first step's 12 all-gathers reduce their own amax; then one all-reduce a step for all 8 weights
        assert res["amax_reductions"] == 12 + (STEPS + 1)


class _Logits(torch.nn.Module):
    """A Hugging Face causal LM as tokens -> logits."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, tokens):
        return self.lm(input_ids=tokens).logits


def hf_patched():
    """A tiny transformers Llama, patched: kp-norms' RMSNorm and fused SwiGLU MLP, kp-attention's attention."""
    import transformers

    import kp_attention
    import kp_norms

    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=32,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    lm = transformers.LlamaForCausalLM(config)
    kp_norms.patch(lm)
    kp_attention.patch(lm)
    return _Logits(lm).to(device())


def _hf_sharded(rank, world):
    model = kp_distributed.shard(hf_patched(), mixed_precision=None, activation_checkpointing="full")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with kp_core.record_launches() as record:
        losses = train(model, opt, STEPS, rank, world)
    blocks = [type(b).__name__ for b in kp_distributed.find_blocks(model)]
    return {
        "losses": losses,
        "params": full_params(model),
        "ops": record.backends(),
        "blocks": blocks,
        "use_cache": model.lm.config.use_cache,  # off: a recomputed block would grow the KV cache again
    }


def _hf_one_process(rank, world):
    model = hf_patched()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with kp_core.record_launches() as record:
        losses = train(model, opt, STEPS)
    return losses, full_params(model), record.kernels()


def test_hugging_face_model_patched_by_kp_norms_and_kp_attention_under_shard(monkeypatch):
    pytest.importorskip("transformers")
    backend = kernels_on(monkeypatch)  # as above
    results = spawn(2, _hf_sharded, backend=BACKEND)
    ((want_losses, want_params, kernels),) = spawn(1, _hf_one_process, backend=BACKEND)
    assert kernels  # the patched model runs kp's kernels in one process too
    for res in results:
        assert res["ops"] == {backend}  # every kp op a kernel, none on its reference path
        assert res["blocks"] == ["FSDPCheckpointWrapper"] * 2  # the decoder layers, checkpointed and sharded
        assert res["use_cache"] is False
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(want_losses), rtol=1e-5, atol=1e-6)
        for name, p in want_params.items():
            torch.testing.assert_close(res["params"][name], p, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


KILL_STEPS, KILLED_AT = 6, 4
HISTORIES = ("amax_history_x", "amax_history_w", "amax_history_grad", "amax_history_filled")


def _delayed_float8():
    """dist_workers' Tiny model (dims 16 and 32) with every linear a delayed-scaling Float8Linear."""
    config = kp_precision.Float8Config("tensorwise", "delayed", history_len=4)
    return kp_precision.convert_to_float8_training(make(), config=config)


def _saving_every_step(rank, world, folder, kill_at):
    """Resume from the latest complete checkpoint, then train to KILL_STEPS, saving after every step; rank 1
    kills itself (SIGKILL: no cleanup, no last save) when it reaches step `kill_at`."""
    model = kp_distributed.shard(_delayed_float8(), mixed_precision=None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = kp_distributed.Checkpointer(folder, keep=2)
    first, _ = ckpt.load(model, opt)
    losses = []
    for step in range(first, KILL_STEPS):
        if step == kill_at and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        losses += train(model, opt, 1, rank, world, first=step)
        ckpt.save(step + 1, model, opt)
    scaling = {n: b.detach().clone() for n, b in model.named_buffers() if n.rsplit(".", 1)[-1] in HISTORIES}
    return {"first": first, "losses": losses, "params": full_params(model), "scaling": scaling}


def test_kill_9_mid_run_resumes_bit_identical(tmp_path, monkeypatch):
    """Issue 36's long-run check on CPU ranks: rank 1 is SIGKILLed mid-run; the run resumed from the last complete
    checkpoint continues the uninterrupted run bit for bit: losses, weights, and the float8 delayed-scaling
    histories (in the state_dict since they are)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the float8 ops on their PyTorch path: fast and exact
    whole = spawn(2, _saving_every_step, str(tmp_path / "whole"), None)
    assert spawn_killed(2, _saving_every_step, str(tmp_path / "run"), KILLED_AT) in ("SIGKILL", -signal.SIGKILL)
    resumed = spawn(2, _saving_every_step, str(tmp_path / "run"), None)
    first = resumed[0]["first"]
    assert 0 < first <= KILLED_AT, f"resumed from step {first}"
    for want, got in zip(whole, resumed):
        assert got["losses"] == want["losses"][first:], "the resumed losses differ"
        for name, p in want["params"].items():
            assert torch.equal(got["params"][name], p), name
        assert want["scaling"].keys() == got["scaling"].keys() and len(want["scaling"]) == 4 * 7
        for name, b in want["scaling"].items():
            assert torch.equal(got["scaling"][name], b), name
