"""Ports: the interfaces control code talks to (Store, Runtime, Elector, Clock, ClusterAPI)."""
