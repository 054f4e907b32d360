"""Peers agree before they exchange: a fixed-size digest of each rank's setup, compared once.

Ranks that disagree on a scheme, its config, value formats or the parameters
would otherwise train silently apart, hang in mismatched collectives or fail
deep inside a decoder. :func:`check_peers` all-gathers a 32-byte digest (one
fixed-size collective, so it cannot hang on mismatched sizes); only when the
digests differ does it gather the readable fields, so every rank raises the
same error naming the fields that differ.
"""

from __future__ import annotations

import hashlib
import json
import weakref
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from thinwire.comm.collectives import Group, world

DIGEST_BYTES = 32  # sha256
PEER_CHECK_S = 300.0  # the longest a rank waits for every peer to reach the check (gloo)
_SHOWN = 4  # differing fields named in the message; the rest are counted


class PeerMismatchError(ValueError):
    """Ranks of one group were set up differently (raised on every rank alike)."""


def flatten(fields: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested mappings to dotted keys with canonical string values (``config.ratio``)."""
    flat: dict[str, str] = {}
    for key, value in fields.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = json.dumps(value, sort_keys=True, default=str)
    return flat


def digest(fields: Mapping[str, str]) -> bytes:
    """sha256 of the fields in canonical (sorted) order."""
    return hashlib.sha256(json.dumps(sorted(fields.items())).encode()).digest()


def describe(per_rank: list[dict[str, str]], where: str) -> str:
    """One sentence naming each field whose value is not the same on every rank, in the
    order the fields were given (the scheme's name before its config)."""
    keys = list(dict.fromkeys(key for ranked in per_rank for key in ranked))
    differing = [key for key in keys if len({ranked.get(key) for ranked in per_rank}) > 1]
    parts = []
    for key in differing[:_SHOWN]:
        values = ", ".join(f"{ranked.get(key, '(missing)')} on rank {rank}"
                           for rank, ranked in enumerate(per_rank))
        parts.append(f"{key!r} is {values}")
    more = len(differing) - _SHOWN
    return (f"peers of {where} disagree before their first exchange: " + "; ".join(parts)
            + (f"; and {more} more field(s)" if more > 0 else "")
            + ". Start every rank with the same settings.")


def check_peers(fields: Mapping[str, Any], where: str, group: Group = None,
                device: torch.device | None = None) -> None:
    """Raise the same :class:`PeerMismatchError` on every rank unless all ``fields`` agree.

    A collective over ``group``: every rank must call it at the same point.
    A no-op when not distributed.

    Args:
        fields: this rank's setup (nested mappings allowed; values JSON-able or str-able).
        where: names the front door in the message (``"the DDP hook"``).
        group: the process group whose ranks must agree.
        device: where the digest travels (a CUDA device under NCCL); default CPU.

    Raises:
        PeerMismatchError: a field differs between ranks, or a peer did not reach the
            check within :data:`PEER_CHECK_S` seconds.
    """
    _, n = world(group)
    if n == 1:
        return
    flat = flatten(fields)
    mine = torch.frombuffer(bytearray(digest(flat)), dtype=torch.uint8).to(device or "cpu")
    gathered = [torch.empty_like(mine) for _ in range(n)]
    _arrive(group, where)
    dist.all_gather(gathered, mine, group=group)
    if all(torch.equal(other, gathered[0]) for other in gathered[1:]):
        return
    per_rank: list[Any] = [None] * n
    dist.all_gather_object(per_rank, flat, group=group)
    raise PeerMismatchError(describe(per_rank, where))


_CHECKS: weakref.WeakKeyDictionary[dist.ProcessGroup, int] = weakref.WeakKeyDictionary()


def _arrive(group: Group, where: str) -> None:
    """Wait until every rank of ``group`` has reached this check, on the group's store: a
    peer that never comes (plain DDP beside thinwire) leaves no collective pending here,
    so this rank fails cleanly, and its exit ends the peer's own wait.

    Raises:
        PeerMismatchError: a peer did not arrive within :data:`PEER_CHECK_S` seconds.
    """
    pg = group if group is not None else dist.group.WORLD
    assert pg is not None
    count = _CHECKS[pg] = _CHECKS.get(pg, -1) + 1  # every rank checks in the same order
    store = dist.distributed_c10d._get_process_group_store(pg)
    rank, n = world(group)
    store.set(f"thinwire-peer-check/{count}/{rank}", "1")
    try:
        store.wait([f"thinwire-peer-check/{count}/{peer}" for peer in range(n)],
                   timedelta(seconds=PEER_CHECK_S))
    except RuntimeError as error:  # DistStoreError: timed out
        raise PeerMismatchError(
            f"not every peer of {where} reached its setup check within {PEER_CHECK_S:g} s: "
            "every rank must set up thinwire alike; a rank that runs plain DDP, another hook "
            "or no thinwire at all beside it never arrives") from error
