"""memfine.cli."""
