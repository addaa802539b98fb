"""Adapters: implementations of the ports. Adapters never import each other."""
