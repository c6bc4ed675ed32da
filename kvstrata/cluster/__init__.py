"""Role-based deployment: spec, member commands, local supervisor, Kubernetes renderer (see cli.py)."""
