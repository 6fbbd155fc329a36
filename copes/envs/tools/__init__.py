"""Tools an agent can call."""
