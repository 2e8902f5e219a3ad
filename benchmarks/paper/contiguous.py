"""Contiguous allocators over an arena of KV units, for the reservation baselines.

A system without paging must give each request one contiguous run of cache slots. These are real
allocators (first-fit with coalescing free holes, and a binary buddy allocator), so the external
fragmentation the baselines suffer is measured, not assumed.
"""

from __future__ import annotations

import bisect
from typing import Dict, List, Optional, Tuple


class ContiguousArena:
    """Interface: `allocate(units) -> (start, granted) | None`, `free(start)`, free and largest-hole sizes."""

    name = "arena"

    def __init__(self, num_units: int) -> None:
        if num_units < 1:
            raise ValueError(f"an arena needs at least one unit, got {num_units}")
        self.num_units = num_units
        self.allocated: Dict[int, int] = {}  # start -> granted units

    def allocate(self, units: int) -> Optional[Tuple[int, int]]:
        raise NotImplementedError

    def free(self, start: int) -> None:
        raise NotImplementedError

    @property
    def free_units(self) -> int:
        return self.num_units - sum(self.allocated.values())

    def largest_free(self) -> int:
        raise NotImplementedError

    def granted_units(self, units: int) -> int:
        """How many units a request for `units` occupies once granted."""
        return units

    def can_fit(self, units: int) -> bool:
        return self.granted_units(units) <= self.largest_free()

    @staticmethod
    def _check_request(units: int) -> None:
        if units < 1:
            raise ValueError(f"cannot allocate {units} units")


class FirstFitArena(ContiguousArena):
    """Free holes kept sorted by address; a request takes the front of the lowest hole that fits."""

    name = "first-fit"

    def __init__(self, num_units: int) -> None:
        super().__init__(num_units)
        self.hole_starts: List[int] = [0]
        self.hole_sizes: List[int] = [num_units]

    def allocate(self, units: int) -> Optional[Tuple[int, int]]:
        self._check_request(units)
        for i, size in enumerate(self.hole_sizes):
            if size >= units:
                start = self.hole_starts[i]
                if size == units:
                    del self.hole_starts[i], self.hole_sizes[i]
                else:
                    self.hole_starts[i] += units
                    self.hole_sizes[i] -= units
                self.allocated[start] = units
                return start, units
        return None

    def free(self, start: int) -> None:
        units = self.allocated.pop(start, None)
        if units is None:
            raise ValueError(f"unit {start} does not start an allocation")
        i = bisect.bisect_left(self.hole_starts, start)
        merge_prev = i > 0 and self.hole_starts[i - 1] + self.hole_sizes[i - 1] == start
        merge_next = i < len(self.hole_starts) and start + units == self.hole_starts[i]
        if merge_prev and merge_next:
            self.hole_sizes[i - 1] += units + self.hole_sizes[i]
            del self.hole_starts[i], self.hole_sizes[i]
        elif merge_prev:
            self.hole_sizes[i - 1] += units
        elif merge_next:
            self.hole_starts[i] = start
            self.hole_sizes[i] += units
        else:
            self.hole_starts.insert(i, start)
            self.hole_sizes.insert(i, units)

    @property
    def free_units(self) -> int:
        return sum(self.hole_sizes)

    def largest_free(self) -> int:
        return max(self.hole_sizes, default=0)


class BuddyArena(ContiguousArena):
    """Binary buddy allocator: power-of-two blocks, split on demand and merged with their buddy on free.

    An arena that is not a power of two is covered by the largest aligned power-of-two blocks that fit.
    """

    name = "buddy"

    def __init__(self, num_units: int) -> None:
        super().__init__(num_units)
        self.max_order = num_units.bit_length() - 1
        self.free_blocks: List[set] = [set() for _ in range(self.max_order + 1)]  # order -> starts
        start = 0
        while start < num_units:
            order = min(self.max_order, (start & -start).bit_length() - 1 if start else self.max_order)
            while start + (1 << order) > num_units:
                order -= 1
            self.free_blocks[order].add(start)
            start += 1 << order

    @staticmethod
    def order_for(units: int) -> int:
        return max(0, (units - 1).bit_length())

    def granted_units(self, units: int) -> int:
        return 1 << self.order_for(units)

    def allocate(self, units: int) -> Optional[Tuple[int, int]]:
        self._check_request(units)
        want = self.order_for(units)
        order = next((o for o in range(want, self.max_order + 1) if self.free_blocks[o]), None)
        if order is None:
            return None
        start = min(self.free_blocks[order])  # lowest address first, like first-fit
        self.free_blocks[order].discard(start)
        while order > want:
            order -= 1
            self.free_blocks[order].add(start + (1 << order))
        self.allocated[start] = 1 << want
        return start, 1 << want

    def free(self, start: int) -> None:
        size = self.allocated.pop(start, None)
        if size is None:
            raise ValueError(f"unit {start} does not start an allocation")
        order = size.bit_length() - 1
        while order < self.max_order:
            buddy = start ^ (1 << order)
            if buddy not in self.free_blocks[order]:
                break
            self.free_blocks[order].discard(buddy)
            start = min(start, buddy)
            order += 1
        self.free_blocks[order].add(start)

    @property
    def free_units(self) -> int:
        return sum(len(starts) << order for order, starts in enumerate(self.free_blocks))

    def largest_free(self) -> int:
        return next((1 << o for o in range(self.max_order, -1, -1) if self.free_blocks[o]), 0)


ARENAS = {"first-fit": FirstFitArena, "buddy": BuddyArena}


def make_arena(kind: str, num_units: int) -> ContiguousArena:
    if kind not in ARENAS:
        raise ValueError(f"unknown contiguous allocator {kind!r}; use one of {sorted(ARENAS)}")
    return ARENAS[kind](num_units)
