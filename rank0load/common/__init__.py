"""What the load and the save share (all ranks; imports only ``integrations`` and ``errors``).
Every collective rank0load issues is in ``_distribute``.
"""
