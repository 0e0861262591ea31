"""What the commands share: the child processes they start, the cards they name."""
