"""Moving payloads over torch.distributed, and the byte Meter.

Floor: core, above compress, beside feedback and launch (which it does not import).
"""

from thinwire.comm.collectives import all_gather_bytes, all_reduce_mean, done, world
from thinwire.comm.meter import ENTITIES, TRAFFIC, Meter, Record

__all__ = ["ENTITIES", "TRAFFIC", "Meter", "Record", "all_gather_bytes", "all_reduce_mean",
           "done", "world"]
