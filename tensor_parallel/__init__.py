"""Tensor parallelism: each layer's matrices split across ranks (torch's DTensor engine)."""
