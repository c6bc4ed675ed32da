"""Prefill/decode disaggregation: the two sides of the KV handoff, and which one a mode gets."""

from __future__ import annotations

from typing import Optional

from kvstrata.runtime.handoff import HandoffFactory


def handoff_for(mode: str) -> Optional[HandoffFactory]:
    """The handoff of --disaggregation-mode `mode` as a factory the Scheduler calls with itself (None: null)."""
    if mode == "null":
        return None
    if mode == "prefill":
        from kvstrata.disagg.prefill import PrefillHandoff

        return PrefillHandoff
    if mode == "decode":
        from kvstrata.disagg.decode import DecodeHandoff

        return DecodeHandoff
    raise ValueError(f"unknown --disaggregation-mode {mode!r}")
