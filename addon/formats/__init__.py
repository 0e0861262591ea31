"""The APIs' wire formats: framing, parsing, rewriting, continuing; what a client has."""
