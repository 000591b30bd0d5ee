"""Bandwidth (bytes/s) and latency (seconds) from numbers or strings with units."""

from __future__ import annotations

import math
import re
from typing import Any, Mapping

from megatron_fcp.topology.errors import TopologyError

__all__ = ["GB", "parse_bandwidth", "parse_latency"]

GB = 1e9
"""One gigabyte (10^9 bytes): bandwidths are bytes/s, ``450 * GB`` is 450 GB/s."""

_BW_UNITS = {
    "b/s": 1.0, "kb/s": 1e3, "mb/s": 1e6, "gb/s": 1e9, "tb/s": 1e12,          # bytes
    "bit/s": 0.125, "kbit/s": 1e3 / 8, "mbit/s": 1e6 / 8, "gbit/s": 1e9 / 8,   # bits
    "gbps": 1e9 / 8, "mbps": 1e6 / 8,
}
_LAT_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def _parse_quantity(value: Any, units: Mapping[str, float], field_name: str) -> float:
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
                # "GB/s" is bytes, "Gb/s" is bits: keep case for the b/B distinction.
                key = unit.lower()
                if unit.endswith("b/s") and not unit.endswith("B/s") and key not in ("b/s",):
                    key = key[:-3] + "bit/s"
                if key in units:
                    return number * units[key]
        raise TopologyError(
            f"{field_name}: cannot parse {value!r}; use a number or units like "
            + ", ".join(sorted({u for u in units if '/' in u or u in _LAT_UNITS})[:6])
        )
    raise TopologyError(f"{field_name}: expected a number or a string with units, got {value!r}")


def parse_bandwidth(value: Any, field_name: str = "bandwidth") -> float:
    """Bytes/s from a number or a string (``"450GB/s"``, ``"200Gb/s"`` = bits, ``"25e9"``); must be > 0."""
    bw = _parse_quantity(value, _BW_UNITS, field_name)
    if not (bw > 0) or math.isinf(bw):
        raise TopologyError(f"{field_name}: bandwidth must be a finite number > 0 bytes/s, got {value!r}")
    return bw


def parse_latency(value: Any, field_name: str = "latency") -> float:
    """Seconds from a number or a string (``"2us"``, ``"1e-6"``); must be >= 0."""
    lat = _parse_quantity(value, _LAT_UNITS, field_name)
    if not (lat >= 0) or math.isinf(lat):
        raise TopologyError(f"{field_name}: latency must be a finite number >= 0 seconds, got {value!r}")
    return lat
