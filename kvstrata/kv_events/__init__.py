"""KV cache events on the wire: vLLM's / SGLang's ZMQ + msgpack format (config, wire structs, publisher)."""
