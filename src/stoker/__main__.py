"""`python -m stoker ...` runs the `stoker` command."""

from stoker.cli import main

main()
