"""Blocks: the block process (``blocks.process``) and the block repository (``blocks.repository``)."""
