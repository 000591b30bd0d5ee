"""Bandwidth (bytes/s) and latency (seconds) from numbers or strings with units.

Note [Bandwidth units]
----------------------
Every bandwidth inside the model is bytes/s. A plain number is bytes/s; a string may carry a unit,
and the case of the ``b`` decides bytes or bits, as in networking::

    "450GB/s", "450GBps", "450e9", 450e9   ->  450e9 bytes/s   (capital B: bytes)
    "200Gb/s", "200Gbps", "200Gbit/s"       ->   25e9 bytes/s   (lowercase b or "bit": bits)

So ``gbps``/``Gbps`` is gigaBITS per second (a "200 Gbps" NIC moves 25 GB/s). The prefixes
``k``, ``M``, ``G``, ``T`` are powers of 1000 in either case. Python names that hold bandwidths
say their unit in full: ``*_gbytes_per_s`` is gigabytes/s (``DEFAULT_NIC_GBYTES_PER_S = 25.0``
in :mod:`megatron_fcp.topology.detect`), never ``*_gbps``.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable

from megatron_fcp.topology.errors import TopologyError

__all__ = ["GB", "parse_bandwidth", "parse_latency"]

GB = 1e9
"""One gigabyte (10^9 bytes): bandwidths are bytes/s, ``450 * GB`` is 450 GB/s."""

_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_BW_UNIT = re.compile(r"([kKmMgGtT]?)(B|b|bit)(/s|ps)")
_LAT_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def _bandwidth_scale(unit: str) -> float | None:
    """Bytes/s per unit of ``unit`` (Note [Bandwidth units]); None when it is not a bandwidth unit."""
    m = _BW_UNIT.fullmatch(unit)
    if m is None:
        return None
    return _PREFIX[m.group(1).lower()] * (1.0 if m.group(2) == "B" else 0.125)


def _parse_quantity(value: Any, scale: Callable[[str], float | None], hint: str, field_name: str) -> float:
    if isinstance(value, bool):
        raise TopologyError(f"{field_name}: expected a number, got {value!r}")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([A-Za-zµ/]*)\s*", value)
        if m:
            try:
                number = float(m.group(1))
            except ValueError:
                number = None
            unit = m.group(2)
            if number is not None:
                if not unit:
                    return number
                factor = scale(unit)
                if factor is not None:
                    return number * factor
        raise TopologyError(f"{field_name}: cannot parse {value!r}; use {hint}")
    raise TopologyError(f"{field_name}: expected a number or a string with units, got {value!r}")


def parse_bandwidth(value: Any, field_name: str = "bandwidth") -> float:
    """Bytes/s from a number or a string (``"450GB/s"``, ``"200Gb/s"`` = ``"200Gbps"`` = bits,
    ``"25e9"``; Note [Bandwidth units]); must be > 0."""
    bw = _parse_quantity(value, _bandwidth_scale,
                         "a number (bytes/s) or units like 450GB/s (bytes), 200Gb/s or 200Gbps (bits)", field_name)
    if not (bw > 0) or math.isinf(bw):
        raise TopologyError(f"{field_name}: bandwidth must be a finite number > 0 bytes/s, got {value!r}")
    return bw


def parse_latency(value: Any, field_name: str = "latency") -> float:
    """Seconds from a number or a string (``"2us"``, ``"1e-6"``); must be >= 0."""
    lat = _parse_quantity(value, _LAT_UNITS.get, "a number (seconds) or units like 2us, 1.5ms, 800ns", field_name)
    if not (lat >= 0) or math.isinf(lat):
        raise TopologyError(f"{field_name}: latency must be a finite number >= 0 seconds, got {value!r}")
    return lat
