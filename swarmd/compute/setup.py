"""Jobs as the daemon configures them: slots, the job user, directories, the protocol handler."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ..config import Config
from ..gossip.service import Gossip
from ..gossip.wire import JobSlots
from .coordinator import Jobs
from .ledger import Ledger
from .service import JOB_PROTOCOL, JobHandler
from .store import JobStore
from .worker import Worker
from .workdir import Cache

if TYPE_CHECKING:
    from ..wg.mesh import Mesh

DEFAULT_SLOTS_WITHOUT_GPU = 2


def job_user(config: Config) -> str | None:
    """The user ranks run as: the configured one when root ('' means root itself), else
    the daemon's own user (None)."""
    if os.geteuid() != 0:
        return None
    return config.job_user or "root"


def from_config(config: Config, gossip: Gossip, mesh: Mesh | None) -> Jobs:
    gpus = tuple(g.index for g in gossip.resources.gpus)
    ledger = Ledger(config.job_slots or len(gpus) or DEFAULT_SLOTS_WITHOUT_GPU, gpus)
    state = config.state_dir
    for d in (state / "archives", config.jobs_path):
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
    config.jobs_path.chmod(0o711)  # ranks of another user reach their own directory inside
    worker = Worker(ledger=ledger, cache=Cache(state / "workdirs"), jobs_dir=config.jobs_path,
                    user=job_user(config), ifname=lambda: mesh.interface if mesh and mesh.started else None,
                    changed=gossip.readvertise)
    gossip.job_slots = lambda: JobSlots(slots=ledger.slots, free=ledger.slots_free,
                                        gpus_free=len(ledger.gpus_free), ranks=worker.ranks)
    handler = JobHandler(worker, check_member=gossip.check_member, submitters=config.job_submitters,
                         rejected=gossip.reject)
    gossip.host.set_stream_handler(JOB_PROTOCOL, gossip.guarded(handler.handle))
    return Jobs(store=JobStore(state), worker=worker, gossip=gossip, archives=state / "archives",
                retention=config.job_retention)
