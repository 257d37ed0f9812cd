"""The static-cache decoder (lab/static_decode.py): the same greedy tokens as Hugging Face
`generate` and the lab's own loop in float32, inputs it cannot hold refused, and on a GPU the
captured graph's tokens equal to the eager step's (marker `cuda`)."""

from __future__ import annotations

import pytest
import torch

from lab.static_decode import StaticDecoder


def tiny_llama(device: str = "cpu"):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.2,  # logits far enough apart that greedy picks are not near-ties
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    return model.to(torch.device(device)).eval()  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def prompt(batch: int = 1, length: int = 7, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 96, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_greedy_tokens_equal_hf_generate_in_float32(model) -> None:
    ids = prompt()
    expected = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False
    )[:, ids.shape[1] :]
    decoder = StaticDecoder(model, max_len=40, graphs="auto")
    got = decoder.generate(ids, max_new_tokens=24)
    assert not got.graphs  # auto on a CPU: the eager path
    assert expected.shape == (1, 24) and len(set(expected[0].tolist())) > 3  # not one token over
    assert torch.equal(got.tokens, expected)


def test_left_padded_batch_with_eos_equals_the_labs_loop(model) -> None:
    from split_engine.generation import UnsplitModel, decode

    ids = prompt(batch=2, length=9, seed=2)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # row 1: a 5-token prompt, left-padded
    ids[1, :4] = 0
    free = decode(UnsplitModel(model), ids, mask, max_new_tokens=20)
    eos = int(free.tokens[0, 6])  # row 0 ends within the run
    expected = decode(UnsplitModel(model), ids, mask, max_new_tokens=20, eos_token_id=eos)
    decoder = StaticDecoder(model, max_len=32, batch_size=2, graphs="off")
    got = decoder.generate(ids, mask, max_new_tokens=20, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(got.tokens, expected.tokens)
    unbounded = decoder.generate(ids, mask, max_new_tokens=20)  # the same decoder, reset
    assert torch.equal(unbounded.tokens, free.tokens)


def test_a_prompt_the_cache_cannot_hold_is_refused(model) -> None:
    decoder = StaticDecoder(model, max_len=16, graphs="off")
    with pytest.raises(ValueError, match="needs 20 cache slots; this decoder has max_len=16"):
        decoder.generate(prompt(length=12), max_new_tokens=8)
    with pytest.raises(ValueError, match="needs 17 cache slots"):
        decoder.generate(prompt(length=16), max_new_tokens=1)
    with pytest.raises(ValueError, match="a batch of 2 rows"):
        decoder.generate(prompt(batch=2), max_new_tokens=2)
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        decoder.generate(prompt(), max_new_tokens=0)


def test_bad_settings_are_refused(model) -> None:
    with pytest.raises(ValueError, match="graphs='sometimes'"):
        StaticDecoder(model, max_len=16, graphs="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_len=1"):
        StaticDecoder(model, max_len=1)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="graphs='on' needs the model on a CUDA device"):
            StaticDecoder(model, max_len=16, graphs="on")


@pytest.mark.cuda
def test_graph_replay_tokens_equal_the_eager_static_step_on_the_gpu() -> None:
    gpu = tiny_llama("cuda")
    ids = prompt(batch=2, length=9, seed=3)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    eager = StaticDecoder(gpu, max_len=64, batch_size=2, graphs="off").generate(
        ids, mask, max_new_tokens=40
    )
    graph = StaticDecoder(gpu, max_len=64, batch_size=2, graphs="on")
    first = graph.generate(ids, mask, max_new_tokens=40)
    again = graph.generate(ids, mask, max_new_tokens=40)  # replayed from a reset cache
    assert first.graphs and first.capture_s > 0 and again.capture_s == 0
    assert torch.equal(first.tokens, eager.tokens)
    assert torch.equal(again.tokens, eager.tokens)
    expected = gpu.generate(
        ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=40, do_sample=False
    )
    assert torch.equal(eager.tokens, expected[:, ids.shape[1] :].cpu())


@pytest.mark.slow  # inductor on 2 CPU cores: about a minute
def test_compiled_step_gives_the_eager_steps_tokens_in_float32(model) -> None:
    """compile=True (inductor, here on the CPU, no graphs) == compile=False, token for token,
    a left-padded batch; the decoder replays from a reset cache without compiling again."""
    ids = prompt(batch=2, length=9, seed=4)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    eager = StaticDecoder(model, max_len=32, batch_size=2, graphs="off").generate(
        ids, mask, max_new_tokens=12
    )
    decoder = StaticDecoder(model, max_len=32, batch_size=2, graphs="off", compile=True)
    first = decoder.generate(ids, mask, max_new_tokens=12)
    again = decoder.generate(ids, mask, max_new_tokens=12)
    assert first.compiled and first.compile_s > 0 and again.compile_s == 0
    assert torch.equal(first.tokens, eager.tokens)
    assert torch.equal(again.tokens, eager.tokens)
    with pytest.raises(ValueError, match="compile_mode='reduce-overhead'"):
        StaticDecoder(model, max_len=16, compile=True, compile_mode="reduce-overhead")
