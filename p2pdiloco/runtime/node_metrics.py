"""Prometheus metrics of a training node (``join --metrics-port``), read live from snapshots.

A custom collector turns the node's and participant's plain-data snapshots into metric families
at scrape time, so nothing in the training loop has to update counters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from p2pdiloco.net.http_api import HTTPApi


class _NodeCollector(Collector):
    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Any]:
        s = self.snapshot()
        yield GaugeMetricFamily("p2pdiloco_version", "certified global version held", s["version"])
        yield GaugeMetricFamily(
            "p2pdiloco_tokens_per_second", "inner training throughput", s["tokens_per_second"]
        )
        for name, key, doc in (
            ("p2pdiloco_tokens_trained", "tokens_trained", "tokens trained locally"),
            ("p2pdiloco_tokens_accepted", "tokens_accepted", "tokens of merged deltas"),
            ("p2pdiloco_deltas_sent", "sent", "deltas submitted"),
            ("p2pdiloco_deltas_accepted", "accepted", "deltas merged (certified receipts)"),
            ("p2pdiloco_deltas_rejected", "rejected", "deltas screened out, as certified"),
            ("p2pdiloco_deltas_late", "late", "deltas that came too late to be merged"),
            ("p2pdiloco_rounds", "rounds", "certified versions applied"),
            ("p2pdiloco_bytes_sent", "bytes_up", "sync protocol bytes sent"),
            ("p2pdiloco_bytes_received", "bytes_down", "sync protocol bytes received"),
        ):
            yield CounterMetricFamily(name, doc, value=s[key])
        peers = GaugeMetricFamily("p2pdiloco_peers", "live peers by reachability", labels=["via"])
        peers.add_metric(["direct"], s["peers_direct"])
        peers.add_metric(["relayed"], s["peers_relayed"])
        yield peers
        yield GaugeMetricFamily(
            "p2pdiloco_on_committee", "1 while this node is a syncer", int(s["on_committee"])
        )
        yield GaugeMetricFamily(
            "p2pdiloco_stalled",
            "1 while no certificate came within grace + agree_timeout of sending a delta",
            int(s["stalled"] is not None),
        )
        yield GaugeMetricFamily(
            "p2pdiloco_stalled_seconds",
            "seconds waited for the awaited certificate while stalled (0 otherwise)",
            s["stalled_seconds"],
        )


def serve_metrics(
    host: str, port: int, snapshot: Callable[[], dict[str, Any]], healthy: Callable[[], bool]
) -> HTTPApi:
    """Start ``/metrics``, ``/healthz`` and ``/api/v1/state`` on (host, port); port 0 picks one.

    ``snapshot`` must return the keys read by the collector (see ``Participant.metrics``).
    Raises OSError if the port is taken.
    """
    registry = CollectorRegistry()
    registry.register(_NodeCollector(snapshot))
    api = HTTPApi(host, port, healthy=healthy, state=snapshot, registry=registry)
    api.start()
    return api
