"""``DistributedAutodiff``: share what backpropagation computes instead of gradients (dAD §3).

A step is ``loss.backward()`` then ``engine.synchronize()``, which replaces every
``.grad`` with the gradient of the loss over the union of all sites' batches:
what pooled training on the concatenated batch gives (each site weighted by
``N_s / Σ N``, the 1/S the reference code omits). Modes (:data:`MODES`):
``dad`` all-gathers each ``nn.Linear``'s inputs A and deltas Δ and forms
``∇W = Δ̂ᵀ·[Â, 1]`` (Alg. 1, Eq. 4); ``edad`` sends Δ of the output layer only and
recomputes the others (Alg. 2, Eq. 5; through time by replay, §3.5); ``rank-dad``
all-gathers at most ``rank`` power-iteration factors per layer (§3.4) and keeps
each layer's effective rank in :attr:`ranks`; ``dsgd`` and ``powersgd`` reduce
gradients. The row modes need every trainable parameter in an ``nn.Linear``;
anything else raises ``ValueError`` naming the module. Modes, bytes and what
each reveals: ``docs/dad.md``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from thinwire._version import __version__
from thinwire.autodiff import edad
from thinwire.autodiff._wire import Block, Site, all_reduce_sum, gather
from thinwire.autodiff.capture import Capture, Step
from thinwire.autodiff.power import (
    Factors,
    check_power_options,
    dense_power_iterations,
    reconstruct,
    structured_power_iterations,
)
from thinwire.autodiff.ranks import EffectiveRanks
from thinwire.autodiff.replay import replay
from thinwire.comm import Meter, world
from thinwire.comm.collectives import Group
from thinwire.comm.fingerprint import check_peers
from thinwire.compress.lowrank import seeded_normal
from thinwire.feedback import all_finite, check_policy
from thinwire.schemes import build

MODES = ("dsgd", "dad", "edad", "rank-dad", "powersgd")
ROW_MODES = ("dad", "edad", "rank-dad")  # modes that read the hooks' A and Δ
REDUCTIONS = ("mean", "sum")
FALLBACKS = ("all_reduce", "factor")


@dataclass(frozen=True)
class AutodiffConfig:
    """Options of :class:`DistributedAutodiff`; validated on construction."""

    mode: str = "dad"  # one of MODES
    rank: int = 4  # maximum rank r of rank-dad, powersgd and the "factor" fallback
    theta: float = 1e-3  # rank-dad's stopping threshold θ (§3.4.1)
    stopping: str = "paper"  # rank-dad's stopping rule: "paper" (§3.4.1) or "residual"
    iterations: int = 10  # power iterations per rank-dad component (§4.2 uses 10)
    private_input: bool = False  # keep the first layer's inputs (the raw data) on the site
    private_fallback: str = "all_reduce"  # a private layer sends its gradient, or "factor"s
    reduction: str = "mean"  # how each site's loss reduces its local batch: "mean" or "sum"
    seed: int = 0  # seeds power-iteration starts and PowerSGD's Q, identically on every site
    nonfinite: str = "raise"  # non-finite local statistics: "raise", or "skip" this site's turn
    verify: bool = True  # check captured statistics against autograd (see DistributedAutodiff)
    error_feedback: bool = False  # rank-dad: carry what the factors left out to the next step

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r} must be one of {MODES}")
        check_power_options(self.rank, self.theta, self.iterations, self.stopping)
        if self.private_fallback not in FALLBACKS:
            raise ValueError(f"private_fallback={self.private_fallback!r} must be one of "
                             f"{FALLBACKS}")
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction={self.reduction!r} must be one of {REDUCTIONS}")
        check_policy(self.nonfinite)
        for name in ("private_input", "verify", "error_feedback"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed={self.seed!r} must be an integer >= 0")


Grads = dict[str, torch.Tensor]


class DistributedAutodiff:
    """Synchronises a model's gradients across ``group`` by one of :data:`MODES`.

    Args:
        model: the network (the same architecture and initial weights on every site).
        mode: ``"dad"``, ``"edad"``, ``"rank-dad"``, ``"dsgd"`` or ``"powersgd"``.
        group: process group of the sites (None: the default group, or a
            single process when torch.distributed is not initialised).
        meter: records the bytes handed to torch.distributed; the engine
            closes one meter step per :meth:`synchronize`.
        **options: fields of :class:`AutodiffConfig` (``rank``, ``theta``, ...).

    With ``verify`` (default), the first step checks that each layer's
    captured (A, Δ) reproduce autograd's local gradient -- catching weight
    tying or parameters used outside their module call -- and every edad
    step checks that the recomputed deltas reproduce this site's own
    autograd deltas -- catching skip connections the hooks cannot see.

    Raises:
        ValueError: a bad option, or (row modes) a trainable parameter that
            does not belong to an ``nn.Linear``.
    """

    def __init__(self, model: nn.Module, mode: str = "dad", group: Group = None, *,
                 meter: Meter | None = None, **options: Any) -> None:
        self.config = AutodiffConfig(mode=mode, **options)
        self.model = model
        self.group = group
        self.meter = meter
        self.site, self.sites = world(group)
        self.step = 0
        self.skipped = 0
        self.ranks = EffectiveRanks()
        # the gradient baseline: the powersgd scheme itself, with its error feedback; a
        # site whose gradient is not finite contributes zeros and keeps its memory
        self.powersgd = build("powersgd", rank=self.config.rank, seed=self.config.seed,
                              nonfinite="skip")
        self.errors: dict[str, torch.Tensor] = {}  # rank-dad error feedback, (out, in + 1)
        self.params = {name: p for name, p in model.named_parameters() if p.requires_grad}
        self.layers = _linear_layers(model, mode) if mode in ROW_MODES else {}
        self._capture = Capture(model, self.layers, record_calls=mode == "edad")
        self._verified = not self.config.verify
        self._agreed = False  # peers compared at the first synchronize()

    # ----------------------------------------------------------------- step
    def synchronize(self, batch_size: int | None = None) -> Grads:
        """Set every trainable parameter's ``.grad`` to the global gradient.

        Call once after each ``loss.backward()``, on every site.

        Args:
            batch_size: this site's local batch size; by default the leading
                size of the model's first tensor input.

        Returns:
            The global gradients by parameter name (also written to ``.grad``).

        Raises:
            PeerMismatchError: (first call) another site runs another mode, config,
                parameter set or thinwire version; raised on every site alike.
            RuntimeError: no forward/backward since the last call, or more
                than one forward with gradients enabled (run evaluation under
                ``torch.no_grad()``).
            FloatingPointError: non-finite statistics under ``nonfinite="raise"``.
        """
        if not self._agreed:
            self._agree()
        step = self._capture.take()
        batch = self._batch(step, batch_size)
        if self.config.mode in ROW_MODES:
            self._check_rows(step)
            contribute = all_finite({**step.acts, **step.deltas}, self.config.nonfinite)
            if contribute and not self._verified:
                self._verify_local(step)
        else:
            contribute = all_finite(self._local_grads(), self.config.nonfinite)
        if not contribute:
            self.skipped += 1
        grads = _HANDLERS[self.config.mode](self, step, batch if contribute else 0)
        for name, grad in grads.items():
            param = self.params[name]
            if param.grad is None:
                param.grad = grad.detach().clone()
            else:
                param.grad.copy_(grad)
        self._verified = self._verified or contribute
        self.step += 1
        if self.meter is not None:
            self.meter.next_step()
        return grads

    def _agree(self) -> None:
        parameters = {name: f"{tuple(p.shape)} {p.dtype}" for name, p in self.params.items()}
        device = next(iter(self.params.values())).device if self.params else None
        check_peers({"config": asdict(self.config), "parameters": parameters,
                     "thinwire": __version__}, "the dAD engine", self.group, device)
        self._agreed = True

    def _batch(self, step: Step, batch_size: int | None) -> int:
        if step.forwards > 1:
            raise RuntimeError(f"the model ran {step.forwards} forward passes with gradients "
                               "enabled since the last synchronize(); run one forward and "
                               "backward per synchronize() and evaluate under torch.no_grad()")
        if batch_size is not None:
            if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 0:
                raise ValueError(f"batch_size={batch_size!r} must be an integer >= 0")
            return batch_size
        if step.forwards == 0:
            raise RuntimeError("no forward pass with gradients since the last synchronize(); "
                               "call synchronize() once after each loss.backward()")
        if step.batch == 0:
            raise ValueError("could not tell the local batch size from the model's first "
                             "input; pass synchronize(batch_size=...)")
        return step.batch

    def _check_rows(self, step: Step) -> None:
        if step.forwards == 0 or (step.order and not step.backward_seen):
            raise RuntimeError("no backward pass reached the watched layers since the last "
                               "forward; call synchronize() after loss.backward()")
        for name, layer in self.layers.items():
            if name not in step.order and any(p.grad is not None and bool(p.grad.any())
                                              for p in layer.parameters()):
                raise ValueError(f"parameters of {name!r} received gradients but the module was "
                                 "never called: they are used outside nn.Linear.forward "
                                 "(e.g. F.linear or weight tying), which dAD cannot see")

    def _verify_local(self, step: Step) -> None:
        """Each layer's captured ``Δᵀ·[A, 1]`` must be autograd's local gradient."""
        for name in step.order:
            local = _aug(step.acts[name], _has_bias(self.layers[name]))
            _compare(step.deltas[name].T @ local, _augmented_grad(self.layers[name]), name,
                     "captured (A, Δ) do not reproduce autograd's local gradient "
                     "(parameters used outside the module call, weight tying, or "
                     "gradients accumulated over several backward passes; zero them, "
                     "or pass verify=False if that is intended)")

    def _local_grads(self) -> Grads:
        return {name: (p.grad if p.grad is not None else torch.zeros_like(p))
                for name, p in self.params.items()}

    # ----------------------------------------------------------- row modes
    def _plan(self, step: Step) -> dict[str, str]:
        """What each layer sends: "rows" (A, Δ), "acts", "acts+delta", "factor", "all_reduce"."""
        mode = self.config.mode
        private = set(step.order[:1]) if self.config.private_input else set()
        last = step.order[-1] if step.order else None
        plan: dict[str, str] = {}
        for name in self.layers:
            if name in private:
                plan[name] = self.config.private_fallback
            elif mode == "rank-dad":
                plan[name] = "factor"
            elif mode == "edad":
                plan[name] = "acts+delta" if name == last else "acts"
            else:
                plan[name] = "rows"
        return plan

    def _rows(self, step: Step, batch: int) -> Grads:
        """dad, edad and rank-dad: one all-gather of row blocks, then local algebra."""
        contribute = batch > 0
        plan = self._plan(step)
        blocks: list[Block] = []
        reduce_parts: list[tuple[str, str, torch.Tensor]] = []
        for name, layer in self.layers.items():
            acts = step.acts.get(name, layer.weight.new_zeros(0, layer.in_features))
            deltas = step.deltas.get(name, layer.weight.new_zeros(0, layer.out_features))
            if plan[name] == "factor":
                factors = self._factors(name, _aug(acts, _has_bias(layer)), deltas, contribute)
                blocks += [Block("factor", name, factors.acts), Block("factor", name,
                                                                      factors.deltas)]
            elif plan[name] == "all_reduce":
                local = deltas.T @ _aug(acts, _has_bias(layer))
                reduce_parts.append(("W_grad", name, local * self._scale(batch) if contribute
                                     else torch.zeros_like(local)))
            else:
                blocks.append(Block("activation", name, acts))
                if plan[name] in ("rows", "acts+delta"):
                    blocks.append(Block("delta", name, deltas))
        if not contribute:
            blocks = [Block(b.entity, b.layer, b.rows[:0]) for b in blocks]
        sites = gather(batch, blocks, [b.rows.shape[1] for b in blocks],
                       [b.rows.dtype for b in blocks], self.group, self.meter)
        got = _Gathered(blocks, sites, self._weights(sites))
        augmented: dict[str, torch.Tensor] = {}
        if reduce_parts:
            divisor = self._divisor(float(sum(site.batch for site in sites)))
            for (_, name, _), summed in zip(reduce_parts, all_reduce_sum(
                    reduce_parts, self.group, self.meter), strict=True):
                augmented[name] = summed / divisor
        for name, layer in self.layers.items():
            if plan[name] == "factor":  # Σ_s w_s·G_sᵀ·U_s: concatenated factors, like rows
                augmented[name] = got.rows(name, "factor", 1, True).T @ got.rows(name, "factor")
            elif plan[name] == "rows":  # Algorithm 1 line 18
                augmented[name] = (got.rows(name, "delta", weighted=True).T
                                   @ _aug(got.rows(name, "activation"), _has_bias(layer)))
        if self.config.mode == "edad" and step.order and plan[step.order[-1]] == "acts+delta":
            self._edad(step, plan, got, augmented)
        grads: Grads = {}
        for name in self.layers:
            grads.update(self._split(name, augmented[name]))
        return grads

    def _edad(self, step: Step, plan: dict[str, str], got: _Gathered,
              augmented: dict[str, torch.Tensor]) -> None:
        """Algorithm 2: every layer's global Δ from the output layer's (Eq. 5), then Eq. 4.

        A chain of layers called once each uses Eq. 5 directly; a recurrent
        model (a layer called once per time step) replays its forward on the
        gathered rows (:mod:`thinwire.autodiff.replay`, §3.5).
        """
        order = step.order
        missing = [name for name in self.layers if name not in order]
        if missing:
            raise ValueError(f"edad needs every nn.Linear in the forward pass; {missing} "
                             "were not called")
        sends_acts = [plan[name] in ("acts", "acts+delta") for name in order]
        acts = [got.rows(name, "activation") if sends else torch.empty(0)
                for name, sends in zip(order, sends_acts, strict=True)]
        top = got.rows(order[-1], "delta", weighted=True)
        if max(step.counts.values()) > 1:
            deltas = self._replay(step, got)
            rows_of = order  # each layer's Δ has the rows of its own inputs
        else:
            weights = [self.layers[name].weight.detach() for name in order]
            deltas = edad.recompute(top, weights, acts, edad.chain(step.calls, order))
            rows_of = order[1:]  # Δ_i has the rows of layer i + 1's input
        if self.config.verify and got.sites[self.site].batch > 0:
            for i, name in enumerate(order[:-1]):
                counts = got.counts(rows_of[i], "activation")
                begin = sum(counts[: self.site])
                _compare(deltas[i][begin: begin + counts[self.site]],
                         step.deltas[name] * got.weights[self.site], name,
                         "edad's recomputed deltas differ from autograd's: something other "
                         "than the Linear layers and their activations joins the layers "
                         "(a skip connection, a side path to the loss, dropout); use mode='dad'")
        for name, sends, global_delta, rows in zip(order, sends_acts, deltas, acts, strict=True):
            if sends:
                augmented[name] = global_delta.T @ _aug(rows, _has_bias(self.layers[name]))

    def _replay(self, step: Step, got: _Gathered) -> list[torch.Tensor]:
        """edAD's deltas on a recurrent model, in forward order (the last is the gathered one)."""
        order = step.order
        if self.config.private_input:
            raise ValueError("edad on a recurrent model needs every layer's inputs to replay "
                             "the time steps; private_input=True works for feed-forward chains "
                             "only (use mode='dad' or 'rank-dad' with private_input)")
        if step.example is None:
            raise ValueError("edad on a recurrent model replays the forward on the pooled batch "
                             "and needs a model called with one tensor argument")
        batches = [site.batch for site in got.sites]
        local = got.sites[self.site].batch
        if local and local != step.example.shape[0]:
            raise ValueError(f"edad on a recurrent model needs batch_size ({local}) to equal the "
                             f"model input's leading size ({step.example.shape[0]})")
        sites = range(len(got.sites))
        acts = {name: [got.site_rows(name, "activation", s) for s in sites] for name in order}
        top = [got.site_rows(order[-1], "delta", s) * got.weights[s] for s in sites]
        layers = {name: self.layers[name] for name in order}
        with self._capture.paused():
            deltas = replay(self.model, layers, step.counts, step.example, batches, acts, top,
                            order[-1])
        return [*(deltas[name] for name in order[:-1]), torch.cat(top)]

    def _factors(self, name: str, acts: torch.Tensor, deltas: torch.Tensor,
                 contribute: bool) -> Factors:
        """rank-dAD's local factors; seeds depend only on (seed, step, layer, component)."""
        if not contribute:
            return Factors(acts[:0], deltas[:0])

        def start(j: int) -> torch.Tensor:
            return seeded_normal(f"{name}/{self.step}/{j}", (deltas.shape[1],),
                                 self.config.seed, dtype=deltas.dtype, device=deltas.device)

        theta, iterations, stopping = (self.config.theta, self.config.iterations,
                                       self.config.stopping)
        if self.config.error_feedback:
            compensated = deltas.T @ acts
            if name in self.errors:
                compensated = compensated + self.errors[name]
            factors = dense_power_iterations(compensated, self.config.rank, start, theta=theta,
                                             iterations=iterations, stopping=stopping)
            self.errors[name] = compensated - reconstruct(factors.acts, factors.deltas)
        else:
            factors = structured_power_iterations(acts, deltas, self.config.rank, start,
                                                  theta=theta, iterations=iterations,
                                                  stopping=stopping)
        self.ranks.record(self.step, name, factors.rank)
        return factors

    def _weights(self, sites: list[Site]) -> list[float]:
        """Each site's weight in the global gradient: ``N_s / Σ N`` (mean) or 1 (sum)."""
        if self.config.reduction == "sum":
            return [1.0 for _ in sites]
        total = sum(site.batch for site in sites)
        return [site.batch / total if total else 0.0 for site in sites]

    def _split(self, name: str, augmented: torch.Tensor) -> Grads:
        """``[∇W | ∇b]`` into the layer's parameter gradients."""
        layer = self.layers[name]
        grads = {f"{name}.weight": augmented[:, : layer.in_features].to(layer.weight.dtype)}
        if _has_bias(layer):
            grads[f"{name}.bias"] = augmented[:, layer.in_features].to(layer.weight.dtype)
        return {key.lstrip("."): value for key, value in grads.items()}

    # ------------------------------------------------------- gradient modes
    def _dsgd(self, step: Step, batch: int) -> Grads:
        """All-reduce of ``N_s·g_s`` and ``N_s``, divided by ``Σ N`` (mean reduction)."""
        local = self._local_grads()
        scale = self._scale(batch)
        parts = [("W_grad", name, grad * scale if batch else torch.zeros_like(grad))
                 for name, grad in local.items()]
        parts.append(("size", "(batch)", next(iter(local.values())).new_tensor([float(batch)])))
        sums = all_reduce_sum(parts, self.group, self.meter)
        divisor = self._divisor(float(sums[-1]))
        return {name: s / divisor for (_, name, _), s in zip(parts[:-1], sums, strict=False)}

    def _powersgd(self, step: Step, batch: int) -> Grads:
        """The ``powersgd`` scheme over every site's ``w_s g_s``, ``w_s`` making its mean the
        global gradient: ``S N_s / Σ N`` (mean reduction) or ``S`` (sum).

        The scheme's error feedback is torch's hook's, the one every PowerSGD in the
        package keeps (:class:`~thinwire.schemes.agreed.LowRankBasis`). A site with no
        samples this step contributes a zero gradient and so still sends what its error
        memory held back; one whose gradient is not finite (``nonfinite="skip"``)
        contributes zeros and keeps its memory as it was.
        """
        local = self._local_grads()
        first = next(iter(local.values()))
        total = float(all_reduce_sum([("size", "(batch)", first.new_tensor([float(batch)]))],
                                     self.group, self.meter)[0])
        weight = self.sites * self._scale(batch) / self._divisor(total) if batch else 0.0
        self.powersgd.meter = self.meter
        return self.powersgd.reduce({name: grad * weight for name, grad in local.items()},
                                    self.group)

    def _scale(self, batch: int) -> float:
        return float(batch) if self.config.reduction == "mean" else float(batch > 0)

    def _divisor(self, total: float) -> float:
        if self.config.reduction == "sum":
            return 1.0
        return total if total > 0 else math.inf  # every site skipped: zero gradients

    # --------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly: step, records, PowerSGD Q and errors."""
        return {"config": asdict(self.config), "step": self.step, "skipped": self.skipped,
                "ranks": self.ranks.state_dict(), "powersgd": self.powersgd.state_dict(),
                "errors": {k: v.clone() for k, v in self.errors.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`.

        Raises:
            ValueError: the state was saved by an engine of another mode or rank.
        """
        for key in ("mode", "rank"):
            if state["config"][key] != getattr(self.config, key):
                raise ValueError(f"state was saved with {key}={state['config'][key]!r}, this "
                                 f"engine has {key}={getattr(self.config, key)!r}")
        self.step = state["step"]
        self.skipped = state["skipped"]
        self.ranks.load_state_dict(state["ranks"])
        self.powersgd.load_state_dict(state["powersgd"])
        self.errors = {k: v.clone() for k, v in state["errors"].items()}
        self._verified = True

    def remove(self) -> None:
        """Take the engine's hooks off the model."""
        self._capture.remove()


_HANDLERS: dict[str, Callable[[DistributedAutodiff, Step, int], Grads]] = {
    "dad": DistributedAutodiff._rows,
    "edad": DistributedAutodiff._rows,
    "rank-dad": DistributedAutodiff._rows,
    "dsgd": DistributedAutodiff._dsgd,
    "powersgd": DistributedAutodiff._powersgd,
}


def _linear_layers(model: nn.Module, mode: str) -> dict[str, nn.Linear]:
    """Every ``nn.Linear`` of ``model``; raises if any other module owns a trainable parameter."""
    layers: dict[str, nn.Linear] = {}
    for name, module in model.named_modules():
        own = [(p_name, p) for p_name, p in module.named_parameters(recurse=False)]
        if isinstance(module, nn.Linear):
            if not all(p.requires_grad for _, p in own):
                raise ValueError(f"{mode} needs every parameter of nn.Linear {name!r} trainable "
                                 "(frozen weights or biases are not supported)")
            layers[name] = module
        elif any(p.requires_grad for _, p in own):
            kind = type(module).__name__
            raise ValueError(f"{mode} handles only nn.Linear layers; {kind} {name!r} has "
                             "trainable parameters (use mode='dsgd' or 'powersgd' for it)")
    if not layers:
        raise ValueError(f"{mode} found no nn.Linear layer in the model")
    return layers


def _has_bias(layer: nn.Linear) -> bool:
    return layer.bias is not None


def _aug(acts: torch.Tensor, bias: bool) -> torch.Tensor:
    """``[A, 1]``: the ones column turns the bias gradient into part of ``Δᵀ·A``."""
    if not bias:
        return acts
    return torch.cat([acts, acts.new_ones(acts.shape[0], 1)], dim=1)


def _augmented_grad(layer: nn.Linear) -> torch.Tensor:
    weight = layer.weight.grad if layer.weight.grad is not None else torch.zeros_like(layer.weight)
    if layer.bias is None:
        return weight
    bias = layer.bias.grad if layer.bias.grad is not None else torch.zeros_like(layer.bias)
    return torch.cat([weight, bias.unsqueeze(1)], dim=1)


def _compare(got: torch.Tensor, want: torch.Tensor, name: str, why: str) -> None:
    """Raise ``ValueError`` unless ``got`` matches ``want`` to √eps of its scale."""
    scale = float(want.abs().max()) if want.numel() else 0.0
    tolerance = math.sqrt(torch.finfo(want.dtype).eps) * max(scale, torch.finfo(want.dtype).tiny)
    error = float((got - want).abs().max()) if want.numel() else 0.0
    if got.shape != want.shape or not error <= tolerance:
        raise ValueError(f"layer {name!r}: {why} (max difference {error:.3g}, "
                         f"tolerance {tolerance:.3g})")


class _Gathered:
    """Every site's blocks after the gather, looked up by (layer, entity, position)."""

    def __init__(self, blocks: list[Block], sites: list[Site], weights: list[float]) -> None:
        self.sites = sites
        self.weights = weights
        self._index: dict[tuple[str, str], list[int]] = {}
        for i, block in enumerate(blocks):
            self._index.setdefault((block.layer, block.entity), []).append(i)

    def rows(self, layer: str, entity: str, position: int = 0,
             weighted: bool = False) -> torch.Tensor:
        """All sites' rows of one block, stacked in rank order (vertcat of Alg. 1 l. 14–15),
        each multiplied by its site's weight when ``weighted``."""
        i = self._index[(layer, entity)][position]
        return torch.cat([site.blocks[i] * w if weighted else site.blocks[i]
                          for site, w in zip(self.sites, self.weights, strict=True)])

    def site_rows(self, layer: str, entity: str, site: int) -> torch.Tensor:
        """One site's rows of one block."""
        return self.sites[site].blocks[self._index[(layer, entity)][0]]

    def counts(self, layer: str, entity: str, position: int = 0) -> list[int]:
        i = self._index[(layer, entity)][position]
        return [int(site.blocks[i].shape[0]) for site in self.sites]
