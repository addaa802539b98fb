"""Pure policy: how many workers a pool wants, which to reap. Time is always an argument."""
