"""ReqSlotTable: row r holds the slot of every token of the request occupying row r.

`table[r, i]` is the slot of token i. Rows are handed out per running request and freed when it ends;
the slots themselves are owned by the allocator / cache, not by this table.
"""

from __future__ import annotations

import torch

from kvstrata.platform import anonymous_buffer


class ReqSlotTable:
    """A `[max_requests, max_context_len]` slot table with a free list of rows."""

    def __init__(self, max_requests: int, max_context_len: int, device: torch.device | str = "cpu"):
        self.table = _zeros((max_requests, max_context_len), torch.device(device))
        self._free_rows = list(range(max_requests - 1, -1, -1))
        self.max_requests = max_requests

    @property
    def free_rows(self) -> int:
        """Rows available."""
        return len(self._free_rows)

    def alloc(self) -> int | None:
        """Take a row, or None when all are in use."""
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        """Give a row back."""
        if row in self._free_rows:
            raise RuntimeError(f"ReqSlotTable row {row} freed twice")
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Record `slots` as the slots of tokens start.. of row."""
        self.table[row, start:start + slots.numel()] = slots

    def write_cells(self, rows: list[int], cols: list[int], slots: list[int]) -> None:
        """Record slots[i] as the slot of token cols[i] of row rows[i], with one copy to the table's device."""
        cells = torch.tensor([rows, cols, slots], dtype=torch.long).to(self.table.device)
        self.table[cells[0], cells[1]] = cells[2]

    def read(self, row: int, length: int) -> torch.Tensor:
        """Slots of tokens 0..length-1 of row (a view)."""
        return self.table[row, :length]


def _zeros(shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    """A zero int64 table. On the CPU its pages come from an anonymous mapping (zero until written), so rows and
    columns no request reaches cost no memory: 257 rows x an 8k context are 17 MB, mostly never touched."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=torch.long, device=device)
    region = anonymous_buffer(shape[0] * shape[1] * torch.long.itemsize)
    return torch.frombuffer(region, dtype=torch.long, count=shape[0] * shape[1]).view(shape)
