"""Model implementations and weight loading."""
