"""The fleet simulator: the real control plane against a simulated cluster in virtual time.

Two parts, one on top of the other (an import contract keeps it so):

- `stoker.sim.cluster`: the fake Kubernetes cluster, reusable on its own: `SimCluster`
  behind the ClusterAPI port (API server, scheduler, kubelets, node autoscaler, workload
  controllers, background load) and its configuration. It knows nothing of scenarios.
- the scale test on top of it: `scenario` (the YAML scenarios), `plane_specs` (the
  scenario as the domain's specs, and the caps in force), `replicas` (each policy's
  control-plane replicas, built by the same builder as `stoker serve`), `baselines` (the
  historical policies stoker is compared with), `observed` (the wrappers that report each
  replica's writes), `load` (the tenants' sessions), `invariants` (I1-I7, checked
  all through a run on the rows as written, `written`), `runner` (one virtual-time loop
  per policy, `vloop`) and `report` (summary, timeseries, plots).
"""
