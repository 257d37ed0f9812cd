"""Several requests in flight through live stage processes (split_engine.batching): a
micro-batch of requests at different lengths, joining and leaving between tokens, gives each
request the tokens it gets alone; the driver's pipeline does the same from many threads."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from lab.serving import Cancelled, Params, ServeConfig, Server, Text
from split_engine.batching import Pipeline
from split_engine.generation import Sampling, UnsplitModel, decode
from split_engine.sharded import ShardedModel
from split_inference.serve import SplitEngine

from .conftest import rpc_world

TEXTS = [
    "def add(a, b):\n    return",
    "import os\nimport sys\n\nclass Path",
    "for i in range(10):",
    "x = [1, 2",
    "while True:\n    if",
]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def sharded(llama_folder: Path, tmp_path_factory: pytest.TempPathFactory):
    with rpc_world(llama_folder, tmp_path_factory.mktemp("batching")) as settings:
        yield ShardedModel.build(settings.model, settings.split)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS]


@pytest.fixture(scope="module")
def alone(unsplit, prompts) -> list[list[int]]:
    """Each prompt's greedy tokens from the lab's own decode loop, one process, one request."""
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])  # (1, T)
        generation = decode(UnsplitModel(unsplit), ids, torch.ones_like(ids),
                            max_new_tokens=NEW_TOKENS)  # fmt: skip
        out.append(generation.tokens[0].tolist())
    return out


def step(sharded: ShardedModel, x: torch.Tensor, requests: list[int], opening: list) -> list[int]:
    """One micro-batch relayed stage to stage, as the driver's pipeline does."""
    for index in range(len(sharded.stages)):
        x = sharded.call(index, "step", x, requests, opening)
    return x.tolist()


def test_a_micro_batch_joined_and_left_between_tokens_gives_each_request_its_alone_tokens(
    sharded, prompts, alone
) -> None:
    greedy = Sampling().as_dict()
    tokens: dict[int, list[int]] = {}

    def join(request: int) -> None:  # its prefill, alone, opens its slot on every stage
        tokens[request] = step(sharded, torch.tensor([prompts[request]]), [request], [greedy])

    for request in (0, 1, 2):
        join(request)
    for number in range(1, NEW_TOKENS):
        if number == 3:  # joins with the others three tokens in (a shorter cache than theirs)
            join(3)
        if number == 5:
            join(4)
        active = [r for r in tokens if len(tokens[r]) < NEW_TOKENS - (r == 1) * 3]
        feed = torch.tensor([[tokens[r][-1]] for r in active])  # (k, 1)
        for request, token in zip(
            active, step(sharded, feed, active, [None] * len(active)), strict=True
        ):
            tokens[request].append(token)
    for request in (3, 4):  # the late ones finish alone or in pairs
        while len(tokens[request]) < NEW_TOKENS:
            active = [r for r in (3, 4) if len(tokens[r]) < NEW_TOKENS]
            feed = torch.tensor([[tokens[r][-1]] for r in active])
            for r, token in zip(
                active, step(sharded, feed, active, [None] * len(active)), strict=True
            ):
                tokens[r].append(token)
    assert [len(tokens[r]) for r in range(5)] == [8, 5, 8, 8, 8]  # request 1 left early
    for request in range(5):
        assert tokens[request] == alone[request][: len(tokens[request])], request
    assert max(s["mean_batch"] for s in sharded.stats()) > 1  # they were batched
    for request in range(5):
        sharded.call_all("end_request", request)
    assert [s["open_requests"] for s in sharded.stats()] == [0.0, 0.0]


def test_a_step_for_a_request_without_a_slot_is_refused(sharded) -> None:
    with pytest.raises(Exception, match="has no slot"):
        step(sharded, torch.tensor([[5]]), [999], [None])


def test_the_pipeline_serves_requests_from_many_threads_as_each_alone(
    sharded, prompts, alone
) -> None:
    pipeline = Pipeline(sharded, max_concurrent=len(prompts), in_flight=2, eos_token_id=None)
    results: dict[int, list[int]] = {}
    errors: dict[int, BaseException] = {}
    start = threading.Barrier(len(prompts))

    def client(index: int) -> None:
        def on_token(token: int) -> None:
            if index == 4 and token is not None and len(seen) == 2:
                raise Cancelled  # its client leaves at its third token
            seen.append(token)

        seen: list[int] = []
        start.wait()
        try:
            results[index] = pipeline.generate(
                prompts[index], Sampling(), max_new_tokens=NEW_TOKENS, on_token=on_token
            )
        except BaseException as exc:
            errors[index] = exc

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert set(errors) == {4} and isinstance(errors[4], Cancelled)
        for index in range(4):
            assert results[index] == alone[index], index
        assert pipeline.active == 0
        stats = pipeline.stats()
        assert stats["steps"] >= NEW_TOKENS and stats["mean_batch"] >= 1
    finally:
        pipeline.close()
    assert [s["open_requests"] for s in sharded.stats()] == [0.0, 0.0]


class _ThreadNotingTokenizer:
    """The lab's tokenizer, noting the thread of every call that decodes."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.threads: set[threading.Thread] = set()

    def decode(self, *args: Any, **kwargs: Any) -> str:
        self.threads.add(threading.current_thread())
        return self.tokenizer.decode(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)


def test_the_scheduler_thread_never_detokenizes_each_stream_does_on_its_own_thread(
    sharded, prompts, alone, tokenizer
) -> None:
    """Three streams served at once through the endpoint's server and the split engine: the
    pipeline's scheduler only steps and hands out ids; each request's detokenizing runs on
    its own worker thread (on the scheduler's, N clients' serving work would queue behind
    the stepping); each streams its alone greedy text."""
    noting = _ThreadNotingTokenizer(tokenizer)
    engine = SplitEngine(sharded, noting, kv_cache=True, max_concurrent=3, in_flight=2)
    assert engine.pipeline is not None
    server = Server(engine, noting, model_id="m", config=ServeConfig(), secret=None)
    params = Params(max_new_tokens=NEW_TOKENS, temperature=0.0, top_p=1.0, seed=0)

    async def stays() -> bool:  # the client never leaves
        return False

    async def stream(index: int) -> tuple[list[int], str, Text]:
        assert await server.take_slot(f"cmpl-{index}", stays)  # three slots: all at once
        pieces: asyncio.Queue[str | None] = asyncio.Queue()
        text = Text(noting, [], eos=tokenizer.eos_token_id)
        future, _ = server.start(f"cmpl-{index}", prompts[index], params, text, pieces)
        tokens = await future  # (every piece was queued before the future's result)
        streamed = []
        while not pieces.empty():
            streamed.append(pieces.get_nowait())
        return tokens, "".join(p for p in streamed if p), text

    async def three() -> list[tuple[list[int], str, Text]]:
        return list(await asyncio.gather(*(stream(index) for index in range(3))))

    try:
        results = asyncio.run(three())
    finally:
        server.stop()
        engine.close()
    threads = set(noting.threads)  # the serving's own calls (the checks below decode too)
    for index, (tokens, streamed, text) in enumerate(results):
        expected = alone[index]
        if tokenizer.eos_token_id in expected:  # the engine stops at the end of text
            expected = expected[: expected.index(tokenizer.eos_token_id) + 1]
        assert tokens == expected, index
        assert streamed and streamed == text.sent
        assert text.text(tokens).startswith(streamed)
    assert threads, "nothing was detokenized"
    assert engine.pipeline.thread not in threads
    assert all(t.name.startswith("generation") for t in threads), threads
    assert [s["open_requests"] for s in sharded.stats()] == [0.0, 0.0]


def test_a_step_the_stages_refuse_ends_its_own_requests_and_the_pipeline_serves_on(
    sharded, prompts, alone
) -> None:
    """A micro-batch a stage refuses (here a token id past the vocabulary: on a GPU a
    device-side assert, so refused by name before the forward) fails its own request; the
    stages still answer, so the pipeline frees its slots and serves the next request."""
    pipeline = Pipeline(sharded, max_concurrent=2, in_flight=2, eos_token_id=None)
    try:
        with pytest.raises(Exception, match="token ids outside"):
            pipeline.generate(
                [5, 10**6], Sampling(), max_new_tokens=NEW_TOKENS, on_token=lambda token: None
            )
        again = pipeline.generate(
            prompts[0], Sampling(), max_new_tokens=NEW_TOKENS, on_token=lambda token: None
        )
        assert again == alone[0]
        assert pipeline.failure is None and pipeline.active == 0
    finally:
        pipeline.close()
    assert [s["open_requests"] for s in sharded.stats()] == [0.0, 0.0]


def test_a_step_that_reopens_a_live_slot_or_sends_the_wrong_shape_is_refused(sharded) -> None:
    """What a signed caller sends a stage is checked before anything is opened or run."""
    opening = [Sampling().as_dict()]
    step(sharded, torch.tensor([[5, 6]]), [41], opening)
    try:
        with pytest.raises(Exception, match="already has a slot"):
            step(sharded, torch.tensor([[5]]), [41], opening)  # another's live cache, reset
        with pytest.raises(Exception, match="int64 token ids"):
            sharded.call(0, "step", torch.tensor([[0.5]]), [42], opening)
        with pytest.raises(Exception, match="hidden states"):
            sharded.call(1, "step", torch.zeros(1, 1, 3), [41], [None])
    finally:
        sharded.call_all("end_request", 41)
    assert [s["open_requests"] for s in sharded.stats()] == [0.0, 0.0]
