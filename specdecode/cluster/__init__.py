"""Scale out on Ray Serve: N engine replicas behind one OpenAI-compatible endpoint (the `[cluster]` extra).

Nothing here imports Ray at import time: `specdecode.cluster.deployment` and `.router` do, and only
`ClusterServer.start()` imports them. See docs/cluster.md.
"""

from specdecode.cluster.config import ClusterConfig

__all__ = ["ClusterConfig"]
