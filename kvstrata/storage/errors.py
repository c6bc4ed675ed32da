"""The storage tier's error type, importable without torch (the service harness runs without it)."""


class StorageError(Exception):
    """A storage backend cannot be created or used (missing package, unreachable service, bad config)."""
