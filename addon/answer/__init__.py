"""One live answer: its legs, server after server, streamed into one client response."""
