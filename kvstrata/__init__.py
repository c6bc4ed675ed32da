"""kvstrata: an LLM serving engine with a three-tier KV cache."""

from kvstrata.args import ServerArgs

__all__ = ["Engine", "ServerArgs"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Engine pulls in torch and the model code; import it lazily so `kvstrata --help` stays fast.
    if name == "Engine":
        from kvstrata.engine import Engine

        return Engine
    raise AttributeError(name)
