"""What people and mitmproxy see: hooks, commands, control routes, status, metrics, views."""
