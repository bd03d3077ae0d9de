"""`python -m server` is the full `surgery` command (graph engine, compiler and `serve`)."""

from server.startup import main

main()
