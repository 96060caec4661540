"""The limits both ends of the gossip plane hold to: the parent (``net.gossip``) refuses to publish
a larger message and the child (``net.gossip_host``) drops one on receipt; a broken link is
mended within a period. It imports nothing, so the parent (which must not import py-libp2p) and
the child (which must not import hivemind) both can."""

# Largest payload one gossip message may carry; larger ones are refused on publish and
# dropped on receipt (bulk data goes over streams, not gossip).
MAX_MESSAGE_BYTES = 256 * 1024

# Every gossip child mends its links this often (``net.gossip_host.mend_links``): its
# subscriptions told again to every pubsub peer, the pubsub stream reopened to a connected peer
# that has none. ~300 bytes per peer per period. A link that lost either delivers again within
# one period.
MEND_INTERVAL = 10.0
