"""swarmd: the daemon of a decentralized cloud for AI.

Kept import-light on purpose: `swarmctl` imports `swarmd.rpc.client`, and everything this
file imports is paid by every CLI call.
"""

__version__ = "0.1.0"
