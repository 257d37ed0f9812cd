"""Where a split run's roles go on the host harness's three hosts, and the settings that put its
traffic on the network and inside the lab's overlay: what both split experiments' manifests
declare (lab.registry). Imports nothing: every tool loads the manifests."""

SPLIT_ROLES = [
    ("desktop", "driver", ["role=driver"]),
    ("laptop", "stage1", ["role=stage", "split.rank=1"]),
    ("pc", "stage2", ["role=stage", "split.rank=2"]),
]
"""(host, role name, overrides): the driver hosts the rendezvous; a stage per other host."""

ACROSS = ["model.lab_preset=debug", "split.num_stages=2", "cluster.overlay.up=true",
          "num_threads=1"]  # fmt: skip
"""Across hosts, TensorPipe, Gloo and the store listen only inside the lab's WireGuard overlay
(a curve's local calibration run, on loopback, needs none); tensors inline on TensorPipe's
connection (`split.channels=basic`, the default), not cma's copy."""

DOCUMENTED = ("model.lab_preset=debug",)
"""A documented two-machine split command in the harness: the 2-layer debug model, tensors
inline on TensorPipe's connection (the default channel)."""
