"""The load after the manifest: the model's steps, the plan and the data movement (all ranks).

Imports ``checkpoint``, ``model``, ``common``, ``integrations``; each module's docstring states its part.
"""
