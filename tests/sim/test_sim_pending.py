"""A pool no node can fit, in the simulator: the real control plane against SimCluster.

The pool's pods ask for 64 CPUs; the cluster's only instance type has 16, so the
scheduler marks every pod Unschedulable and the autoscaler has nothing to launch. stoker
counts each as a spawn failure and keeps it for `timeouts.pending_s` (600 s) even with a
`spawn_s` of 120 s: 9 pods in 30 minutes (3 per 600 s), where retiring them at `spawn_s`
created 42.
"""

from __future__ import annotations

from stoker.sim.runner import run_scenario
from stoker.sim.scenario import scenario_from_mapping


def test_an_unschedulable_pool_creates_its_pods_once_per_pending_deadline() -> None:
    scenario = scenario_from_mapping(
        {
            "name": "unschedulable",
            "duration_s": 1800,
            "policies": ["stoker"],
            "pool": {"warm_target": 3, "cpu": "64", "memory": "8Gi", "spawn_timeout_s": 120},
            "cluster": {
                "node_pools": [
                    {
                        "name": "workers",
                        "instance_types": ["m5.4xlarge"],
                        "initial_nodes": {"m5.4xlarge": 2},
                    }
                ]
            },
        }
    )
    [stoker] = run_scenario(scenario).policies
    workers = stoker.summary["workers"]
    assert workers["spawns"] == {"warm": 9}
    assert workers["spawn_failures"] == {"unschedulable": 9}
    assert workers["retirements"] == {"stuck": 6}
    assert workers["final"]["spawning"] == 3
    assert stoker.violations == []
