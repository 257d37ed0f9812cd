"""spec_decoding's netproto messages (range 0x0200-0x02FF).

    drafter -> verifier  OPEN      JSON  {"prompt": [ids], "temperature", "top_p", "seed",
                                          "vocab_hash", ["pipeline"], ["decode_alone"],
                                          ["drafting"], ["max_new_tokens"],
                                          ["batch_hold_ms"]}
                                                             -> OPENED {"vocab_size", "prefill_ms"}
                         (prefill_ms: the target's whole time on OPEN; pipelined, the first
                         prediction's forward too: the rest of the round trip is the link's)
                         (batch_hold_ms: how long the session consents to be held for
                         other sessions to share its forwards; spec_decoding/batching.py)
                         The drafter does not wait for OPENED: its first DRAFT or STREAM
                         follows OPEN on the wire, and OPENED comes back before its answer.
    drafter -> verifier  DRAFT     TENSORS {"tokens": int32 (k,), [q]}
                                                             -> VERDICT {"accepted", "token",
                                                                         "verify_ms"}
    drafter -> verifier  BASELINE  JSON  {"prompt", "max_new_tokens", "temperature", "top_p",
                                          "seed"}            -> BASELINE_DONE {"tokens", "seconds"}
    drafter -> verifier  STATS     EMPTY                 -> STATS_DONE {what its batcher did so
                                          far, all sessions: batching.BatchStats; for benches}
    drafter -> verifier  CLOSE     EMPTY (frees the session; so does closing the connection)

Pipelined sessions (`spec.pipeline`) stream instead of DRAFT/VERDICT rounds:

    drafter -> verifier  STREAM    TENSORS {"tokens": int32 (k,), "epoch": int64 (1,),
                                            "at": int64 (1,)}   (no reply of its own)
    verifier -> drafter  PROGRESS  JSON  {"epoch", "at", "accepted", "tokens", ["alone"],
                                          "fed", "verify_ms", ["held_ms"],
                                          ["forward_before"]}

The drafter sends each token as soon as it has drafted it, `at` its place among the generated
tokens, and keeps drafting while the verifier checks (at most `gamma` tokens unconfirmed). An
epoch is one run of the drafter's stream: it starts at a place the verifier has committed and
goes on token after token; the drafter starts the next one (a higher `epoch`) whenever the
verifier commits a token that is not the drafter's. Each PROGRESS says what the verifier
committed from token `at` on: `accepted` tokens of the epoch's stream, then `tokens` of its own
(at most one, save a branch's, below): the target's correction of the next drafted token, or,
with `alone`, a token it decoded by itself because no draft for that place had reached it
(`spec.decode_alone`). Drafts
that arrive for places already committed are compared with what was committed: equal ones are
done with, the first that differs ends its epoch; tokens of an ended or older epoch are
dropped unread. `fed` is the tokens of the forward pass behind the verdict (0: checked against
the prediction already held), `held_ms` how long the last token checked waited at the verifier,
`forward_before` [tokens fed, ms] a forward it ran since its last PROGRESS that only computed
its next prediction (after a correction, before the next drafts arrived).
With sampling, each side's token at a place is its Gumbel-max draw with noise seeded by the
session's seed and the place (spec_decoding.sampling.coupled_token): no q travels.

Branches (`spec.branch_depth`, pipelined):

    drafter -> verifier  BRANCH    TENSORS {"tokens": int32 (1..16,), "epoch": int64 (1,),
                                            "at": int64 (1,)}   (no reply of its own)

A branch is an alternative to the drafter's token at place `at` of epoch `epoch`'s stream:
`tokens[0]` (its root) is one of the drafter's next-best tokens there, the rest what it drafts
after the root. The place must be one the stream has reached; at most 4 roots per place. When
the stream dies at that place because the verifier's token there is the root (a rejection, or
a draft that differs from a token decoded alone), the verifier checks the branch's other
tokens in its next forward pass; a branch that arrives just after that is still taken, its
tokens compared with what the verifier decoded meanwhile. Its verdict is a PROGRESS with
`"branch": j` (j of `tokens` were the branch's drafts, the rest at most one correction) and
`accepted` 0: to the drafter they are the verifier's own tokens, compared with its new stream.

A pipelined OPEN with `"drafting": false` is the target alone served: no drafts will come, and
the verifier decodes every token itself without waiting for one (the capacity bench's baseline).
Whatever the mode, the verifier runs the forwards of its sessions that are ready at the same
moment as one batch (spec_decoding/batching.py): what a session is sent does not change.

One session per connection: the verifier's KV cache for it lives and dies with the connection.
In rounds, q, the draft's probabilities for its tokens, is sent only when sampling:
dense as `"q": float32 (k, V)`, or as its support, `"q_rows": int32 (k,)` entries per row,
`"q_index": uint16 or int32 (n,)` ascending within a row, `"q_value": float32 (n,)`, whichever
is smaller (spec_decoding/draft_q.py).
"""

from __future__ import annotations

from enum import IntEnum

from netproto import REGISTRY, PayloadKind


class SpecMsg(IntEnum):
    OPEN = 0x0201
    OPENED = 0x0202
    DRAFT = 0x0203
    VERDICT = 0x0204
    BASELINE = 0x0205
    BASELINE_DONE = 0x0206
    CLOSE = 0x0207
    STREAM = 0x0208
    PROGRESS = 0x0209
    BRANCH = 0x020A
    STATS = 0x020B
    STATS_DONE = 0x020C


REGISTRY.register(
    "spec_decoding",
    0x0200,
    0x02FF,
    {
        SpecMsg.OPEN: PayloadKind.JSON,
        SpecMsg.OPENED: PayloadKind.JSON,
        SpecMsg.DRAFT: PayloadKind.TENSORS,
        SpecMsg.VERDICT: PayloadKind.JSON,
        SpecMsg.BASELINE: PayloadKind.JSON,
        SpecMsg.BASELINE_DONE: PayloadKind.JSON,
        SpecMsg.CLOSE: PayloadKind.EMPTY,
        SpecMsg.STREAM: PayloadKind.TENSORS,
        SpecMsg.PROGRESS: PayloadKind.JSON,
        SpecMsg.BRANCH: PayloadKind.TENSORS,
        SpecMsg.STATS: PayloadKind.EMPTY,
        SpecMsg.STATS_DONE: PayloadKind.JSON,
    },
)
