"""Distributed MuonClip on 2 CPU processes (gloo): FSDP2 (`fully_shard`, DTensor parameters, distributed Muon;
with activation checkpointing; once more with the model's own loss in recomputed chunks, `chunked_causal_lm_loss`)
and DDP with gradient accumulation each give the parameters of one process on the same global batch, and the QK-Clip max logits are the global ones (MAX over micro-batches and ranks).

The model is the tiny early-fusion model (MoonViT + KDA/MLA/MoE backbone): stacked experts, MLA QK-Clip and
vision (MHA) QK-Clip are all exercised, with tau low enough that heads are clipped in most steps.

The model runs in float64 (loss included) so that the comparison sees the algorithm, not fp32 summation order:
AdamW's first steps divide each gradient element by `|g| + eps`, so an element whose contributions cancel to
~1e-8 turns fp32 reduction-order noise (~1e-9, different between one batch of 4 and two of 2 even in a single
process, no distribution involved) into ~1e-4 parameter differences. Newton-Schulz still runs in fp32, as in fp32
training. For the same reason the backbone is all MLA: KDA computes its gates in fp32 even in a float64 model.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from kimi_vl.configuration import KimiVLConfig
from kimi_vl.modeling import KimiVLForConditionalGeneration
from kimi_vl.text import KimiTextConfig
from kimi_vl.training import MuonClip, route_parameters
from kimi_vl.vision import MoonViTConfig
from tests.test_modeling import IMG, PAD, VID, image, sample
from tests.training.launch import free_port

WORLD, STEPS, GLOBAL_BATCH = 2, 5, 4
MODES = ("fsdp2", "fsdp2_chunked_loss", "ddp")
TAU = 1.5
LR = 0.02


def _global_batches() -> list[dict[str, torch.Tensor]]:
    """STEPS global batches of GLOBAL_BATCH samples, each with one image (2 merged tokens) and 8 text tokens."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(1234)
    batches = []
    for _ in range(STEPS):
        ids, pixels, grids = [], [], []
        for _ in range(GLOBAL_BATCH):
            px, grid = image(2, 4)
            text = torch.randint(3, 60, (7,)).tolist()
            ids.append(sample(text[:2], [grid], text[2:]))
            pixels.append(px)
            grids.append(grid)
        batches.append({"input_ids": torch.tensor(ids), "pixel_values": torch.cat(pixels),
                        "image_grid_thw": torch.tensor(grids)})
    torch.random.set_rng_state(gen_state)
    return batches


def _slice(batch: dict[str, torch.Tensor], start: int, stop: int) -> dict[str, torch.Tensor]:
    """Samples `start:stop` of a global batch (every sample has the same number of patches)."""
    per = batch["pixel_values"].shape[0] // batch["input_ids"].shape[0]
    return {"input_ids": batch["input_ids"][start:stop], "pixel_values": batch["pixel_values"][start * per:stop * per],
            "image_grid_thw": batch["image_grid_thw"][start:stop]}


def _model() -> KimiVLForConditionalGeneration:
    """The tiny early-fusion model with an all-MLA backbone (layer 0 dense, layer 1 MoE), in float64. KDA layers
    are left out: their gates run in fp32 even in a float64 model (see the module docstring)."""
    torch.manual_seed(0)
    text = KimiTextConfig(
        vocab_size=80, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        layer_types=["mla", "mla"], num_attention_heads=2, kv_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=8,
        v_head_dim=8, num_experts=4, num_experts_per_tok=2, first_k_dense=1, pad_token_id=PAD, bos_token_id=1,
        eos_token_id=2,
    )
    vision = MoonViTConfig(hidden_size=24, num_attention_heads=2, num_hidden_layers=2, intermediate_size=32,
                           pos_emb_height=8, pos_emb_width=8)
    model = KimiVLForConditionalGeneration(
        KimiVLConfig(vision_config=vision, text_config=text, image_token_id=IMG, video_token_id=VID)
    )
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0, 0.2)
    return model.double().train()


def _loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross-entropy (float64, as the model)."""
    logits = model(**batch).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["input_ids"][:, 1:].flatten())


def _chunked_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The same loss from the model, as the trainer asks for it, in chunks of 3 tokens (no logits come back)."""
    import kimi_vl.text.modeling as modeling

    modeling.LOSS_CHUNK_ELEMENTS = 3 * model.config.text_config.vocab_size  # this rank's process only
    out = model(**batch, labels=batch["input_ids"], return_logits=False)
    assert out.logits is None
    return out.loss


def _single_process() -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    model = _model()
    opt = MuonClip(model, lr=LR, qk_clip_tau=TAU)
    maxima = []
    for batch in _global_batches():
        opt.zero_grad(set_to_none=True)
        _loss(model, batch).backward()
        opt.step()
        maxima.append(opt.last_max_logits)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, maxima


def _worker(rank: int, port: int, out: str) -> None:
    """One rank: for each mode (FSDP2, then DDP) builds the model, wraps it, trains STEPS steps on its half of each
    global batch, and saves the full parameters and the reported max logits."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    from kimi_vl.training.distributed import gather_ints, get_world_size, init_distributed, is_main_process

    try:
        assert init_distributed("gloo", timeout_s=60) == (rank, WORLD)
        assert get_world_size() == WORLD and is_main_process() == (rank == 0)
        assert gather_ints(7 * rank) == [0, 7]  # by rank, on every rank
        half = GLOBAL_BATCH // WORLD
        for mode in MODES:
            model = _model()
            loss_of = _chunked_loss if mode == "fsdp2_chunked_loss" else _loss
            if mode.startswith("fsdp2"):
                model.activation_checkpointing_enable()  # as the trainer does before wrapping: the same numbers
                mesh = init_device_mesh("cpu", (WORLD,))
                # Decoder layers run through their `attention` / `feed_forward` methods, not `forward`, so the
                # FSDP units are their mixer and FFN modules (norms and embeddings fall to the root unit).
                units = [*model.vision_tower.layers]
                for layer in model.language_model.model.layers:
                    units += [layer.self_attn, layer.mlp]
                for unit in units:
                    fully_shard(unit, mesh=mesh)
                fully_shard(model, mesh=mesh)
                assert all(isinstance(p, DTensor) for p in model.parameters())
                opt = MuonClip(model, lr=LR, qk_clip_tau=TAU)
                assert opt.routing() == route_parameters(_model())  # sharding changes no route
                wrapped, micro = model, 1
            else:
                opt = MuonClip(model, lr=LR, qk_clip_tau=TAU)  # built from the bare model, as under accelerate
                wrapped, micro = DistributedDataParallel(model, find_unused_parameters=True), half
            maxima = []
            for batch in _global_batches():
                opt.zero_grad(set_to_none=True)
                mine = _slice(batch, rank * half, (rank + 1) * half)
                size = half // micro
                for m in range(micro):  # DDP: gradient accumulation, synchronised on the last micro-batch only
                    part = _slice(mine, m * size, (m + 1) * size)
                    if m < micro - 1:
                        with wrapped.no_sync():
                            (loss_of(wrapped, part) / micro).backward()
                    else:
                        (loss_of(wrapped, part) / micro).backward()
                opt.step()
                maxima.append(opt.last_max_logits)
            params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                      for n, p in model.named_parameters()}
            torch.save({"params": params, "maxima": maxima}, os.path.join(out, f"{mode}-{rank}.pt"))
            # DDP and FSDP2 keep the process group alive; freed only at interpreter exit, its gloo threads once
            # aborted a rank that had finished (SIGABRT, "terminate called without an active exception", 1 CI run)
            del wrapped, model, opt
            gc.collect()
        dist.barrier()  # neither rank closes its connections while the other still talks
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _launch(out: str, timeout_s: float = 180.0) -> None:
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(rank, port, out)) for rank in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
        p.join()
    assert not hung, f"{len(hung)} rank(s) still running after {timeout_s} s (killed)"
    assert all(p.exitcode == 0 for p in procs), f"exit codes {[p.exitcode for p in procs]}"


@pytest.fixture(scope="module")
def reference():
    return _single_process()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One 2-process launch that runs every mode (spawning costs more than the training)."""
    out = tmp_path_factory.mktemp("ranks")
    _launch(str(out))
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", MODES)
def test_two_ranks_equal_one_process_on_the_global_batch(mode, two_ranks, reference):
    ref_params, ref_maxima = reference
    # the reference clips heads of the vision tower and of the MLA layer in most steps
    for kind in ("vision_tower.", "language_model."):
        clipped = [any((s > TAU).any() for n, s in step.items() if n.startswith(kind)) for step in ref_maxima]
        assert sum(clipped) >= 3, (kind, clipped)
    ranks = [torch.load(two_ranks / f"{mode}-{r}.pt", weights_only=True) for r in range(WORLD)]
    for got in ranks:
        assert got["params"].keys() == ref_params.keys()
        worst = max((got["params"][n] - ref_params[n]).abs().max().item() for n in ref_params)
        assert worst <= 1e-5, f"{mode}: max |param - single-process param| = {worst:.2e}"
        for step, want in zip(got["maxima"], ref_maxima, strict=True):  # global MAX, identical on every rank
            assert step.keys() == want.keys()
            for name in want:
                torch.testing.assert_close(step[name], want[name], rtol=1e-5, atol=1e-5)
    for name, p in ranks[0]["params"].items():  # every rank holds the same model
        assert torch.equal(p, ranks[1]["params"][name]), name


def test_scale_rows_on_dtensors_of_any_placement(tmp_path):
    """`scale_rows_` on a one-rank mesh: dim-0 shards, other-dim shards (gathered and re-sliced) and replicas give
    the plain-tensor result; rows scaled by 1 stay bitwise unchanged."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from kimi_vl.training.distributed import all_reduce_max, scale_rows_

    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        w = torch.randn(6, 5, dtype=torch.bfloat16)
        scale = torch.tensor([1.0, 0.5, 1.0, 0.25, 1.0, 0.7])
        want = w.clone()
        scale_rows_(want, scale)
        assert torch.equal(want[[0, 2, 4]], w[[0, 2, 4]])
        torch.testing.assert_close(want.float(), (w.float() * scale[:, None]).bfloat16().float())
        for placement in (Shard(0), Shard(1), Replicate()):
            d = distribute_tensor(w.clone(), mesh, [placement])
            scale_rows_(d, scale)
            assert d.placements == (placement,) and torch.equal(d.full_tensor(), want), placement
        t = torch.tensor([1.0, -2.0])
        assert all_reduce_max(t) is t and torch.equal(t, torch.tensor([1.0, -2.0]))
    finally:
        dist.destroy_process_group()


def test_fsdp2_runs_the_vision_tower_in_every_forward(tmp_path):
    """Under FSDP2 a batch without images or videos (a text-only rank) still runs the vision tower, once per kind of
    media, adding exactly zero: the same loss and gradients as unsharded, and zero (not missing) gradients on the
    tower, so that every rank's all-gathers and reduce-scatters pair up whatever its data."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    batch = {"input_ids": torch.randint(3, 60, (2, 9), generator=torch.Generator().manual_seed(0))}
    plain = _model()
    want = _loss(plain, batch)
    want.backward()
    assert all(p.grad is None for p in plain.vision_tower.parameters())
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = _model()
        mesh = init_device_mesh("cpu", (1,))
        units = [*model.vision_tower.layers]
        for layer in model.language_model.model.layers:
            units += [layer.self_attn, layer.mlp]
        for unit in [*units, model]:
            fully_shard(unit, mesh=mesh)
        calls = []
        model.vision_tower.register_forward_hook(lambda module, args, out: calls.append(args[1].tolist()))
        loss = _loss(model, batch)
        loss.backward()
        assert calls == [[[1, 2, 2]], [[1, 2, 2]]]  # one blank grid of one merged token, for images and for videos
        assert loss.item() == want.item()
        for (name, p), q in zip(model.named_parameters(), plain.parameters()):
            grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            if name.startswith(("vision_tower.", "multi_modal_projector.")):
                assert torch.count_nonzero(grad) == 0, name
            else:
                torch.testing.assert_close(grad, q.grad, rtol=1e-12, atol=1e-12, msg=name)
    finally:
        dist.destroy_process_group()
