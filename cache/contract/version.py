"""The vlaunch version, shared by packaging and the fingerprint."""

__version__ = "0.1.0"
