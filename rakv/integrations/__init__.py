"""Integrations with other serving engines (optional: each imports its engine lazily)."""
