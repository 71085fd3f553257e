"""How weights are read and held: checkpoints, shard plans, manifests, slabs, artifacts."""
