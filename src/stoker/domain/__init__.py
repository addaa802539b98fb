"""Pure domain of stoker: states, transitions, specs, records and errors (no I/O, no clock)."""
