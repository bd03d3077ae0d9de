"""`python -m surgery` is the `surgery` command."""

from surgery.cli import main

main()
