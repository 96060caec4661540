"""The limit both ends of the gossip plane hold to: the parent (``net.gossip``) refuses to publish
a larger message and the child (``net.gossip_host``) drops one on receipt. It imports nothing, so
the parent (which must not import py-libp2p) and the child (which must not import hivemind) both
can."""

# Largest payload one gossip message may carry; larger ones are refused on publish and
# dropped on receipt (bulk data goes over streams, not gossip).
MAX_MESSAGE_BYTES = 256 * 1024
