"""Error-feedback memories: residual (DCT), low-pass (ScaleCom), stochastic drain, momentum,
EF21 estimate, decayed (SparseLoCo).

Floor: core, above compress, beside comm and launch (which it does not import).
"""

from thinwire.feedback.base import NONFINITE_POLICIES, Memory, all_finite, check_policy
from thinwire.feedback.decayed import Decayed
from thinwire.feedback.estimate import Estimate
from thinwire.feedback.lowpass import LowPass
from thinwire.feedback.momentum import MomentumCorrection
from thinwire.feedback.residual import Residual

__all__ = ["NONFINITE_POLICIES", "Decayed", "Estimate", "LowPass", "Memory",
           "MomentumCorrection", "Residual", "all_finite", "check_policy"]
