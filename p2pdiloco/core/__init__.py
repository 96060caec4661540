"""The node's decisions as sans-IO machines: no asyncio, torch, clock or transport inside.

The runtime (``p2pdiloco.runtime``) interprets them on the asyncio loop and the transport; the
simulator (``p2pdiloco.sim``) on its event heap and link model. ``tests/test_layers.py`` keeps
this package importing nothing but ``protocol`` and the standard library.
"""
