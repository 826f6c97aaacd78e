"""What a run writes: `summary.json` (the data), `RESULTS.md` (tables), PNG charts."""
