"""The router: one HTTP entry in front of N kvstrata workers (cache-, load- and tier-aware routing)."""
