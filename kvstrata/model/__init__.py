"""Models: config and safetensors loading, tokenizers, Llama-family architectures, paged attention, built-ins."""
