"""`python -m fila.dashboard`: the same command `fila dashboard` runs."""

from fila.dashboard.command import dashboard

if __name__ == "__main__":
    dashboard(prog_name="fila dashboard")
