"""Error feedback on the momentum: each worker's velocity is what gets compressed (DGC §3.2)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from thinwire.feedback.base import Memory


class MomentumCorrection(Memory):
    """Local heavy-ball (or Nesterov) velocity in front of another error-feedback memory.

    Deep Gradient Compression's momentum correction (Lin et al., ICLR 2018,
    §3.2, Eq. 6-7): each worker keeps its own velocity ``u <- mu u + g`` and
    error feedback accumulates ``u`` instead of ``g``; the optimiser then
    applies what arrives without momentum of its own. With no compression
    the mean of the workers' ``u`` is exactly the velocity plain SGD with
    momentum would hold, so training is the user's recipe; with
    compression, a delayed entry is released once instead of being
    re-amplified by a momentum that already counted it.

    Factor masking (DGC Eq. 8, zeroing ``u`` where an entry was sent) is
    left out: measured on the digits MLP it was slower than momentum
    correction alone (docs/convergence.md).

    A round is ``compensate(key, g)`` -> ``inner.compensate(key, v)`` with
    ``v = u`` (heavy ball) or ``v = g + mu u`` (Nesterov, as
    ``torch.optim.SGD(nesterov=True)``), and ``update`` is the inner
    memory's, so ``v + e_old == sent + e_new`` holds exactly as for plain
    error feedback.

    With ``beta2`` the worker also keeps Adam's second moment of its own
    gradient, ``s <- beta2 s + (1 - beta2) g^2`` (:meth:`second_moment`,
    bias-corrected); nothing sends it: :mod:`thinwire.optim.adam` scales the
    worker's look-ahead by it. ``arrivals`` keeps that module's per-entry step
    state (the same on every rank), so one ``state_dict`` holds all of Adam's.

    With ``decay``, SGD's weight decay enters the velocity as
    ``torch.optim.SGD`` adds it, ``g <- g + wd p`` before the momentum, so
    with nothing dropped the step is the user's, decay included.

    Args:
        inner: the memory that keeps what was not sent (Residual, LowPass).
        momentum: mu, in [0, 1).
        dampening: as ``torch.optim.SGD``: ``u <- mu u + (1 - dampening) g``.
        nesterov: send ``g + mu u`` instead of ``u``.
        beta2: keep the local second moment with this decay, in [0, 1); None: not kept.
        decay: key -> (its parameter, its weight decay), for the keys that decay.

    Raises:
        ValueError: ``momentum`` or ``beta2`` outside [0, 1), ``dampening`` outside [0, 1].
    """

    def __init__(self, inner: Memory, momentum: float, dampening: float = 0.0,
                 nesterov: bool = False, beta2: float | None = None,
                 decay: Mapping[str, tuple[torch.Tensor, float]] | None = None) -> None:
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum={momentum!r} must lie in [0, 1)")
        if not 0.0 <= dampening <= 1.0:
            raise ValueError(f"dampening={dampening!r} must lie in [0, 1]")
        if beta2 is not None and not 0.0 <= beta2 < 1.0:
            raise ValueError(f"beta2={beta2!r} must lie in [0, 1)")
        # No Memory.__init__: the error buffers are the inner memory's (see `buffers`).
        self.inner = inner
        self.momentum = momentum
        self.dampening = dampening
        self.nesterov = nesterov
        self.velocity: dict[str, torch.Tensor] = {}
        self.beta2 = beta2
        self.decay = {key: pair for key, pair in (decay or {}).items() if pair[1]}
        self.squares: dict[str, torch.Tensor] = {}  # key -> s, when beta2 is set
        self.counts: dict[str, int] = {}  # key -> gradients s has seen
        self.arrivals: dict[str, dict[str, torch.Tensor]] = {}  # thinwire.optim.adam's
        self._advanced: set[str] = set()  # keys advance_ moved on this round, not yet used

    @property
    def rule(self) -> str:  # type: ignore[override]
        """``momentum+`` the inner memory's rule."""
        return f"momentum+{self.inner.rule}"

    @property
    def forgets_what_is_sent(self) -> bool:  # type: ignore[override]
        """As the inner memory: the velocity moves on in :meth:`compensate` either way."""
        return self.inner.forgets_what_is_sent

    @property
    def buffers(self) -> dict[str, torch.Tensor]:  # type: ignore[override]
        """The error buffers, which the inner memory owns."""
        return self.inner.buffers

    def _advance(self, key: str, grad: torch.Tensor) -> torch.Tensor:
        """Advance ``key``'s velocity with ``grad``; the tensor to send in its place.

        The first call starts the velocity at ``grad``, as ``torch.optim.SGD`` does;
        a key that :meth:`advance_` already moved on this round is not moved again.
        """
        velocity = self.velocity.get(key)
        moved = key in self._advanced and velocity is not None
        decayed = grad if moved and not self.nesterov else self._decayed(key, grad)
        if moved:
            self._advanced.discard(key)
        elif velocity is None:
            velocity = self.velocity[key] = decayed.clone()
            self._square(key, grad)
        else:
            velocity.mul_(self.momentum).add_(decayed.view(velocity.shape),
                                              alpha=1.0 - self.dampening)
            self._square(key, grad)
        assert velocity is not None
        return decayed.add(velocity.view(grad.shape), alpha=self.momentum) if self.nesterov \
            else velocity.view(grad.shape)

    def _decayed(self, key: str, grad: torch.Tensor, start: int = 0) -> torch.Tensor:
        """``grad + wd p`` (of the part from ``start``) where ``key`` decays, else ``grad``."""
        if key not in self.decay:
            return grad
        parameter, weight_decay = self.decay[key]
        weights = parameter.detach().reshape(-1)[start: start + grad.numel()]
        return grad.add(weights.view(grad.shape).to(grad.dtype), alpha=weight_decay)

    def advance_(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Advance the velocity of every key of ``grads`` that has one, batched.

        ``torch._foreach_mul_`` / ``_foreach_add_`` apply the same per-tensor
        kernels as ``mul_`` / ``add_`` (``torch.optim.SGD``'s foreach path uses
        them too), so the bits are those of advancing one key at a time; what
        goes is the per-tensor dispatch, which dominates on models of many
        small tensors. The round's :meth:`compensate_` / :meth:`absorb_` then
        use the moved velocity; a key without one yet starts there.
        """
        keys = [key for key, grad in grads.items()
                if key in self.velocity and self.velocity[key].numel() == grad.numel()]
        self._advanced = set(keys)
        if keys:
            velocities = [self.velocity[key] for key in keys]
            torch._foreach_mul_(velocities, self.momentum)
            torch._foreach_add_(velocities,
                                [self._decayed(key, grads[key]).view(self.velocity[key].shape)
                                 for key in keys], alpha=1.0 - self.dampening)
            for key in keys:
                self._square(key, grads[key])

    def _square(self, key: str, grad: torch.Tensor, start: int = 0) -> None:
        """Move ``key``'s second moment on with ``grad`` (its part from ``start``), if kept."""
        if self.beta2 is None:
            return
        whole = self.velocity[key]
        square = self.squares.get(key)
        if square is None or square.numel() != whole.numel():
            square = self.squares[key] = torch.zeros_like(whole)
            self.counts[key] = 0
        part = square.view(-1)[start: start + grad.numel()]
        part.mul_(self.beta2).addcmul_(grad.reshape(-1), grad.reshape(-1), value=1.0 - self.beta2)
        if start == 0:  # once per round, however the key is split
            self.counts[key] += 1

    def second_moment(self, key: str) -> torch.Tensor | None:
        """``key``'s bias-corrected local second moment ``s / (1 - beta2^t)``, or None
        before its first gradient (or without ``beta2``)."""
        square = self.squares.get(key)
        if square is None or self.beta2 is None or not self.counts.get(key):
            return None
        return square / (1.0 - self.beta2 ** self.counts[key])

    def compensate(self, key: str, grad: torch.Tensor) -> torch.Tensor:
        """Advance ``key``'s velocity with ``grad``; velocity + error as a new tensor."""
        return self.inner.compensate(key, self._advance(key, grad))

    def compensate_(self, key: str, target: torch.Tensor) -> torch.Tensor:
        """In place: ``target`` (the gradient) becomes velocity + error."""
        target.copy_(self._advance(key, target))
        return self.inner.compensate_(key, target)

    def compensate_all_(self, targets: Mapping[str, torch.Tensor]) -> None:
        """:meth:`compensate_` for every key; the velocities :meth:`advance_` moved are
        copied in one batched op (a copy is exact, so the bits are the same)."""
        moved = [] if self.nesterov else [key for key in targets if key in self._advanced]
        if moved:
            torch._foreach_copy_([targets[key] for key in moved],
                                 [self.velocity[key].view(targets[key].shape) for key in moved])
            self._advanced.difference_update(moved)
        done = set(moved)
        for key, target in targets.items():
            if key not in done:
                target.copy_(self._advance(key, target))
        self.inner.compensate_all_(targets)

    def absorb_(self, key: str, grad: torch.Tensor) -> torch.Tensor:
        """Velocity + error in the inner memory's own buffer (see :meth:`Memory.absorb_`)."""
        return self.inner.absorb_(key, self._advance(key, grad))

    @property
    def absorbs_regions(self) -> bool:
        return self.inner.absorbs_regions

    def absorb_region_(self, keys: Sequence[str], numels: Sequence[int],
                       grads: torch.Tensor) -> torch.Tensor:
        """Each key's velocity advanced as :meth:`absorb_` advances it, then absorbed
        into the inner memory's region at once."""
        sent = [self._advance(key, grad) for key, grad in zip(keys, grads.split(list(numels)))]
        return self.inner.absorb_region_(keys, numels, sent[0].reshape(-1) if len(sent) == 1
                                         else torch.cat([part.reshape(-1) for part in sent]))

    def update_region_(self, keys: Sequence[str], p: torch.Tensor, indices: torch.Tensor,
                       sent: torch.Tensor | None) -> None:
        self.inner.update_region_(keys, p, indices, sent)

    def holds(self, key: str, grad: torch.Tensor) -> bool:
        velocity = self.velocity.get(key)
        return (velocity is not None and velocity.numel() == grad.numel()
                and self.inner.holds(key, grad))

    def absorb_part_(self, key: str, grad: torch.Tensor, start: int) -> torch.Tensor:
        """Advance the part's velocity, then absorb it into the inner memory's part.

        The same ``mul_`` / ``add_`` kernels as :meth:`advance_`, on the part.
        """
        part = self.velocity[key].view(-1)[start: start + grad.numel()]
        decayed = self._decayed(key, grad, start)
        part.mul_(self.momentum).add_(decayed, alpha=1.0 - self.dampening)
        self._square(key, grad, start)
        sent = decayed.add(part, alpha=self.momentum) if self.nesterov else part
        return self.inner.absorb_part_(key, sent, start)

    def update(self, key: str, compensated: torch.Tensor, sent: torch.Tensor) -> None:
        self.inner.update(key, compensated, sent)

    def update_sparse(self, key: str, compensated: torch.Tensor, indices: torch.Tensor,
                      sent: torch.Tensor) -> None:
        self.inner.update_sparse(key, compensated, indices, sent)

    def update_selected_(self, key: str, compensated: torch.Tensor,
                         indices: torch.Tensor) -> None:
        self.inner.update_selected_(key, compensated, indices)

    def settle(self, key: str, mean: torch.Tensor) -> torch.Tensor:
        return self.inner.settle(key, mean)

    def settle_(self, key: str, mean: torch.Tensor) -> None:
        self.inner.settle_(key, mean)

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict(),
                "velocity": {k: v.clone() for k, v in self.velocity.items()},
                "squares": {k: v.clone() for k, v in self.squares.items()},
                "counts": dict(self.counts),
                "arrivals": {k: {n: t.clone() for n, t in v.items()}
                             for k, v in self.arrivals.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state["inner"])
        self.velocity = {k: v.clone() for k, v in state["velocity"].items()}
        self.squares = {k: v.clone() for k, v in state.get("squares", {}).items()}
        self.counts = dict(state.get("counts", {}))
        self.arrivals = {k: {n: t.clone() for n, t in v.items()}
                         for k, v in state.get("arrivals", {}).items()}
        self._advanced = set()
