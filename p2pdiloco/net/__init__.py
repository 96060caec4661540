"""Networking: DHT records, gossip, bulk streams, bootstrap servers, reachability."""
