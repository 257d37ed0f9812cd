"""Secure aggregation: the coordinator learns the sum of a round's updates, not one of them.

SecAgg+ (Bell et al. 2020), the sparse-graph form of Bonawitz et al. 2017: each client masks
its update with one pairwise mask per neighbour (they cancel in the sum) and a self-mask (the
coordinator removes it once the round is over), and hands Shamir shares of what could undo its
masks to its neighbours, so a client that drops out is recovered without its help. With
`neighbors` at least the round's size minus one every client is every other's neighbour: the
original protocol.

One round, as the coordinator (`Server`) and each client (`Client`) see it:

0. keys       client -> coordinator  two X25519 public keys: `c` (to encrypt shares between
                                     clients) and `s` (to agree on pairwise masks)
              coordinator -> client  its neighbours' public keys (the coordinator relays them:
                                     an honest-but-curious coordinator, trusted not to swap
                                     them; one that did could impersonate clients: no PKI here)
1. shares     client -> coordinator  for each neighbour, one AEAD box (ChaCha20-Poly1305, its
                                     key from the `c` agreement, sender and recipient bound in)
                                     holding Shamir shares of its self-mask seed and of its `s`
                                     private key; and a hash committing to the seed
              coordinator -> client  the boxes addressed to it (who sent one is U2), each
                                     with its sender's holder list (below)
2. masked     client -> coordinator  its weighted update in fixed point modulo 2^64, plus the
                                     self-mask and the pairwise masks with its U2 neighbours
                                     (ChaCha20 keystreams from seeds: a 32-byte seed stands in
                                     for a mask as long as the update)
3. unmask     coordinator -> client  who sent a masked input (U3) and who dropped before (U2-U3)
              client -> coordinator  for each neighbour in U3 its share of the self-mask seed,
                                     for each in U2-U3 its shares of the `s` key: never both for
                                     one client (that would unmask its input)

The coordinator rebuilds each U3 client's seed (checked against its commitment) and each
dropped client's `s` key (checked against its public key) from at least `threshold` shares,
removes the masks, and is left with the sum. Fewer than `threshold` survivors at any step fail
the round (`RoundFailed`), as the protocol must. The round's parameters and its graph are
`fed_learn.secagg_params`'s.

Share indices. A client gives Shamir index i + 1 to the i-th of its holders: itself, then its
neighbours that advertised keys, in id order. The coordinator relays each box with its sender's
holder list (`Server.holders`, the list it built that sender's roster from and checks revealed
indices against), so the receiver checks the index in the box exactly and refuses a box whose
index disagrees, naming its sender: it then holds no share of that sender and reveals none, so a
sender that writes a wrong but in-range index costs its receiver nothing (unchecked, its reveal
would be refused as a lie and the receiver excluded). What the coordinator could lie about: the
list. The receiver checks what it can: the sender first, then some of the sender's neighbours in
the round's public graph, in id order, the receiver among them, at least `threshold` in all, and
of those that are its own neighbours too, exactly the ones its own roster said have keys. So a
lie can only change which of the sender's other neighbours are said to have keys (none are, in
SecAgg's complete graph): the receiver then refuses an honest sender's box, or takes an index
that the coordinator's check of its reveal then refuses. Either costs what a coordinator can
always cost (dropping a box, refusing a reveal) and shows it nothing: an index is no secret, and
no more shares are revealed than before. Not covered: a sender that gives a neighbour a false
share value at the right index (shares carry no per-holder commitment here, so the rebuild's
leave-one-out names the revealer).

Shamir sharing is pycryptodome's (`Crypto.Protocol.SecretSharing.Shamir`, 16-byte secrets over
GF(2^128): a 32-byte key travels as two); the coordinator rebuilds a round's secrets in one
batch (`fed_learn.shamir`: equal to `Shamir.combine` byte for byte, tested). X25519, HKDF,
ChaCha20 and ChaCha20-Poly1305 are the `cryptography` package's. Everything a peer sends is
checked by structure (lengths, ranges, recipients, AEAD tags) and refused by name (`Refused`,
naming the client): the round goes on without that client where the protocol allows.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from Crypto.Protocol.SecretSharing import Shamir
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fed_learn import shamir
from fed_learn.fixed_point import dequantize, quantize
from fed_learn.secagg_params import Params

KEY_BYTES = 32
SEED_BYTES = 16
"""The self-mask seed: one Shamir secret (pycryptodome shares 16-byte secrets)."""
SHARE_BYTES = 16
_SHARES = struct.Struct("<IHHH")  # round, sender, recipient, Shamir index
_BOX_PLAIN = _SHARES.size + 3 * SHARE_BYTES  # then the seed's share and the key's two halves
BOX_BYTES = _BOX_PLAIN + 16  # the Poly1305 tag
COMMIT_BYTES = 32
SEED = "seed"
KEY = "key"
RETRIES_PER_SECRET = 2
"""Rebuilds of one secret past the round's batch when its check fails, each from at most
threshold + 1 shares (`Server._rebuild`): a round's wrong shares cost it at most twice the
secrets it rebuilds, each O(threshold^2) field products, whoever sends them."""


class Refused(ValueError):
    """A peer's message that does not fit the protocol: its sender's failure, named."""

    def __init__(self, client: int, why: str) -> None:
        super().__init__(f"client {client}: {why}")
        self.client = client


class RoundFailed(RuntimeError):
    """Too few clients left to finish the round securely (fewer than the threshold)."""


# ---------------------------------------------------------------------------- primitives


def _hkdf(secret: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=info).derive(secret)


def _agree(private: X25519PrivateKey, public: bytes, client: int) -> bytes:
    try:
        return private.exchange(X25519PublicKey.from_public_bytes(public))
    except ValueError as exc:  # wrong length, or a low-order point (an all-zero secret)
        raise Refused(client, f"unusable public key ({exc})") from None


def expand(seed: bytes, length: int) -> np.ndarray:
    """A mask: `length` uint64s of ChaCha20 keystream keyed by `seed` (32 bytes)."""
    stream = Cipher(algorithms.ChaCha20(seed, bytes(16)), mode=None).encryptor()
    return np.frombuffer(stream.update(bytes(8 * length)), dtype="<u8").copy()


def _pair_seed(shared: bytes, params: Params, low: int, high: int) -> bytes:
    return _hkdf(shared, b"lab-secagg mask %d %d %d" % (params.round, low, high))


def _self_seed(seed: bytes, params: Params) -> bytes:
    return _hkdf(seed, b"lab-secagg self %d" % params.round)


def _box_key(shared: bytes, params: Params, sender: int, recipient: int) -> bytes:
    """One key per direction: the two neighbours' boxes never share a key and nonce."""
    return _hkdf(shared, b"lab-secagg box %d %d %d" % (params.round, sender, recipient))


def _commit(seed: bytes, params: Params, client: int) -> bytes:
    return hashlib.sha256(b"lab-secagg commit %d %d " % (params.round, client) + seed).digest()


def _sign(me: int, other: int) -> int:
    return 1 if me < other else -1


def _add_mask(acc: np.ndarray, mask: np.ndarray, sign: int) -> None:
    """acc += sign * mask, modulo 2^64 (numpy's uint64 arithmetic wraps)."""
    if sign > 0:
        np.add(acc, mask, out=acc)
    else:
        np.subtract(acc, mask, out=acc)


# ---------------------------------------------------------------------------- a client


@dataclass
class Client:
    """One client's side of one round. Fresh keys every round."""

    client_id: int
    params: Params
    _c: X25519PrivateKey = field(default_factory=X25519PrivateKey.generate, repr=False)
    _s: X25519PrivateKey = field(default_factory=X25519PrivateKey.generate, repr=False)
    _seed: bytes = field(default_factory=lambda: secrets.token_bytes(SEED_BYTES), repr=False)
    _keys: dict[int, tuple[bytes, bytes]] = field(default_factory=dict, repr=False)
    _held: dict[int, tuple[int, bytes, bytes, bytes]] = field(default_factory=dict, repr=False)
    """Neighbour -> (Shamir index, its seed's share, its key's two half shares)."""
    _revealed: dict[int, str] = field(default_factory=dict, repr=False)
    _u2: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if self.client_id not in self.params.clients:
            raise ValueError(f"client {self.client_id} is not in this round")
        self.neighbours = self.params.neighbours(self.client_id)

    # step 0
    def public_keys(self) -> tuple[bytes, bytes]:
        return self._c.public_key().public_bytes_raw(), self._s.public_key().public_bytes_raw()

    # step 1
    def share(self, keys: Mapping[int, tuple[bytes, bytes]]) -> tuple[dict[int, bytes], bytes]:
        """Boxes of shares for each neighbour whose keys came back (`keys`: id -> (c, s)
        public keys, as the coordinator relayed them), and the seed's commitment."""
        mine = self.public_keys()
        if keys.get(self.client_id, mine) != mine:
            raise Refused(self.client_id, "the relayed keys are not the ones this client sent")
        for other, pair in keys.items():
            if other == self.client_id:
                continue
            if other not in self.neighbours:
                raise RoundFailed(f"keys relayed for client {other}, not a neighbour")
            if (
                not isinstance(pair, tuple)
                or len(pair) != 2
                or not all(isinstance(k, bytes) and len(k) == KEY_BYTES for k in pair)
            ):
                raise Refused(other, "public keys must be two 32-byte strings")
            self._keys[other] = pair
        present = sorted(self._keys)
        if len(present) + 1 < self.params.threshold:
            raise RoundFailed(
                f"{len(present)} neighbours of client {self.client_id} advertised keys; "
                f"the threshold is {self.params.threshold}"
            )
        holders = [self.client_id, *present]  # Shamir index i + 1 goes to holders[i]
        k = self.params.threshold
        s_raw = self._s.private_bytes_raw()
        seed_shares = Shamir.split(k, len(holders), self._seed)
        low_shares = Shamir.split(k, len(holders), s_raw[:SHARE_BYTES])
        high_shares = Shamir.split(k, len(holders), s_raw[SHARE_BYTES:])
        boxes: dict[int, bytes] = {}
        for i, holder in enumerate(holders):
            index = seed_shares[i][0]
            held = (index, seed_shares[i][1], low_shares[i][1], high_shares[i][1])
            if holder == self.client_id:
                self._held[holder] = held
                continue
            shared = _agree(self._c, self._keys[holder][0], holder)
            plain = _SHARES.pack(self.params.round, self.client_id, holder, index) + b"".join(
                held[1:]
            )
            key = _box_key(shared, self.params, self.client_id, holder)
            boxes[holder] = ChaCha20Poly1305(key).encrypt(bytes(12), plain, None)
        return boxes, _commit(self._seed, self.params, self.client_id)

    def receive(
        self, boxes: Mapping[int, bytes], holders: Mapping[int, Sequence[int]]
    ) -> list[Refused]:
        """Open the boxes relayed to this client (`holders`: each sender's holder list, as
        relayed with them). Their senders are U2 as this client sees it: its input is masked
        with each of them (a pairwise mask needs only their public `s` key, as the
        coordinator's removal of it assumes). A box that does not open, names another round,
        sender or recipient, or holds an index other than the one its sender's holder list
        gives this client, is refused (returned): this client then holds no share of that
        sender, and the others' shares must do."""
        refused: list[Refused] = []
        for sender, box in boxes.items():
            if sender not in self._keys:
                refused.append(Refused(sender, f"a box for {self.client_id}, not its neighbour"))
                continue
            self._u2.add(sender)
            try:
                held = self._open(sender, box)
                self._check_index(sender, held[0], holders.get(sender))
            except Refused as exc:
                refused.append(exc)
                continue
            self._held[sender] = held
        return refused

    def _check_index(self, sender: int, index: int, listed: object) -> None:
        """`index` (from `sender`'s box) is the one `sender`'s relayed holder list gives this
        client, the list checked against the round's graph first ("Share indices" above)."""
        ids = list(listed) if isinstance(listed, (list, tuple)) else []
        rest = ids[1:]
        theirs = set(self.params.neighbours(sender))
        ours = theirs & {self.client_id, *self.neighbours}  # this client's roster covers these
        if (
            not all(type(c) is int for c in ids)
            or ids[:1] != [sender]
            or rest != sorted(set(rest) & theirs)
            or self.client_id not in rest
            or len(ids) < self.params.threshold
            or ours & set(rest) != ours & {self.client_id, *self._keys}
        ):
            raise Refused(sender, f"its box came with a holder list {ids[:8]} the graph refutes")
        if index != ids.index(self.client_id) + 1:
            raise Refused(
                sender,
                f"share index {index} in its box; its holder list gives client "
                f"{self.client_id} index {ids.index(self.client_id) + 1}",
            )

    def _open(self, sender: int, box: bytes) -> tuple[int, bytes, bytes, bytes]:
        if sender not in self._keys:
            raise Refused(sender, f"a share box for client {self.client_id}, not its neighbour")
        if not isinstance(box, bytes) or len(box) != BOX_BYTES:
            raise Refused(sender, f"a share box must be {BOX_BYTES} bytes")
        shared = _agree(self._c, self._keys[sender][0], sender)
        key = _box_key(shared, self.params, sender, self.client_id)
        try:
            plain = ChaCha20Poly1305(key).decrypt(bytes(12), box, None)
        except InvalidTag:
            raise Refused(sender, "a share box that does not open (wrong key or altered)") from None
        round_, from_, to, index = _SHARES.unpack_from(plain)
        if (round_, from_, to) != (self.params.round, sender, self.client_id):
            raise Refused(sender, f"a share box for round {round_}, from {from_} to {to}")
        body = plain[_SHARES.size :]
        return (
            index,
            body[:SHARE_BYTES],
            body[SHARE_BYTES : 2 * SHARE_BYTES],
            body[2 * SHARE_BYTES :],
        )

    @property
    def sharers(self) -> tuple[int, ...]:
        """The neighbours whose boxes were relayed to this client (its view of U2)."""
        return tuple(sorted(self._u2))

    # step 2
    def masked_input(
        self, values: np.ndarray, weight: int, noise: np.ndarray | None = None
    ) -> np.ndarray:
        """`weight * values` (plus `noise`, this client's share of DP noise) and `weight` in
        fixed point (uint64, length params.length), masked: the coordinator cannot tell it
        from uniform noise."""
        if not isinstance(weight, int) or not 0 < weight < 2**31:
            raise ValueError(f"weight={weight!r} must be an int in 1..2^31-1")
        flat = np.asarray(values, dtype=np.float64).ravel()
        if flat.size + 1 != self.params.length:
            raise ValueError(f"{flat.size} values; the round carries {self.params.length - 1}")
        out = np.empty(self.params.length, dtype=np.uint64)
        weighted = flat * weight if noise is None else flat * weight + noise
        out[:-1] = quantize(weighted, self.params.frac_bits)
        out[-1] = np.uint64(weight)  # exact: the weights' sum comes out whole
        _add_mask(out, expand(_self_seed(self._seed, self.params), self.params.length), 1)
        for other in self.sharers:
            shared = _agree(self._s, self._keys[other][1], other)
            low, high = sorted((self.client_id, other))
            seed = _pair_seed(shared, self.params, low, high)
            _add_mask(out, expand(seed, self.params.length), _sign(self.client_id, other))
        return out

    # step 3
    def reveal(
        self, survivors: Iterable[int], dropped: Iterable[int]
    ) -> dict[int, tuple[str, int, bytes]]:
        """Shares for the coordinator: the self-mask seed's share of each surviving
        neighbour, the `s` key's (both halves, concatenated) of each dropped one. Refuses to
        reveal both kinds for one client, in this call or across calls."""
        alive, gone = set(survivors), set(dropped)
        if alive & gone:
            raise RoundFailed(f"clients {sorted(alive & gone)} listed as survived and dropped")
        if len(alive) < self.params.threshold:
            raise RoundFailed(
                f"{len(alive)} survivors listed; the threshold is {self.params.threshold}"
            )
        out: dict[int, tuple[str, int, bytes]] = {}
        for client, kind in [*((c, SEED) for c in alive), *((c, KEY) for c in gone)]:
            if client not in self._held:
                continue  # not a neighbour, or it never shared with us
            if self._revealed.setdefault(client, kind) != kind:
                raise RoundFailed(f"asked for both kinds of share of client {client}")
            index, seed, low, high = self._held[client]
            out[client] = (kind, index, seed if kind == SEED else low + high)
        return out


# ---------------------------------------------------------------------------- the coordinator


@dataclass
class Server:
    """The coordinator's side of one round: relays, then unmasks the sum."""

    params: Params
    keys: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)
    commitments: dict[int, bytes] = field(default_factory=dict)
    boxes: dict[int, dict[int, bytes]] = field(default_factory=dict)
    """Recipient -> sender -> box."""
    inputs: dict[int, np.ndarray] = field(default_factory=dict)
    reveals: dict[int, dict[int, tuple[str, int, bytes]]] = field(default_factory=dict)
    """Revealer -> owner -> (kind, index, share)."""
    relayed: dict[int, set[int]] = field(default_factory=dict)
    """Recipient -> the senders whose boxes it was relayed (its U2)."""

    def __post_init__(self) -> None:
        self.graph = self.params.graph()
        self._first: dict[tuple[int, str], bytes] = {}
        """(owner, kind) -> the secret rebuilt from its first `threshold` shares."""
        self.liars: set[int] = set()
        """Revealers suspected of a wrong share: left out of this round's later rebuilds."""
        self.retries = 0  # rebuilds past the batch (at most RETRIES_PER_SECRET a secret)
        self._holders: dict[int, tuple[int, ...]] = {}
        """owner -> `holders(owner)`, once asked (a new key clears them)."""
        self._revealed: dict[int, list[tuple[int, tuple[str, int, bytes]]]] = {}

    def add_keys(self, client: int, c_public: bytes, s_public: bytes) -> None:
        self._member(client)
        for name, key in (("c", c_public), ("s", s_public)):
            if not isinstance(key, bytes) or len(key) != KEY_BYTES:
                raise Refused(client, f"its {name} public key must be {KEY_BYTES} bytes")
        if c_public == s_public:
            raise Refused(client, "the same key for both purposes")
        self.keys[client] = (c_public, s_public)
        self._holders.clear()

    def keys_for(self, client: int) -> dict[int, tuple[bytes, bytes]]:
        """What `client` is sent in step 0: its own keys and its neighbours'."""
        return {c: self.keys[c] for c in (client, *self.graph[client]) if c in self.keys}

    def add_shares(self, client: int, boxes: Mapping[int, bytes], commitment: bytes) -> None:
        self._member(client)
        if client not in self.keys:
            raise Refused(client, "shares from a client that advertised no keys")
        if not isinstance(commitment, bytes) or len(commitment) != COMMIT_BYTES:
            raise Refused(client, f"a seed commitment must be {COMMIT_BYTES} bytes")
        expected = {c for c in self.graph[client] if c in self.keys}
        if set(boxes) != expected:
            raise Refused(
                client,
                f"share boxes for {sorted(boxes)[:8]}, expected its neighbours with keys",
            )
        for box in boxes.values():
            if not isinstance(box, bytes) or len(box) != BOX_BYTES:
                raise Refused(client, f"a share box must be {BOX_BYTES} bytes")
        self.commitments[client] = commitment
        for recipient, box in boxes.items():
            self.boxes.setdefault(recipient, {})[client] = box

    def boxes_for(self, client: int) -> dict[int, bytes]:
        """Step 1's answer to `client`, once step 1 is closed: the boxes from U2 (clients
        whose shares were taken). What was relayed is kept: `client` masks its input with
        exactly those senders, and `aggregate` removes the masks of the ones that drop."""
        relayed = {s: b for s, b in self.boxes.get(client, {}).items() if s in self.commitments}
        self.relayed[client] = set(relayed)
        return relayed

    def add_input(self, client: int, masked: np.ndarray) -> None:
        self._member(client)
        if client not in self.commitments:
            raise Refused(client, "a masked input from a client that shared no keys")
        if (
            not isinstance(masked, np.ndarray)
            or masked.dtype != np.uint64
            or masked.shape != (self.params.length,)
        ):
            raise Refused(client, f"a masked input must be {self.params.length} uint64s")
        self.inputs[client] = masked

    def unmask_request(self) -> tuple[list[int], list[int]]:
        """Step 3's question: who survived (U3) and who dropped after sharing (U2 - U3)."""
        survivors = sorted(self.inputs)
        if len(survivors) < self.params.threshold:
            raise RoundFailed(
                f"{len(survivors)} masked inputs; the threshold is {self.params.threshold}"
            )
        return survivors, sorted(set(self.commitments) - set(self.inputs))

    def add_reveal(self, client: int, shares: Mapping[int, tuple[str, int, bytes]]) -> None:
        self._member(client)
        if client not in self.inputs:
            raise Refused(client, "shares revealed by a client that sent no masked input")
        survivors, dropped = map(set, self.unmask_request())
        for owner, item in shares.items():
            if owner not in self.graph[client] and owner != client:
                raise Refused(client, f"a share of client {owner}, not its neighbour")
            if not isinstance(item, tuple) or len(item) != 3:
                raise Refused(client, "a revealed share is (kind, index, bytes)")
            kind, index, share = item
            want = SEED if owner in survivors else KEY if owner in dropped else None
            if kind != want:
                raise Refused(client, f"a {kind!r} share of client {owner}, asked for {want}")
            size = SHARE_BYTES if kind == SEED else 2 * SHARE_BYTES
            held = self.share_index(owner, client)
            if type(index) is not int or index != held:
                raise Refused(client, f"share index {index!r} of client {owner}; it holds {held}")
            if not isinstance(share, bytes) or len(share) != size:
                raise Refused(client, f"a {kind} share must be {size} bytes")
        self.reveals[client] = dict(shares)

    def holders(self, owner: int) -> tuple[int, ...]:
        """Whom `owner` shared to, in order: itself, then its neighbours with keys (its
        roster), in id order; Shamir index i + 1 is the i-th's (Client.share). Relayed with
        `owner`'s boxes, so each receiver checks the index in its own."""
        held = self._holders.get(owner)
        if held is None:
            held = self._holders[owner] = (owner, *(c for c in self.graph[owner] if c in self.keys))
        return held

    def share_index(self, owner: int, holder: int) -> int:
        """The Shamir index of `owner`'s shares that `holder` was given (0: none)."""
        holders = self.holders(owner)
        return holders.index(holder) + 1 if holder in holders else 0

    def _member(self, client: int) -> None:
        if client not in self.graph:
            raise Refused(client, "not a client of this round")

    def _shares_of(self, owner: int, kind: str) -> list[tuple[int, tuple[int, bytes]]]:
        """(revealer, (index, share)) for `owner`, from every reveal that holds one."""
        held = self._revealed.get(owner, [])
        return [(revealer, (got[1], got[2])) for revealer, got in held if got[0] == kind]

    def _rebuild(self, owner: int, kind: str, check: object) -> tuple[bytes, list[Refused]]:
        """`owner`'s secret, checked (`check(secret) -> bool`): the batch's, from its first
        `threshold` shares by index. If that fails, at most RETRIES_PER_SECRET more, the
        shares of revealers already caught left out: the first `threshold` again (if a caught
        one was among them), then each secret of the first threshold + 1 less one
        (`shamir.leave_one_out`: one basis's work); the revealer whose absence passes the
        check is suspected and left out from then on (not proven: two wrong shares crafted
        together can blame an honest one); two wrong shares otherwise fail the round."""
        k = self.params.threshold
        shares = sorted(self._shares_of(owner, kind), key=lambda got: got[1][0])
        secret = self._first.get((owner, kind))  # rebuilt in the round's batch
        if secret is not None and check(secret):  # type: ignore[operator]
            return secret, []
        stale = secret is None or any(revealer in self.liars for revealer, _ in shares[:k])
        shares = [got for got in shares if got[0] not in self.liars]
        if len(shares) < k:
            raise RoundFailed(
                f"{len(shares)} shares of client {owner}'s {kind}; the threshold is {k}"
            )
        if stale:
            self.retries += 1
            secret = _combine([s for _, s in shares[:k]], kind)
            if check(secret):  # type: ignore[operator]
                return secret, []
        window = shares[: k + 1]
        if len(window) > k:
            self.retries += 1
            candidates = shamir.leave_one_out(
                [s for _, s in window], pieces=1 if kind == SEED else 2
            )
            for (revealer, _), candidate in zip(window, candidates, strict=True):
                if check(candidate):  # type: ignore[operator]
                    self.liars.add(revealer)
                    return candidate, [
                        Refused(revealer, f"a wrong share of client {owner}'s {kind}")
                    ]
        raise RoundFailed(f"client {owner}'s {kind} does not rebuild from its shares")

    def aggregate(self) -> tuple[np.ndarray, int, list[Refused]]:
        """The round's sum: (sum of weight * values as float64, sum of weights, refused)."""
        survivors, dropped = self.unmask_request()
        if len(self.reveals) < self.params.threshold:
            raise RoundFailed(
                f"{len(self.reveals)} clients revealed shares; the threshold is "
                f"{self.params.threshold}"
            )
        # each secret from exactly `threshold` shares, the lowest indices first (most secrets
        # then share an index set and its basis), all of a kind in one batch; `_rebuild`
        # checks each and looks further for those that fail
        k = self.params.threshold
        self._revealed.clear()  # owner -> (revealer, its share), by revealer: indexed once
        for revealer, got in sorted(self.reveals.items()):
            for owner, item in got.items():
                self._revealed.setdefault(owner, []).append((revealer, item))
        wanted = [(c, SEED) for c in survivors] + [(c, KEY) for c in dropped]
        firsts = {key: sorted(s for _, s in self._shares_of(*key))[:k] for key in wanted}
        for kind in (SEED, KEY):
            keys = [key for key, got in firsts.items() if key[1] == kind and len(got) == k]
            rebuilt = _combine_many([firsts[key] for key in keys], kind)
            self._first.update(zip(keys, rebuilt, strict=True))
        refused: list[Refused] = []
        total = np.zeros(self.params.length, dtype=np.uint64)
        for client in survivors:
            _add_mask(total, self.inputs[client], 1)
        for client in survivors:
            seed, bad = self._rebuild(
                client,
                SEED,
                lambda s, c=client: hmac.compare_digest(
                    _commit(s, self.params, c), self.commitments[c]
                ),
            )
            refused += bad
            _add_mask(total, expand(_self_seed(seed, self.params), self.params.length), -1)
        for client in dropped:
            raw, bad = self._rebuild(
                client,
                KEY,
                lambda s, c=client: (
                    s[0] & 7 == 0
                    and s[31] & 0xC0 == 0x40  # clamped, as made: X25519 ignores those 5 bits
                    and X25519PrivateKey.from_private_bytes(s).public_key().public_bytes_raw()
                    == self.keys[c][1]
                ),
            )
            refused += bad
            private = X25519PrivateKey.from_private_bytes(raw)
            for other in self.graph[client]:
                # `other` masked with `client` if it survived and was relayed client's box
                if other not in self.inputs or client not in self.relayed.get(other, ()):
                    continue
                shared = _agree(private, self.keys[other][1], other)
                low, high = sorted((client, other))
                mask = expand(_pair_seed(shared, self.params, low, high), self.params.length)
                _add_mask(total, mask, -_sign(other, client))
        weights = int(total[-1])
        return dequantize(total[:-1], self.params.frac_bits), weights, refused


def _combine(shares: list[tuple[int, bytes]], kind: str) -> bytes:
    return _combine_many([shares], kind)[0]


def _combine_many(groups: list[list[tuple[int, bytes]]], kind: str) -> list[bytes]:
    return shamir.combine_pieces(groups, pieces=1 if kind == SEED else 2)  # a key is two
