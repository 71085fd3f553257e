"""The engine side: connect to a rank, check the fingerprint, map or copy the weights."""
