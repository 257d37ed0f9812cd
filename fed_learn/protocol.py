"""fed_learn's netproto messages (range 0x0100-0x01FF).

    client -> coordinator  JOIN     JSON {"name", "num_examples"}   -> WELCOME {"client_id"}
    coordinator -> client  TASK     JSON {"round", "strategy", "local_epochs", "local_steps",
                                          "batch_size", "lr", "prox_mu"}
    coordinator -> client  GLOBAL   TENSORS  the global adapter (PEFT state dict)
    client -> coordinator  RESULT   JSON {"round", "num_examples", "train_loss", "val_loss",
                                          "seconds"}
    client -> coordinator  UPDATE   TENSORS  the client's adapter after local training
    coordinator -> client  FINISH   EMPTY    training is over
Heartbeats are netproto PINGs from the client; only adapters ever cross the wire.
"""

from __future__ import annotations

from enum import IntEnum

from netproto import REGISTRY, PayloadKind


class FedMsg(IntEnum):
    JOIN = 0x0101
    WELCOME = 0x0102
    TASK = 0x0103
    GLOBAL = 0x0104
    RESULT = 0x0105
    UPDATE = 0x0106
    FINISH = 0x0107


REGISTRY.register(
    "fed_learn",
    0x0100,
    0x01FF,
    {
        FedMsg.JOIN: PayloadKind.JSON,
        FedMsg.WELCOME: PayloadKind.JSON,
        FedMsg.TASK: PayloadKind.JSON,
        FedMsg.GLOBAL: PayloadKind.TENSORS,
        FedMsg.RESULT: PayloadKind.JSON,
        FedMsg.UPDATE: PayloadKind.TENSORS,
        FedMsg.FINISH: PayloadKind.EMPTY,
    },
)
