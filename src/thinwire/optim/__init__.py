"""Couple the user's optimiser to a compressed scheme, by a rule chosen per optimiser family.

One module per mechanism:

- :mod:`~thinwire.optim.coupling`: :func:`couple` moves the optimiser's momentum into
  the scheme's error memory (DGC's momentum correction), or leaves the optimiser as it
  is, by a rule per family (:func:`default_rule`); :mod:`~thinwire.optim.virtual` and
  :mod:`~thinwire.optim.adam` are what it installs.
- :mod:`~thinwire.optim.defaults`: what a front door installs under the family: the
  options (:data:`ADAM_OPTIONS`) and warm-up (:data:`ADAM_WARMUP`) of a scheme under
  Adam and AdamW (:func:`prepare`), and :func:`announce`'s log line.
- :mod:`~thinwire.optim.step_check`: :func:`watch`, a check before every optimiser step
  that warns when SGD's momentum skips an uncoupled scheme; why it is process-wide is
  in its docstring.

Floor: above schemes, below the front doors (the DDP hook couples through it).
"""

from thinwire.optim._family import MARK, default_rule
from thinwire.optim.coupling import FEEDBACKS, RULES, Coupling, couple
from thinwire.optim.defaults import (
    ADAM_OPTIONS,
    ADAM_WARMUP,
    announce,
    default_options,
    default_warmup,
    follow,
    prepare,
)
from thinwire.optim.step_check import watch

__all__ = ["ADAM_OPTIONS", "ADAM_WARMUP", "FEEDBACKS", "MARK", "RULES", "Coupling", "couple",
           "announce", "default_options", "default_rule", "default_warmup", "follow", "prepare",
           "watch"]
