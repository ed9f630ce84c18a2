"""Workers and the physical devices they run on: several workers may share one GPU.

A worker reports its device's identity (:attr:`~mgpu.worker.device.DeviceFacts.physical`: a GPU's
or MIG slice's UUID, a CPU worker's own name). Everything that counts devices (the
roofline, a result's ``devices`` and ``per_device``, scaling, the report) counts each
physical device once and says how many workers shared it; a worker's budget and its
ceilings are its share of its device's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from .worker.device import DeviceFacts

__all__ = ["by_device", "first_per_device", "share_rates", "shared_by"]

T = TypeVar("T")

# Ceilings that are a device's rate, which workers sharing it split between them (a rate
# of a unit per second); the others (a count, a latency) are the device's as they are.
_RATE_UNITS = ("/s",)


def by_device(devices: Mapping[str, DeviceFacts]) -> dict[str, list[str]]:
    """The workers of each physical device (identity -> worker addresses), in ``devices``' order."""
    out: dict[str, list[str]] = {}
    for addr, facts in devices.items():
        out.setdefault(facts.physical, []).append(addr)
    return out


def shared_by(devices: Mapping[str, DeviceFacts]) -> dict[str, int]:
    """How many workers share each worker's device (worker address -> count, 1 for a device
    of its own)."""
    groups = by_device(devices)
    return {addr: len(groups[facts.physical]) for addr, facts in devices.items()}


def first_per_device(values: Mapping[str, T], devices: Mapping[str, DeviceFacts]) -> dict[str, T]:
    """``values`` (worker address -> value) of the first worker of each physical device: what
    a figure of the device, measured on any one of its workers, is counted once by."""
    return {addrs[0]: values[addrs[0]] for addrs in by_device(devices).values() if addrs[0] in values}


def share_rates(
    ceilings: Mapping[str, Mapping[str, float]], devices: Mapping[str, DeviceFacts], units: Mapping[str, str]
) -> dict[str, dict[str, float]]:
    """Each worker's share of its device's ceilings (worker address -> {name: rate}): a rate
    divided among the workers that share the device, what a worker's tiles can count on
    when all of them work at once (the estimate's). ``units`` gives each ceiling's unit."""
    counts = shared_by(devices)
    out = {}
    for addr, rates in ceilings.items():
        n = counts.get(addr, 1)
        out[addr] = {
            name: rate / n if n > 1 and units.get(name, "").endswith(_RATE_UNITS) else rate
            for name, rate in rates.items()
        }
    return out
