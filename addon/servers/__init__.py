"""What the addon knows of each server and how it asks: health, routes, slots, keys, HTTP."""
