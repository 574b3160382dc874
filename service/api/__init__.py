"""HTTP routers, one per resource, all mounted under ``/api/v1`` except health and metrics."""
