"""`python -m kvstrata.launch_server [flags]`: run the HTTP server (SGLang's flag names)."""

from kvstrata.server.launch import main, run_and_exit

__all__ = ["main"]

if __name__ == "__main__":
    run_and_exit()
