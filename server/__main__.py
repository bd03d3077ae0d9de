"""`python -m server` is the full `surgery` command (graph engine, compiler and `serve`)."""

from server.cli import main

main()
