"""The book's tooling: one figure style, tables, mechanism diagrams, parameter sweeps and GPU runs.

- `plot`: column-wide figures with fixed text sizes, and the checks on them (every lab).
- `report`: tables and the one glue helper (every lab).
- `diagrams`: mechanism diagrams drawn from kvlab's own state (chapters 1, 5, 7, 8, 9, 13).
- `sweep`: `kvlab sweep`, a lab over a parameter grid with papermill.
- `gpu`: `make gpu`, every lab at its GPU sizes, results kept as data.
"""
