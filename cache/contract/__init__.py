"""The contract between launcher, cache ranks and engines: light modules, no torch.

The launcher imports only this package (tests/test_layout.py checks it by path)."""
