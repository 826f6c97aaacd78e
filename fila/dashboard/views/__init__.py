"""Route handlers, one module per page; each exposes `routes`."""
