"""How an answer goes on elsewhere: the next leg, exact replay, shadows, migration, records."""
