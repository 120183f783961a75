"""The ray driver: sandboxes placed over a Ray cluster, each confined by its node's own
local driver (``docs/deploy/ray.md``).

Files by concern: ``wire`` (what crosses the Ray boundary; no Ray import), ``host`` (the
per-node host actor), ``placement`` (slots as placement groups), ``cluster`` (connection,
host actors, loss verdicts), ``driver`` (``RayDriver``). Importing this package imports
nothing of Ray; ``create_driver("ray")`` imports ``driver``, which does.
"""
