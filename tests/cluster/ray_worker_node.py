"""``ray start --address ...`` for a worker node of the loopback cluster (``tests/cluster/conftest.py``).

    python tests/cluster/ray_worker_node.py NODE_IP [ray start arguments ...]

[Note: Ray's cluster switch, on for this one process]
Every node of the loopback cluster runs with ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, the
project's loopback setting, so that no Ray process asks the network for "its" address
(``get_node_ip_address`` answers 127.0.0.1 instead of a UDP ``connect()`` to 8.8.8.8). But
``ray start --address`` reads the same switch (``ray_constants.ENABLE_RAY_CLUSTER``) to refuse
joining a cluster. Here, in the ``ray start`` process alone, the switch is turned on and the
node's address "from the network's perspective" is NODE_IP (127.0.0.1): the check passes,
127.0.0.1 is kept where Ray would rewrite it, nothing is probed, and the processes it starts
(raylet, agents, workers) inherit the environment's ``0``. The switch gates nothing else in Ray 2.60 (grep ``ENABLE_RAY_CLUSTER``).
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    node_ip, arguments = argv[0], argv[1:]
    from ray._private import ray_constants, services

    ray_constants.ENABLE_RAY_CLUSTER = True
    services.node_ip_address_from_perspective = lambda address=None: node_ip
    from ray.scripts.scripts import main as ray_main

    sys.argv = ["ray", *arguments]
    return ray_main() or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
