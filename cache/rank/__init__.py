"""The cache rank process: load a shard, serve it over a Unix socket, seed from a peer."""
