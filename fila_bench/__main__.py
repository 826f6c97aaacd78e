"""`python -m fila_bench`, for checkouts where the console script is not installed."""

from fila_bench.cli import main

main()
