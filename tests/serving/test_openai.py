"""`role=serve` of split_inference and spec_decoding, called with the official `openai` client:
the endpoint runs the experiment's real generation (stages, or a drafter against its verifier)
in its own process, as a user starts it."""

from __future__ import annotations

import asyncio
import http.client
import io
import json
import logging
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import openai
import psutil
import pytest
import torch
from hydra import compose, initialize_config_dir

from lab import experiment
from lab.config import CONF_DIR, ModelConfig
from lab.launch import free_port, services, settings_role
from lab.models import load_model, load_tokenizer
from lab.pretrain import TinyModelSpec, build_llama
from lab.serving import ApiError, Params, ServeConfig, Server, Text
from split_engine.generation import UnsplitModel, decode

from ..conftest import import_schemas

SECRET = "serving-test-secret"
PROMPT = "def parse(text):\n    "
MAX_TOKENS = 12
LEAVERS = 50
"""Clients that go away mid-stream."""


def random_llama(folder: Path, tokenizer: Any, *, num_layers: int, seed: int) -> Path:
    """A random-init Llama with the lab's tokenizer: its greedy text is varied (the debug tiny
    model's is all spaces), so equal texts say something."""
    torch.manual_seed(seed)
    spec = TinyModelSpec(num_layers=num_layers, hidden_size=64, num_heads=4, intermediate_size=128)
    model = build_llama(spec, vocab_size=len(tokenizer), context_length=256, tokenizer=tokenizer)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _settings(name: str, run_dir: Path, cache: Path, models: Path) -> Any:
    import_schemas()
    if name == "spec_decoding":  # a 4-layer target and a 1-layer draft, random
        chosen = [f"target.pretrained={models / 'target'}", "target.name=random_target",
                  f"draft.pretrained={models / 'draft'}", "draft.name=random_draft"]  # fmt: skip
    else:
        chosen = [f"model.pretrained={models / 'target'}", "model.name=random_target"]
    overrides = [
        f"paths.run_dir={run_dir}",
        f"paths.cache_dir={cache}",
        *chosen,
        "tracking.console=false",
        "tracking.wandb=false",
        f"cluster.secret={SECRET}",
    ]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name=name, overrides=overrides)


@pytest.fixture(scope="module")
def random_models(tiny_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_models / "tiny_target")
    folder = tmp_path_factory.mktemp("random_models")
    random_llama(folder / "target", tokenizer, num_layers=4, seed=0)
    random_llama(folder / "draft", tokenizer, num_layers=1, seed=1)
    return folder


@pytest.fixture(scope="module", params=["split_inference", "spec_decoding"])
def endpoint(request, random_models: Path, lab_cache: Path, tmp_path_factory) -> Iterator[dict]:
    """The experiment's servers as a local run starts them (stages, or the verifier), and its
    `role=serve` process beside them, started as a user would start it."""
    name = request.param
    run_dir = tmp_path_factory.mktemp(name)
    cfg = _settings(name, run_dir, lab_cache, random_models)
    out = io.StringIO()
    with experiment.serving(experiment.get(name), cfg, out=out) as (local, servers):
        port = free_port("127.0.0.1")
        role = settings_role(
            "serve",
            name,
            local,
            schema=f"{name}_schema",
            overrides=("role=serve", f"serve.port={port}", "serve.max_tokens_limit=4096"),
            service=True,
            ready="serving ",
        )
        with services([role], out=out) as group:
            group.wait_ready(300)
            model = local.target if name == "spec_decoding" else local.model
            yield {
                "name": name,
                "url": f"http://127.0.0.1:{port}/v1",
                "model": model,
                "cache": local.paths.cache_path,
                "pids": [group.process("serve").pid] + [p.process.pid for p in servers.running],
                "out": out,
            }


def client(endpoint: dict, key: str = SECRET) -> Any:
    """The official client (typed Any: its TypedDict overloads fight the plain dicts the tests
    send, the bad ones on purpose)."""
    return openai.OpenAI(base_url=endpoint["url"], api_key=key, max_retries=0, timeout=120)


def health(endpoint: dict) -> dict:
    ask = urllib.request.Request(
        endpoint["url"].removesuffix("/v1") + "/health",
        headers={"Authorization": f"Bearer {SECRET}"},
    )
    with urllib.request.urlopen(ask, timeout=60) as answer:
        return json.load(answer)


def own_generation(endpoint: dict, prompt: str, max_tokens: int) -> str:
    """The lab's own greedy generation of the model served (its decode loop, one process: what
    the split run's and the spec run's greedy output are each checked against)."""
    model_config: ModelConfig = endpoint["model"]
    tokenizer = load_tokenizer(model_config, cache_dir=endpoint["cache"])
    model = load_model(model_config, cache_dir=endpoint["cache"]).eval()
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])  # (1, T)
    generation = decode(
        UnsplitModel(model), ids, torch.ones_like(ids), max_new_tokens=max_tokens,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id or 0,
    )  # fmt: skip
    tokens = generation.tokens[0].tolist()
    if tokenizer.eos_token_id in tokens:
        tokens = tokens[: tokens.index(tokenizer.eos_token_id)]
    return tokenizer.decode(tokens, skip_special_tokens=True)


def model_id(endpoint: dict) -> str:
    return endpoint["model"].name


def test_openai_streamed_equals_whole_equals_the_labs_own_greedy(endpoint: dict) -> None:
    api = client(endpoint)
    assert [m.id for m in api.models.list().data] == [model_id(endpoint)]
    whole = api.completions.create(
        model=model_id(endpoint), prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0
    )
    pieces = [
        chunk.choices[0].text
        for chunk in api.completions.create(
            model=model_id(endpoint), prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
            stream=True,
        )
    ]  # fmt: skip
    text = whole.choices[0].text
    assert text and "".join(pieces) == text
    assert len(pieces) > 2  # it streamed: more than the opening and closing events
    assert text == own_generation(endpoint, PROMPT, MAX_TOKENS)
    assert whole.usage.completion_tokens <= MAX_TOKENS
    # a stop string cuts the text where it first starts, streamed or not
    where = next(i for i in range(2, len(text) - 1) if text.find(text[i : i + 2]) == i)
    stop = text[where : where + 2]
    for streamed in (False, True):
        cut = api.completions.create(
            model=model_id(endpoint), prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
            stop=[stop], stream=streamed,
        )  # fmt: skip
        pieces = [c.choices[0] for c in cut] if streamed else cut.choices
        assert "".join(c.text for c in pieces) == text[:where]
        assert pieces[-1].finish_reason == "stop"
    # chat: the lab's tokenizer has no template; the fallback's lines, streamed or not, agree
    messages = [{"role": "user", "content": "print the sum"}]
    chat = api.chat.completions.create(
        model=model_id(endpoint), messages=messages, max_tokens=MAX_TOKENS, temperature=0
    )
    streamed = api.chat.completions.create(
        model=model_id(endpoint), messages=messages, max_tokens=MAX_TOKENS, temperature=0,
        stream=True,
    )  # fmt: skip
    content = "".join(c.choices[0].delta.content or "" for c in streamed)
    assert chat.choices[0].message.content == content
    assert content == own_generation(endpoint, "user: print the sum\nassistant:", MAX_TOKENS)
    # seeded sampling: the same seed, the same text
    sampled = [
        api.completions.create(
            model=model_id(endpoint), prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=1.0,
            top_p=0.9, seed=7,
        ).choices[0].text
        for _ in range(2)
    ]  # fmt: skip
    assert sampled[0] == sampled[1]


CONCURRENT_PROMPTS = [PROMPT, "import os\n", "class Tree:\n    def", "for i in range(", "x = {",
                      "while True:\n"]  # fmt: skip


def test_openai_concurrent_clients_each_get_the_text_they_get_alone(endpoint: dict) -> None:
    """Requests in flight together (the split: batched through its stages; spec decoding:
    queued for its one slot), streamed or not: each text is the lab's own greedy generation."""
    expected = [own_generation(endpoint, p, MAX_TOKENS) for p in CONCURRENT_PROMPTS]
    start = threading.Barrier(len(CONCURRENT_PROMPTS))

    def ask(index: int) -> str:
        api = client(endpoint)
        start.wait()
        reply = api.completions.create(
            model=model_id(endpoint), prompt=CONCURRENT_PROMPTS[index], max_tokens=MAX_TOKENS,
            temperature=0, stream=index % 2 == 1,
        )  # fmt: skip
        if index % 2 == 1:
            return "".join(chunk.choices[0].text for chunk in reply)
        return reply.choices[0].text

    with ThreadPoolExecutor(len(CONCURRENT_PROMPTS)) as pool:
        texts = list(pool.map(ask, range(len(CONCURRENT_PROMPTS))))
    assert texts == expected
    state = health(endpoint)
    assert state["generating"] == 0 and state["waiting"] == 0
    assert state["cpu_s"]["requests"] > 0 and state["cpu_s"]["event_loop"] > 0  # (the bench's)
    if endpoint["name"] == "split_inference":
        assert state["engine"]["open_requests"] == [0, 0]
        assert state["engine"]["pipeline"]["steps"] > 0


def _leave_mid_stream(endpoint: dict) -> int:
    """A client that reads the first piece of a long stream and goes away; the pieces read."""
    api = client(endpoint)
    stream = api.completions.create(
        model=model_id(endpoint), prompt=PROMPT, max_tokens=100, temperature=0, stream=True
    )
    read = 0
    for _ in stream:
        read += 1
        break
    stream.close()
    return read


def test_openai_clients_leaving_mid_stream_free_the_slot_and_memory(endpoint: dict) -> None:
    api = client(endpoint)
    expected = (
        api.completions.create(
            model=model_id(endpoint), prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0
        )
        .choices[0]
        .text
    )
    _leave_mid_stream(endpoint)  # warm: the first stream's allocations are no leak
    cancelled = health(endpoint)["cancelled"]
    processes = [psutil.Process(pid) for pid in endpoint["pids"]]
    baseline = [p.memory_info().rss for p in processes]
    with ThreadPoolExecutor(8) as pool:
        reads = list(pool.map(lambda _: _leave_mid_stream(endpoint), range(LEAVERS)))
    assert reads == [1] * LEAVERS
    # the slot is free: the next request is served, with the same text as before
    after = api.completions.create(
        model=model_id(endpoint), prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0
    )
    assert after.choices[0].text == expected
    state = health(endpoint)
    assert state["generating"] == 0 and state["waiting"] == 0
    assert state["cancelled"] > cancelled  # they were cut short, not run to their end
    if endpoint["name"] == "split_inference":  # no stage holds a request's KV cache
        assert state["engine"]["open_requests"] == [0, 0]
    for process, before in zip(processes, baseline, strict=True):
        grown_mib = (process.memory_info().rss - before) / 2**20
        assert grown_mib < 150, f"{process.name()} {process.pid} grew {grown_mib:.0f} MiB"


def _raw(endpoint: dict, path: str, body: bytes, key: str = SECRET) -> tuple[int, dict]:
    ask = urllib.request.Request(
        endpoint["url"] + path,
        data=body,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(ask, timeout=60) as answer:
            return answer.status, json.load(answer)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def _announced_only(endpoint: dict, path: str, length: int) -> tuple[int, dict]:
    """A request whose headers announce a `length`-byte body that is never sent: the answer
    can only come from the headers, before any of the body is read. (Sent whole, the server
    answers before reading it and closes: a client still sending then meets a reset, as
    with any HTTP server that refuses a body early, and may never read the answer.)"""
    url = urllib.parse.urlsplit(endpoint["url"])
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    try:
        conn.putrequest("POST", url.path + path)
        conn.putheader("Authorization", f"Bearer {SECRET}")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(length))
        conn.endheaders()
        answer = conn.getresponse()
        return answer.status, json.load(answer)
    finally:
        conn.close()


def test_openai_bad_requests_get_a_4xx_in_openais_shape(endpoint: dict) -> None:
    api, model = client(endpoint), model_id(endpoint)
    cases: list[tuple[type[Exception], dict[str, Any]]] = [
        (openai.NotFoundError, {"model": "gpt-4", "prompt": PROMPT}),
        (openai.BadRequestError, {"model": model, "prompt": PROMPT, "max_tokens": 0}),
        (openai.BadRequestError, {"model": model, "prompt": PROMPT, "max_tokens": 10**9}),
        (openai.BadRequestError, {"model": model, "prompt": PROMPT, "temperature": -1}),
        (openai.BadRequestError, {"model": model, "prompt": PROMPT, "temperature": 7}),
        (openai.BadRequestError, {"model": model, "prompt": PROMPT, "top_p": 0}),
        (openai.BadRequestError, {"model": model, "prompt": ""}),
        (openai.BadRequestError, {"model": model, "prompt": PROMPT, "max_tokens": 4000}),
    ]
    for error, arguments in cases:
        with pytest.raises(error) as caught:
            api.completions.create(**arguments)
        raised: Any = caught.value  # an openai.APIStatusError subclass, each case's own
        message = raised.body["message"]  # OpenAI's {"error": {"message": ...}}
        assert message and "Traceback" not in message, arguments
    with pytest.raises(openai.AuthenticationError):
        client(endpoint, key="wrong").completions.create(model=model, prompt=PROMPT)
    with pytest.raises(openai.BadRequestError):
        api.chat.completions.create(model=model, messages=[{"role": "wizard", "content": "x"}])
    status, body = _raw(endpoint, "/completions", b'{"model": "x", "prompt": ')
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, body = _raw(endpoint, "/completions", b"[1, 2]")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, body = _announced_only(endpoint, "/completions", 2 * 2**20)
    assert status == 413 and "serve.max_body_kib" in body["error"]["message"]
    # and the slot is free: a good request is served after them
    assert api.completions.create(model=model, prompt=PROMPT, max_tokens=2).choices[0].text
    assert "Traceback" not in endpoint["out"].getvalue()


class _Unused:
    """An engine the queue tests never reach (they test the slot in front of it)."""

    context_tokens = None

    def generate(self, prompt: list[int], params: Params, on_tokens: Any) -> list[int]:
        raise AssertionError("the queue tests generate nothing")

    def health(self) -> dict[str, Any]:
        return {}


def test_openai_queue_is_bounded_and_a_wait_says_so(caplog: pytest.LogCaptureFixture) -> None:
    config = ServeConfig(max_queue=1, queue_timeout_s=0.3)
    server = Server(_Unused(),  # type: ignore[arg-type]
                    SimpleNamespace(chat_template=None), model_id="m", config=config,
                    secret=None)  # fmt: skip

    async def stays() -> bool:
        return False

    async def leaves() -> bool:
        return True

    async def scenario() -> None:
        await server.slot.acquire()  # a generation holds the slot
        waiting = asyncio.create_task(server.take_slot("cmpl-a", stays))
        await asyncio.sleep(0)  # it waits now
        with pytest.raises(ApiError) as full:
            await server.take_slot("cmpl-b", stays)
        assert full.value.status == 429 and "serve.max_queue=1" in str(full.value)
        with pytest.raises(ApiError) as late:
            await waiting
        assert late.value.status == 503 and "serve.queue_timeout_s=0.3" in str(late.value)
        assert late.value.body()["error"]["code"] == "queue_timeout"
        assert await server.take_slot("cmpl-c", leaves) is False  # its client left meanwhile
        assert server.waiting == 0
        server.slot.release()  # the generation ends: the next request gets the slot
        assert await server.take_slot("cmpl-d", stays) is True

    with caplog.at_level(logging.INFO, logger="lab.serving"):
        asyncio.run(scenario())
    said = caplog.messages
    assert any("cmpl-a waits for the generation slot" in line and "serve.queue_timeout_s=0.3"
               in line for line in said)  # fmt: skip
    assert any("cmpl-a gave up after waiting" in line for line in said)
    assert any("cmpl-c: client left while waiting" in line for line in said)


def test_openai_streamed_pieces_hold_back_a_stop_string_and_half_a_character() -> None:
    vocab = ["ab", "c<", "/s", ">x", "\ufffd", "é"]
    tokenizer = SimpleNamespace(decode=lambda ids, **_: "".join(vocab[i] for i in ids))
    text = Text(tokenizer, ["</s>"], eos=None)
    assert [text.delta([0]), text.delta([0, 1])] == ["ab", "c"]  # `<` may start `</s>`
    assert text.delta([0, 1, 2]) == ""  # `</s` still may
    assert text.delta([0, 1, 2, 3]) == "" and text.stopped  # it did: nothing after `c`
    assert text.text([0, 1, 2, 3]) == "abc"
    halves = Text(tokenizer, [], eos=None)
    assert halves.delta([0, 4]) == "ab"  # a character whose bytes have not all come
    assert halves.delta([0, 5]) == "é"


def test_openai_server_summary_counts_each_period_once() -> None:
    """The periodic summary line: what was served since the last one (an injected clock)."""
    from lab.serving import Summary

    now = [100.0]
    summary = Summary(clock=lambda: now[0])
    assert summary.line(generating=0, waiting=0) is None  # nothing served, nothing running
    for tokens, seconds in ((10, 0.5), (30, 1.5), (20, 1.0)):
        summary.add(tokens, seconds)
    now[0] += 60.0
    line = summary.line(generating=2, waiting=1)
    assert line == (
        "last 60 s: 3 requests served, 60 tokens (1.0 tokens/s), request ms p50 1000 p95 1500; "
        "2 generating, 1 waiting"
    )
    now[0] += 60.0
    assert summary.line(generating=1, waiting=0) == (
        "last 60 s: 0 requests served, 0 tokens (0.0 tokens/s), request ms p50 0 p95 0; "
        "1 generating, 0 waiting"
    )


def test_openai_server_takes_the_engines_slots_and_names_them_when_full(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = SimpleNamespace(max_concurrent=2, slots_key="split.max_concurrent=2",
                             context_tokens=None)  # fmt: skip
    config = ServeConfig(max_queue=4, queue_timeout_s=0.3)

    async def scenario() -> None:
        server = Server(engine, None, model_id="m", config=config, secret=None)

        async def stays() -> bool:
            return False

        assert await server.take_slot("cmpl-a", stays) is True
        assert await server.take_slot("cmpl-b", stays) is True  # two slots: both at once
        with pytest.raises(ApiError) as late:
            await server.take_slot("cmpl-c", stays)
        assert late.value.status == 503
        server.executor.shutdown()

    with caplog.at_level(logging.INFO, logger="lab.serving"):
        asyncio.run(scenario())
    assert any("cmpl-c waits for the generation slot (split.max_concurrent=2" in line
               for line in caplog.messages)  # fmt: skip
