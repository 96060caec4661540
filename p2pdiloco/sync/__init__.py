"""Round logic: committee election, and the sans-IO round state machine."""
