"""The built-in community bootstrap list shipped with the package.

Operators of public bootstrap servers add their full multiaddrs here by pull request (see
bootstrap/README.md). It is empty until the first community servers are announced; until then
nodes need ``--bootstrap``, ``P2PDILOCO_BOOTSTRAP`` or the config file.
"""

COMMUNITY_BOOTSTRAP: tuple[str, ...] = ()
