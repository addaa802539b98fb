"""The fleet simulator: a fake cluster and virtual time for running the real control plane."""
