"""Workers that fail and join: thinwire's exchanges on torchft's fault tolerance.

torchft's Lighthouse forms a quorum of the live workers at each sync (local
updates, :class:`ElasticLocalUpdates`) or step (per-step DDP,
:class:`ElasticDDP`); its Manager re-forms torch.distributed's default group
for each quorum (:class:`QuorumGroup`), heals a worker that joins from a live
peer, and commits a step only where every worker's exchange went through.
thinwire adds its schemes (error feedback, top-k, CLT-k, PowerSGD,
quantisers), rolled back when a step does not commit, and a record of the
job's latest commit (:class:`JobRecord`) so that a worker left behind with
no one to heal it stops (:class:`StaleWorker`) instead of training a second
history.

Floor: above the front doors it drives (local, ddp); below models, data and jobs.
Needs torchft (``pip install thinwire[ft]``).
"""

from thinwire.elastic.ddp import ElasticDDP
from thinwire.elastic.group import QuorumGroup
from thinwire.elastic.job import JobRecord, StaleWorker
from thinwire.elastic.local import ElasticLocalUpdates
from thinwire.elastic.manager import LIGHTHOUSE_ENV, QuorumLost, connect, start_lighthouse
from thinwire.elastic.state import Rollback

__all__ = ["LIGHTHOUSE_ENV", "ElasticDDP", "ElasticLocalUpdates", "JobRecord", "QuorumGroup",
           "QuorumLost", "Rollback", "StaleWorker", "connect", "start_lighthouse"]
