"""Remote state for the streaming benchmark's ``-s3`` implementations: moto's S3 server (a real
process on loopback) behind our latency proxy, started by the bench process for the whole run;
the job processes find the catalog properties in ``ours.S3_CATALOG_ENV``."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from benchmarks.streaming.ours import S3_CATALOG_ENV
from tests import s3_server
from tests.net_proxy import NetProxy

BUCKET = "icestate-bench-spark"


@dataclass
class RemoteState:
    server: s3_server.S3Server
    proxy: NetProxy

    @classmethod
    def start(cls, root: Path, latency_ms: float) -> RemoteState:
        server = s3_server.start(root)
        s3_server.create_bucket(server.endpoint, BUCKET)
        proxy = NetProxy(server.endpoint, latency_s=latency_ms / 1000).start()
        os.environ[S3_CATALOG_ENV] = json.dumps({
            "type": "sql", "init_catalog_tables": "true", "warehouse": f"s3://{BUCKET}/state",
            **s3_server.properties(proxy.endpoint)})
        return cls(server, proxy)

    def close(self) -> None:
        os.environ.pop(S3_CATALOG_ENV, None)
        self.proxy.close()
        self.server.stop()
