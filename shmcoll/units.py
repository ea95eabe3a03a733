"""Sizes, times and bandwidths: the one place shmcoll parses and formats them.

Two conventions, kept apart on purpose:

- **sizes** (buffers, slots, ``SHMCOLL_SLOT_BYTES``, ``--size``, bytes moved): binary multiples,
  ``64K`` is 65536 bytes (:func:`parse_size`, :func:`format_size` exactly, :func:`human_size`
  rounded to 3 digits, ``57.3K``);
- **bandwidths** (the simulator's ``--beta``, bench's GB/s): decimal multiples as in nccl-tests,
  ``25GB/s`` is 25e9 bytes per second, with ``Ki``/``Mi``/``Gi``/``Ti`` for the binary ones
  (:func:`parse_bandwidth`, :func:`format_bytes`).

Times are seconds (:func:`parse_time`, :func:`format_time`). This module imports nothing from
shmcoll, so any module may use it.
"""

from __future__ import annotations

import math
import re

_SUFFIXES = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_TIME_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_BW_UNITS = {"": 1.0, "b": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30}
_BW_UNITS["ti"] = 2.0**40


# --- sizes ---------------------------------------------------------------------------------------
def parse_size(text: str | int) -> int:
    """``"64K"`` -> 65536. Binary multiples; a trailing ``B``/``iB`` is allowed."""
    if isinstance(text, int):
        return text
    s = text.strip().upper().replace("IB", "").rstrip("B") or "0"
    unit = s[-1] if s[-1] in _SUFFIXES else ""
    number = s[: len(s) - len(unit)] if unit else s
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"not a size: {text!r} (expected e.g. 512, 64K, 1M, 2G)") from None
    if value < 0:
        raise ValueError(f"size must be >= 0: {text!r}")
    return int(value * _SUFFIXES[unit])


def format_size(nbytes: int) -> str:
    """65536 -> ``"64K"``: the shortest exact binary-suffixed spelling."""
    for unit in ("T", "G", "M", "K"):
        mult = _SUFFIXES[unit]
        if nbytes >= mult and nbytes % mult == 0:
            return f"{nbytes // mult}{unit}"
    return str(nbytes)


def human_size(nbytes: float, *, iec: bool = False) -> str:
    """A size in binary multiples, 3 significant digits: 65536 -> ``"64K"``, 58700 -> ``"57.3K"``.

    ``iec=True`` spells the units out for figures and prose: ``"64 KiB"``, ``"16 B"``.
    """
    for unit in ("T", "G", "M", "K"):
        mult = _SUFFIXES[unit]
        if nbytes >= mult:
            value = nbytes / mult
            text = f"{value:.0f}" if value >= 100 or value == int(value) else f"{value:.3g}"
            return f"{text} {unit}iB" if iec else f"{text}{unit}"
    return f"{nbytes:.0f} B" if iec else f"{nbytes:.0f}"


# --- times ---------------------------------------------------------------------------------------
def parse_time(text: str | float) -> float:
    """``"5us"`` -> 5e-6 seconds; units s, ms, us (or µs), ns; a bare number is seconds."""
    if isinstance(text, int | float):
        value = float(text)
    else:
        m = re.fullmatch(r"\s*([0-9.]+(?:[eE][-+]?[0-9]+)?)\s*([a-zµ]*)\s*", text.lower())
        if m is None or m.group(2) not in _TIME_UNITS:
            raise ValueError(f"not a time: {text!r} (expected e.g. 5us, 1.5ms, 2e-6)")
        value = float(m.group(1)) * _TIME_UNITS[m.group(2)]
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"time must be finite and >= 0: {text!r}")
    return value


def format_time(seconds: float) -> str:
    """Seconds in the unit that keeps 3-4 significant digits readable: ``12.5 us``."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.4g} {unit}"
    return f"{seconds / 1e-9:.4g} ns"


# --- bandwidths and traffic ------------------------------------------------------------------------
def parse_bandwidth(text: str | float) -> float:
    """``"25GB/s"`` -> 25e9 bytes/s. K/M/G/T are decimal (as in nccl-tests), Ki/Mi/Gi binary."""
    if isinstance(text, int | float):
        value = float(text)
    else:
        m = re.fullmatch(r"\s*([0-9.]+(?:[eE][-+]?[0-9]+)?)\s*([kmgt]i?)?b?(?:/s|ps)?\s*", text.lower())
        if m is None:
            raise ValueError(f"not a bandwidth: {text!r} (expected e.g. 25GB/s, 10GiB/s, 1e9)")
        value = float(m.group(1)) * _BW_UNITS[m.group(2) or ""]
    if not value > 0:
        raise ValueError(f"bandwidth must be > 0: {text!r}")
    return value


def format_bytes(nbytes: float) -> str:
    """Decimal-prefixed bytes with 3 significant digits: ``1.57 GB``."""
    for unit, scale in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"
