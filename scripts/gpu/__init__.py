"""The GPU proof: the addon before a real llama-server on an NVIDIA card, run offline."""
