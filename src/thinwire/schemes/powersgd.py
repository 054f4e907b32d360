"""PowerSGD (Vogels et al., NeurIPS 2019) as a scheme: two all-reduce rounds, gloo-safe.

Per parameter (never per bucket, so DDP's re-bucketing cannot mix up state):
``M = grad + error``, all-reduce ``P = M Q``, ``P_hat = orthonormalize(P)``,
all-reduce ``Q = M^T P_hat`` with the dense tensors, ``G_hat = P_hat Q^T``,
``error <- M - G_hat`` (the maths: :mod:`thinwire.compress.powersgd`). P is
waited for in the caller's thread, at once for the step's last DDP bucket,
else at the next launch (:class:`thinwire.comm.rounds.TwoRounds`), so the
backward pass runs while P is on the wire; no collective is issued or waited
on in a callback, which is how torch 2.13's ``powerSGD_hook`` deadlocks on
gloo. Callbacks do elementwise maths only, so replicas stay bit identical
whatever thread runs them. Before ``warmup_steps``, and for tensors that do
not compress, gradients are all-reduced dense.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import reduce
from typing import Any

import torch

from thinwire.comm import done, world
from thinwire.comm.collectives import Future, Group, split_flat
from thinwire.comm.rounds import TwoRounds, all_reduce_round
from thinwire.compress import TensorInfo
from thinwire.compress.powersgd import PowerSGD, as_matrix, orthonormalize, right
from thinwire.feedback import Residual
from thinwire.schemes.base import Scheme, count_step
from thinwire.schemes.registry import register, validate_common
from thinwire.schemes.traits import ALL_REDUCE, Traits


@dataclass(frozen=True)
class PowerSGDConfig:
    """Options of ``powersgd``."""

    rank: int = 2  # r, columns of the factors P and Q, >= 1
    warmup_steps: int = 0  # steps all-reduced dense before PowerSGD starts, >= 0
    warm_start: bool = True  # reuse the previous step's Q (else draw a fresh one each step)
    seed: int = 0  # seeds the initial Q, equal on every rank
    error_feedback: bool = True  # keep M - G_hat and add it to the next gradient
    nonfinite: str = "raise"  # "raise" or "skip" on a non-finite gradient

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"rank={self.rank!r} must be an integer >= 1")
        if (isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int)
                or self.warmup_steps < 0):
            raise ValueError(f"warmup_steps={self.warmup_steps!r} must be an integer >= 0")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed={self.seed!r} must be an integer")
        for name in ("warm_start", "error_feedback"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
        validate_common(self)


class PowerSGDScheme(Scheme):
    """Rank-r PowerSGD with warm start and error feedback, per parameter.

    Args:
        config: a :class:`PowerSGDConfig`.

    Attributes:
        codec: the per-key Q state (:class:`thinwire.compress.powersgd.PowerSGD`).
        memory: the error ``M - G_hat`` per key, or None without error feedback.
    """

    def __init__(self, config: PowerSGDConfig) -> None:
        super().__init__()
        self.config = config
        self.codec = PowerSGD(config.rank, warm_start=config.warm_start, seed=config.seed)
        self.memory = Residual() if config.error_feedback else None
        self.steps: dict[str, int] = {}  # key -> launches so far
        self.rounds = TwoRounds()  # holds at most one bucket whose Q round waits for its P

    @property
    def traits(self) -> Traits:
        return Traits(memory=None if self.memory is None else self.memory.rule,
                      collectives=(ALL_REDUCE, ALL_REDUCE))

    def low_rank(self, shape: tuple[int, ...], step: int) -> bool:
        """Whether a tensor of ``shape`` is compressed at ``step`` (the same on every rank)."""
        return step >= self.config.warmup_steps and self.codec.compresses(shape)

    def launch(self, grads: Mapping[str, torch.Tensor], group: Group = None) -> Future[Any]:
        """Average ``grads`` (not modified) with PowerSGD; the future holds a dict."""
        if not grads:
            return done({})
        return self._launch(grads, group, None, last=True)

    def launch_flat(self, buffer: torch.Tensor, infos: Sequence[TensorInfo],
                    group: Group = None, *, last: bool = True) -> Future[Any]:
        """Average a flat buffer (a DDP bucket) in place; ``G_hat`` is written straight into it.

        Without ``last``, the P round is waited for at the next launch (see
        :class:`~thinwire.comm.rounds.TwoRounds`): the returned future
        completes only after a later launch with ``last``.
        """
        views = split_flat(buffer, [info.numel for info in infos])
        grads = {info.key: view.view(info.shape) for info, view in zip(infos, views)}
        return self._launch(grads, group, buffer, last)

    def _launch(self, grads: Mapping[str, torch.Tensor], group: Group,
                buffer: torch.Tensor | None, last: bool) -> Future[Any]:
        """Both front ends: with ``buffer``, ``grads`` are views of it and receive the mean."""
        start = time.perf_counter()
        _, n = world(group)
        finite = self._finite(grads, self.config.nonfinite, buffer)
        step = count_step(self.steps, grads)
        low = [key for key, grad in grads.items() if self.low_rank(tuple(grad.shape), step)]
        low_keys = set(low)
        dense = [key for key in grads if key not in low_keys]
        dtype = reduce(torch.promote_types, (grad.dtype for grad in grads.values()))
        device = next(iter(grads.values())).device
        rank = self.config.rank
        matrices: dict[str, torch.Tensor] = {}  # M = grad + error, (n, m), in dtype
        for key in low:
            if not finite:  # contributes zeros; the memory is kept for later
                matrix = torch.zeros_like(grads[key])
            elif self.memory is None:
                matrix = grads[key]
            else:  # M lives in the error buffer until the callback leaves M - G_hat there
                matrix = self.memory.absorb_(key, grads[key])
            matrices[key] = as_matrix(matrix).to(dtype)
        ps = [self.codec.left(key, matrices[key]).reshape(-1) for key in low]
        first = _fresh_flat(ps, dtype, device)
        p_hats: dict[str, torch.Tensor] = {}
        self._charge(time.perf_counter() - start)

        def second(p_mean: torch.Tensor) -> torch.Tensor:
            parts = []
            offset = 0
            for key in low:
                rows = matrices[key].shape[0]
                p_hat = orthonormalize(p_mean[offset: offset + rows * rank].view(rows, rank))
                offset += rows * rank
                p_hats[key] = p_hat
                # Q^T (r x m) flat: Q column-major, as finish() and the next left() read it.
                parts.append(right(matrices[key], p_hat).t().reshape(-1))
            if dense:
                for key in dense:
                    grad = grads[key].reshape(-1).to(dtype)
                    parts.append(grad if finite else torch.zeros_like(grad))
                parts = [torch.cat(parts)]  # a copy: the all-reduce must not touch the grads
            return _fresh_flat(parts, dtype, device)

        size = dtype.itemsize
        p_segments = [(key, matrices[key].shape[0] * rank * size) for key in low]
        future = self.rounds.launch(
            lambda: all_reduce_round(first, group, self.meter, p_segments), self._charged(second),
            device=device, last=last, group=group, meter=self.meter,
            segments=[(key, matrices[key].shape[1] * rank * size) for key in low]
            + [(key, grads[key].numel() * size) for key in dense])

        def decompress(fut: Future[Any]) -> Any:
            # Elementwise maths only (see reconstruct): identical bits on every rank
            # whichever thread runs this callback.
            mean = fut.value()
            out: dict[str, torch.Tensor] = {}
            offset = 0
            for key in low:
                grad = grads[key]
                rows, cols = matrices[key].shape
                q_mean = mean[offset: offset + cols * rank].view(rank, cols).t()
                offset += cols * rank
                into = grad.view(rows, cols) if buffer is not None and grad.dtype == dtype \
                    else None
                approx = self.codec.finish(key, p_hats[key], q_mean, out=into)
                if self.memory is not None and finite:
                    self.memory.subtract_(key, approx)  # e <- M - G_hat
                out[key] = approx.view(grad.shape).to(grad.dtype)
            dense_means = split_flat(mean[offset:], [grads[key].numel() for key in dense])
            for key, part in zip(dense, dense_means):
                out[key] = part.view(grads[key].shape).to(grads[key].dtype)
            if buffer is not None:
                for key in grads:
                    if out[key].data_ptr() != grads[key].data_ptr():
                        grads[key].copy_(out[key])
            return buffer if buffer is not None else {key: out[key] for key in grads}

        return future.then(self._charged(decompress))

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "codec": self.codec.state_dict(),
                "memory": None if self.memory is None else self.memory.state_dict(),
                "steps": dict(self.steps)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.codec.load_state_dict(state["codec"])
        if self.memory is not None:
            self.memory.load_state_dict(state["memory"])
        self.steps = dict(state["steps"])


def _fresh_flat(parts: list[torch.Tensor], dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    """New flat tensors back to back, for an all-reduce in place (a lone one as it is)."""
    if len(parts) == 1:
        return parts[0]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=dtype, device=device)


@register("powersgd", PowerSGDConfig)
def _powersgd(config: PowerSGDConfig) -> Scheme:
    return PowerSGDScheme(config)
