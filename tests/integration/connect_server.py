"""A Spark Connect server for ``test_spark_connect``: a classic local session whose
``SparkConnectPlugin`` serves on the loopback port given as the argument, as
``start-connect-server.sh`` would. Clients authenticate with the token in
``SPARK_CONNECT_AUTHENTICATE_TOKEN`` (the environment, never the command line). Runs until killed."""

from __future__ import annotations

import sys
import threading

from pyspark.sql import SparkSession


def main(port: str) -> None:
    SparkSession.builder.master("local[2]").appName("icestate-connect-server") \
        .config("spark.plugins", "org.apache.spark.sql.connect.SparkConnectPlugin") \
        .config("spark.connect.grpc.binding.address", "127.0.0.1") \
        .config("spark.connect.grpc.binding.port", port) \
        .config("spark.sql.shuffle.partitions", "2") \
        .config("spark.ui.enabled", "false").getOrCreate()
    print(f"SERVING {port}", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main(sys.argv[1])
