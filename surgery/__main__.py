"""`python -m surgery` runs the graph engine's commands (check, inspect, rules, apply, fix, …).

The full command, with quantize/compile/serve, is the `surgery` console script
(`python -m server`).
"""

from surgery.cli import main

main()
