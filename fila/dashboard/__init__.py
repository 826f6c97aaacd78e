"""The web dashboard: a separate process that shows a broker through its public gRPC API.

It holds its own API key (the broker's ACLs apply to it; the key never reaches a
browser), samples the broker on an interval to derive rates and delivery shares,
and serves server-rendered pages with a small script for live refresh. The command
is `fila.dashboard.command:dashboard` (`fila dashboard`, or `python -m fila.dashboard`).

Layout: `broker` (gRPC client), `sampler` + `history` (what is known and derived),
`charts` (SVG geometry), `auth` / `csrf` / `headers` / `flash` (the web's security),
`views/` (one module per page), `render` (templates), `app` (assembly), `command`.
"""
