"""The node daemon's side of the actor runtime: what runs in the one daemon
process of each machine (``python -m pmetal.node``).

* :mod:`pmetal.node.daemon`: the daemon's shell, its requests and its process;
* :mod:`pmetal.node.status`: what a node says about itself (status, resources);
* :mod:`pmetal.node.process`: starting or finding a node without the node's imports;
* :mod:`pmetal.node.pool` and :mod:`pmetal.node.zygote`: the worker pool and
  the fork server its workers come from;
* :mod:`pmetal.node.lifecycle` and :mod:`pmetal.node.records`: the node's actors,
  their placement here, restarts and ends;
* :mod:`pmetal.node.scheduler` and :mod:`pmetal.node.placement`: the master's
  choice of node;
* :mod:`pmetal.node.owners`: who owns each actor, and the leases that end them;
* :mod:`pmetal.node.membership`: the member list the daemon serves;
* :mod:`pmetal.node.metrics` and :mod:`pmetal.node.telemetry`: ``/metrics``, and
  what the node's workers and drivers report they ran.

The client side (handles, refs, calls, the worker that runs an actor) is
:mod:`pmetal.actors`; it never imports this package (``tests/test_layering.py``).
"""

__all__: list[str] = []
