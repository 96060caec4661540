"""Wire protocol: node identity, signed envelopes and typed record bodies (no network stack)."""
