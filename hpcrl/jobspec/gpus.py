"""A GPU's memory from its GRES type, as sites name them (`h100`, `a100_80gb`, `a100-40g`), for the memory plan.

A size written in the name wins (`a100_40gb`: 40 GB); else the card's table entry below; a name the
table does not know, or a spec without a type, gives no size: the plan then asks for
`roles.<role>.gpu_mem`. Where one name covers cards of two sizes (`a100`: 40 or 80 GB) the smaller
is assumed, and the plan says so: a plan that refuses a spec that would fit is told `gpu_mem: 80G`
in the message; one that passes a spec that will not fit costs a queue wait and a crash.
"""
from __future__ import annotations

import re

GIB = 2**30
CARDS_MIB = {
    "b200": 183359, "h200": 143771, "gh200": 97871, "h100nvl": 95830, "h100": 81559, "h800": 81559, "a100": 40960, "a800": 81920,
    "l40s": 46068, "l40": 46068, "a40": 46068, "a6000": 49140, "rtx6000": 49140, "l4": 23034, "a10": 23028,
    "a10g": 23028, "a30": 24576, "v100": 16384, "t4": 15360, "rtx4090": 24564, "4090": 24564, "rtx3090": 24576,
    "mi300x": 196592, "mi250x": 65536, "mi250": 65536,
}
"""The whole memory of each card as nvidia-smi (rocm-smi) reports it, MiB; the smaller size where a
name covers two (a100: 40 or 80 GB, v100: 16 or 32 GB)."""
TWO_SIZES = {"a100": "80G", "v100": "32G"}
"""Names shared by cards of two sizes: the larger, for the message."""


def gpu_memory(gpu_type: str | None) -> tuple[int | None, str]:
    """(bytes, how it was found) of a GPU of this GRES type; None where the type does not say."""
    if not gpu_type:
        return None, "no GPU type given"
    name = gpu_type.lower()
    written = re.search(r"\b(\d+)\s*g(?:b)?\b", name.replace("_", " ").replace("-", " "))
    if written:
        return int(written.group(1)) * 10**9, f"{gpu_type}: {written.group(1)} GB, from its name"
    base = re.sub(r"[^a-z0-9]", "", name)
    card = next((c for c in sorted(CARDS_MIB, key=len, reverse=True) if base.startswith(c) or base == c), None)
    if card is None:
        return None, f"{gpu_type}: not a GPU type hpcrl knows"
    note = f"{gpu_type}: {CARDS_MIB[card] / 1024:.0f} GiB"
    if card in TWO_SIZES:
        note += f" assumed (cards of two sizes share the name; {TWO_SIZES[card]} ones: gpu_mem: {TWO_SIZES[card]})"
    return CARDS_MIB[card] * 2**20, note
