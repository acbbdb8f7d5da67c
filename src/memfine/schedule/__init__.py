"""memfine.schedule."""
