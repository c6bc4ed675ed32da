"""ReqSlotTable: rows handed out and back, and a table that reads zero until written (lazily mapped on CPU)."""

from __future__ import annotations

import pytest
import torch

from kvstrata.memory.req_slots import ReqSlotTable


def test_rows_read_zero_until_written_and_keep_what_is_written():
    table = ReqSlotTable(4, 64)
    assert table.table.shape == (4, 64) and table.table.dtype == torch.long
    assert int(table.table.abs().sum()) == 0
    row = table.alloc()
    table.write(row, 3, torch.tensor([7, 8, 9]))
    table.write_cells([row, row], [0, 63], [5, 6])
    assert table.read(row, 6).tolist() == [5, 0, 0, 7, 8, 9] and int(table.table[row, 63]) == 6
    other = table.alloc()
    assert other != row and int(table.table[other].abs().sum()) == 0


def test_a_row_freed_twice_is_refused_and_rows_run_out():
    table = ReqSlotTable(2, 8)
    rows = [table.alloc(), table.alloc()]
    assert table.alloc() is None and table.free_rows == 0
    table.free(rows[0])
    with pytest.raises(RuntimeError, match="freed twice"):
        table.free(rows[0])
    assert table.free_rows == 1
