"""Sessions: KV rollback equals recomputation; concurrency; faults close one session only."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from netproto import Connection, RemoteError
from spec_decoding.cache import CachedDecoder
from spec_decoding.draft_q import to_varints
from spec_decoding.protocol import SpecMsg
from spec_decoding.verifier import MAX_SESSION_TOKENS, vocab_hash
from tests.clocks import HANG_GUARD_S


def test_rollback_leaves_the_same_state_as_recomputation(target) -> None:
    prompt = [5, 17, 42, 8, 99]
    decoder = CachedDecoder(target, prompt)
    decoder.prefill()
    decoder.extend([7, 7, 7, 7])  # a draft that will be mostly rejected
    decoder.commit([7, 13])  # one accepted, then a correction
    decoder.extend([21, 22])  # another speculative run past the rollback point
    decoder.commit([])  # nothing accepted
    after_rollback = decoder.extend([30])[-1]
    fresh = CachedDecoder(target, [*prompt, 7, 13])
    fresh.prefill()
    recomputed = fresh.extend([30])[-1]
    torch.testing.assert_close(after_rollback, recomputed, rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        full = target(input_ids=torch.tensor([[*prompt, 7, 13, 30]])).logits[0, -1]
    torch.testing.assert_close(after_rollback, full, rtol=1e-4, atol=1e-4)
    assert decoder.cached == [*prompt, 7, 13, 30]


@pytest.mark.parametrize("pipeline", [False, True], ids=["rounds", "pipelined"])
def test_concurrent_sessions_give_their_solo_outputs(
    make_drafter, drafts, tokenizer, pipeline: bool
) -> None:
    prompts = [
        tokenizer(t, add_special_tokens=False)["input_ids"]
        for t in ("def run(self):\n", "import json\n")
    ]
    solo = [
        make_drafter(drafts["noisy"], temperature=0.8, pipeline=pipeline)
        .generate(p, max_new_tokens=20, seed=i)
        .tokens
        for i, p in enumerate(prompts)
    ]
    together: list[list[int]] = [[], []]

    def worker(index: int) -> None:
        drafter = make_drafter(drafts["noisy"], temperature=0.8, pipeline=pipeline)
        together[index] = drafter.generate(prompts[index], max_new_tokens=20, seed=index).tokens

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=HANG_GUARD_S)
    assert together == solo
    assert solo[0] != solo[1]


def open_body(tokenizer, **extra) -> dict:
    return {"prompt": [1, 2, 3], "vocab_hash": vocab_hash(tokenizer), **extra}


def test_openeds_prefill_counts_the_first_prediction(verifier, tokenizer, monkeypatch) -> None:
    """The drafter takes OPEN's round trip less OPENED's `prefill_ms` for the link. Pipelined,
    the verifier computes its first prediction before OPENED goes out: that forward is the
    target's time, not the link's (left out, the drafter's only round-trip samples while the
    verifier decoded alone read ~9 ms at loopback)."""
    from spec_decoding.verifier import _Session

    step = _Session.step
    steps: list[bool] = []

    def slow_step(self, *args, **kwargs):
        steps.append(True)
        time.sleep(0.5)  # a forward that takes at least this long
        return step(self, *args, **kwargs)

    monkeypatch.setattr(_Session, "step", slow_step)
    pipelined = _Session.open(verifier, open_body(tokenizer, pipeline=True, max_new_tokens=4))
    assert steps and pipelined.prefill_ms >= 500  # the prediction's forward, counted in
    steps.clear()
    _Session.open(verifier, open_body(tokenizer, pipeline=False, max_new_tokens=4))
    assert not steps  # rounds hold no prediction: OPEN's time is the prompt's prefill alone


def test_draft_before_open_closes_that_session_only(verifier_server, tokenizer) -> None:
    address = verifier_server.address
    with Connection.connect(*address) as good, Connection.connect(*address) as bad:
        good.request(SpecMsg.OPEN, open_body(tokenizer), expect=SpecMsg.OPENED)
        with pytest.raises(RemoteError, match="DRAFT before OPEN"):
            bad.request(
                SpecMsg.DRAFT,
                {"tokens": torch.tensor([1], dtype=torch.int32)},
                expect=SpecMsg.VERDICT,
            )
        verdict = good.request(
            SpecMsg.DRAFT, {"tokens": torch.tensor([4], dtype=torch.int32)}, expect=SpecMsg.VERDICT
        ).payload
        assert set(verdict) == {"accepted", "token", "verify_ms"}


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ({"prompt": [10**9]}, "token ids outside"),
        ({"prompt": []}, "does not fit a session"),
        ({"temperature": -1}, "temperature"),
        ({"vocab_hash": "not-the-same"}, "tokenizer differs"),
        ({"max_new_tokens": "10"}, "max_new_tokens must be an int"),
        ({"max_new_tokens": 0}, "max_new_tokens must be an int"),
        ({"max_new_tokens": 10**6}, "max_new_tokens must be an int"),
        ({"batch_hold_ms": -1}, "batch_hold_ms must be a number"),
        ({"batch_hold_ms": 10**6}, "batch_hold_ms must be a number"),
        ({"batch_hold_ms": True}, "batch_hold_ms must be a number"),
        ({"batch_hold_ms": "5"}, "batch_hold_ms must be a number"),
        ({"batch_hold_ms": 2**60}, "batch_hold_ms must be a number"),
    ],
)
def test_bad_open_is_refused_with_a_reason(verifier_server, tokenizer, body, error) -> None:
    with (
        Connection.connect(*verifier_server.address) as conn,
        pytest.raises(RemoteError, match=error),
    ):
        conn.request(SpecMsg.OPEN, open_body(tokenizer, **body), expect=SpecMsg.OPENED)


def test_draft_model_with_another_tokenizer_is_refused(make_drafter, drafts, tokenizer) -> None:
    drafter = make_drafter(drafts["noisy"])
    drafter.vocab_hash = "another-vocabulary"
    with pytest.raises(RemoteError, match="share one vocabulary"):
        drafter.generate([1, 2, 3], max_new_tokens=4)


def test_a_vanished_drafter_frees_its_session(verifier_server, tokenizer) -> None:
    verifier = verifier_server.verifier
    conn = Connection.connect(*verifier_server.address)
    conn.request(SpecMsg.OPEN, open_body(tokenizer), expect=SpecMsg.OPENED)
    assert verifier.active_sessions == 1
    conn._abort()  # gone without a goodbye
    deadline = time.monotonic() + HANG_GUARD_S
    while verifier.active_sessions and time.monotonic() < deadline:
        time.sleep(0.01)
    assert verifier.active_sessions == 0


def test_any_model_pair_is_chosen_with_package_overrides(compose_config) -> None:
    from lab.config import to_settings
    from spec_decoding.config import SpecDecodingRunConfig

    settings = to_settings(
        compose_config(
            "spec_decoding", ["model@target=tinyllama", "model@draft=tiny_draft", "spec.gamma=5"]
        ),
        SpecDecodingRunConfig,
    )
    assert settings.target.pretrained == "TinyLlama/TinyLlama-1.1B-Chat-v1.0"
    assert settings.draft.pretrained == "lab:tiny_draft"
    assert settings.spec.fixed_gamma == 5


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("spec.gamma=lots", "spec.gamma='lots' must be `auto` or a number"),
        ("spec.gamma=0", "spec.gamma=0 must be in 1..32"),
        ("spec.top_p=1.5", "spec.top_p=1.5 must be in (0, 1]"),
    ],
)
def test_bad_spec_settings_name_the_key(compose_config, override: str, needle: str) -> None:
    from lab.config import to_settings
    from spec_decoding.config import SpecDecodingRunConfig

    with pytest.raises(ValueError) as info:
        to_settings(compose_config("spec_decoding", [override]), SpecDecodingRunConfig)
    assert needle in str(info.value)


def stream(conn: Connection, tokens: list[int], epoch: int, at: int = 0) -> None:
    conn.send(SpecMsg.STREAM, stream_payload(tokens, epoch, at))


def stream_payload(
    tokens: list[int], epoch: int, at: int, more: int = 1
) -> dict[str, torch.Tensor]:
    return {
        "tokens": torch.tensor(tokens, dtype=torch.int32),
        "epoch": torch.tensor([epoch], dtype=torch.int64),
        "at": torch.tensor([at], dtype=torch.int64),
        "more": torch.tensor([more], dtype=torch.int64),
    }


def greedy_continuation(target, prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            tokens.append(int(target(input_ids=torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt) :]


def test_stream_of_a_rejected_epoch_is_dropped(verifier_server, target, tokenizer) -> None:
    """After a correction, tokens drafted on the old prefix get no verdict of their own (a
    verifier told not to decode alone: every token it commits answers a draft)."""
    prompt = [5, 17, 42, 8]
    choice, after = greedy_continuation(target, prompt, 2)
    wrong = (choice + 1) % len(tokenizer)
    body = open_body(tokenizer, prompt=prompt, pipeline=True, decode_alone=False)
    with Connection.connect(*verifier_server.address) as conn:
        # the first token right behind OPEN, unanswered: the verifier still holds the
        # prompt's prediction before it reads the token (it computes it before OPENED)
        conn.send_msg(SpecMsg.OPEN, {**body, "max_new_tokens": 8})
        stream(conn, [wrong], epoch=0)
        conn.recv_msg(SpecMsg.OPENED)
        first = conn.recv_msg(SpecMsg.PROGRESS)
        assert (first["at"], first["accepted"], first["tokens"]) == (0, 0, [choice])
        assert first["fed"] == 0  # checked against the prediction it held: no forward pass
        stream(conn, [wrong, wrong], epoch=0, at=1)  # drafted before the drafter heard: stale
        stream(conn, [after], epoch=1, at=1)
        second = conn.recv_msg(SpecMsg.PROGRESS)
        assert (second["epoch"], second["at"], second["accepted"], second["tokens"]) == (
            1,
            1,
            1,
            [],
        )


def test_the_verifier_decodes_alone_and_compares_late_drafts(verifier, target, tokenizer) -> None:
    """With no draft on its prefix the verifier commits the target's own tokens; drafts that
    arrive for them are compared (agreeing ones cost nothing, the ones after are checked as
    usual), a draft that differs ends its epoch, and a stream may not start past what the
    verifier has committed."""
    from spec_decoding.verifier import BadRequest, _Session

    prompt = [5, 17, 42, 8]
    greedy = greedy_continuation(target, prompt, 8)
    body = open_body(tokenizer, prompt=prompt, pipeline=True, max_new_tokens=8)
    session = _Session.open(verifier, body)
    assert session.can_decode_alone()
    alone = []
    for _ in range(2):
        alone.append(session.decode_alone())
        assert session.step() is None  # the prediction after its own token
    assert [(p["at"], p["tokens"], p["alone"]) for p in alone] == [
        (0, [greedy[0]], True),
        (1, [greedy[1]], True),
    ]
    session.stream(stream_payload(greedy[:4], epoch=0, at=0))  # late for two of them
    assert (session.pending, session.pending_at) == (greedy[2:4], len(prompt) + 2)
    checked = session.step()
    assert checked is not None
    assert (checked["at"], checked["accepted"], checked["tokens"]) == (2, 2, [])
    wrong = (greedy[4] + 1) % len(tokenizer)
    session.stream(stream_payload([wrong], epoch=0, at=4))
    rejected = session.step()
    assert rejected is not None and (rejected["accepted"], rejected["tokens"]) == (0, [greedy[4]])
    session.stream(stream_payload([greedy[5]], epoch=0, at=5))  # the dead epoch: dropped
    assert session.pending == [] and session.dead
    session.stream(stream_payload([wrong], epoch=1, at=3))  # differs from what was committed
    assert session.dead and session.pending == []
    with pytest.raises(BadRequest, match=r"starts at token 9, outside the 0\.\.5 this session has"):
        session.stream(stream_payload([greedy[5]], epoch=2, at=9))
    assert session.decoder.tokens[len(prompt) :] == greedy[:5]
    while session.has_work():  # alone to the end of the plan: the target's greedy text
        if session.can_decode_alone():
            session.decode_alone()
        else:
            session.step()
    assert session.decoder.tokens[len(prompt) :] == greedy


@pytest.mark.parametrize(
    ("messages", "error"),
    [
        ([("stream", 5)], "starts at token 5, outside the 0.."),
        ([("stream", -1)], "starts at token -1, outside the 0.."),
        ([("stream", 0), ("draft", 0)], "DRAFT rounds or a STREAM"),
        ([("draft", 0), ("stream", 0)], "DRAFT rounds or a STREAM"),
    ],
)
def test_bad_stream_closes_that_session_only(
    verifier_server, tokenizer, messages: list[tuple[str, int]], error: str
) -> None:
    address = verifier_server.address
    with Connection.connect(*address) as good, Connection.connect(*address) as bad:
        good.request(SpecMsg.OPEN, open_body(tokenizer), expect=SpecMsg.OPENED)
        bad.request(SpecMsg.OPEN, open_body(tokenizer), expect=SpecMsg.OPENED)
        with pytest.raises(RemoteError, match=error):
            for kind, at in messages:
                if kind == "draft":
                    bad.send(SpecMsg.DRAFT, {"tokens": torch.tensor([4], dtype=torch.int32)})
                else:
                    stream(bad, [4], epoch=0, at=at)
            # a valid first message may be answered before the second is refused, or not:
            # whether the verifier checked a STREAM before the DRAFT arrived is up to timing
            for _ in range(len(messages) + 2):
                bad.recv(expect={SpecMsg.PROGRESS, SpecMsg.VERDICT}, timeout_s=HANG_GUARD_S)
        stream(good, [4], epoch=0)
        assert good.recv_msg(SpecMsg.PROGRESS)["epoch"] == 0


def test_unchecked_stream_is_bounded(verifier_server, tokenizer) -> None:
    """A drafter streaming faster than any window allows is refused, not buffered."""
    from spec_decoding.verifier import BadRequest, _Session

    session = _Session.open(verifier_server.verifier, open_body(tokenizer, pipeline=True))
    session.stream(stream_payload([4] * 32, epoch=0, at=0))
    with pytest.raises(BadRequest, match="more than 32 streamed tokens"):
        session.stream(stream_payload([4] * 32, epoch=0, at=32))
    with pytest.raises(BadRequest, match="epoch 0's stream goes on at 32"):
        session.stream(stream_payload([4], epoch=0, at=40))
    with pytest.raises(BadRequest, match=r"`more` must be in 0\.\.32"):
        session.stream(stream_payload([4], epoch=1, at=0, more=33))
    with pytest.raises(BadRequest, match="STREAM needs an int64 `more`"):
        session.stream({k: v for k, v in stream_payload([4], 1, 0).items() if k != "more"})


@pytest.mark.parametrize(
    ("pipeline", "branch_depth", "draft_top_k"),
    [(False, 0, 0), (False, 0, 3), (True, 0, 0), (True, 0, 3), (True, 2, 0)],
    ids=["rounds-dense_q", "rounds-sparse_q", "pipelined", "pipelined-top_k", "branches"],
)
def test_sampling_gives_the_targets_joint_distribution(
    make_drafter,
    drafts,
    target,
    tokenizer,
    verifier_server,
    pipeline: bool,
    branch_depth: int,
    draft_top_k: int,
) -> None:
    """End to end, over the wire: the first two tokens of many seeded generations follow the
    target's own p(x1) p(x2 | x1), though the draft's law is far from it. (Two tokens also
    make rounds send an empty draft when one token is left.) With `draft_top_k` the drafter
    samples from, and sends, a q of 3 tokens: the target's law must not change. With
    branches (the draft's next-best first token and its guess after it), neither."""
    from scipy.stats import chisquare

    # a random-init target is nearly flat (logit std 0.15): a low temperature gives it peaks
    temperature, prompt, runs = 0.05, [5, 17, 42, 8], 600

    def joint_law(model) -> dict[tuple[int, int], float]:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt])).logits[0, -1]
            p1 = torch.softmax(logits / temperature, -1)
            nexts = model(input_ids=torch.tensor([[*prompt, x] for x in range(len(p1))]))
            p2 = torch.softmax(nexts.logits[:, -1] / temperature, -1)
        joint = p1[:, None] * p2  # (V, V)
        return {(a, b): float(joint[a, b]) for a, b in torch.nonzero(joint > 0).tolist()}

    law, draft_law = joint_law(target), joint_law(drafts["noisy"])
    bins = [pair for pair, chance in law.items() if runs * chance >= 5]
    expected = [runs * law[pair] for pair in bins]
    expected.append(runs - sum(expected))
    # the test can tell: sampling the draft's own law instead would be far off
    drift = sum(
        (runs * draft_law.get(pair, 0.0) - e) ** 2 / e
        for pair, e in zip(bins, expected[:-1], strict=True)
    )
    assert len(bins) >= 4 and drift > 10 * len(bins)
    drafter = make_drafter(
        drafts["noisy"],
        gamma=4,
        temperature=temperature,
        pipeline=pipeline,
        draft_top_k=draft_top_k,
        branch_depth=branch_depth,
        branch_width=2,
        # (waiting, the verifier takes a branch that arrives after its stream died whatever the
        # timing; decoding alone, it may have decided the branch's token first)
        decode_alone=not branch_depth,
    )
    counts = dict.fromkeys(bins, 0)
    other, q_bytes, drafted = 0, 0, 0
    for seed in range(runs):
        generation = drafter.generate(prompt, max_new_tokens=2, seed=seed)
        q_bytes += generation.q_bytes
        drafted += generation.drafted or sum(r.drafted for r in generation.rounds)
        pair = tuple(generation.tokens)
        if pair in counts:
            counts[pair] += 1
        else:
            other += 1
    observed = [*counts.values(), other]
    assert chisquare(observed, expected).pvalue > 1e-3, (observed, expected)
    if branch_depth:  # the verifier did go on along branches (46-48 of them on a quiet
        # machine; how many depends on how often a branch reached it before its stream's
        # verdict, which is timing: one failed a fresh clone's run beside the multihost suite,
        # so only that some were taken is asserted, the law above holding with them)
        assert verifier_server.verifier.branches_taken >= 1
    # rounds: the support travelled: with draft_top_k at most 3 entries (a weight takes at
    # most 3 bytes, a gap 2 in this vocabulary) and a row count; without, far more of the
    # vocabulary. Pipelined: no q at all (the drafter guesses the verifier's own draw)
    bytes_per_token = q_bytes / drafted
    if pipeline:
        assert q_bytes == 0
    else:
        assert bytes_per_token <= 3 * 5 + 4 if draft_top_k else bytes_per_token > 3 * 5 + 4


@pytest.mark.parametrize(
    ("override", "key"),
    [("model.pretrained=/nonexistent", "pretrained"), ("model.quantization=4bit", "quantization")],
)
def test_model_keys_spec_decoding_does_not_read_are_refused(
    compose_config, override: str, key: str
) -> None:
    """It has a target and a draft: a `model.*` override would be recorded and ignored."""
    from lab.config import to_settings
    from spec_decoding.config import SpecDecodingRunConfig

    with pytest.raises(ValueError) as info:
        to_settings(compose_config("spec_decoding", [override]), SpecDecodingRunConfig)
    assert f"set target.{key} (the verifier's model) or draft.{key}" in str(info.value)


# ----------------------------------------------------------------- fields a drafter sends
# Each malformed field is that session's bad_request (and its connection closed), never an
# `internal` error, and the verifier goes on serving others.


def _refused(verifier_server, tokenizer, send, error: str) -> None:
    address = verifier_server.address
    with Connection.connect(*address) as bad, Connection.connect(*address) as good:
        with pytest.raises(RemoteError, match=r"\[bad_request\]") as info:
            send(bad)
        assert error in str(info.value)
        assert good.request(SpecMsg.OPEN, open_body(tokenizer), expect=SpecMsg.OPENED)


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"prompt": "1 2 3"}, "prompt must be a list of token ids"),
        ({"prompt": {"a": 1}}, "prompt must be a list of token ids"),
        ({"prompt": [1, "2", 3]}, "prompt holds token ids outside"),
        ({"prompt": [1, 2.0, 3]}, "prompt holds token ids outside"),
        ({"prompt": [1, True, 3]}, "prompt holds token ids outside"),
        ({"prompt": []}, "does not fit a session"),
        ({"prompt": [1] * 8192}, "does not fit a session"),
        ({"seed": 2**70}, "seed must be an integer in 0.."),
        ({"seed": -1}, "seed must be an integer in 0.."),
        ({"seed": 1.5}, "seed must be an integer in 0.."),
        ({"temperature": 1e-320}, "temperature must be 0 (greedy) or in"),
        ({"temperature": "hot"}, "temperature must be 0 (greedy) or in"),
        ({"temperature": 10**400}, "temperature must be 0 (greedy) or in"),  # float() overflows
        ({"top_p": 0}, "top_p must be in (0, 1]"),
        ({"temperature": 1.0, "top_p": 10**400}, "top_p must be in (0, 1]"),
    ],
)
def test_bad_open_fields_are_that_sessions_bad_request(
    verifier_server, tokenizer, fields: dict, error: str
) -> None:
    _refused(
        verifier_server,
        tokenizer,
        lambda conn: conn.request(
            SpecMsg.OPEN, open_body(tokenizer, **fields), expect=SpecMsg.OPENED
        ),
        error,
    )


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"prompt": [1] * 40_000, "max_new_tokens": 4}, "does not fit a session"),
        ({"prompt": [1] * 8000, "max_new_tokens": 400}, "does not fit a session"),
        ({"prompt": [1, 2], "max_new_tokens": 10**9}, "max_new_tokens in 1.."),
        ({"prompt": [1, 2], "max_new_tokens": 2.0}, "max_new_tokens in 1.."),
        ({"prompt": [1, 2], "max_new_tokens": 4, "seed": 2**70}, "seed must be an integer"),
    ],
)
def test_bad_baseline_fields_are_refused_before_any_work(
    verifier_server, tokenizer, fields: dict, error: str
) -> None:
    _refused(
        verifier_server,
        tokenizer,
        lambda conn: conn.request(SpecMsg.BASELINE, fields, expect=SpecMsg.BASELINE_DONE),
        error,
    )


def _weights(weights: list[int], gaps: list[int]) -> dict[str, torch.Tensor]:
    """q as the drafter sends it (spec_decoding.draft_q): index gaps and weights, as varints."""
    return {
        "q_rows": torch.tensor([len(weights)], dtype=torch.int32),
        "q_index": to_varints(torch.tensor(gaps)),
        "q_weight": to_varints(torch.tensor(weights) - 1),
    }


def _q(vocab: int, token: int, *, fill: float = 0.0, own: float = 1.0) -> torch.Tensor:
    q = torch.full((1, vocab), fill)
    q[0, token] = own
    return q


@pytest.mark.parametrize(
    ("make_q", "error"),
    [
        (lambda v: _q(v, 5, own=0.0, fill=1.0 / (v - 1)), "gives a drafted token no probability"),
        (lambda v: _q(v, 5, own=-1.0, fill=2.0 / (v - 1)), "finite, non-negative"),
        (lambda v: _q(v, 5, own=float("nan")), "finite, non-negative"),
        (lambda v: _q(v, 5, own=0.5), "each row of `q` must sum to 1"),
        (lambda v: _q(v, 5).to(torch.int64), "float32 or float64 probabilities"),
        (lambda v: _q(v, 5).to(torch.float8_e4m3fn), "float32 or float64 probabilities"),
        (lambda v: torch.zeros(1, v, dtype=torch.float4_e2m1fn_x2), "float32 or float64"),
        (lambda v: torch.ones(2, v) / v, "shape (k, vocab_size)"),
        (lambda v: _weights([2**15, 2**15], [6, 0]), "gives a drafted token no probability"),
        (lambda v: _weights([2**15, 2**15 - 1], [5, 0]), "sum to exactly 65536"),
        (lambda v: _weights([2**16], [v]), "ids outside 0.."),
    ],
    ids=[
        "q_zero",
        "q_negative",
        "q_nan",
        "q_not_a_distribution",
        "q_integer",
        "q_float8",
        "q_float4",
        "q_shape",
        "weights_miss_the_drafted_token",
        "weights_short_of_the_total",
        "weights_index_out_of_range",
    ],
)
def test_a_q_that_would_make_the_verifier_accept_anything_is_refused(
    verifier_server, tokenizer, make_q, error: str
) -> None:
    """At temperature > 0 a round's token is accepted with probability min(1, p/q): q <= 0 or
    a q that is not a distribution would let a drafter write whatever it likes."""
    vocab = verifier_server.verifier.vocab_size

    def send(conn: Connection) -> None:
        conn.request(SpecMsg.OPEN, open_body(tokenizer, temperature=1.0), expect=SpecMsg.OPENED)
        q = make_q(vocab)
        entries = q if isinstance(q, dict) else {"q": q}
        payload = {"tokens": torch.tensor([5], dtype=torch.int32), **entries}
        conn.request(SpecMsg.DRAFT, payload, expect=SpecMsg.VERDICT)

    _refused(verifier_server, tokenizer, send, error)


def test_a_stream_carrying_q_is_refused(verifier_server, tokenizer) -> None:
    """Pipelined sampling needs no q (a guess is accepted when it equals the target's own
    draw): a q, or any other field, in a STREAM is a malformed message."""

    def send(conn: Connection) -> None:
        body = open_body(tokenizer, temperature=1.0, pipeline=True)
        conn.request(SpecMsg.OPEN, body, expect=SpecMsg.OPENED)
        q = torch.zeros(1, verifier_server.verifier.vocab_size)
        q[0, 5] = 1.0
        conn.send(SpecMsg.STREAM, {**stream_payload([5], epoch=0, at=0), "q": q})
        for _ in range(3):
            conn.recv_msg(SpecMsg.PROGRESS)

    _refused(verifier_server, tokenizer, send, "no q travels")


def test_sessions_are_capped_at_the_targets_context(verifier_server, tokenizer) -> None:
    """Past its position limit a model computes garbage (RoPE) or fails (learned positions)."""
    context = verifier_server.verifier.model.config.max_position_embeddings
    assert verifier_server.verifier.max_tokens == min(context, MAX_SESSION_TOKENS)
    with Connection.connect(*verifier_server.address) as conn:
        opened = conn.request(SpecMsg.OPEN, open_body(tokenizer), expect=SpecMsg.OPENED).payload
        assert opened["max_tokens"] == verifier_server.verifier.max_tokens


def test_a_plan_longer_than_the_context_fails_at_open(
    verifier_server, make_drafter, drafts
) -> None:
    """The drafter says how many tokens it will ask for: too many fails before any work."""
    cap = verifier_server.verifier.max_tokens
    for pipeline in (False, True):  # pipelined, the drafts already following OPEN
        drafter = make_drafter(drafts["noisy"], pipeline=pipeline)
        with pytest.raises(RemoteError, match=f"3 tokens with {cap - 2} more to come does not"):
            drafter.generate([1, 2, 3], max_new_tokens=cap - 2)
    for pipeline in (False, True):  # a plan that fits runs to its end, both ways
        drafter = make_drafter(drafts["noisy"], temperature=0.8, pipeline=pipeline)
        fits = drafter.generate([1, 2, 3], max_new_tokens=cap - 3)
        assert 0 < len(fits.tokens) <= cap - 3


def test_a_session_cannot_grow_past_its_cap(verifier_server, tokenizer, monkeypatch) -> None:
    """Accepted tokens add up: past the cap the session is refused, whatever q claims."""
    monkeypatch.setattr(verifier_server.verifier, "max_tokens", 8)

    def send(conn: Connection) -> None:
        conn.request(SpecMsg.OPEN, open_body(tokenizer), expect=SpecMsg.OPENED)
        for _ in range(8):
            conn.request(
                SpecMsg.DRAFT,
                {"tokens": torch.tensor([5], dtype=torch.int32)},
                expect=SpecMsg.VERDICT,
            )

    _refused(verifier_server, tokenizer, send, "reached its cap of 8 tokens")
