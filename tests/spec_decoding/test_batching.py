"""One verifier for several drafters: forwards batched across sessions change no session's
output (greedy: the target's own; sampling: the target's law, each seed its solo text), as
sessions join and leave between forwards, and a session that fails costs only itself."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import pytest
import torch

from netproto import Connection, RemoteError
from spec_decoding.batching import BatchedTarget
from spec_decoding.cache import CachedDecoder
from spec_decoding.protocol import SpecMsg
from spec_decoding.verifier import Verifier
from tests.clocks import HANG_GUARD_S
from tests.spec_decoding.test_greedy import PROMPTS, target_greedy
from tests.spec_decoding.test_sessions import open_body, stream_payload


def test_each_row_of_a_batch_is_its_session_alone_as_sessions_join_and_leave(target) -> None:
    """Batched forwards over decoders of different lengths, with rejections cropping their
    caches between forwards, a session joining with its prompt and one leaving: every row's
    logits are those of the same decoder run alone."""
    batched = BatchedTarget(target)
    prompts = {
        "a": [5, 6, 7, 8, 9, 10],
        "b": [11, 12],
        "c": [3, 4, 5, 6, 7, 8, 9, 10, 11],
        "d": [9],
    }
    together = {k: CachedDecoder(target, p, batched=batched) for k, p in prompts.items()}
    alone = {k: CachedDecoder(target, p) for k, p in prompts.items()}
    for key in ("a", "b"):
        together[key].prefill()
        alone[key].prefill()
    schedule = [  # per forward: session -> (tokens checked, tokens committed after)
        {"a": ([21, 22, 23], [21, 30]), "b": ([40], [40, 41])},
        {"a": ([31, 32], []), "b": ([42, 43, 44, 45], [42, 43]), "c": ([], [50])},
        {"b": ([7], [7]), "c": ([51, 52], [51, 52]), "d": ([60, 61], [60])},
        {"c": ([53], [53, 54]), "d": ([62, 63, 64], [62, 63, 64])},
    ]
    for step in schedule:
        jobs = []
        for key, (checked, _) in step.items():
            decoder = together[key]
            base = decoder.tokens if len(decoder.cached) < len(decoder.tokens) else decoder.cached
            jobs.append((decoder, base[len(decoder.cached) :] + checked))
        outputs = batched.forward(jobs)
        for (decoder, feed), logits, (key, (checked, commit)) in zip(
            jobs, outputs, step.items(), strict=True
        ):
            decoder.cached.extend(feed)
            solo = alone[key].extend(checked)
            assert logits.shape == solo.shape
            torch.testing.assert_close(logits, solo, rtol=1e-4, atol=1e-5)
            assert torch.equal(logits.argmax(-1), solo.argmax(-1))
            decoder.commit(commit)
            alone[key].commit(commit)
            assert decoder.cached == alone[key].cached
    assert batched.stats.forwards == len(schedule)  # (prefills run alone, outside it)
    assert batched.stats.most_rows == 3


def test_a_batch_that_fails_while_handing_out_caches_reruns_every_row_from_its_own(
    target, monkeypatch
) -> None:
    """A batched forward that fails after the model ran (a row's cache copy out of memory,
    here forced on the second row) leaves every session's cache as it was: the rows rerun
    alone and each gets its solo logits (handed out row by row, the first session's cache
    would have been fed the same tokens twice)."""
    import spec_decoding.batching as batching

    batched = BatchedTarget(target)
    prompts = [[5, 6, 7, 8], [11, 12, 13]]
    together = [CachedDecoder(target, p, batched=batched) for p in prompts]
    alone = [CachedDecoder(target, p) for p in prompts]
    for decoder in (*together, *alone):
        decoder.prefill()
    row_cache = batching._row_cache
    failed: list[int] = []

    def second_row_fails_once(cache, row, start, end):
        if row == 1 and not failed:
            failed.append(row)
            raise RuntimeError("out of memory (forced)")
        return row_cache(cache, row, start, end)

    monkeypatch.setattr(batching, "_row_cache", second_row_fails_once)
    requests = [batching._Request(d, [d.tokens[-1], 30 + i]) for i, d in enumerate(together)]
    batched._serve(requests)
    assert failed and all(r.error is None and r.logits is not None for r in requests)
    for request, decoder, solo in zip(requests, together, alone, strict=True):
        decoder.cached.extend(request.feed)
        expected = solo.extend([request.feed[-1]])
        torch.testing.assert_close(request.logits, expected, rtol=1e-4, atol=1e-5)
        assert decoder.cache.get_seq_length() == len(decoder.cached)


def hold_first_forward(verifier: Verifier, others: int) -> threading.Event:
    """Make the verifier's first forward wait until `others` more sessions have asked for
    one, so that the next forward batches them whatever the machine's speed. Returns the
    event set once that forward is held."""
    batched = verifier.batched
    forward = batched.forward
    held = threading.Event()

    def forward_once_held(jobs):
        if not held.is_set():
            held.set()
            deadline = time.monotonic() + HANG_GUARD_S  # (a stuck test ends; asserts fail)
            while len(batched._queue) < others and time.monotonic() < deadline:
                time.sleep(0.005)
        return forward(jobs)

    batched.forward = forward_once_held  # type: ignore[method-assign]
    return held


def tokens_of(drafter: Any, prompt: list[int], *, max_new_tokens: int, seed: int) -> list[int]:
    return drafter.generate(prompt, max_new_tokens=max_new_tokens, seed=seed).tokens


def run_together(work: Sequence[Callable[[], Any]]) -> list[Any]:
    results: list[Any] = [None] * len(work)
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            results[index] = work[index]()
        except BaseException as exc:  # reported below, not lost in the thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(work))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=HANG_GUARD_S)
    assert not errors, errors
    return results


@pytest.mark.parametrize("pipeline", [False, True], ids=["rounds", "pipelined"])
def test_drafters_batched_in_one_verifier_each_get_the_targets_greedy_output(
    make_drafter, drafts, target, tokenizer, verifier_server, pipeline: bool
) -> None:
    """Four drafters at once, of different drafts and lengths (so they leave at different
    forwards), the fourth joining once the first has tokens: each output is the target's own
    greedy output, and forwards did serve several sessions at once."""
    verifier = verifier_server.verifier
    hold_first_forward(verifier, others=2)
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in [*PROMPTS, PROMPTS[0]]]
    lengths = [24, 16, 30, 20]
    names = ["noisy", "same", "unrelated", "noisy"]
    first_has_tokens = threading.Event()
    drafters = [make_drafter(drafts[n], gamma=3, pipeline=pipeline) for n in names]

    def generate(index: int) -> list[int]:
        if index == 3:
            first_has_tokens.wait(timeout=HANG_GUARD_S)
        seen = first_has_tokens.set if index == 0 else None
        return (
            drafters[index]
            .generate(
                ids[index],
                max_new_tokens=lengths[index],
                on_tokens=(lambda _: seen()) if seen else None,
            )
            .tokens
        )

    outputs = run_together([partial(generate, i) for i in range(4)])
    for index, output in enumerate(outputs):
        assert output == target_greedy(target, tokenizer, ids[index], lengths[index]), index
    stats = verifier.batched.stats
    assert stats.most_rows >= 2 and stats.rows > stats.forwards
    assert verifier.active_sessions == 4  # (the drafters' connections are still open)


def test_sampled_sessions_batched_give_each_seed_its_solo_text(
    target, tokenizer, drafts, make_drafter, verifier_server
) -> None:
    """Pipelined sampling is coupled by position: a seed's text is a function of the seed and
    the target's p, so batched with others it must be the same as served alone (one session
    a forward, `max_batch=1`). Rounds keep each session's own random stream."""
    from netproto import Server
    from spec_decoding.drafter import Drafter
    from spec_decoding.gamma import GammaController

    ids = tokenizer(PROMPTS[1], add_special_tokens=False)["input_ids"]
    alone_verifier = Verifier(target, tokenizer, max_batch=1)
    server = Server(alone_verifier.handle, name="verifier-alone").start()
    try:
        solo = {}
        for pipeline in (False, True):
            with Connection.connect(*server.address) as conn:
                drafter = Drafter(
                    drafts["noisy"], tokenizer, conn, gamma=GammaController(fixed=3, max_gamma=8),
                    temperature=0.8, pipeline=pipeline,
                )  # fmt: skip
                solo[pipeline] = [
                    drafter.generate(ids, max_new_tokens=16, seed=seed).tokens for seed in range(4)
                ]
    finally:
        server.stop()
    assert alone_verifier.batched.stats.most_rows == 1
    verifier = verifier_server.verifier
    for pipeline in (False, True):
        hold_first_forward(verifier, others=3)
        verifier.batched.stats.most_rows = 0
        drafters = [
            make_drafter(drafts["noisy"], gamma=3, temperature=0.8, pipeline=pipeline)
            for _ in range(4)
        ]
        outputs = run_together(
            [
                partial(tokens_of, d, ids, max_new_tokens=16, seed=seed)
                for seed, d in enumerate(drafters)
            ]
        )
        assert outputs == solo[pipeline]
        assert verifier.batched.stats.most_rows >= 3  # the three held behind the first
    assert len({tuple(o) for o in solo[True]}) > 1  # the seeds do give different texts


@pytest.mark.parametrize("pipeline", [False, True], ids=["rounds", "pipelined"])
def test_sampling_batched_follows_the_targets_law(
    make_drafter, drafts, target, tokenizer, verifier_server, pipeline: bool
) -> None:
    """Over the wire, four drafters at once: the first tokens of their seeded generations
    follow the target's own law at a low temperature (a chi-square test that the draft's own
    law fails)."""
    from scipy.stats import chisquare

    temperature, prompt, runs = 0.05, [5, 17, 42, 8], 400
    with torch.no_grad():
        logits = target(input_ids=torch.tensor([prompt])).logits[0, -1]
        draft_logits = drafts["noisy"](input_ids=torch.tensor([prompt])).logits[0, -1]
    law = torch.softmax(logits / temperature, -1)
    draft_law = torch.softmax(draft_logits / temperature, -1)
    bins = [t for t in range(len(law)) if runs * law[t] >= 5]
    expected = [runs * float(law[t]) for t in bins]
    expected.append(runs - sum(expected))
    drift = sum(
        (runs * float(draft_law[t]) - e) ** 2 / e for t, e in zip(bins, expected, strict=False)
    )
    assert len(bins) >= 3 and drift > 10 * len(bins)
    hold_first_forward(verifier_server.verifier, others=3)
    drafters = [
        make_drafter(drafts["noisy"], gamma=3, temperature=temperature, pipeline=pipeline)
        for _ in range(4)
    ]

    def firsts(index: int) -> list[int]:
        return [
            drafters[index].generate(prompt, max_new_tokens=2, seed=seed).tokens[0]
            for seed in range(index, runs, 4)
        ]

    tokens = [t for batch in run_together([partial(firsts, i) for i in range(4)]) for t in batch]
    observed = [tokens.count(t) for t in bins]
    observed.append(runs - sum(observed))
    assert chisquare(observed, expected).pvalue > 1e-3, (observed, expected)
    assert verifier_server.verifier.batched.stats.most_rows >= 2


def test_a_session_whose_forward_fails_costs_only_itself(
    make_drafter, drafts, target, tokenizer, verifier_server, monkeypatch
) -> None:
    """A forward that fails for one session's tokens (here: the model refuses a poisoned
    token) fails the batch it is in; the batch is run again session by session, so that
    session ends with an error while the others get their outputs and the verifier serves on."""
    verifier = verifier_server.verifier
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    wanted = [target_greedy(target, tokenizer, i, 20) for i in ids]
    first = target_greedy(target, tokenizer, [1, 2, 3], 1)  # the bad session's first token
    poison = next(
        t
        for t in range(100, len(tokenizer))
        if t not in first and all(t not in w + i for w, i in zip(wanted, ids, strict=True))
    )
    forward = type(target).forward

    def refusing(self, input_ids=None, **kwargs):
        if input_ids is not None and bool((input_ids == poison).any()):
            raise RuntimeError("poisoned")
        return forward(self, input_ids=input_ids, **kwargs)

    monkeypatch.setattr(type(target), "forward", refusing)
    hold_first_forward(verifier, others=3)
    drafters = [make_drafter(drafts["noisy"], gamma=3, pipeline=True) for _ in ids]

    def bad_session() -> str:
        with Connection.connect(*verifier_server.address) as conn:
            conn.send_msg(SpecMsg.OPEN, open_body(tokenizer, pipeline=True, max_new_tokens=8))
            # its first token right (checked without a forward), the next in the forward
            conn.send(SpecMsg.STREAM, stream_payload([*first, poison], epoch=0, at=0))
            try:
                while True:
                    conn.recv(expect={SpecMsg.OPENED, SpecMsg.PROGRESS})
            except Exception as exc:  # the verifier ends this session
                return type(exc).__name__

    work: list[Callable[[], object]] = [
        partial(tokens_of, d, i, max_new_tokens=20, seed=0)
        for d, i in zip(drafters, ids, strict=True)
    ]
    *outputs, ended = run_together([*work, bad_session])
    assert outputs == wanted
    assert ended in {"ConnectionClosed", "RemoteError", "PeerProtocolError"}
    assert verifier.batched.stats.failed_rows == 1
    with Connection.connect(*verifier_server.address) as conn:  # the verifier still serves
        conn.request(SpecMsg.OPEN, open_body(tokenizer), expect=SpecMsg.OPENED)


def test_a_target_alone_session_decodes_every_token_itself(
    verifier_server, target, tokenizer
) -> None:
    """`drafting: false`: no draft comes; the verifier sends every token as decoded alone,
    the target's greedy output (the capacity bench's baseline, batched like any session)."""
    prompt = tokenizer(PROMPTS[2], add_special_tokens=False)["input_ids"]
    with Connection.connect(*verifier_server.address) as conn:
        body = open_body(tokenizer, prompt=prompt, pipeline=True, max_new_tokens=12, drafting=False)
        conn.send_msg(SpecMsg.OPEN, body)
        tokens: list[int] = []
        while len(tokens) < 12:
            message = conn.recv(expect={SpecMsg.OPENED, SpecMsg.PROGRESS})
            if message.type == SpecMsg.PROGRESS:
                assert message.payload["alone"] and message.payload["accepted"] == 0
                tokens.extend(message.payload["tokens"])
    assert tokens == target_greedy(target, tokenizer, prompt, 12)
    with (
        Connection.connect(*verifier_server.address) as conn,
        pytest.raises(RemoteError, match="drafting=false"),
    ):
        conn.request(SpecMsg.OPEN, open_body(tokenizer, drafting=False), expect=SpecMsg.OPENED)


def test_the_endpoints_engine_puts_several_requests_through_one_verifier(
    drafts, target, tokenizer, verifier_server
) -> None:
    """`role=serve`'s engine runs `spec.serve_sessions` generations at once, each a drafter and
    a session of its own on the verifier, which batches them: each request gets the target's
    greedy text, and the endpoint's slot admits that many at once."""
    import asyncio
    from types import SimpleNamespace

    from lab.serving import Params, ServeConfig, Server
    from spec_decoding.config import SpecConfig
    from spec_decoding.drafter import drafter_for
    from spec_decoding.serve import SpecEngine

    verifier = verifier_server.verifier
    conns: list[Connection] = []

    def dial() -> Connection:
        conns.append(Connection.connect(*verifier_server.address))
        return conns[-1]

    spec = SpecConfig(gamma="3")
    engine = SpecEngine(
        lambda conn: drafter_for(drafts["noisy"], tokenizer, conn, spec), dial, slots=4
    )
    try:
        ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in [*PROMPTS, "x = 1\n"]]
        hold_first_forward(verifier, others=3)
        params = Params(max_new_tokens=16, temperature=0.0, top_p=1.0, seed=0)
        outputs = run_together(
            [partial(engine.generate, i, params, lambda tokens: None) for i in ids]
        )
        assert outputs == [target_greedy(target, tokenizer, i, 16) for i in ids]
        assert verifier.batched.stats.most_rows >= 3
        assert verifier.sessions_opened == 4 and engine.health()["sessions"]["idle"] == 4
        server = Server(engine, SimpleNamespace(chat_template=None), model_id="m",
                        config=ServeConfig(), secret=None)  # fmt: skip

        async def admitted() -> int:
            async def stays() -> bool:
                return False

            taken = [await server.take_slot(f"r{n}", stays) for n in range(4)]
            return sum(taken) if server.slot.locked() else -1

        assert asyncio.run(admitted()) == 4  # four at once, the fifth would wait
    finally:
        engine.close()
        for conn in conns:
            conn.close()


def test_a_long_session_beside_short_ones_never_takes_a_batch_over_its_cache_budget(
    drafts, target, tokenizer
) -> None:
    """Padding amplification: one session with a long past beside three short ones, all asking
    at once. Every row of a batch is padded to the longest past, so batched with the long one
    each short session would hold its length; with the budget (`spec.batch_cache_tokens`) no
    forward holds more cache positions than it (as the batcher records them), the long session
    runs in forwards of its own, the short ones still batch together, and every session, the
    long one too, gets the target's greedy output to the end."""
    from netproto import Server
    from spec_decoding.drafter import Drafter
    from spec_decoding.gamma import GammaController

    budget, new_tokens = 160, 20
    long_prompt = (tokenizer("".join(PROMPTS * 40), add_special_tokens=False)["input_ids"])[:120]
    ids = [long_prompt, *(tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS)]
    assert len(long_prompt) == 120 and all(len(i) <= 20 for i in ids[1:])
    # alone the long session fits its budget (120 + 20 + a draft); beside any other, it does not
    verifier = Verifier(target, tokenizer, max_batch=4, batch_cache_tokens=budget)
    held = hold_first_forward(verifier, others=3)  # a short one's: the long one asks after it
    server = Server(verifier.handle, name="verifier-budget").start()
    conns = [Connection.connect(*server.address) for _ in ids]
    try:
        gamma = partial(GammaController, fixed=3, max_gamma=8)
        drafters = [
            Drafter(drafts["noisy"], tokenizer, conn, gamma=gamma(), pipeline=True)
            for conn in conns
        ]

        def generate(index: int) -> list[int]:
            if index == 0:  # so the held forward is a short one's, and the long one waits
                held.wait(timeout=HANG_GUARD_S)  # beside the other two for the next
            return tokens_of(drafters[index], ids[index], max_new_tokens=new_tokens, seed=0)

        outputs = run_together([partial(generate, i) for i in range(len(ids))])
    finally:
        for conn in conns:
            conn.close()
        server.stop()
    assert outputs == [target_greedy(target, tokenizer, i, new_tokens) for i in ids]
    stats = verifier.batched.stats
    assert stats.most_cache_tokens <= budget, stats
    assert stats.deferred >= 1 and stats.most_rows >= 2, stats  # it did split, they did batch


def test_the_oldest_waiting_forward_goes_first_however_long_its_cache() -> None:
    """No starvation: whoever leads, the next batch holds the oldest waiting request, with the
    others that fit the cache budget beside it; a long session's request that does not fit
    beside the short ones waits for at most the forwards of those before it."""
    import spec_decoding.batching as batching

    batched = BatchedTarget(torch.nn.Linear(1, 1), max_batch=4, max_cache_tokens=100)

    def request(past: int) -> batching._Request:
        decoder = CachedDecoder(torch.nn.Linear(1, 1), [1])
        decoder.cached = [1] * past
        return batching._Request(decoder, [2, 3])

    long_one, shorts = request(90), [request(20) for _ in range(3)]
    batched._queue = [shorts[0], long_one, shorts[1], shorts[2]]
    assert batched._take() == shorts  # 3 x (20 + 2) = 66: within 100; beside 90, not
    assert batched._take() == [long_one]
    batched._queue = [long_one, *shorts]
    assert batched._take() == [long_one]  # the oldest, alone: 2 x (90 + 2) > 100
    assert batched._take() == shorts
    assert batched.stats.deferred >= 2


def test_the_cache_budget_defaults_from_the_context_and_max_batch(target, tokenizer) -> None:
    """`spec.batch_cache_tokens=0` (auto): `max_batch` rows of min(session cap, 2048)
    positions, so one forward's cache stays bounded whatever the target's context; a set
    value is taken as it is, a negative one refused naming the key."""
    from spec_decoding.batching import cache_budget
    from spec_decoding.config import SpecConfig

    assert cache_budget(0, max_batch=8, session_cap=8192) == 8 * 2048
    assert cache_budget(0, max_batch=8, session_cap=128) == 8 * 128
    assert cache_budget(500, max_batch=8, session_cap=8192) == 500
    assert Verifier(target, tokenizer, max_batch=3).batched.max_cache_tokens == 3 * 256
    with pytest.raises(ValueError, match=r"spec\.batch_cache_tokens=-1 must be >= 0"):
        SpecConfig(batch_cache_tokens=-1)


def test_a_request_left_out_for_padding_is_counted_and_goes_in_the_next_forward() -> None:
    """A long check beside short ones would make most of the batch's slots padding: the short
    ones wait for the next forward (together), and each refusal is counted, so the bench's
    [batches] lines can say how often a batch ran short for that reason."""
    import spec_decoding.batching as batching

    batched = BatchedTarget(torch.nn.Linear(1, 1), max_batch=4)

    def request(fed: int) -> batching._Request:
        decoder = CachedDecoder(torch.nn.Linear(1, 1), [1])
        decoder.cached = [1] * 10
        return batching._Request(decoder, list(range(fed)))

    long_one, shorts = request(33), [request(2) for _ in range(3)]
    batched._queue = [long_one, *shorts]
    # a pair is at most half padding; a third row would make 3 x 33 slots for 37 tokens
    assert batched._take() == [long_one, shorts[0]]
    assert batched.stats.padding_refused == 2  # shorts[1] and shorts[2], once each
    assert batched._take() == shorts[1:]  # alike: no padding, no refusal
    assert batched.stats.padding_refused == 2
    assert batched.stats.as_dict()["padding_refused"] == 2  # what STATS reports


def test_a_forward_counts_the_slots_it_computed_padding_included(target) -> None:
    """Rows of unequal feeds are padded to the longest: STATS says the slots computed beside
    the tokens fed, so the bench can price the padding."""
    batched = BatchedTarget(target)
    short, long = (CachedDecoder(target, p, batched=batched) for p in ([5, 6, 7], [8, 9]))
    for decoder in (short, long):
        decoder.prefill()
    batched.forward([(short, [7]), (long, [9, 10, 11, 12])])
    assert batched.stats.tokens == 5 and batched.stats.slots == 2 * 4
    assert batched.stats.as_dict()["slots"] == 8
