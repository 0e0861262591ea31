"""`spillover run --workers N`: several proxies behind HAProxy (pool.py)."""
