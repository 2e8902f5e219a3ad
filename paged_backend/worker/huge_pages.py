"""A CPU model's weights in transparent huge pages (2 MiB), where Linux lends them on request (`madvise`).

A decode step reads every weight once, so at small batches it is bound by memory reads; on 4 KiB pages that read
crosses a page, with its TLB miss, every 4 KiB (66 thousand pages per step of smollm2 in bfloat16). Weights are
usually 4 KiB pages: a loaded checkpoint is a file mapping, a copy is malloc's, and this machine's kernel grants
huge pages only to memory advised so (`/sys/kernel/mm/transparent_hugepage/enabled` = `madvise`). So the model
runner copies each weight that owns its storage into one anonymous mapping advised `MADV_HUGEPAGE`, and a CPU KV
cache is allocated in one (on a 2-core Intel Xeon, all of smollm2's bfloat16 linear layers at one row went from
12.3 to 11.5 ms; docs/compilation.md). Values and `Parameter` objects stay; only their storage moves.
`PAGED_BACKEND_HUGE_PAGES=0` turns both off.
"""

from __future__ import annotations

import math
import mmap
import os
from dataclasses import dataclass
from typing import Dict, List, Sequence

import torch

_HUGE_PAGE = 2 << 20             # the mapping starts on a huge page
_ALIGN = 4096                    # each tensor in it starts on a page, packed one after another
_MIN_BYTES = 64 << 10            # smaller tensors (norms, biases) stay where they are
_THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"
ENV = "PAGED_BACKEND_HUGE_PAGES"
_MOVED = "_paged_backend_huge_pages"   # set on a module whose weights were moved


@dataclass
class HugePageWeights:
    """What was moved. Each tensor has its own storage within one mapping, which lives as long as any of them
    (torch.frombuffer keeps a reference to it; nothing closes it)."""

    tensors: int
    bytes: int
    huge_bytes: int   # of the mapping, what the kernel backs with huge pages (AnonHugePages of its range)


def transparent_huge_pages() -> str:
    """The kernel's policy for transparent huge pages: "always", "madvise", "never", or "unavailable"."""
    try:
        with open(_THP_SETTING) as f:
            text = f.read()
    except OSError:
        return "unavailable"
    return text[text.find("[") + 1:text.find("]")] if "[" in text else "unavailable"


def wanted() -> bool:
    """Whether to move weights: huge pages can be had by advice and the environment does not turn it off."""
    return (os.environ.get(ENV, "1") != "0" and hasattr(mmap, "MADV_HUGEPAGE")
            and transparent_huge_pages() in ("always", "madvise"))


def _sole_owners(module: torch.nn.Module) -> List[torch.Tensor]:
    """The CPU parameters and buffers of at least `_MIN_BYTES` that are plain tensors (no subclass) alone on their
    storage, contiguous and the whole of it (a view into a shared storage stays shared); a tied weight counts
    once."""
    by_storage: Dict[int, List[torch.Tensor]] = {}
    seen = set()
    for tensor in [*module.parameters(), *module.buffers()]:
        if id(tensor) in seen or tensor.device.type != "cpu" or type(tensor) not in (torch.Tensor, torch.nn.Parameter):
            continue
        seen.add(id(tensor))
        by_storage.setdefault(tensor.untyped_storage().data_ptr(), []).append(tensor)
    return [group[0] for group in by_storage.values()
            if len(group) == 1 and group[0].is_contiguous() and group[0].storage_offset() == 0
            and group[0].untyped_storage().nbytes() == group[0].nbytes >= _MIN_BYTES]


def _huge_bytes(address: int) -> int:
    """AnonHugePages of the mapping that holds `address` (from /proc/self/smaps), 0 if unknown."""
    try:
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                head = line.split(" ", 1)[0]
                if "-" in head and ":" not in head:
                    low, high = (int(part, 16) for part in head.split("-"))
                    inside = low <= address < high
                elif inside and line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def _advised_mapping(nbytes: int) -> mmap.mmap:
    """An anonymous private mapping advised MADV_HUGEPAGE, whole huge pages from its first 2 MiB boundary on
    covering `nbytes` (a tensor placed there lies on huge pages only)."""
    mapping = mmap.mmap(-1, -(-nbytes // _HUGE_PAGE) * _HUGE_PAGE + _HUGE_PAGE,
                        flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    return mapping


def move_weights_to_huge_pages(module: torch.nn.Module) -> HugePageWeights:
    """Copy `module`'s large CPU weights (`_sole_owners`) into one mapping advised MADV_HUGEPAGE, each tensor's
    `.data` then a view of it. Nothing moves when `wanted()` is false, nor a second time (another engine over
    the same model)."""
    tensors = _sole_owners(module) if wanted() and not getattr(module, _MOVED, False) else []
    if not tensors:
        return HugePageWeights(0, 0, 0)
    sizes = [-(-t.nbytes // _ALIGN) * _ALIGN for t in tensors]
    mapping = _advised_mapping(sum(sizes))
    base = torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()
    offset = -base % _HUGE_PAGE
    with torch.no_grad():
        for tensor, size in zip(tensors, sizes):
            # its own storage (a save that groups tensors by storage sees no sharing), within the mapping
            place = torch.frombuffer(mapping, dtype=tensor.dtype, count=tensor.numel(), offset=offset)
            place = place.view(tensor.shape).copy_(tensor)
            tensor.data = place
            offset += size
    setattr(module, _MOVED, True)
    return HugePageWeights(len(tensors), sum(t.nbytes for t in tensors), _huge_bytes(base))


def huge_page_zeros(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor in a mapping of its own advised MADV_HUGEPAGE (the KV cache, which attention reads every
    step), its pages touched now as `torch.zeros` would; `torch.zeros` where `wanted()` is false or it is small."""
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if not wanted() or nbytes < _MIN_BYTES:
        return torch.zeros(tuple(shape), dtype=dtype)
    mapping = _advised_mapping(nbytes)
    offset = -torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr() % _HUGE_PAGE
    return torch.frombuffer(mapping, dtype=dtype, count=numel, offset=offset).view(tuple(shape)).zero_()
