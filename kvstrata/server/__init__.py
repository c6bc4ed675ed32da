"""HTTP server: SGLang-native and OpenAI-compatible APIs in front of the scheduler process (see launch.py)."""
