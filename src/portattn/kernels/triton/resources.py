"""Tiles that fit the device: step down when a launch runs out of on-chip resources.

Default tiles are tuned on one GPU. Another vendor's GPU may have less shared memory per program
(AMD's LDS is 64 KB, Intel's SLM 128 KB, Hopper's 227 KB), and Triton then refuses the launch
with ``OutOfResources`` before anything runs. Rather than read a per-vendor device property, the
launch is retried with the next smaller tiles, and the tiles that fit are remembered for later
launches of the same shape on the same device. Results never depend on the tiles.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Hashable
from typing import TypeVar

from triton.runtime.errors import OutOfResources

logger = logging.getLogger("portattn")

Tiles = TypeVar("Tiles")

_FITTED: dict[Hashable, object] = {}


def launch_fitting(
    launch: Callable[[Tiles], None], tiles: Tiles, shrink: Callable[[Tiles], Tiles | None], key: Hashable
) -> Tiles:
    """Run ``launch(tiles)``, shrinking ``tiles`` while the device lacks the resources; return the tiles used.

    ``key`` names the launch's shape and device (with the first-choice tiles); ``shrink`` returns
    the next smaller tiles, or ``None`` when there are none (the error is then raised).
    """
    tiles = _FITTED.get(key, tiles)
    while True:
        try:
            launch(tiles)
        except OutOfResources as exc:
            smaller = shrink(tiles)
            if smaller is None:
                raise
            logger.info("tiles %s do not fit (%s); trying %s", tiles, exc, smaller)
            tiles = smaller
            continue
        _FITTED[key] = tiles
        return tiles


def fewer_stages_then(tiles: Tiles, *halvings: str, minimum: int = 16) -> Tiles | None:
    """One pipeline stage less; at one stage, halve the first of ``halvings`` still above ``minimum``."""
    if tiles.num_stages > 1:
        return dataclasses.replace(tiles, num_stages=tiles.num_stages - 1)
    for name in halvings:
        if getattr(tiles, name) > minimum:
            return dataclasses.replace(tiles, **{name: getattr(tiles, name) // 2})
    return None
