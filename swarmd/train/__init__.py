"""The swarm's library for training jobs: syncing rarely across slow links.

Importable in every rank (the daemon runs ranks with its own interpreter). Nothing of the
daemon is imported here, and the daemon never imports this package.

    from swarmd.train import plan
    sync = plan("diloco:32", compression="int8")  # or "ddp", "local:8"; groups from SWARM_GROUPS
    net = sync.wrap(model)                        # DDP where ranks sync every step
    ...; optimizer.step(); sync.step()            # every 32 steps: the outer step

See sync.py (the modes), compress.py (what goes on the wire), env.py (what is read).
"""

from .env import EnvError, Layout, layout
from .sync import OUTER_LR, OUTER_MOMENTUM, DiLoCo, Plan, Spec, parse, plan

__all__ = ["OUTER_LR", "OUTER_MOMENTUM", "DiLoCo", "EnvError", "Layout", "Plan", "Spec", "layout", "parse", "plan"]
