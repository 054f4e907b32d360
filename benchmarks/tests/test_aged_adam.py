"""benchmarks.aged_adam: its every-entry reference is the library's rule, and a run's record."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from benchmarks import aged_adam
from thinwire.feedback import MomentumCorrection, Residual
from thinwire.optim.adam import AgedAdam


def test_the_librarys_step_is_the_every_entry_rule_to_the_bit() -> None:
    # only the arrived entries are touched; the rule over every entry is the reference
    torch.manual_seed(0)
    start = torch.randn(300)
    library = torch.nn.Parameter(start.clone())
    optimizer = torch.optim.AdamW([library], lr=aged_adam.LR, betas=(0.0, aged_adam.BETA2),
                                  eps=aged_adam.EPS, weight_decay=aged_adam.DECAY)
    AgedAdam(optimizer, {id(library): "w"}, MomentumCorrection(Residual(), 0.0, aged_adam.LR),
             horizon=aged_adam.HORIZON)
    reference, state = start.clone(), tuple(torch.zeros(300) for _ in range(3))
    for _ in range(12):
        grad = torch.randn(300) * (torch.rand(300) < 0.1)
        library.grad = grad.clone()
        optimizer.step()
        aged_adam.every_entry_step(reference, grad, state)
    assert torch.equal(library.detach(), reference)  # the same rule, to the bit
    assert not torch.equal(library.detach(), start)


def test_a_run_records_every_step_and_its_ratio(tmp_path: Path) -> None:
    out = tmp_path / "aged.json"
    assert aged_adam.main(["--entries", "2000", "--repeats", "2", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert set(record["ms"]) == {"aged-adam", "every-entry", "adamw"}
    assert record["ratio_vs_adamw"]["adamw"] == 1.0
    assert record["command"].endswith("--entries 2000 --repeats 2 --out " + str(out))
