"""KV memory: the device pool (L1), the host pool (L2), page allocators and the request-to-slot table."""
