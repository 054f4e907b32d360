"""Distributed auto-differentiation: dAD, edAD and rank-dAD (Baker et al., ICML 2020).

Floor: front door, beside pipeline and ps (neither imported). Library code
only: the network and the sites' data come in as arguments.
"""

from thinwire.autodiff.engine import MODES, AutodiffConfig, DistributedAutodiff
from thinwire.autodiff.power import Factors, structured_power_iterations
from thinwire.autodiff.ranks import EffectiveRanks

__all__ = ["MODES", "AutodiffConfig", "DistributedAutodiff", "EffectiveRanks", "Factors",
           "structured_power_iterations"]
