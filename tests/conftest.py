"""Shared fixtures. Fixtures specific to one subsystem live in that subsystem's test file."""
