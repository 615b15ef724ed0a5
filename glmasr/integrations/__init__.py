"""Integrations with other frameworks; each module imports its framework only when used (``ray_data``: Ray
Data's ``map_batches``)."""
