"""Where distributed ranks meet safely: the authenticated rendezvous store (`world.store`), the
WireGuard overlay (`world.overlay`), address and interface choice and the safety policy
(`world.network`), the per-run fence (`world.fence`), and the one call that brings up a world of
N ranks at an endpoint (`world.group.process_group`; `world.elastic` for torchrun's agent).

A floor between `lab` and `split_engine` (docs/architecture.md): it imports lab and netproto only.
"""
