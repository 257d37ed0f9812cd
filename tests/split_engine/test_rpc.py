"""A live split: two stage processes over loopback RPC, this process as the driver.

One world serves every test here (starting processes costs seconds): inference first, then
training on freshly built stages in the same stage processes.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from split_engine.generation import Sampling, UnsplitModel, decode
from split_engine.sharded import ShardedModel
from split_inference.run import batches
from split_training.config import SplitTrainConfig
from split_training.trainer import DistributedTrainer
from tests.clocks import HANG_GUARD_S

from .conftest import NUM_LAYERS, model_config, rpc_world


@pytest.fixture(scope="module")
def world(llama_folder: Path, tmp_path_factory: pytest.TempPathFactory):
    # split_training's stages: they allow its optimizer's and checkpoints' calls (rpc_guard.allow);
    # they serve inference as split_inference's do
    with rpc_world(
        llama_folder, tmp_path_factory.mktemp("world"), module="split_training"
    ) as settings:
        yield settings


@pytest.fixture(scope="module")
def sharded(world) -> ShardedModel:
    return ShardedModel.build(world.model, world.split)


def prompts(tokenizer, count: int) -> list[list[int]]:
    texts = [
        "def add(a, b):\n    return",
        "import os\nimport sys\n\nclass Path",
        "for i in range(10):",
        "x = [1, 2",
    ]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts[:count]]


def test_split_logits_equal_the_unsplit_model(sharded: ShardedModel, unsplit) -> None:
    ids = torch.randint(3, unsplit.config.vocab_size, (2, 16))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    got = sharded.forward(ids, mask)
    with torch.no_grad():
        positions = mask.cumsum(-1) - 1
        expected = unsplit(
            input_ids=ids, attention_mask=mask, position_ids=positions.clamp(min=0)
        ).logits
    keep = mask.bool()
    torch.testing.assert_close(got[keep], expected[keep], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("batch_size", [1, 2])
def test_split_greedy_generation_equals_hf_generate(
    sharded, unsplit, tokenizer, batch_size: int
) -> None:
    for ids, mask in batches(
        prompts(tokenizer, 2 * batch_size),
        batch_size=batch_size,
        pad_token_id=tokenizer.pad_token_id,
    ):
        got = sharded.generate(ids, mask, max_new_tokens=12, pad_token_id=tokenizer.pad_token_id)
        expected = unsplit.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=tokenizer.pad_token_id,
        )[:, ids.shape[1] :]
        assert torch.equal(got.tokens, expected)


def test_kv_cache_and_recomputation_agree_and_caches_are_freed(sharded, tokenizer) -> None:
    ((ids, mask),) = batches(
        prompts(tokenizer, 2), batch_size=2, pad_token_id=tokenizer.pad_token_id
    )
    cached = sharded.generate(ids, mask, max_new_tokens=8, kv_cache=True)
    recomputed = sharded.generate(ids, mask, max_new_tokens=8, kv_cache=False)
    assert torch.equal(cached.tokens, recomputed.tokens)
    assert [s["open_requests"] for s in sharded.stats()] == [0.0, 0.0]


def test_a_cached_request_keeps_its_mask_and_refuses_one_that_does_not_fit(sharded) -> None:
    """With a KV cache each stage holds the request's mask; a call brings only its own tokens'
    columns. A mask whose rows or length do not fit the cache is refused, naming the request."""
    from split_engine.generation import Sampling

    ids = torch.randint(3, 200, (2, 6))
    request = 10_001
    sharded.call(0, "open_request", request, Sampling().as_dict(), True)
    try:
        positions = torch.arange(6).expand(2, 6)
        sharded.call(0, "forward", ids, torch.ones(2, 6, dtype=torch.long), positions,
                     request=request, chain=True, pick=True)  # fmt: skip
        with pytest.raises(Exception, match=f"request {request}: a mask of"):
            sharded.call(0, "forward", ids[:, :1], torch.ones(3, 7, dtype=torch.long),
                         torch.full((2, 1), 6), request=request, chain=True, pick=True)  # fmt: skip
    finally:
        sharded.call(0, "end_request", request, chain=True)
    assert [s["open_requests"] for s in sharded.stats()] == [0.0, 0.0]


def test_sampling_follows_the_same_distribution_path(sharded, unsplit, tokenizer) -> None:
    ((ids, mask),) = batches(
        prompts(tokenizer, 2), batch_size=2, pad_token_id=tokenizer.pad_token_id
    )
    sampling = Sampling(temperature=0.8, top_p=0.9, seed=7)
    got = sharded.generate(ids, mask, max_new_tokens=10, sampling=sampling)
    again = sharded.generate(ids, mask, max_new_tokens=10, sampling=sampling)
    local = decode(UnsplitModel(unsplit), ids, mask, max_new_tokens=10, sampling=sampling)
    other = sharded.generate(ids, mask, max_new_tokens=10, sampling=replace(sampling, seed=8))
    assert torch.equal(got.tokens, again.tokens)
    assert torch.equal(got.tokens, local.tokens)  # picked on the last stage: the same draws
    assert not torch.equal(got.tokens, other.tokens)


def test_each_stage_holds_only_its_layers(sharded, unsplit) -> None:
    layers = sharded.call_all("held_layers")
    assert layers == [[0, 1], [2, 3]]
    names = sharded.call_all("parameter_names")
    assert any("embed_tokens" in n for n in names[0]) and not any("lm_head" in n for n in names[0])
    assert "lm_head.weight" in names[1] and not any("embed_tokens" in n for n in names[1])
    params = [s["params"] for s in sharded.stats()]
    assert sum(params) == sum(p.numel() for p in unsplit.parameters())


def test_bfloat16_on_the_wire_halves_the_bytes_and_stays_close(world, unsplit) -> None:
    from dataclasses import replace

    narrow = ShardedModel.build(world.model, replace(world.split, wire_dtype="bfloat16"))
    wide = ShardedModel.build(world.model, world.split)
    ids = torch.randint(3, unsplit.config.vocab_size, (1, 16))
    with torch.no_grad():
        expected = unsplit(input_ids=ids).logits
    torch.testing.assert_close(narrow.forward(ids), expected, rtol=0.05, atol=0.05)
    wide.forward(ids)
    assert narrow.bytes_between_stages() * 2 == wide.bytes_between_stages()


# ---------------------------------------------------------------------------- training


def training_batches(
    vocab: int, *, steps: int, batch: int = 4, length: int = 16
) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (batch, length), generator=generator) for _ in range(steps)]


def reference_training(
    folder: Path, data: list[torch.Tensor], split: SplitTrainConfig
) -> tuple[list[float], list[float]]:
    """The same training in one process: whole model, torch AdamW, HF's own loss. Returns the
    losses and each step's global gradient norm before clipping (`clip_grad_norm_`)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=split.lr, weight_decay=split.weight_decay)
    losses, norms = [], []
    for batch in data:
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        limit = split.grad_clip or float("inf")  # 0: off, the norm is still measured
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), limit)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, norms


def build_trainer(world, split: SplitTrainConfig, **kwargs) -> DistributedTrainer:
    sharded = ShardedModel.build(
        model_config(Path(world.model.pretrained)), split, training=True, **kwargs
    )
    return DistributedTrainer(sharded, split)


def test_split_training_matches_single_process_training(world, llama_folder, unsplit) -> None:
    split = SplitTrainConfig(
        num_stages=2, microbatches=2, batch_size=4, lr=3e-3, grad_clip=0.5, rpc_timeout_s=20
    )
    data = training_batches(unsplit.config.vocab_size, steps=2) * 2  # each batch seen twice
    trainer = build_trainer(world, split)
    got = [trainer.train_step([batch]).loss for batch in data]
    expected, _ = reference_training(llama_folder, data, split)
    assert got == pytest.approx(expected, rel=1e-4, abs=1e-4)
    assert got[2] < got[0] and got[3] < got[1]  # it does learn


def test_pipelining_and_accumulation_do_not_change_the_gradients(world, unsplit) -> None:
    split = SplitTrainConfig(num_stages=2, microbatches=4, batch_size=4, rpc_timeout_s=20)
    trainer = build_trainer(world, split)
    (batch,) = training_batches(unsplit.config.vocab_size, steps=1)
    plain = trainer.gradients([batch], microbatches=1)
    piped = trainer.gradients([batch], microbatches=4)
    accumulated = trainer.gradients([batch[:2], batch[2:]], microbatches=1)
    assert plain.keys() == piped.keys() == accumulated.keys()
    assert len(plain) == sum(1 for _ in unsplit.parameters())
    for name in plain:
        torch.testing.assert_close(piped[name], plain[name], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(accumulated[name], plain[name], rtol=1e-4, atol=1e-6)


def test_checkpoint_restores_weights_and_optimizer_state(world, unsplit, tmp_path: Path) -> None:
    split = SplitTrainConfig(num_stages=2, microbatches=2, batch_size=4, lr=3e-3, rpc_timeout_s=20)
    data = training_batches(unsplit.config.vocab_size, steps=4)
    trainer = build_trainer(world, split)
    for batch in data[:2]:
        trainer.train_step([batch])
    trainer.save(tmp_path)
    uninterrupted = [trainer.train_step([batch]).loss for batch in data[2:]]
    resumed = build_trainer(world, split)  # fresh stages: the pretrained weights again
    manifest = resumed.load(tmp_path)
    assert manifest["step"] == 2 and resumed.step == 2
    again = [resumed.train_step([batch]).loss for batch in data[2:]]
    assert again == pytest.approx(uninterrupted, rel=1e-6)
    files = sorted(p.name for p in (tmp_path / "step-000002").iterdir())
    assert files == [
        "stage1.optim.pt",
        "stage1.safetensors",
        "stage2.optim.pt",
        "stage2.safetensors",
    ]


def test_lora_mode_trains_only_the_adapters(world, unsplit) -> None:
    split = SplitTrainConfig(
        num_stages=2, microbatches=2, batch_size=4, lr=1e-2, lora=True, rpc_timeout_s=20
    )
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    trainer = build_trainer(world, split, lora=lora)
    (batch,) = training_batches(unsplit.config.vocab_size, steps=1)
    grads = trainer.gradients([batch], microbatches=2)
    assert grads and all("lora_" in name for name in grads)
    # 2 adapted modules x A and B per layer
    assert len(grads) == NUM_LAYERS * 2 * 2
    before = trainer.sharded.call_all("trainable_state")
    trainer.train_step([batch])
    after = trainer.sharded.call_all("trainable_state")
    moved = [
        name
        for stage_b, stage_a in zip(before, after, strict=True)
        for name in stage_b
        if not torch.equal(stage_b[name], stage_a[name])
    ]
    assert moved and all("lora_B" in n or "lora_A" in n for n in moved)


def test_1f1b_gives_gpipes_losses_and_holds_fewer_micro_batches(world, unsplit) -> None:
    """The same steps under both schedules: equal losses and norms step for step (each stage
    adds its micro-batches' gradients in the same order), and at 8 micro-batches the first
    stage holds 2 micro-batches' saved tensors at a time instead of 8."""
    data = training_batches(unsplit.config.vocab_size, steps=3, batch=8, length=32)
    runs = {}
    for schedule in ("gpipe", "1f1b"):
        split = SplitTrainConfig(
            num_stages=2, microbatches=8, batch_size=8, lr=3e-3, grad_clip=0.5,
            schedule=schedule, rpc_timeout_s=20,
        )  # fmt: skip
        trainer = build_trainer(world, split)
        runs[schedule] = [trainer.train_step([batch]) for batch in data]
    gpipe, one_f_one_b = runs["gpipe"], runs["1f1b"]
    for a, b in zip(gpipe, one_f_one_b, strict=True):
        assert b.loss == pytest.approx(a.loss, rel=1e-6) and b.grad_norm == pytest.approx(
            a.grad_norm, rel=1e-6
        )
    first_gpipe, first_1f1b = gpipe[-1].saved_peak_bytes[0], one_f_one_b[-1].saved_peak_bytes[0]
    assert first_gpipe > 0 and first_1f1b <= 0.6 * first_gpipe, (first_1f1b, first_gpipe)
    assert first_1f1b == pytest.approx(first_gpipe * 2 / 8, rel=0.05)  # 2 of 8 in flight


def test_a_peer_message_that_does_not_fit_the_step_fails_its_sender_only(world, unsplit) -> None:
    """A push a stage did not expect (another kind, a step long past, a shape or dtype other
    than the plan's, a non-finite value) is refused to whoever sent it; the stage trains on."""
    import torch.distributed.rpc as rpc

    # waits of the hang guard: a refusal must come from the stage, never a 5 s lapse on a busy box
    split = SplitTrainConfig(num_stages=2, microbatches=2, batch_size=4, rpc_timeout_s=HANG_GUARD_S)
    trainer = build_trainer(world, split)
    (batch,) = training_batches(unsplit.config.vocab_size, steps=1)
    trainer.train_step([batch])
    last = trainer.pipes[-1]
    hidden = torch.zeros(2, 16, 64)  # an activation as this cut carries it
    bad = [
        ("exec", 1, (0, 0), hidden),  # no such kind
        ("activation", 1, (0, -1), hidden),  # a negative slot
        ("activation", True, (0, 0), hidden),  # a bool is not a step
        ("activation", 0, (0, 0), hidden),  # a step already done
        ("activation", 99, (0, 0), hidden),  # a step far ahead
        ("activation", 1, (0, 0), torch.zeros(2, 16, 65)),  # not this cut's width
        ("activation", 1, (0, 0), hidden.double()),  # not the wire dtype
        ("norm", 1, (0, 0), float("nan")),
        ("norm", 1, (0, 0), -1.0),
        ("norm", 1, (0, 7), 1.0),  # no stage 8
        ("abort", 1, (0, 0), "two\nlines"),  # a reason is one printable line
        ("gradient", 1, (0, 0), "not a tensor"),
        ("activation", 1, [0, 0], hidden),  # a list is not a slot
    ]
    for kind, step, slot, value in bad:
        with pytest.raises(Exception, match=r"step|slot|kind|norm|tensor|cut|stages|line"):
            last.rpc_sync(timeout=HANG_GUARD_S).receive(kind, step, slot, value)
    # rows and tokens other than the plan's pass the door, then fail the step that takes them
    last.rpc_sync(timeout=HANG_GUARD_S).receive("activation", 1, (0, 0), torch.zeros(1, 3, 64))
    with pytest.raises(Exception, match=r"stage 2 gave up: activation .* of shape \(1, 3, 64\)"):
        trainer.train_step([batch])  # at once: stage 1 hears why and waits no timeout
    assert rpc.get_worker_info().name == "driver"
    result = trainer.train_step([batch])  # the stages go on with the next step
    assert result.loss > 0
