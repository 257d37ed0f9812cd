"""Data-parallel training: one model replicated on every worker, torch's elastic agent, DDP or
FSDP2, gradients summed across workers (see docs/data_parallel.md)."""
