"""Benchmarks of icestate, each a module run from the repository root as
``python -m benchmarks.<name> [--help]``; each prints its figures and writes them to
``benchmarks/results/`` (JSON, and a PNG plot where it draws one).

- ``bench_store``: the keyed state store on Iceberg against rocksdict (lookups, checkpoint,
  restore, commit growth);
- ``bench_keygroups``: vectorized key-group assignment against a Python loop over xxhash;
- ``bench_partitioning``: the partition width of state tables;
- ``bench_rescale``: rescale as metadata against a copying rescale;
- ``bench_compaction``: many checkpoints of small deltas, with and without the compactor;
- ``bench_spark``: the streaming benchmark against the Spark peers (its parts in ``streaming/``);
- ``bench_spark_cpu``: where a streaming micro-batch's CPU goes, per process;
- ``remote_storage``: state on S3 (moto) behind a latency proxy against local disk: commit,
  cold first lookup, throughput, requests per operation;
- ``bench_restart_reads``: the first batches after a restart on a large state, key groups
  filled partially against loaded whole against an empty state, locally and on S3.

``harness`` holds what several of them share: timing, the results writer, progress, plots,
and the keyed inputs of the store benchmarks. This package's ``__init__`` imports nothing:
Spark's Python workers import ``benchmarks.streaming.processors`` and must stay light.
"""
