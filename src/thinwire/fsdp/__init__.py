"""Front door: FSDP2 inside a site, a thinwire scheme across sites (hybrid sharding).

``fully_shard`` shards the model over each site's ranks; :func:`register` installs
FSDP2's all-reduce hook, which sends each site's gradient shard to the other sites
through any scheme. See docs/fsdp.md.

Floor: beside the DDP hook. Library code only: no model, data set, job or command line.
"""

from thinwire.fsdp.hook import Checkpoint, FSDPState, Shard, fsdp_modules, register, shards
from thinwire.fsdp.mesh import site_mesh

__all__ = ["Checkpoint", "FSDPState", "Shard", "fsdp_modules", "register", "shards",
           "site_mesh"]
