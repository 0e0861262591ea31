"""The test bed: real servers and mitmdump on free ports, tiny models, scripted upstreams."""
