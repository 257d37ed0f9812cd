"""split_inference: a model cut at layer boundaries across hosts (torch.distributed.rpc)."""
