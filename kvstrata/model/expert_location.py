"""Where the routed experts live under expert parallelism, and how many rows each one gets.

SGLang's expert location, for --ep-size N:

    placement   `physical_to_logical[layer][slot]`: rank r holds the physical slots
                [r * P / N, (r + 1) * P / N), P = experts + --ep-num-redundant-experts. Without redundancy
                and by default ("trivial"), slot i holds expert i: rank r holds a contiguous range. With
                --ep-num-redundant-experts R, R experts have a second copy on another rank (slot i holds
                expert i mod E, or what --init-expert-location says).
    balanced    from a recorded `logical_count[layer][expert]` (--init-expert-location FILE): the most loaded
                experts get the spare copies, then the copies are packed onto the ranks heaviest first, each
                to the lightest rank that has room and no copy of it yet.
    dispatch    per forward, from the batch's rows per expert (the same on every rank: rank 0's routing is
                broadcast): an expert with one copy runs on its rank; the rows of an expert with several are
                split among its ranks so as to even out the ranks' rows (`ExpertDispatch.spans`), in shares
                of at least MIN_SHARE_ROWS (fewer rows go whole to one copy: a split costs a second read of
                the expert's weights). Each
                (token, k) row is computed by exactly one rank, so the answer does not depend on the split
                (deterministic mode's products are batch-invariant: the same bits for any split).
    recorder    `ExpertDistributionRecorder`: rows per (layer, expert) while recording, what
                /dump_expert_distribution_record returns and --init-expert-location reads back.

Why the spare copies: a router sends a batch's rows to its experts unevenly, and under expert parallelism the
rank with the busier experts sets the pace (measured on bench-moe: 1.1-1.3x the mean over a 2048-token
prefill, and which experts are busy changes from prompt to prompt). A replicated expert's rows can go to
whichever rank has fewer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

TRIVIAL = "trivial"


class ExpertLocationError(ValueError):
    """An --init-expert-location that cannot be used with this model and --ep-size (says why)."""


@dataclass(frozen=True)
class ExpertPlacement:
    """The logical expert in each physical slot of each layer; rank r holds slots [r * local, (r + 1) * local)."""

    physical_to_logical: tuple[tuple[int, ...], ...]    # [layer][physical slot]
    num_experts: int                                     # logical experts per layer
    ep_size: int

    @property
    def local_slots(self) -> int:
        """Physical slots (expert weights) per rank and layer."""
        return len(self.physical_to_logical[0]) // self.ep_size

    @property
    def redundant(self) -> int:
        """Spare copies per layer (physical slots beyond one per logical expert)."""
        return len(self.physical_to_logical[0]) - self.num_experts

    def held(self, rank: int, layer: int) -> tuple[int, ...]:
        """The logical experts in `rank`'s slots of `layer`, in slot order."""
        local = self.local_slots
        return self.physical_to_logical[layer][rank * local:(rank + 1) * local]

    def holders(self, layer: int) -> list[list[tuple[int, int]]]:
        """Per logical expert of `layer`: its copies as (rank, local slot), in rank order."""
        out: list[list[tuple[int, int]]] = [[] for _ in range(self.num_experts)]
        for slot, expert in enumerate(self.physical_to_logical[layer]):
            out[expert].append(divmod(slot, self.local_slots))
        return out

    def flat(self) -> list[int]:
        """Every layer's map in one list (the ranks check that they resolved the same placement)."""
        return [e for layer in self.physical_to_logical for e in layer]

    @classmethod
    def trivial(cls, layers: int, experts: int, ep_size: int, redundant: int = 0) -> ExpertPlacement:
        """Slot i holds expert i mod `experts` in every layer (SGLang's "trivial")."""
        row = tuple(i % experts for i in range(experts + redundant))
        return cls.checked((row,) * layers, experts, ep_size, redundant)

    @classmethod
    def balanced(cls, logical_count: list[list[float]], ep_size: int, redundant: int = 0) -> ExpertPlacement:
        """A placement evening out the ranks' rows under `logical_count[layer][expert]` (module docstring)."""
        experts = len(logical_count[0])
        layers = tuple(_balance_layer([float(c) for c in counts], ep_size, redundant) for counts in logical_count)
        return cls.checked(layers, experts, ep_size, redundant)

    @classmethod
    def checked(cls, physical_to_logical: Any, experts: int, ep_size: int, redundant: int) -> ExpertPlacement:
        """A placement from a `[layer][slot]` map, refused with ExpertLocationError unless every layer has
        experts + redundant slots holding every expert, and no rank holds one expert twice."""
        slots = experts + redundant
        if slots % ep_size:
            raise ExpertLocationError(f"{experts} experts + {redundant} redundant = {slots} physical slots do not "
                                      f"divide over --ep-size {ep_size}")
        rows = tuple(tuple(int(e) for e in row) for row in physical_to_logical)
        local = slots // ep_size
        for layer, row in enumerate(rows):
            if len(row) != slots:
                raise ExpertLocationError(f"layer {layer} of the physical_to_logical_map has {len(row)} slots, "
                                          f"expected {slots} ({experts} experts + {redundant} redundant)")
            if set(row) != set(range(experts)):
                missing = sorted(set(range(experts)) - set(row)) or sorted(set(row) - set(range(experts)))
                raise ExpertLocationError(f"layer {layer} of the physical_to_logical_map does not hold each of the "
                                          f"{experts} experts at least once (check expert ids {missing[:8]})")
            for rank in range(ep_size):
                held = row[rank * local:(rank + 1) * local]
                if len(set(held)) != len(held):
                    raise ExpertLocationError(f"layer {layer}: rank {rank} would hold an expert twice ({list(held)})")
        return cls(rows, experts, ep_size)

    @classmethod
    def of(cls, spec: str, layers: int, experts: int, ep_size: int, redundant: int = 0) -> ExpertPlacement:
        """--init-expert-location `spec`: "trivial", a .json (or .pt) file, or inline JSON, holding
        `physical_to_logical_map` `[layer][slot]` or a recorded `logical_count` `[layer][expert]`."""
        if spec == TRIVIAL:
            return cls.trivial(layers, experts, ep_size, redundant)
        data = _read_spec(spec)
        if "physical_to_logical_map" in data:
            table = _table(data["physical_to_logical_map"], layers, "physical_to_logical_map")
            return cls.checked(table, experts, ep_size, redundant)
        if "logical_count" in data:
            counts = _table(data["logical_count"], layers, "logical_count")
            if any(len(row) != experts for row in counts):
                raise ExpertLocationError(f"logical_count must have {experts} counts per layer (the model's experts)")
            return cls.balanced(counts, ep_size, redundant)
        raise ExpertLocationError(f"--init-expert-location: expected 'physical_to_logical_map' or 'logical_count', "
                                  f"found keys {sorted(data)[:8]}")


def _read_spec(spec: str) -> dict:
    """The dict an --init-expert-location file (.json, .pt) or inline JSON string holds."""
    try:
        if spec.endswith(".pt"):    # SGLang's dump; weights_only: tensors and plain containers, no code
            data = torch.load(spec, map_location="cpu", weights_only=True)
        elif spec.endswith(".json"):
            data = json.loads(Path(spec).read_text())
        else:
            data = json.loads(spec)
    except (OSError, ValueError, RuntimeError) as e:
        raise ExpertLocationError(f"--init-expert-location {spec[:200]!r}: {e}") from None
    if not isinstance(data, dict):
        raise ExpertLocationError(f"--init-expert-location {spec[:200]!r}: expected a JSON object")
    return data


def _table(value: Any, layers: int, name: str) -> list[list[float]]:
    """`value` as a `[layers][n]` list of numbers (a recorded `[passes][layers][n]` is summed over passes)."""
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    try:
        if value and value[0] and isinstance(value[0][0], list):
            value = [[sum(col) for col in zip(*rows, strict=True)] for rows in zip(*value, strict=True)]
        table = [[float(v) for v in row] for row in value]
    except (TypeError, ValueError, IndexError) as e:
        raise ExpertLocationError(f"--init-expert-location: {name} is not a table of numbers ({e})") from None
    if len(table) != layers or not all(table):
        raise ExpertLocationError(f"--init-expert-location: {name} has {len(table)} layers, the model {layers}")
    return table


def _balance_layer(counts: list[float], ep_size: int, redundant: int) -> tuple[int, ...]:
    """One layer's physical_to_logical row: spare copies to the experts with the most rows per copy (at most
    one copy per rank), then copies heaviest first, each to the lightest rank with room and none of it."""
    experts = len(counts)
    copies = [1] * experts
    for _ in range(redundant):
        candidates = [e for e in range(experts) if copies[e] < ep_size]
        if not candidates:
            raise ExpertLocationError(f"--ep-num-redundant-experts {redundant}: more copies than ranks per expert")
        best = max(candidates, key=lambda e: (counts[e] / copies[e], -e))
        copies[best] += 1
    local = (experts + redundant) // ep_size
    held: list[list[int]] = [[] for _ in range(ep_size)]
    load = [0.0] * ep_size
    for share, expert in sorted(((counts[e] / copies[e], e) for e in range(experts) for _ in range(copies[e])),
                                key=lambda item: (-item[0], item[1])):
        rank = min((r for r in range(ep_size) if len(held[r]) < local and expert not in held[r]),
                   key=lambda r: (load[r], r), default=None)
        if rank is None:   # the lighter ranks are full and the rest hold it already: a caller's impossible ask
            raise ExpertLocationError(f"cannot place {experts} experts + {redundant} copies on {ep_size} ranks")
        held[rank].append(expert)
        load[rank] += share
    return tuple(e for rank in held for e in sorted(rank))


class ExpertDispatch:
    """One MoE layer's copies as seen from `rank`: which of a batch's grouped rows this rank computes."""

    def __init__(self, placement: ExpertPlacement, layer: int, rank: int):
        self.rank = rank
        self.ep_size = placement.ep_size
        self.num_experts = placement.num_experts
        self.held = placement.held(rank, layer)             # logical expert of each local slot
        self.holders = placement.holders(layer)
        self.single = [hs[0] if len(hs) == 1 else None for hs in self.holders]
        self.replicated = [e for e, hs in enumerate(self.holders) if len(hs) > 1]

    def spans(self, counts: list[int]) -> list[tuple[int, int, int]]:
        """(local slot, first row, end row) of the rows this rank computes, in row order, given each
        expert's row count `counts` (rows grouped by expert id, as a stable sort of the ids puts them)."""
        load = [0] * self.ep_size
        for expert, count in enumerate(counts):
            if self.single[expert] is not None:
                load[self.single[expert][0]] += count
        shares: dict[int, tuple[int, int, int]] = {}   # replicated expert -> this rank's (slot, offset, rows)
        # Experts too small to split go whole to their lightest copy, biggest first; the others' rows then
        # fill the ranks up evenly.
        busy = [e for e in self.replicated if counts[e]]
        whole = sorted((e for e in busy if counts[e] < 2 * MIN_SHARE_ROWS), key=lambda e: (-counts[e], e))
        for expert in whole:
            r, slot = min(self.holders[expert], key=lambda copy: (load[copy[0]], copy[0]))
            load[r] += counts[expert]
            if r == self.rank:
                shares[expert] = (slot, 0, counts[expert])
        for expert in busy:
            if counts[expert] < 2 * MIN_SHARE_ROWS:
                continue
            copies = self.holders[expert]
            given = _fewer_reads(_water_fill([load[r] for r, _ in copies], counts[expert]))
            offset = 0
            for (r, slot), rows in zip(copies, given, strict=True):
                load[r] += rows
                if r == self.rank and rows:
                    shares[expert] = (slot, offset, rows)
                offset += rows
        out = []
        start = 0
        for expert, count in enumerate(counts):
            single = self.single[expert]
            if count and single is not None and single[0] == self.rank:
                out.append((single[1], start, start + count))
            elif expert in shares:
                slot, offset, rows = shares[expert]
                out.append((slot, start + offset, start + offset + rows))
            start += count
        return out


# A copy given fewer rows than this reads the expert's whole weights for little work: on a CPU core an
# expert's product over ~40 rows (AMX bf16) costs about as much as reading its weights once, so small shares
# go whole to one copy (a decode step's few rows per expert are never split).
MIN_SHARE_ROWS = 32


def _fewer_reads(given: list[int]) -> list[int]:
    """`given` with every share under MIN_SHARE_ROWS moved to the largest share (ties: the first)."""
    small = [i for i, rows in enumerate(given) if 0 < rows < MIN_SHARE_ROWS]
    if not small:
        return given
    out = list(given)
    keep = max(range(len(out)), key=lambda i: (out[i], -i))
    for i in small:
        if i != keep:
            out[keep] += out[i]
            out[i] = 0
    return out


def _water_fill(levels: list[int], rows: int) -> list[int]:
    """Rows to add to each of `levels` (summing to `rows`) that minimize the highest level; ties to the first."""
    order = sorted(range(len(levels)), key=lambda i: (levels[i], i))
    given = [0] * len(levels)
    # Raise the lowest m levels to a common level, for the largest m whose level stays under the next one.
    filled = 0
    m = len(order)
    for k in range(1, len(order) + 1):
        filled += levels[order[k - 1]]
        if k == len(order) or (rows + filled) // k <= levels[order[k]]:
            m = k
            break
    base_total = rows + sum(levels[i] for i in order[:m])
    level, extra = divmod(base_total, m)
    for rank_pos, i in enumerate(sorted(order[:m])):
        given[i] = level - levels[i] + (1 if rank_pos < extra else 0)
    return given


class ExpertDistributionRecorder:
    """Rows routed to each (layer, expert) while recording (rank 0's routing: the same on every rank)."""

    def __init__(self, layers: int, experts: int):
        self.counts = torch.zeros(layers, experts, dtype=torch.long)
        self.recording = False

    def start(self) -> None:
        """Clear the counts and record from now on."""
        self.counts.zero_()
        self.recording = True

    def stop(self) -> None:
        """Stop recording (the counts stay for a dump)."""
        self.recording = False

    def add(self, layer: int, ids: torch.Tensor) -> None:
        """Count one forward's expert ids `[T, k]` of `layer`."""
        self.counts[layer] += torch.bincount(ids.reshape(-1).cpu(), minlength=self.counts.shape[1])

    def dump(self) -> dict:
        """What --init-expert-location reads back: `logical_count` `[layer][expert]`, with its context."""
        return {"logical_count": self.counts.tolist(), "recording": self.recording,
                "num_layers": self.counts.shape[0], "num_experts": self.counts.shape[1]}


def balance_of(placement: ExpertPlacement, logical_count: list[list[int]]) -> Optional[float]:
    """The busiest rank's rows over the mean, summed over layers, if `logical_count` were one batch."""
    busiest = total = 0
    for layer, counts in enumerate(logical_count):
        load = [0] * placement.ep_size
        for rank in range(placement.ep_size):
            dispatch = ExpertDispatch(placement, layer, rank)
            load[rank] = sum(end - start for _, start, end in dispatch.spans(counts))
        busiest += max(load)
        total += sum(load)
    return busiest * placement.ep_size / total if total else None
