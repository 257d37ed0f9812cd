"""split_engine: what a model cut at layer boundaries across hosts runs on.

torch.distributed.rpc stages (`stage`: each host's slice of the model), sharding (`layout`,
`sharded`: where the cuts go and the driver's view of the whole), the RPC guard (`rpc_guard`:
allow-list unpickling and signed calls), the rendezvous store (`store`), the workers' start-up
and handshake (`workers`), the roles (`roles`: stage and driver) and the shared `split` config
(`config.SplitConfig`). Both split experiments sit on it: split_inference (generation,
`generation`) and split_training (backprop across the split); neither imports the other.
"""
