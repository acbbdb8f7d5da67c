"""memfine.integrations."""
